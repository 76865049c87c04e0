"""The values of the ``tda`` options that name the library's strategies, as plain strings so
that the parser imports no torch. Each tuple is its registry's keys, sorted (the CLI tests
compare them): a method or durability mode registered later is added here too."""

#: ``tda attribute --method``: :data:`tda_plugins.methods.METHODS`.
METHODS = (
    "adamw_influence",
    "adamw_own_step",
    "adamw_unrolled",
    "ekfac",
    "gradcos",
    "graddot",
    "kfac",
    "less",
    "logra",
    "tracin",
)
#: ``tda score --method``: :data:`tda_plugins.session.scoring.LIVE_METHODS`.
LIVE_METHODS = ("gradcos", "graddot")
#: ``tda capture --durability``: :data:`tda_plugins.store.sync.DURABILITY`.
DURABILITY = ("end", "none", "step")
#: ``tda capture --dtype``: names of torch dtypes.
DTYPES = ("bfloat16", "float32", "float64")
#: ``--dtype``'s help: what a bfloat16 model's gradients are.
DTYPE_HELP = (
    "the model's dtype; bfloat16 halves its memory, but its gradients, like those of bf16 "
    "training, carry bf16 rounding (scores of the order of 1e-3 to 1e-2 off float32's)"
)
#: ``--top-k``: examples per query in a top-k (``tda report``: the k its scores were saved
#: with, where recorded).
DEFAULT_TOP_K = 10
