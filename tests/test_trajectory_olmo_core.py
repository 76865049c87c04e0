"""OLMo-core's ``Trainer`` with ``GradientCaptureCallback(record_trajectory=True)``.

The tiny OLMo-2 run of ``tests.test_olmo_core`` (two micro-batches per step, a warmup
scheduler, so the learning rate moves every step) records a trajectory, checked against
what the optimizer itself held after each step (read by a callback that runs after the
update) and against the store: Adam's second moment rebuilt from the stored per-example
gradients, each divided by its recorded ``loss_scale``, equals the recorded one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from olmo_core.optim import LinearWithWarmup
from olmo_core.train.callbacks import Callback

from tda_plugins.capture.adapters import DEFAULT_REGISTRY
from tda_plugins.integrations.olmo_core import GradientCaptureCallback
from tda_plugins.session import CaptureSettings
from tda_plugins.store import StoreReader
from tda_plugins.trajectory import TrajectoryReader
from tests.stores import rel_error
from tests.test_olmo_core import fit

STEPS = 3


@dataclass
class OptimizerAfterStep(Callback):
    """After each step: the first group's learning rate and every parameter's
    ``exp_avg_sq``, by parameter name."""

    lrs: list[float] = field(default_factory=list)
    second_moments: list[dict[str, torch.Tensor]] = field(default_factory=list)

    def post_step(self) -> None:
        module = self.trainer.train_module
        optimizer = module.optim
        self.lrs.append(float(optimizer.param_groups[0]["lr"]))
        self.second_moments.append(
            {
                n: optimizer.state[p]["exp_avg_sq"].clone()
                for n, p in module.model.named_parameters()
                if p in optimizer.state
            }
        )


def test_olmo_core_run_records_the_optimizers_steps(tmp_path: Path) -> None:
    store = tmp_path / "grads"
    settings = CaptureSettings(store_dir=str(store), curvature=False, record_trajectory=True)
    after = OptimizerAfterStep()
    trainer = fit(
        tmp_path,
        {"tda": GradientCaptureCallback(settings), "after": after},
        steps=STEPS,
        save_folder=tmp_path / "run",
        scheduler=LinearWithWarmup(warmup_steps=2),
    )
    model = trainer.train_module.model
    trajectory = TrajectoryReader(store)
    assert trajectory.steps == list(range(STEPS))
    assert len(set(after.lrs)) == STEPS  # the learning rate moved every step
    chunk = StoreReader(store).load_all()
    rebuilt: dict[str, torch.Tensor] = {}
    for step in trajectory.steps:
        record = trajectory.record(step)
        assert [g.lr for g in record.groups] == [after.lrs[step]]
        assert record.clip == 1.0  # no max_grad_norm
        rows = (chunk.steps == step).nonzero().flatten()
        assert chunk.example_ids[rows].tolist() == record.example_ids.tolist()
        beta2 = record.groups[0].beta2
        for layer in trajectory.layers:
            module = model.get_submodule(layer)
            adapter = DEFAULT_REGISTRY.lookup(module)
            assert adapter is not None
            held = {
                local: after.second_moments[step][f"{layer}.{local}"]
                for local in adapter.captured_parameters(module)
            }
            recorded = trajectory.second_moment(step, layer)
            assert torch.equal(recorded, adapter.flatten(module, held))
            update = chunk.layers[layer].materialize()[rows]
            update = (update.double() / record.loss_scale[:, None]).sum(dim=0)
            previous = rebuilt.get(layer, torch.zeros_like(update))
            rebuilt[layer] = beta2 * previous + (1 - beta2) * update.square()
            assert rel_error(recorded, rebuilt[layer]) < 1e-4, (step, layer)
