"""One rank of an OLMo-core ``Trainer`` run with ``GradientCaptureCallback``: the subject of
the data-parallel tests.

:func:`main`, on every rank of a two-rank launch (``tests/ranks_worker.py``, job
``olmo_core_dist_worker:MODE,...``: modes among ``ddp fsdp hsdp``, one after the other in
the same processes), trains the tiny OLMo-2 transformer
(fp32, CPU, gloo) for :data:`STEPS` steps on the token file that :func:`write_tokens` put
in ``FOLDER``, data-parallel through OLMo-core's own
``TransformerTrainModuleConfig(dp_config=TransformerDataParallelConfig(name=...))``
(``replicate`` for DDP, ``fully_shard`` for FSDP; for HSDP ``fully_shard`` over a 2-D
mesh of two replicas of a one-rank shard group: on two ranks HSDP can replicate or shard
but not both, and the replicas are what sets it apart from FSDP), AdamW with a non-zero
learning rate, two micro-batches per rank and step, and captures every layer
(``layers="all"``: linear, embedding, norm scales; K-FAC statistics and Adam moments too)
into ``FOLDER/<mode>/grads``.
Each rank saves ``FOLDER/<mode>/rank<r>.pt``: its batch's instance indices at each step
and (rank 0) the full parameters each step started from.

:func:`train` with ``mode="single"`` is the one-process reference on the same data and
global batch size (no ``torch.distributed``, two micro-batches per step); the test calls
it in its own process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import olmo_core.distributed.parallel as olmo_parallel
import torch
import torch.distributed as dist
from olmo_core.data import NumpyDataLoaderConfig, NumpyFSLDatasetConfig, TokenizerConfig
from olmo_core.distributed.parallel import DataParallelType
from olmo_core.nn.transformer import TransformerConfig
from olmo_core.optim import AdamWConfig
from olmo_core.train import Duration, TrainerConfig
from olmo_core.train.callbacks import Callback
from olmo_core.train.train_module import (
    TransformerDataParallelConfig,
    TransformerTrainModule,
    TransformerTrainModuleConfig,
)
from torch import Tensor
from torch.distributed.tensor import DTensor

from tda_plugins.integrations.olmo_core import GradientCaptureCallback
from tda_plugins.session.settings import CaptureSettings

Mode = Literal["single", "ddp", "fsdp", "hsdp"]
#: The modes a launch trains in, by name.
PARALLEL_MODES: dict[str, Mode] = {"ddp": "ddp", "fsdp": "fsdp", "hsdp": "hsdp"}

VOCAB = 64
SEQ = 8
INSTANCES = 24
GLOBAL_BATCH = 4  # instances per optimizer step, over all ranks
WORLD = 2
STEPS = 3
LEARNING_RATE = 1e-2
MODEL = TransformerConfig.olmo2_1M(vocab_size=VOCAB, n_layers=2)


#: The label mask of a folder's tokens, where :func:`write_label_mask` wrote one.
LABEL_MASK = "label_mask.npy"


def dataset_config(folder: Path, mode: Mode) -> NumpyFSLDatasetConfig:
    tokenizer = TokenizerConfig(vocab_size=VOCAB, eos_token_id=0, pad_token_id=0)
    mask = folder / LABEL_MASK
    return NumpyFSLDatasetConfig(
        paths=[str(folder / "tokens.npy")],
        label_mask_paths=[str(mask)] if mask.exists() else None,
        sequence_length=SEQ,
        tokenizer=tokenizer,
        work_dir=str(folder / mode / "data"),
    )


def write_tokens(folder: Path) -> None:
    """``INSTANCES`` random sequences of ``SEQ`` tokens, in OLMo-core's raw token format."""
    dtype = dataset_config(folder, "single").get_dtype()
    tokens = np.random.default_rng(0).integers(1, VOCAB, size=INSTANCES * SEQ).astype(dtype)
    tokens.tofile(folder / "tokens.npy")  # no .npy header: OLMo-core reads raw arrays


def write_label_mask(folder: Path) -> None:
    """A label mask over :func:`write_tokens`' tokens that leaves out about a third of
    them at random, so that instances, and ranks, hold unequal counts of label tokens."""
    mask = np.random.default_rng(1).random(INSTANCES * SEQ) > 0.35
    mask.tofile(folder / LABEL_MASK)


def _full(t: Tensor) -> Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


@dataclass
class StepLog(Callback):
    """Before each step: this rank's instance indices and the full parameters; and the
    DTensor placements of the parameters (their layout under FSDP/HSDP)."""

    indices: list[Tensor] = field(default_factory=list)
    params: list[dict[str, Tensor]] = field(default_factory=list)
    placements: set[str] = field(default_factory=set)

    def pre_step(self, batch: dict) -> None:
        self.indices.append(batch["index"].clone())
        train_module = self.trainer.train_module
        assert isinstance(train_module, TransformerTrainModule)
        model = train_module.model
        self.placements |= {str(p.placements) for p in model.parameters() if isinstance(p, DTensor)}
        # Under FSDP full_tensor() is an all-gather, which every rank joins here.
        self.params.append({n: _full(p) for n, p in model.named_parameters()})


def dp_config(mode: str) -> TransformerDataParallelConfig | None:
    """OLMo-core's data-parallel config of ``mode`` (``single``: none). HSDP: two
    replicas (gradients all-reduced across them) of a one-rank shard group."""
    if mode == "single":
        return None
    if mode == "hsdp":
        return TransformerDataParallelConfig(
            name=DataParallelType.hsdp, num_replicas=WORLD, shard_degree=1
        )
    return TransformerDataParallelConfig(name=DataParallelType(mode))


def loader_and_module(folder: Path, mode: str) -> tuple[Any, TransformerTrainModule]:
    """The data loader of ``folder``'s tokens for ``mode`` and a train module of
    :data:`MODEL` with two micro-batches per rank, built through ``mode``'s
    :func:`dp_config` (what every OLMo-core worker trains). A worker may call it once per
    mode: each builds its own device mesh."""
    # OLMo-core builds its device mesh once per process (a module-level mesh with no
    # public reset); forget the previous mode's.
    olmo_parallel._WORLD_MESH = None
    world = 1 if mode == "single" else WORLD
    dataset = dataset_config(folder, mode).build()  # type: ignore[arg-type]
    loader = NumpyDataLoaderConfig(global_batch_size=GLOBAL_BATCH * SEQ, seed=0).build(dataset)
    module = TransformerTrainModuleConfig(
        rank_microbatch_size=GLOBAL_BATCH // world // 2 * SEQ,  # two micro-batches per rank
        max_sequence_length=SEQ,
        optim=AdamWConfig(lr=LEARNING_RATE),
        dp_config=dp_config(mode),
    ).build(MODEL.build(init_device="cpu"), device=torch.device("cpu"))
    return loader, module


def train(folder: Path, mode: Mode) -> StepLog:
    """Train :data:`STEPS` steps, capturing into ``folder/mode/grads``."""
    torch.manual_seed(0)
    loader, module = loader_and_module(folder, mode)
    settings = CaptureSettings.from_options(store_dir=str(folder / mode / "grads"), layers="all")
    log = StepLog()
    config = TrainerConfig(
        save_folder=str(folder / mode / "run"),
        max_duration=Duration.steps(STEPS),
        metrics_collect_interval=1,
        no_checkpoints=True,
    ).with_callbacks({"tda": GradientCaptureCallback(settings), "log": log})
    config.build(module, loader).fit()
    return log


def save_log(log: StepLog, path: Path, keep_params: bool) -> None:
    params = log.params if keep_params else []
    torch.save({"indices": log.indices, "params": params, "placements": log.placements}, path)


def main(folder: Path, *modes: str) -> None:
    rank = dist.get_rank()
    for name in modes:
        mode = PARALLEL_MODES[name]
        save_log(train(folder, mode), folder / mode / f"rank{rank}.pt", keep_params=rank == 0)


def save_each_mode(
    folder: Path, modes: Iterable[str], train: Callable[[Path, str], dict[str, Any]]
) -> None:
    """On this rank: ``train(folder, mode)`` of each mode in turn, saved as
    ``folder/<mode>/rank<r>.pt`` (the ``main`` of the influence and selection workers)."""
    for mode in modes:
        torch.save(train(folder, mode), folder / mode / f"rank{dist.get_rank()}.pt")
