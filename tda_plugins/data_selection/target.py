"""The selection target: the summed loss gradient of target examples, in the layers' layout.

The target needs no per-example gradients, only their sum, so it comes from one plain
backward of the summed loss: its cost is a forward and backward over the target
examples. The same backward also hands the target's per-token factors to a temporary
capture engine; where those are the smaller form of a layer's target (few target tokens
against a wide layer: ``S (N_i + N_o) <= N_i N_o`` for ``S`` target tokens), scoring a
training example against them costs ``T S (N_i + N_o)`` instead of the ``T N_i N_o`` of
a dot with the summed vector (:func:`~tda_plugins.grads.ops.dots_with`). A
:class:`TargetPool` hands out which examples each refresh uses: the whole pool, or the
next ``m`` of it in turn (the dattri-llm protocol scores each step against one example of
a 16-example pool).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn

from tda_plugins.capture.adapters import LayerAdapter
from tda_plugins.capture.consumer import CaptureConsumer
from tda_plugins.capture.engine import CaptureEngine, capture_suspended
from tda_plugins.capture.layers import LayerSelection, shared_parameter_ids
from tda_plugins.capture.records import MicroBatchRecord
from tda_plugins.data_selection.parallel import Ranks, is_sharded, local
from tda_plugins.grads.blocks import TensorKey, tensor_key
from tda_plugins.grads.tokens import TokenFactors
from tda_plugins.parallel.dtensor import gathered
from tda_plugins.parallel.gather import without_gradient_sync
from tda_plugins.session.batch import grads_set_aside

Batch = Mapping[str, Tensor]
#: ``(model, batch) -> (B,)`` per-example losses, each the sum over its loss tokens.
ExampleLosses = Callable[[nn.Module, Batch], Tensor]


@dataclass
class Target(Mapping[str, Tensor]):
    """A selection target at the current weights: layer name -> its ``(D,)`` gradient of
    ``sum_i L_i`` over the target examples, in the layout of the layer's flattened
    per-example gradients (a ``Mapping``; a layer known by its factors alone gets its
    vector built from them on first access, and kept).

    Attributes:
        vectors: the layers' vectors known so far.
        factors: layer name -> the same gradient as per-token factors, every target
            token a row of one example (``TokenFactors`` of batch 1, ``S`` tokens), for the
            linear layers where that form is the smaller one (``S (N_i + N_o) <= N_i N_o``,
            ``S`` counting the ``input_ids`` of the chunks the pass runs,
            :func:`target_chunks`; none for a batch without them) and
            whose parameters no other layer shares (a tied weight's vector is its whole
            gradient, its factors would be one call site's part of it).
    """

    vectors: dict[str, Tensor]
    factors: dict[str, TokenFactors] = field(default_factory=dict)

    def __getitem__(self, name: str) -> Tensor:
        if name not in self.vectors:
            self.vectors[name] = self.factors[name].materialize()[0]
        return self.vectors[name]

    def __iter__(self) -> Iterator[str]:
        return iter({**dict.fromkeys(self.vectors), **dict.fromkeys(self.factors)})

    def __len__(self) -> int:
        return len(set(self.vectors) | set(self.factors))


class _FactorKeeper(CaptureConsumer):
    """Keeps the target's token factors of every layer it is handed, chunk by chunk."""

    def __init__(self) -> None:
        self.parts: dict[str, list[TokenFactors]] = {}

    def on_micro_batch(self, record: MicroBatchRecord) -> None:
        for name, grads in record.example_grads().items():
            if isinstance(grads, TokenFactors):
                self.parts.setdefault(name, []).append(grads)

    def factors(self) -> dict[str, TokenFactors]:
        """Per layer, every chunk's tokens as the rows of one example; layers fed by one
        input (q/k/v) get one tensor for it, so scoring takes their input Gram once."""
        out = {}
        inputs: dict[tuple[TensorKey, ...], Tensor] = {}
        for name, parts in self.parts.items():
            key = tuple(tensor_key(p.a) for p in parts)
            if key not in inputs:
                inputs[key] = _token_rows([p.a for p in parts])
            g = _token_rows([p.g for p in parts])
            out[name] = TokenFactors(inputs[key][None], g[None], parts[0].bias)
        return out


def _token_rows(parts: list[Tensor]) -> Tensor:
    """``(B, T, N)`` chunks -> ``(sum B T, N)``, every token a row (one chunk: a view)."""
    rows = [p.reshape(-1, p.shape[-1]) for p in parts]
    return rows[0] if len(rows) == 1 else torch.cat(rows)


def _smaller_as_factors(
    layers: Mapping[str, tuple[nn.Module, LayerAdapter]], tokens: int
) -> list[str]:
    """The layers whose target is smaller as ``tokens`` token factors than as a vector,
    ``tokens (N_i [+1] + N_o) <= (N_i [+1]) N_o`` (``[+1]``: a bias): linear ones only
    (norm scales and embeddings are scored by their vectors), and none whose parameters
    another layer shares (a tied weight's factors would be one call site's part of its
    gradient, its vector is the whole)."""
    shared = shared_parameter_ids(layers)
    out = []
    for name, (module, adapter) in layers.items():
        params = adapter.captured_parameters(module)
        if adapter.family != "linear" or "weight" not in params:
            continue
        if any(id(p) in shared for p in params.values()):
            continue
        weight, bias = params["weight"], params.get("bias")
        # N_i N_o and N_i + N_o whichever way round the weight is stored (Conv1D: N_i x N_o)
        width = sum(weight.shape) + (bias is not None)
        size = weight.numel() + (bias.numel() if bias is not None else 0)
        if tokens * width <= size:
            out.append(name)
    return out


def target_gradient(
    model: nn.Module,
    layers: Mapping[str, tuple[nn.Module, LayerAdapter]],
    batch: Batch,
    losses: ExampleLosses,
    chunk_size: int | None = None,
    *,
    keep_factors: bool = True,
) -> Target:
    """Gradient of ``sum_i L_i`` over ``batch`` (``L_i``: example ``i``'s summed-token
    loss) for each layer's captured parameters.

    Args:
        model: the model, called by ``losses``; its ``.grad`` is set aside during the
            backward and restored, so a training step in progress is untouched. Other
            capture engines on it (a training run's) do not record this pass.
        layers: name -> (module, adapter), e.g. an engine's ``captured_layers``.
        batch: tensors with the example axis first.
        losses: per-example summed losses of a batch; one forward call of ``model``.
        chunk_size: examples per forward/backward (default: all at once).
        keep_factors: keep the layers where they are smaller as factors (else vectors
            only).

    Returns:
        The :class:`Target`: per layer the ``(D,)`` vector (a parameter shared by several
        layers, such as tied weights, gets its full gradient in each of them) or, where
        smaller, its factors. Layers kept as factors are left out of autograd during the
        pass (their weight-gradient products skipped); their vectors are built from the
        factors only when asked for.
    """
    tokens = (
        sum(int(c["input_ids"].numel()) for c in target_chunks(batch, chunk_size))
        if "input_ids" in batch
        else 0
    )
    candidates = _smaller_as_factors(layers, tokens) if tokens and keep_factors else []
    keeper = _FactorKeeper()
    with contextlib.ExitStack() as stack:
        stack.enter_context(grads_set_aside(model))
        if candidates:
            names = "|".join(re.escape(name) for name in candidates)
            selection = LayerSelection("all", include=f"^(?:{names})$")
            engine = CaptureEngine(
                model, layers=selection, consumers=[keeper], parameter_grads=False
            )
            stack.enter_context(engine)
            stack.enter_context(engine.exclusive())
        else:
            stack.enter_context(capture_suspended())
        _summed_backward(model, batch, losses, chunk_size)
        factors = keeper.factors()
        vectors = {}
        for name, (module, adapter) in layers.items():
            if name in factors:
                continue
            params = adapter.captured_parameters(module)
            grads = {
                # this backward's own .grad tensors (set aside on exit): no copy needed
                local: p.grad.detach() if p.grad is not None else torch.zeros_like(p)
                for local, p in params.items()
            }
            vectors[name] = adapter.flatten(module, grads)
    return Target(vectors, factors)


def _summed_backward(
    model: nn.Module,
    batch: Batch,
    losses: ExampleLosses,
    chunk_size: int | None,
    weight: float = 1.0,
) -> None:
    """``weight * sum_i L_i`` over ``batch`` backpropagated, in :func:`target_chunks`
    (nothing for an empty batch)."""
    with torch.enable_grad():
        for chunk in target_chunks(batch, chunk_size):
            loss = losses(model, chunk).sum()
            (loss * weight if weight != 1.0 else loss).backward()


def target_chunks(batch: Batch, chunk_size: int | None) -> list[dict[str, Tensor]]:
    """``batch`` in chunks of ``chunk_size`` examples (default: one chunk). With a 2-D
    ``attention_mask`` the examples go longest first, so that each chunk holds examples of
    about one length, and each chunk is cut after its last attended column (trailing
    columns that only pad): a pool with one long example no longer pads every other one to
    its length. The summed loss is the same."""
    size = len(next(iter(batch.values())))
    mask = batch.get("attention_mask")
    ragged = isinstance(mask, Tensor) and mask.dim() == 2 and size > 0
    order = (
        torch.argsort(mask.sum(dim=1), descending=True, stable=True)  # type: ignore[union-attr]
        if ragged
        else torch.arange(size)
    )
    step = max(chunk_size or size, 1)
    chunks = []
    for start in range(0, size, step):
        rows = order[start : start + step]
        chunk = {k: v[rows.to(v.device)] for k, v in batch.items()}
        if ragged:
            attended = chunk["attention_mask"].any(dim=0).nonzero()
            length = chunk["attention_mask"].shape[1]
            width = int(attended.max()) + 1 if attended.numel() else length
            chunk = {
                k: v[:, :width] if v.dim() >= 2 and v.shape[1] == length else v
                for k, v in chunk.items()
            }
        chunks.append(chunk)
    return chunks


class ShardedTarget(Target):
    """A target on ``fully_shard``-ed parameters: per layer and captured parameter, this
    rank's shard (a DTensor, rows on dim 0) of the target's gradient. It lives sharded
    (``1/S`` of the captured parameters per rank); a layer's ``(D,)`` vector is gathered on
    each access and not kept, so scoring holds one layer's full target at a time.

    Attributes:
        peak_bytes: the largest layer vector gathered so far.
    """

    def __init__(
        self,
        shards: dict[str, dict[str, Tensor]],
        layers: Mapping[str, tuple[nn.Module, LayerAdapter]],
    ):
        super().__init__({}, {})
        self.shards = shards
        self.layers = layers
        self.peak_bytes = 0

    def __getitem__(self, name: str) -> Tensor:
        module, adapter = self.layers[name]
        full = {local: gathered(shard) for local, shard in self.shards[name].items()}
        vector = adapter.flatten(module, full)
        self.peak_bytes = max(self.peak_bytes, vector.numel() * vector.element_size())
        return vector

    def __iter__(self) -> Iterator[str]:
        return iter(self.shards)

    def __len__(self) -> int:
        return len(self.shards)

    def local_values(self) -> list[Tensor]:
        return [local(v) for shards in self.shards.values() for v in shards.values()]


def shared_target(
    model: nn.Module,
    layers: Mapping[str, tuple[nn.Module, LayerAdapter]],
    batch: Batch,
    losses: ExampleLosses,
    *,
    ranks: Ranks,
    divide: float,
    chunk_size: int | None = None,
) -> Target:
    """The target of ``batch`` computed once over the data-parallel ranks: rank ``r``
    backpropagates the examples ``r, r + W, ...`` and the parts are summed by one
    collective, so no rank computes the whole target.

    * Replicated parameters (DDP, one process each): each rank's part with the trainer's
      gradient sync off, then one all-reduce of every layer's vector in one flat buffer;
      every rank holds the whole ``(D,)`` target (no factor form).
    * ``fully_shard``-ed parameters: each rank's part through FSDP's own reduce-scatter
      (every rank joins it, a rank without examples with a zero-weighted pass), times
      ``divide`` (FSDP averages); the target stays sharded (:class:`ShardedTarget`).
    """
    if ranks.world == 1:
        return target_gradient(model, layers, batch, losses, chunk_size)
    size = len(next(iter(batch.values())))
    share = {k: v[ranks.rank :: ranks.world] for k, v in batch.items()}
    if not is_sharded(layers):
        with without_gradient_sync(model):
            part = target_gradient(model, layers, share, losses, chunk_size, keep_factors=False)
        vectors = part.vectors
        flat = torch.cat([vectors[name].flatten() for name in layers])
        ranks.all_reduce(flat)
        sizes = [vectors[name].numel() for name in layers]
        return Target(dict(zip(layers, flat.split(sizes), strict=True)))
    weight = 1.0
    if ranks.rank >= size:  # no example here: a zero-weighted pass joins the collectives
        share, weight = {k: v[:1] for k, v in batch.items()}, 0.0
    shards: dict[str, dict[str, Tensor]] = {}
    with grads_set_aside(model), capture_suspended():
        _summed_backward(model, share, losses, chunk_size, weight)
        for name, (module, adapter) in layers.items():
            shards[name] = {
                k: p.grad.detach() * divide if p.grad is not None else torch.zeros_like(p)
                for k, p in adapter.captured_parameters(module).items()
            }
    return ShardedTarget(shards, layers)


def nonfinite(target: Target, ranks: Ranks) -> bool:
    """Whether any value of ``target`` is not finite, on any rank (one host read)."""
    if isinstance(target, ShardedTarget):
        values = target.local_values()
    else:
        values = list(target.vectors.values())
        values += [t for f in target.factors.values() for t in (f.a, f.g)]
    flag = torch.stack([~torch.isfinite(v).all() for v in values]).any().to(torch.int32)
    return bool(
        ranks.all_reduce(flag, dist.ReduceOp.MAX) if isinstance(target, ShardedTarget) else flag
    )


class TargetPool:
    """The target examples, and which of them each refresh uses.

    Args:
        batch: the pool, tensors with the example axis first (``P`` examples).
        per_refresh: examples per refresh; ``None`` (default) or ``P``: the whole pool
            every time; ``m < P``: the next ``m`` examples in turn, wrapping around.
    """

    def __init__(self, batch: Batch, per_refresh: int | None = None):
        self.batch = dict(batch)
        self.size = len(next(iter(self.batch.values())))
        if per_refresh is not None and not 1 <= per_refresh <= self.size:
            raise ValueError(
                f"target_examples must be between 1 and the pool size {self.size}, got "
                f"{per_refresh}"
            )
        self.per_refresh = per_refresh or self.size
        #: Pool position of the next refresh's first example (saved with a checkpoint).
        self.next = 0
        #: Pool positions of the last :meth:`next_batch`.
        self.last_rows: list[int] = []

    def next_batch(self, device: torch.device | None = None) -> dict[str, Tensor]:
        """The examples of the coming refresh, moved to ``device``."""
        rows = (torch.arange(self.per_refresh) + self.next) % self.size
        self.next = (self.next + self.per_refresh) % self.size
        self.last_rows = rows.tolist()
        return {k: v[rows].to(device) for k, v in self.batch.items()}
