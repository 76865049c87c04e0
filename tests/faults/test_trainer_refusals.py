"""Trainer setups the transformers callbacks cannot follow exactly are refused before step 0.

Each case builds the real thing where this machine can (DTensor parameters on a one-rank
gloo group; FSDP1 on CPU; a ``ParallelismConfig``; ZeRO-3's parameter attribute) and
asserts that every callback refuses it at ``on_train_begin`` with one line naming the
cause and the fix, and that nothing was trained or written. The supported setups next to
them (FSDP2's own DTensor parameters, HSDP placements) are accepted.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
from torch.distributed.tensor import Shard, distribute_tensor
from transformers import TrainerControl, TrainerState

from tda_plugins.integrations.transformers import (
    DataSelectionCallback,
    GradientCaptureCallback,
    InfluenceLoggingCallback,
)
from tda_plugins.integrations.transformers.setup import check_trainer_setup
from tda_plugins.session import UnsupportedTrainingSetup
from tests.models import tiny_causal_lm
from tests.trainers import token_rows, training_args

ROWS = [{"input_ids": r} for r in token_rows(2, seed=3)]
CALLBACKS: dict[str, Callable[[Path], Any]] = {
    "capture": lambda tmp: GradientCaptureCallback(store_dir=str(tmp / "store"), layers="all"),
    "influence": lambda tmp: InfluenceLoggingCallback(queries=ROWS, layers="all"),
    "selection": lambda tmp: DataSelectionCallback(target=ROWS, layers="all"),
}


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    """A gloo process group of one rank (DTensors and FSDP need one)."""
    with tempfile.NamedTemporaryFile() as file:
        dist.init_process_group("gloo", store=dist.FileStore(file.name, 1), rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def assert_refused(tmp: Path, model: nn.Module, *fragments: str, **args: Any) -> None:
    """Every callback refuses at on_train_begin, one line holding ``fragments``; the model
    keeps its weights and no store exists."""
    before = {k: v.clone() for k, v in model.state_dict().items() if not v.is_meta}
    for name, make in CALLBACKS.items():
        callback = make(tmp)
        arguments = training_args(tmp / "out", **args)
        with pytest.raises(UnsupportedTrainingSetup) as refused:
            callback.on_train_begin(arguments, TrainerState(), TrainerControl(), model=model)
        message = str(refused.value)
        assert "\n" not in message, name
        for fragment in fragments:
            assert fragment in message, (name, fragment, message)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert not (tmp / "store").exists()


def llama() -> nn.Module:
    return tiny_causal_lm("llama", torch.float32)


def test_deepspeed_enabled_through_the_accelerate_environment_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``accelerate launch`` with a DeepSpeed config sets ACCELERATE_USE_DEEPSPEED (the
    training arguments are built first: with it set they need DeepSpeed installed)."""
    args = training_args(tmp_path / "out")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(UnsupportedTrainingSetup, match="ACCELERATE_USE_DEEPSPEED"):
        check_trainer_setup(args, llama())
    for make in CALLBACKS.values():
        with pytest.raises(UnsupportedTrainingSetup, match=r"DeepSpeed .* FSDP2"):
            make(tmp_path).on_train_begin(args, TrainerState(), TrainerControl(), model=llama())
    assert not (tmp_path / "store").exists()


def test_deepspeed_in_the_training_arguments_is_refused(tmp_path: Path) -> None:
    args = training_args(tmp_path / "out")
    args.deepspeed = "ds_config.json"  # what --deepspeed sets (deepspeed is not installed)
    with pytest.raises(UnsupportedTrainingSetup, match="DeepSpeed"):
        check_trainer_setup(args, llama())


def test_zero3_partitioned_parameters_are_refused(tmp_path: Path) -> None:
    """ZeRO-3 marks every parameter it partitions with ``ds_id``."""
    model = llama()
    for i, p in enumerate(model.parameters()):
        p.ds_id = i  # type: ignore[attr-defined]
    assert_refused(tmp_path, model, "DeepSpeed")


def test_fsdp1_is_refused(tmp_path: Path, one_rank_group: None) -> None:
    model = FullyShardedDataParallel(llama(), device_id=torch.device("cpu"))
    assert_refused(tmp_path, model, "FSDP1", "FSDP2")


def test_fsdp1_in_the_training_arguments_is_refused(tmp_path: Path) -> None:
    args = training_args(tmp_path / "out")
    args.fsdp, args.fsdp_config = "full_shard", {"version": 1}
    with pytest.raises(UnsupportedTrainingSetup, match="FSDP1 flattens"):
        check_trainer_setup(args, llama())


def test_tensor_parallel_dtensor_parameters_are_refused(
    tmp_path: Path, one_rank_group: None
) -> None:
    """A weight sharded on its input dimension (row-wise tensor parallelism) without
    fully_shard: each rank would hold part of every per-example gradient."""
    model = llama()
    mesh = init_device_mesh("cpu", (1,))
    layer = model.model.layers[0].mlp.down_proj
    layer.weight = nn.Parameter(distribute_tensor(layer.weight.detach(), mesh, [Shard(1)]))
    assert_refused(tmp_path, model, "Linear.weight", "tensor parallel")


def test_column_sharded_dtensor_without_fully_shard_is_refused(
    tmp_path: Path, one_rank_group: None
) -> None:
    """Shard(0) alone is what column-wise tensor parallelism also uses: only fully_shard's
    own parameters are accepted."""
    model = llama()
    mesh = init_device_mesh("cpu", (1,))
    layer = model.model.layers[0].self_attn.q_proj
    layer.weight = nn.Parameter(distribute_tensor(layer.weight.detach(), mesh, [Shard(0)]))
    assert_refused(tmp_path, model, "tensor parallel")


def test_fully_shard_parameters_are_accepted(one_rank_group: None, tmp_path: Path) -> None:
    model = llama()
    mesh = init_device_mesh("cpu", (1,))
    for block in model.model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert check_trainer_setup(training_args(tmp_path), model) is model


def test_tensor_parallel_in_the_parallelism_config_is_refused(tmp_path: Path) -> None:
    from accelerate.parallelism_config import ParallelismConfig

    args = training_args(tmp_path / "out")
    args.parallelism_config = ParallelismConfig(tp_size=2)
    with pytest.raises(UnsupportedTrainingSetup, match="tp_size=2 splits each layer"):
        check_trainer_setup(args, llama())


def test_a_model_split_over_several_devices_is_refused(tmp_path: Path) -> None:
    """A device_map or pipeline split (here: one block on the meta device)."""
    model = llama()
    model.model.layers[1].to("meta")
    assert_refused(tmp_path, model, "2 devices", "one device per process")


def test_a_compiled_model_is_refused(tmp_path: Path) -> None:
    assert_refused(tmp_path, torch.compile(llama()), "torch.compile")


def test_packing_is_refused(tmp_path: Path) -> None:
    from trl import SFTConfig

    args = training_args(tmp_path / "out", SFTConfig, packing=True)
    with pytest.raises(UnsupportedTrainingSetup, match="packing=True"):
        check_trainer_setup(args, llama())
