"""OLMo-core training that ends attribution-ready, then attribution from the store.

An OLMo-core ``Trainer`` trains a tiny OLMo-2 transformer (built from a config, CPU) on
Python reference paragraphs tokenized as bytes, with ``GradientCaptureCallback`` added
by ``TrainerConfig.with_callback``. Every step's per-example gradients (keyed by
OLMo-core's instance indices) and the K-FAC statistics land in the store with no second
pass; a few instances of the last step are then used as queries (their gradients at the
final weights) and attributed with GradCos, printing where each query's own instance ranks.

    python recipes/olmo_core_capture.py --out runs/olmo --steps 12
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
from byte_text import VOCAB, encode, paragraphs  # the script's folder is on sys.path
from olmo_core.data import NumpyDataLoaderConfig, NumpyFSLDatasetConfig, TokenizerConfig
from olmo_core.nn.transformer import TransformerConfig
from olmo_core.optim import AdamWConfig
from olmo_core.train import Duration, TrainerConfig
from olmo_core.train.train_module import TransformerTrainModuleConfig

from tda_plugins import CaptureEngine, LayerSelection, causal_lm_example_losses
from tda_plugins.integrations.olmo_core import GradientCaptureCallback
from tda_plugins.methods import method_by_name
from tda_plugins.session import CaptureSettings
from tda_plugins.store import GradientStore, StoreReader


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default="runs/olmo", help="output directory")
    p.add_argument("--steps", type=int, default=12, help="optimizer steps")
    p.add_argument("--sequence", type=int, default=64, help="tokens per instance")
    p.add_argument("--batch", type=int, default=8, help="instances per optimizer step")
    p.add_argument("--micro-batch", type=int, default=4, help="instances per forward/backward")
    p.add_argument("--queries", type=int, default=3, help="training instances used as queries")
    p.add_argument("--learning-rate", type=float, default=3e-3, help="AdamW learning rate")
    return p.parse_args(argv)


def write_tokens(folder: Path, sequence: int, instances: int) -> NumpyFSLDatasetConfig:
    """Byte tokens of reference paragraphs, one instance per ``sequence`` tokens."""
    tokens: list[int] = []
    for _, text in paragraphs():
        tokens += [*encode(text), 0]
        if len(tokens) >= sequence * instances:
            break
    tokenizer = TokenizerConfig(vocab_size=VOCAB, eos_token_id=0, pad_token_id=0)
    path = folder / "tokens.npy"
    config = NumpyFSLDatasetConfig(
        paths=[str(path)],
        sequence_length=sequence,
        tokenizer=tokenizer,
        work_dir=str(folder / "data"),
    )
    folder.mkdir(parents=True, exist_ok=True)
    np.asarray(tokens[: sequence * instances], dtype=config.get_dtype()).tofile(path)
    return config


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    torch.manual_seed(0)
    dataset = write_tokens(out, args.sequence, args.steps * args.batch).build()
    loader = NumpyDataLoaderConfig(global_batch_size=args.batch * args.sequence, seed=0).build(
        dataset
    )
    model = TransformerConfig.olmo2_1M(vocab_size=VOCAB, n_layers=2).build(init_device="cpu")
    module = TransformerTrainModuleConfig(
        rank_microbatch_size=args.micro_batch * args.sequence,
        max_sequence_length=args.sequence,
        optim=AdamWConfig(lr=args.learning_rate),
    ).build(model, device=torch.device("cpu"))
    settings = CaptureSettings(store_dir=str(out / "store"), layers="linear")
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
    with CaptureEngine(model, LayerSelection("linear"), None, [query_store]) as engine:
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
