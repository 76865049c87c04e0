"""Engine lifecycle: consumers, step boundaries, ids, detaching, no leaks, no host syncs."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import Tensor, nn
from transformers.pytorch_utils import Conv1D

from tda_plugins import CaptureConsumer, CaptureEngine, LayerSelection, MicroBatchRecord
from tda_plugins.capture import RecordCollector, content_hash
from tests.models import lm_batch, tiny_causal_lm


class Mixed(nn.Module):
    """One of each supported layer type, reading token ids."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.norm = nn.LayerNorm(8)
        self.rms = nn.RMSNorm(8)
        self.fc = nn.Linear(8, 8)
        self.conv = Conv1D(4, 8)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        h = self.rms(self.norm(self.emb(input_ids)))
        return self.conv(torch.tanh(self.fc(h))).sum(dim=(1, 2))


class StepLog(CaptureConsumer):
    wants_step_records = True

    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []
        self.step_records: list[list[MicroBatchRecord]] = []

    def on_micro_batch(self, record: MicroBatchRecord) -> None:
        self.events.append(("micro", record.step))

    def on_optimizer_step(self, step: int, records: list[MicroBatchRecord]) -> None:
        self.events.append(("step", step))
        self.step_records.append(records)

    def on_end(self) -> None:
        self.events.append(("end", -1))


def _ids(batch: int = 3, length: int = 6) -> Tensor:
    return torch.randint(0, 20, (batch, length), generator=torch.Generator().manual_seed(0))


def test_consumers_see_micro_batches_steps_and_end_in_order() -> None:
    model, log = Mixed(), StepLog()
    with CaptureEngine(model, layers=LayerSelection("all"), consumers=[log]) as engine:
        for _ in range(2):
            for _ in range(3):
                model(_ids()).sum().backward()
            engine.optimizer_step()
        engine.end()
    micro_then_step = [("micro", 0)] * 3 + [("step", 0)] + [("micro", 1)] * 3 + [("step", 1)]
    assert log.events == [*micro_then_step, ("end", -1)]
    assert [len(r) for r in log.step_records] == [3, 3]
    assert set(log.step_records[0][0].layers) == {"emb", "norm", "rms", "fc", "conv"}


def test_micro_batch_finishes_at_end_of_backward_without_flush() -> None:
    model, collector = Mixed(), RecordCollector()
    with CaptureEngine(model, layers=LayerSelection("all"), consumers=[collector]):
        model(_ids()).sum().backward()
        assert len(collector.records) == 1


def test_step_records_are_released_after_the_step() -> None:
    model, log = Mixed(), StepLog()
    with CaptureEngine(model, layers=LayerSelection("all"), consumers=[log]) as engine:
        model(_ids()).sum().backward()
        assert engine.held_bytes() > 0
        engine.optimizer_step()
        assert engine.held_bytes() == 0


def test_without_step_consumers_the_engine_holds_nothing() -> None:
    model = Mixed()
    with CaptureEngine(
        model, layers=LayerSelection("all"), consumers=[RecordCollector()]
    ) as engine:
        model(_ids()).sum().backward()
        assert engine.held_bytes() == 0


def _live_tensors() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) in (Tensor, nn.Parameter))


def test_thousand_forward_only_calls_leave_memory_unchanged() -> None:
    """Evaluation-style forwards (with and without grad) neither record nor hold tensors."""
    model, collector = Mixed(), RecordCollector()
    ids = _ids()
    with CaptureEngine(model, layers=LayerSelection("all"), consumers=[collector]) as engine:
        model(ids)  # warm-up: lazily created state exists before the baseline
        before = _live_tensors()
        for i in range(1000):
            if i % 2:
                with torch.no_grad():
                    model(ids)
            else:
                model(ids)  # grad enabled, never backpropagated
        engine.flush()
        # at most as many: a background thread of an earlier test in this process may
        # let go of its tensors meanwhile, never one of these forwards keep one
        assert _live_tensors() <= before
        assert engine.held_bytes() == 0
    assert collector.records == []


def test_generation_under_capture_records_nothing() -> None:
    model, collector = tiny_causal_lm("llama", torch.float32), RecordCollector()
    with CaptureEngine(model, consumers=[collector]) as engine:
        model.generate(lm_batch(1, 4)["input_ids"], max_new_tokens=3, do_sample=False)
        engine.flush()
    assert collector.records == []


def test_detach_removes_every_hook() -> None:
    model, collector = Mixed(), RecordCollector()
    counts = lambda: [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()]  # noqa: E731
    clean = counts()
    engine = CaptureEngine(model, layers=LayerSelection("all"), consumers=[collector]).attach()
    assert counts() != clean
    engine.detach()
    assert counts() == clean
    model(_ids()).sum().backward()
    assert collector.records == [] and not engine.attached


def test_attaching_twice_is_an_error() -> None:
    with (
        CaptureEngine(Mixed(), layers=LayerSelection("all")) as engine,
        pytest.raises(RuntimeError),
    ):
        engine.attach()


def test_hooks_never_read_tensor_values() -> None:
    """On the meta device any host read (.item(), bool(), .tolist()) raises: capture runs."""
    with torch.device("meta"):
        model = Mixed()
        ids = torch.zeros(3, 6, dtype=torch.long)
        mask = torch.ones(3, 6, dtype=torch.long)
    collector = RecordCollector()
    with CaptureEngine(model, layers=LayerSelection("all"), consumers=[collector]) as engine:
        model(ids, attention_mask=mask).sum().backward()
        engine.optimizer_step()
    (record,) = collector.records
    assert record.example_ids.device.type == "meta"
    assert {r.grads.materialize().device.type for r in record.layers.values()} == {"meta"}


def test_record_to_moves_every_tensor() -> None:
    model, collector = Mixed(), RecordCollector()
    with CaptureEngine(model, layers=LayerSelection("all"), consumers=[collector]):
        model(_ids()).sum().backward()
    moved = collector.records[0].to("meta")
    assert moved.example_ids.device.type == "meta"
    assert all(r.grads.materialize().device.type == "meta" for r in moved.layers.values())


def test_content_hash_ignores_padding_side_and_batch_position() -> None:
    text = torch.tensor([5, 9, 2, 7])
    right = torch.tensor([[5, 9, 2, 7, 0, 0], [1, 2, 3, 4, 5, 6]])
    left = torch.tensor([[1, 2, 3, 4, 5, 6], [0, 0, 5, 9, 2, 7]])
    right_mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1] * 6])
    ids_right = content_hash(right, right_mask)
    ids_left = content_hash(left, torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1]]))
    assert ids_right[0] == ids_left[1] == content_hash(text[None])[0]
    assert ids_right[1] == ids_left[0]
    assert ids_right[0] != ids_right[1]


def test_content_hash_is_order_sensitive() -> None:
    a, b = torch.tensor([[1, 2, 3]]), torch.tensor([[3, 2, 1]])
    assert content_hash(a) != content_hash(b)


def test_records_carry_content_ids_and_token_mask() -> None:
    model, collector = tiny_causal_lm("llama", torch.float32), RecordCollector()
    batch = lm_batch(lengths=(10, 7, 5))
    with CaptureEngine(model, consumers=[collector]):
        model(**batch).loss.backward()
    (record,) = collector.records
    assert torch.equal(
        record.example_ids, content_hash(batch["input_ids"], batch["attention_mask"])
    )
    assert torch.equal(record.token_mask, batch["attention_mask"].bool())


def test_explicit_example_ids_are_used_once() -> None:
    model, collector = Mixed(), RecordCollector()
    with CaptureEngine(model, layers=LayerSelection("all"), consumers=[collector]) as engine:
        engine.set_example_ids(torch.tensor([10, 11, 12]))
        model(_ids()).sum().backward()
        model(_ids()).sum().backward()
    assert collector.records[0].example_ids.tolist() == [10, 11, 12]
    assert collector.records[1].example_ids.tolist() != [10, 11, 12]


def test_bad_example_ids_are_refused() -> None:
    engine = CaptureEngine(Mixed(), layers=LayerSelection("all"))
    with pytest.raises(ValueError, match="1-D integer tensor"):
        engine.set_example_ids(torch.tensor([1.0, 2.0]))


def test_broadcast_call_is_expanded_to_the_batch() -> None:
    """GPT-2 position embeddings are called once for the batch; each example gets its share."""
    from tda_plugins import per_example_gradients
    from tests.oracle import loop_oracle, max_rel_error

    model, batch = tiny_causal_lm("gpt2"), lm_batch(lengths=(10, 7, 5))
    got = per_example_gradients(model, batch, layers=LayerSelection("all", include="wpe"))
    assert list(got) == ["transformer.wpe.weight"]
    assert max_rel_error(got, loop_oracle(model, batch, list(got))) <= 1e-10


def _capture(model: nn.Module, batch: dict[str, Tensor], **options: bool) -> MicroBatchRecord:
    collector = RecordCollector()
    with CaptureEngine(model, layers=LayerSelection("all"), consumers=[collector], **options):
        model(**{k: v for k, v in batch.items() if k != "labels"}).logits.sum().backward()
    (record,) = collector.records
    return record


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_without_parameter_grads_the_capture_is_the_same_and_weights_get_no_grad(
    arch: str,
) -> None:
    """``parameter_grads=False`` (attribution-only passes) captures exactly what a normal
    pass captures, but autograd no longer computes the captured linear layers' weight
    gradients: their ``.grad`` stays ``None``, while an embedding (whose input, token ids,
    needs no gradient) keeps its own; every parameter requires grad again afterwards."""
    model, batch = tiny_causal_lm(arch), lm_batch(lengths=(10, 7, 5))
    normal = _capture(model, batch).param_grads()
    model.zero_grad(set_to_none=True)
    lean = _capture(model, batch, parameter_grads=False)
    assert lean.param_grads().keys() == normal.keys()
    for name, grad in lean.param_grads().items():
        torch.testing.assert_close(grad, normal[name], rtol=0, atol=0)
    linear = LayerSelection("linear").resolve(model)
    assert linear
    for module, _ in linear.values():
        assert module.weight.grad is None
    assert model.get_input_embeddings().weight.grad is not None
    assert all(p.requires_grad for p in model.parameters())


def test_parameters_come_back_when_a_forward_fails() -> None:
    """A forward that raises between a layer's pre-hook and its forward hook leaves the
    parameters out of autograd only until the engine detaches."""
    model = Mixed()

    def fail(*_: object) -> None:
        raise RuntimeError("boom")

    model.fc.register_forward_hook(fail, prepend=True)
    with (
        CaptureEngine(model, layers=LayerSelection("all"), parameter_grads=False),
        pytest.raises(RuntimeError, match="boom"),
    ):
        model(torch.randint(0, 20, (2, 5)))
    assert all(p.requires_grad for p in model.parameters())
