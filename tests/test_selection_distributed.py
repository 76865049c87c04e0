"""Data selection on a ``fully_shard``-ed model it cannot edit exactly: refused before the
first step, in one process (a one-rank process group).

The two-rank selection runs, each against one process on the same global batches, are in
``tests/test_hf_distributed.py`` (the DDP ``Trainer`` and an FSDP2 model) and
``tests/test_olmo_core_distributed.py`` (OLMo-core DDP, FSDP and HSDP): one torchrun
launch per framework.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard
from transformers import TrainerControl, TrainerState

from tda_plugins.integrations.transformers import DataSelectionCallback
from tda_plugins.session.capture import UnsupportedTrainingSetup
from tests.models import tiny_causal_lm
from tests.selection_ddp_worker import target_rows
from tests.selection_helpers import PINNED
from tests.trainers import training_args


@pytest.mark.parametrize(
    "options, reason",
    [
        ({"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16)}, "MixedPrecisionPolicy"),
        ({"shard_placement_fn": lambda p: Shard(1) if p.dim() == 2 else None}, "laid out as"),
    ],
    ids=["mixed-precision", "shard-dim-1"],
)
def test_sharded_layouts_it_cannot_edit_exactly_are_refused_before_step_0(
    tmp_path: Path, options: dict[str, Any], reason: str
) -> None:
    """``fully_shard`` with mixed-precision parameters, or sharding a weight on dim 1: the
    callback refuses at ``on_train_begin`` with the reason and the way out, and leaves no
    hook of its own on the model (a one-rank process group, so the test runs in one process)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        model = tiny_causal_lm("llama", torch.float32)
        fully_shard(model, **options)
        selection = DataSelectionCallback(target_rows(), layers="all", **PINNED)
        hooks = {
            n: (len(m._forward_hooks), len(m._forward_pre_hooks)) for n, m in model.named_modules()
        }
        args = training_args(tmp_path / "out", max_grad_norm=1.0)
        with pytest.raises(UnsupportedTrainingSetup, match=reason) as info:
            selection.on_train_begin(args, TrainerState(), TrainerControl(), model=model)
        assert "; " in str(info.value)  # the reason, then the way out
        assert args.max_grad_norm == 1.0
        after = {
            n: (len(m._forward_hooks), len(m._forward_pre_hooks)) for n, m in model.named_modules()
        }
        assert after == hooks, "the refused callback left hooks on the model"
    finally:
        dist.destroy_process_group()
