"""OLMo-core training that ends attribution-ready, then attribution from the store.

An OLMo-core ``Trainer`` trains a tiny OLMo-2 transformer (built from a config, CPU) on
Python reference paragraphs tokenized as bytes, with ``GradientCaptureCallback`` added
by ``TrainerConfig.with_callback``. Every step's per-example gradients (keyed by
OLMo-core's instance indices) and the K-FAC statistics land in the store with no second
pass; a few instances of the last step are then used as queries (their gradients at the
final weights) and attributed with GradCos, printing where each query's own instance ranks.

``--model DIR`` (a local Llama-architecture transformers directory) or ``--smollm2``
(SmolLM2-135M-Instruct, the cache ``make demo`` writes) trains a real model under OLMo-core
instead: a ``TransformerConfig.llama_like`` built from the checkpoint's config, the weights
converted by OLMo-core's HF state-dict converter and checked against the transformers
model's logits before training (for SmolLM2-135M-Instruct they agree exactly, max |diff|
0.0 on a 13-token probe), the same paragraphs tokenized by the checkpoint's tokenizer.
A step of the whole 30-block model is too slow for a CPU run of a few minutes, so only
the linear layers of the last ``--train-blocks`` blocks train, and are captured; the rest
is frozen (with SmolLM2 the whole job then takes about 1.5 minutes on CPU).

    python recipes/olmo_core_capture.py --out runs/olmo --steps 12
    python recipes/olmo_core_capture.py --smollm2 --out runs/olmo-smollm2
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from byte_text import VOCAB, encode, paragraphs  # the script's folder is on sys.path
from olmo_core.data import NumpyDataLoaderConfig, NumpyFSLDatasetConfig, TokenizerConfig
from olmo_core.nn.feed_forward import FeedForwardConfig
from olmo_core.nn.hf.convert import convert_state_from_hf
from olmo_core.nn.transformer import Transformer, TransformerConfig
from olmo_core.optim import AdamWConfig
from olmo_core.train import Duration, TrainerConfig
from olmo_core.train.train_module import TransformerTrainModuleConfig
from smollm2 import add_model_flags, load_pretrained, model_dir, train_only_last_blocks
from transformers import PretrainedConfig

from tda_plugins import CaptureEngine, causal_lm_example_losses
from tda_plugins.integrations.olmo_core import GradientCaptureCallback
from tda_plugins.methods import method_by_name
from tda_plugins.session.settings import CaptureSettings
from tda_plugins.store import GradientStore, StoreReader

PROBE = "The with statement is used to wrap the execution of a block."
LOGIT_TOLERANCE = 1e-4  # relative to the largest logit; fp32 rounding is ~1e-6


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default="runs/olmo", help="output directory")
    p.add_argument("--steps", type=int, default=12, help="optimizer steps")
    p.add_argument("--sequence", type=int, default=64, help="tokens per instance")
    p.add_argument("--batch", type=int, default=8, help="instances per optimizer step")
    p.add_argument("--micro-batch", type=int, default=4, help="instances per forward/backward")
    p.add_argument("--queries", type=int, default=3, help="training instances used as queries")
    p.add_argument(
        "--learning-rate",
        type=float,
        help="AdamW learning rate (default: 3e-3 for the tiny model, 1e-4 for a real one)",
    )
    add_model_flags(p)
    p.add_argument(
        "--train-blocks",
        type=int,
        default=2,
        help="with a real model: train and capture the linear layers of the last n blocks, "
        "freeze the rest",
    )
    args = p.parse_args(argv)
    args.model_dir = model_dir(args, p)
    if args.learning_rate is None:
        args.learning_rate = 3e-3 if args.model_dir is None else 1e-4
    return args


@dataclass
class ModelWithTokenizer:
    """An OLMo-core model with the tokenizer its training data is written with."""

    transformer: Transformer
    tokenizer: TokenizerConfig
    encode: Callable[[str], list[int]]


def tiny_model() -> ModelWithTokenizer:
    """A 2-block OLMo-2 transformer from a config, on UTF-8 bytes (eos and padding 0)."""
    transformer = TransformerConfig.olmo2_1M(vocab_size=VOCAB, n_layers=2).build(init_device="cpu")
    return ModelWithTokenizer(
        transformer, TokenizerConfig(vocab_size=VOCAB, eos_token_id=0, pad_token_id=0), encode
    )


def llama_config(config: PretrainedConfig) -> TransformerConfig:
    """The OLMo-core config of a transformers Llama checkpoint (pre-norm blocks, RMSNorm,
    grouped-query attention with RoPE, SwiGLU, optionally tied embeddings)."""
    rope = config.rope_parameters
    unsupported = {
        "model_type": (config.model_type, "llama"),
        "hidden_act": (config.hidden_act, "silu"),
        "attention_bias": (config.attention_bias, False),
        "mlp_bias": (config.mlp_bias, False),
        "rope_type": (rope["rope_type"], "default"),
    }
    wrong = {k: got for k, (got, want) in unsupported.items() if got != want}
    if wrong:
        raise ValueError(
            f"this recipe maps plain Llama checkpoints to OLMo-core, but the checkpoint has "
            f"{wrong}; give a Llama-architecture model (model_type 'llama', SiLU MLP, no "
            "biases, unscaled RoPE) such as SmolLM2, or run without --model"
        )
    return TransformerConfig.llama_like(
        d_model=config.hidden_size,
        vocab_size=config.vocab_size,
        n_layers=config.num_hidden_layers,
        n_heads=config.num_attention_heads,
        n_kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        layer_norm_eps=config.rms_norm_eps,
        rope_theta=int(rope["rope_theta"]),
        feed_forward=FeedForwardConfig(hidden_size=config.intermediate_size, bias=False),
        tie_word_embeddings=config.tie_word_embeddings,
    )


def pretrained_model(directory: Path, train_blocks: int) -> ModelWithTokenizer:
    """A transformers Llama checkpoint as an OLMo-core model with its last ``train_blocks``
    blocks' linear layers trainable; refuses weights whose logits differ from the
    transformers model's on a probe sentence (a config or conversion mismatch)."""
    hf_model, tokenizer = load_pretrained(directory)
    config = hf_model.config
    transformer = llama_config(config).build(init_device="cpu")
    state = convert_state_from_hf(config, hf_model.state_dict(), model_type=config.model_type)
    transformer.load_state_dict(state)
    probe = torch.tensor([tokenizer(PROBE)["input_ids"]])
    with torch.no_grad():
        reference = hf_model(probe).logits
        difference = (transformer(probe) - reference).abs().max().item()
    scale = reference.abs().max().item()
    print(
        f"OLMo-core vs transformers logits on {probe.shape[1]} tokens: max |diff| "
        f"{difference:.2e} (logits up to {scale:.3g})"
    )
    if not difference <= LOGIT_TOLERANCE * scale:
        raise RuntimeError(
            f"the OLMo-core model's logits differ from {directory}'s by up to {difference:.3g} "
            f"(> {LOGIT_TOLERANCE} of their largest, {scale:.3g}): llama_config misses a "
            "setting of this checkpoint's config.json; compare the two models block by block"
        )
    trained = train_only_last_blocks(transformer, train_blocks)
    print(f"training and capturing {len(trained)} linear layers, {trained[0]}...")
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    tokens = TokenizerConfig(vocab_size=config.vocab_size, eos_token_id=eos, pad_token_id=pad)
    return ModelWithTokenizer(transformer, tokens, lambda text: tokenizer(text)["input_ids"])


def write_tokens(
    folder: Path, sequence: int, instances: int, model: ModelWithTokenizer
) -> NumpyFSLDatasetConfig:
    """Reference paragraphs in ``model``'s tokens, each ended by eos, one instance per
    ``sequence`` tokens."""
    tokens: list[int] = []
    for _, text in paragraphs():
        tokens += [*model.encode(text), model.tokenizer.eos_token_id]
        if len(tokens) >= sequence * instances:
            break
    path = folder / "tokens.npy"
    config = NumpyFSLDatasetConfig(
        paths=[str(path)],
        sequence_length=sequence,
        tokenizer=model.tokenizer,
        work_dir=str(folder / "data"),
    )
    folder.mkdir(parents=True, exist_ok=True)
    np.asarray(tokens[: sequence * instances], dtype=config.get_dtype()).tofile(path)
    return config


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    torch.manual_seed(0)
    if args.model_dir is None:
        setup = tiny_model()
    else:
        setup = pretrained_model(args.model_dir, args.train_blocks)
    model = setup.transformer
    dataset = write_tokens(out, args.sequence, args.steps * args.batch, setup).build()
    loader = NumpyDataLoaderConfig(global_batch_size=args.batch * args.sequence, seed=0).build(
        dataset
    )
    module = TransformerTrainModuleConfig(
        rank_microbatch_size=args.micro_batch * args.sequence,
        max_sequence_length=args.sequence,
        optim=AdamWConfig(lr=args.learning_rate),
    ).build(model, device=torch.device("cpu"))
    settings = CaptureSettings.from_options(store_dir=str(out / "store"), layers="linear")
    trainer = (
        TrainerConfig(
            save_folder=str(out / "trainer"),
            max_duration=Duration.steps(args.steps),
            no_checkpoints=True,
            metrics_collect_interval=1,
        )
        .with_callback("tda", GradientCaptureCallback(settings))
        .build(module, loader)
    )
    trainer.fit()

    store = StoreReader(out / "store")
    print(f"store: {store.num_examples} per-example gradients over steps {store.steps}")
    # Queries: instances of the last step, whose stored gradients were taken at nearly the
    # final weights (gradients captured at early weights point elsewhere).
    everything = store.load_all()
    last = everything.steps == everything.steps.max()
    picked = everything.example_ids[last][: args.queries].tolist()
    query_dir = out / "queries"
    query_store = GradientStore(query_dir)
    ids = torch.stack([torch.as_tensor(dataset[i]["input_ids"]) for i in picked]).long()
    with CaptureEngine(model, layers=settings.layers.selection, consumers=[query_store]) as engine:
        engine.set_example_ids(torch.tensor(picked))
        logits = model(ids)
        causal_lm_example_losses(logits, ids).sum().backward()
        engine.end()
    scores = method_by_name("gradcos").score(store, StoreReader(query_dir))
    train_ids = scores.train_ids.tolist()
    for column, query in enumerate(scores.query_ids.tolist()):
        order = torch.argsort(scores.values[:, column], descending=True).tolist()
        rank = [train_ids[i] for i in order].index(query) + 1
        print(
            f"query instance {query}: top training instance {train_ids[order[0]]}; its own "
            f"instance ranks {rank} of {len(train_ids)}"
        )
    scores.save(out / "scores")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
