"""The exact metagradient (docs/design.md section 13) against independent references.

* Retraining: the run redone with ``torch.optim.AdamW`` (and ``clip_grad_norm_``) in
  fp64, example ``z``'s loss weighted ``1 +- eps``; the central difference of each query's
  loss is the derivative.
* The loss conventions: each step's objective against the loss transformers' own models
  return (``labels``, ``num_items_in_batch``). transformers takes that loss in fp32, whose
  rounding a central difference cannot see through, so retraining uses the same objective
  in fp64.
* Unrolling: the whole run as one ``torch.func`` function of the weights ``w`` and its
  ``jacrev``, without recomputation (``v`` detached for ``adam_denominator="fixed"``).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence
from functools import partial
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call

from tda_plugins import causal_lm_example_losses, metagradient
from tda_plugins.methods import metagradient as metagradient_module
from tda_plugins.methods.metagradient import WeightDerivatives, loss_weight_derivatives
from tda_plugins.methods.training_run import (
    AdamWSettings,
    MicroBatch,
    TrainingStep,
    TrainingTrajectory,
)
from tests.models import VOCAB, tiny_causal_lm, with_lora


class ToyLM(nn.Module):
    """Dense features -> tanh layer -> logits; every weight gets a gradient from every
    example, so Adam's ``v`` is never zero."""

    def __init__(self, features: int = 3, hidden: int = 4, classes: int = 5):
        super().__init__()
        torch.manual_seed(0)
        self.hidden = nn.Linear(features, hidden, dtype=torch.float64)
        self.head = nn.Linear(hidden, classes, dtype=torch.float64)

    def forward(self, x: Tensor) -> SimpleNamespace:
        return SimpleNamespace(logits=self.head(torch.tanh(self.hidden(x))))


def toy_examples(ids: Sequence[int], length: int = 5) -> dict[int, dict[str, Tensor]]:
    """Per id one example: ``x (1, T, 3)`` and ``labels (1, T)``, of which 0 to 2 are
    ignored, so that micro-batches differ in label tokens (the conventions differ)."""
    out = {}
    for i in ids:
        gen = torch.Generator().manual_seed(1000 + i)
        labels = torch.randint(0, 5, (1, length), generator=gen)
        labels[0, length - i % 3 :] = -100
        out[i] = {
            "x": torch.randn(1, length, 3, generator=gen, dtype=torch.float64),
            "labels": labels,
        }
    return out


def lm_examples(ids: Sequence[int], length: int = 6) -> dict[int, dict[str, Tensor]]:
    """Per id one unpadded token sequence (all examples of a run share the length) whose
    first 0 to 2 labels are masked, like a prompt."""
    out = {}
    for i in ids:
        gen = torch.Generator().manual_seed(2000 + i)
        tokens = torch.randint(1, VOCAB, (1, length), generator=gen)
        labels = tokens.clone()
        labels[0, : 1 + i % 3] = -100
        out[i] = {"input_ids": tokens, "attention_mask": torch.ones_like(tokens), "labels": labels}
    return out


def micro_batch(examples: dict[int, dict[str, Tensor]], ids: Sequence[int]) -> MicroBatch:
    keys = examples[ids[0]]
    inputs = {k: torch.cat([examples[i][k] for i in ids]) for k in keys}
    return MicroBatch(torch.tensor(list(ids)), inputs)


def trajectory(
    examples: dict[int, dict[str, Tensor]],
    steps: int,
    micro: int,
    size: int,
    lrs: Sequence[float],
    seed: int = 0,
) -> TrainingTrajectory:
    """Steps of ``micro`` micro-batches of ``size`` examples drawn from ``examples``
    without replacement within a step, so examples recur across steps."""
    gen = torch.Generator().manual_seed(seed)
    pool = sorted(examples)
    out = []
    for t in range(steps):
        order = [pool[j] for j in torch.randperm(len(pool), generator=gen)[: micro * size]]
        batches = [micro_batch(examples, order[b * size : (b + 1) * size]) for b in range(micro)]
        out.append(TrainingStep(batches, lrs[t]))
    return TrainingTrajectory(out)


def label_count(batch: MicroBatch) -> int:
    return int((batch.inputs["labels"][:, 1:] != -100).sum())


def example_losses(model: nn.Module, batch: MicroBatch) -> Tensor:
    inputs = {k: v for k, v in batch.inputs.items() if k != "labels"}
    return causal_lm_example_losses(model(**inputs).logits, batch.inputs["labels"])


def scale(convention: str, step: TrainingStep, batch: MicroBatch) -> float:
    """The trainer's ``c_b``, for the toy (no model loss of its own)."""
    if convention == "micro_batch_mean":
        return 1.0 / (len(step.micro_batches) * label_count(batch))
    return 1.0 / sum(label_count(b) for b in step.micro_batches)


def step_loss(model: nn.Module, step: TrainingStep, batch: MicroBatch, convention: str) -> Tensor:
    """What the trainer backpropagates for ``batch``, in fp64."""
    return scale(convention, step, batch) * example_losses(model, batch).sum()


def transformers_loss(
    model: nn.Module, step: TrainingStep, batch: MicroBatch, convention: str
) -> Tensor:
    """The loss a transformers ``Trainer`` backpropagates: the model's mean token loss over
    the accumulation steps, or its loss over ``num_items_in_batch``."""
    if convention == "micro_batch_mean":
        return model(**batch.inputs).loss / len(step.micro_batches)
    window = sum(label_count(b) for b in step.micro_batches)
    return model(**batch.inputs, num_items_in_batch=torch.tensor(window)).loss


def decay(name: str, weight_decay: float) -> float:
    """transformers' rule (close enough for these models): no decay on biases and norms."""
    return 0.0 if "bias" in name or "norm" in name else weight_decay


def adamw(model: nn.Module, weight_decay: float) -> torch.optim.AdamW:
    """AdamW with one group per decay value."""
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {
            "params": [p for n, p in trainable if decay(n, weight_decay) == value],
            "weight_decay": value,
        }
        for value in sorted({decay(n, weight_decay) for n, _ in trainable})
    ]
    return torch.optim.AdamW(groups, lr=0.0, eps=1e-8)


def retrain(
    model: nn.Module,
    run: TrainingTrajectory,
    convention: str,
    weight_decay: float,
    max_grad_norm: float | None,
    upweight: tuple[int, float] | None = None,
) -> tuple[nn.Module, list[float]]:
    """The run redone with torch's AdamW, example ``upweight[0]``'s loss weighted
    ``1 + upweight[1]``; the trained copy and each step's gradient norm before clipping."""
    trained = copy.deepcopy(model)
    optimizer = adamw(trained, weight_decay)
    trainable = [p for p in trained.parameters() if p.requires_grad]
    norms = []
    for step in run.steps:
        optimizer.zero_grad()
        for group in optimizer.param_groups:
            group["lr"] = step.lr
        for batch in step.micro_batches:
            loss = step_loss(trained, step, batch, convention)
            if upweight is not None:
                rows = batch.example_ids == upweight[0]
                extra = example_losses(trained, batch)[rows].sum()
                loss = loss + upweight[1] * scale(convention, step, batch) * extra
            loss.backward()
        norms.append(
            float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in trainable])))
        )
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(trainable, max_grad_norm)
        optimizer.step()
    return trained, norms


def finite_differences(
    model: nn.Module,
    run: TrainingTrajectory,
    queries: MicroBatch,
    convention: str,
    weight_decay: float,
    max_grad_norm: float | None,
    examples: Sequence[int],
    eps: float = 1e-5,
) -> Tensor:
    """``(len(examples), M)`` central differences of the queries' final losses."""
    rows = []
    for z in examples:
        ends = [
            retrain(model, run, convention, weight_decay, max_grad_norm, (z, sign * eps))[0]
            for sign in (1.0, -1.0)
        ]
        with torch.no_grad():
            plus, minus = (example_losses(m, queries) for m in ends)
        rows.append((plus - minus) / (2 * eps))
    return torch.stack(rows)


def method(
    model: nn.Module,
    run: TrainingTrajectory,
    queries: MicroBatch,
    convention: str,
    weight_decay: float,
    max_grad_norm: float | None,
    **options: object,
) -> WeightDerivatives:
    settings = AdamWSettings.from_optimizer(
        adamw(model, weight_decay), model, max_grad_norm=max_grad_norm
    )
    return loss_weight_derivatives(
        model, run, queries, optimizer=settings, loss_convention=convention, **options
    )


def rows_of(result: WeightDerivatives, ids: Sequence[int]) -> Tensor:
    index = torch.searchsorted(result.train_ids, torch.tensor(list(ids)))
    assert torch.equal(result.train_ids[index], torch.tensor(list(ids)))
    return result.values[index]


def assert_close(got: Tensor, want: Tensor, rel: float) -> None:
    assert got.shape == want.shape and got.numel() > 0
    scale = want.abs().max()
    assert scale > 0, "the reference is all zero: the test would compare nothing"
    error = (got - want).abs().max() / scale
    assert error < rel, f"max error {error:.3g} of the largest entry"


# -- the toy: retraining ---------------------------------------------------------------------

TOY = toy_examples(range(8))
TOY_QUERIES = micro_batch(toy_examples([100, 101]), [100, 101])
TOY_RUN = trajectory(TOY, steps=4, micro=2, size=3, lrs=[0.05, 0.04, 0.03, 0.02])


@pytest.mark.parametrize("convention", ["micro_batch_mean", "window_mean"])
@pytest.mark.parametrize(("weight_decay", "max_grad_norm"), [(0.0, None), (0.1, 0.3)])
def test_toy_matches_retraining(
    convention: str, weight_decay: float, max_grad_norm: float | None
) -> None:
    """2 micro-batches per step, examples recurring across steps, weight decay on the
    weights only, clipping active (the gradient norm passes the bound)."""
    model = ToyLM()
    _, norms = retrain(model, TOY_RUN, convention, weight_decay, max_grad_norm)
    if max_grad_norm is not None:
        assert max(norms) > max_grad_norm
    recurring = [
        z
        for z in range(8)
        if sum(z in mb.example_ids for s in TOY_RUN.steps for mb in s.micro_batches) > 1
    ]
    examples = [recurring[0], 3, 6]
    want = finite_differences(
        model, TOY_RUN, TOY_QUERIES, convention, weight_decay, max_grad_norm, examples
    )
    got = method(model, TOY_RUN, TOY_QUERIES, convention, weight_decay, max_grad_norm)
    assert_close(rows_of(got, examples), want, 1e-6)


# -- the toy: one unrolled graph -------------------------------------------------------------


def unrolled(
    model: nn.Module,
    run: TrainingTrajectory,
    queries: MicroBatch,
    convention: str,
    weight_decay: float,
    max_grad_norm: float | None,
    detach_v: bool,
) -> Tensor:
    """``(N, M)`` derivatives of the queries' final losses in ``w``: the whole run as one
    autograd graph (``create_graph`` at every step, AdamW written out with transformers'
    decay groups, no recomputation), then one backward per query."""
    trainable = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    ids = run.example_ids()
    weights = torch.ones(len(ids), dtype=torch.float64, requires_grad=True)
    beta1, beta2, eps = 0.9, 0.999, 1e-8

    def losses(params: dict[str, Tensor], batch: MicroBatch) -> Tensor:
        inputs = {k: v for k, v in batch.inputs.items() if k != "labels"}
        logits = functional_call(model, params, (), inputs).logits
        return causal_lm_example_losses(logits, batch.inputs["labels"])

    params = {n: p.clone().requires_grad_() for n, p in trainable.items()}
    m = {n: torch.zeros_like(p) for n, p in params.items()}
    v = {n: torch.zeros_like(p) for n, p in params.items()}
    for k, step in enumerate(run.steps, start=1):
        objective = sum(
            scale(convention, step, b)
            * (weights[torch.searchsorted(ids, b.example_ids)] * losses(params, b)).sum()
            for b in step.micro_batches
        )
        g = dict(
            zip(
                params,
                torch.autograd.grad(objective, list(params.values()), create_graph=True),
                strict=True,
            )
        )
        norm = torch.sqrt(sum((x * x).sum() for x in g.values()))
        clip = 1.0 if max_grad_norm is None else torch.clamp(max_grad_norm / (norm + 1e-6), max=1.0)
        for n in params:
            m[n] = beta1 * m[n] + (1 - beta1) * g[n] * clip
            v[n] = beta2 * v[n] + (1 - beta2) * (g[n] * clip) ** 2
            v_hat = (v[n].detach() if detach_v else v[n]) / (1 - beta2**k)
            # a coordinate no example moves (v = 0) has derivative 0, not sqrt'(0) = inf
            root = torch.where(v_hat > 0, torch.where(v_hat > 0, v_hat, 1.0).sqrt(), 0.0)
            update = m[n] / (1 - beta1**k) / (root + eps)
            params[n] = params[n] * (1 - step.lr * decay(n, weight_decay)) - step.lr * update
    final = losses(params, queries)
    columns = [
        torch.autograd.grad(final[j], weights, retain_graph=True)[0] for j in range(len(final))
    ]
    return torch.stack(columns, dim=1)


@pytest.mark.parametrize("denominator", ["exact", "fixed"])
def test_toy_equals_the_unrolled_graph(denominator: str) -> None:
    """The step-by-step recomputation is the full graph's derivative, to fp64 rounding;
    ``fixed`` is the unroll with ``v`` detached."""
    model = ToyLM()
    want = unrolled(model, TOY_RUN, TOY_QUERIES, "window_mean", 0.1, 0.3, denominator == "fixed")
    got = method(model, TOY_RUN, TOY_QUERIES, "window_mean", 0.1, 0.3, adam_denominator=denominator)
    assert torch.equal(got.train_ids, torch.arange(8))
    assert_close(got.values, want, 1e-12)


# -- transformers models ---------------------------------------------------------------------

LM = lm_examples(range(6))
LM_QUERIES = micro_batch(lm_examples([100, 101]), [100, 101])
LM_RUN = trajectory(LM, steps=3, micro=2, size=2, lrs=[0.01, 0.008, 0.006], seed=1)


@pytest.mark.parametrize(
    ("arch", "convention"), [("gpt2", "micro_batch_mean"), ("llama", "window_mean")]
)
def test_transformers_models_equal_the_unrolled_graph(arch: str, convention: str) -> None:
    """Tiny GPT-2 (tied embeddings; unused position rows whose ``v`` stays 0) and Llama,
    full fine-tuning, 2 micro-batches a step, decay and clipping."""
    model = tiny_causal_lm(arch)
    want = unrolled(model, LM_RUN, LM_QUERIES, convention, 0.1, 1.0, detach_v=False)
    got = method(model, LM_RUN, LM_QUERIES, convention, 0.1, 1.0)
    assert torch.isfinite(got.values).all()
    assert_close(got.values, want, 1e-10)


def test_sdpa_attention_runs_on_the_math_kernel() -> None:
    """PyTorch's fused CPU attention has no double backward (fp64 too); ``sdpa`` models get
    the math kernel and the eager model's derivatives."""
    model = tiny_causal_lm("gpt2")
    eager = method(model, LM_RUN, LM_QUERIES, "window_mean", 0.1, 1.0)
    model.set_attn_implementation("sdpa")
    assert model.config._attn_implementation == "sdpa"
    sdpa = method(model, LM_RUN, LM_QUERIES, "window_mean", 0.1, 1.0)
    assert_close(sdpa.values, eager.values, 1e-10)


def test_only_the_second_order_work_runs_on_the_math_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The replay is first order: it keeps the run's own attention kernel (the kernels
    round differently, and AdamW carries that far); the Hessian-vector products of the
    backward need the math kernel."""
    kernels: dict[str, set[bool]] = {"replay": set(), "backward": set()}

    def spied(phase: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            kernels[phase].add(torch.backends.cuda.flash_sdp_enabled())
            return original(*args, **kwargs)

        return call

    plan = metagradient_module._Metagradient
    monkeypatch.setattr(plan, "replay", spied("replay", plan.replay))
    monkeypatch.setattr(plan, "step_backward", spied("backward", plan.step_backward))
    method(tiny_causal_lm("gpt2"), LM_RUN, LM_QUERIES, "window_mean", 0.1, 1.0)
    assert kernels == {"replay": {True}, "backward": {False}}


def test_the_replay_is_checked_in_the_losses_not_the_weights() -> None:
    """Trained weights may part from the replay's along a direction no loss sees: GPT-2's
    attention ignores its key bias ``b`` (softmax of ``q.(k_j + b)`` over ``j`` drops the
    shared ``q.b``). Moving every key bias by the run's whole displacement is accepted;
    the same move of the value bias is refused."""
    model = tiny_causal_lm("gpt2")
    trained, _ = retrain(model, LM_RUN, "window_mean", 0.1, 1.0)
    start = dict(model.named_parameters())
    end = {n: p.detach().clone() for n, p in trained.named_parameters()}
    moved = torch.sqrt(sum((end[n] - start[n].detach()).square().sum() for n in end))
    width, name = model.config.n_embd, "transformer.h.0.attn.c_attn.bias"
    query, key, value = (slice(i * width, (i + 1) * width) for i in range(3))
    assert end[name].shape == (3 * width,) and query.start == 0
    for part, accepted in ((key, True), (value, False)):
        bias = end[name].clone()
        bias[part] += moved / width**0.5
        shifted = end | {name: bias}
        run = partial(
            method, model, LM_RUN, LM_QUERIES, "window_mean", 0.1, 1.0, trained_state=shifted
        )
        if accepted:
            run(replay_tolerance=1e-6)
        else:
            with pytest.raises(ValueError, match="does not reproduce the run"):
                run(replay_tolerance=1e-3)


def test_gpt2_matches_retraining() -> None:
    """The same run redone by torch's AdamW on GPT-2. Llama is left to the unrolled graph:
    its RMSNorm computes in fp32 even in an fp64 model, noise that no central difference
    sees through; GPT-2 is fp64 throughout, but so curved (Adam divides by small
    gradients) that the central difference's error is 5e-4 at ``eps = 1e-6`` and 5e-6 at
    ``1e-7``."""
    model = tiny_causal_lm("gpt2")
    want = finite_differences(model, LM_RUN, LM_QUERIES, "window_mean", 0.1, 1.0, [0, 5], eps=1e-7)
    got = method(model, LM_RUN, LM_QUERIES, "window_mean", 0.1, 1.0)
    assert_close(rows_of(got, [0, 5]), want, 1e-4)


def test_lora_equals_the_unrolled_graph_and_trains_only_adapters() -> None:
    model = with_lora(tiny_causal_lm("llama"))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    want = unrolled(model, LM_RUN, LM_QUERIES, "window_mean", 0.1, None, detach_v=False)
    got = method(model, LM_RUN, LM_QUERIES, "window_mean", 0.1, None)
    assert_close(got.values, want, 1e-10)
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), f"{n} changed"


@pytest.mark.parametrize("convention", ["micro_batch_mean", "window_mean"])
def test_conventions_are_the_transformers_losses(convention: str) -> None:
    """``sum_b c_b sum_i L_i`` of each step is what transformers' model returns, summed
    over the micro-batches (to transformers' fp32)."""
    from tda_plugins.methods.training_run import convention_by_name

    model = tiny_causal_lm("llama")
    compared = 0
    with torch.no_grad():
        for step in LM_RUN.steps:
            scales = convention_by_name(convention).scales(step)
            ours = sum(
                c * example_losses(model, b).sum()
                for c, b in zip(scales, step.micro_batches, strict=True)
            )
            theirs = sum(transformers_loss(model, step, b, convention) for b in step.micro_batches)
            assert abs(ours - theirs) < 1e-6 * abs(theirs)
            compared += 1
    assert compared == len(LM_RUN.steps)


# -- the scores, the options, the refusals ----------------------------------------------------


def toy_settings(model: nn.Module) -> AdamWSettings:
    return AdamWSettings.from_optimizer(adamw(model, 0.1), model, max_grad_norm=None)


def test_scores_are_the_rise_of_the_query_loss_when_an_example_is_removed() -> None:
    """``score = -dL_q/dw_z``: retraining with ``w_z = 1 - delta`` (a sliver of ``z``
    removed) raises the query loss by ``delta * score``."""
    model = ToyLM()
    scores = metagradient(
        model, TOY_RUN, TOY_QUERIES, optimizer=toy_settings(model), loss_convention="window_mean"
    )
    derivatives = method(model, TOY_RUN, TOY_QUERIES, "window_mean", 0.1, None)
    assert torch.equal(scores.train_ids, torch.arange(8))
    assert torch.equal(derivatives.train_ids, torch.arange(8))
    assert torch.equal(scores.query_ids, torch.tensor([100, 101]))
    assert scores.values.dtype == torch.float32 and scores.method == "metagradient"
    delta = 1e-6
    base, _ = retrain(model, TOY_RUN, "window_mean", 0.1, None)
    before = example_losses(base, TOY_QUERIES).detach()
    for z in (2, 7):
        removed, _ = retrain(model, TOY_RUN, "window_mean", 0.1, None, (z, -delta))
        rise = (example_losses(removed, TOY_QUERIES).detach() - before) / delta
        assert_close(scores.values[z].double(), rise, 1e-4)
        assert_close(scores.values[z].double(), -derivatives.values[z], 1e-7)


def test_a_max_grad_norm_of_zero_means_no_clipping_as_the_trainer_takes_it() -> None:
    """transformers' ``Trainer`` clips only for ``max_grad_norm > 0``; the replay used to
    clip every update to zero at 0 (every score 0, without a word)."""
    model = ToyLM()
    zero = dataclasses.replace(toy_settings(model), max_grad_norm=0.0)
    assert zero.max_grad_norm is None
    scores = metagradient(model, TOY_RUN, TOY_QUERIES, optimizer=zero, loss_convention="sum")
    unclipped = metagradient(
        model, TOY_RUN, TOY_QUERIES, optimizer=toy_settings(model), loss_convention="sum"
    )
    assert bool(scores.values.abs().max() > 0)
    assert torch.equal(scores.values, unclipped.values)


def test_optimizer_groups_at_different_learning_rates_are_refused() -> None:
    """The replay takes one learning rate per step; groups at other rates (compared by a
    scheduler's ``initial_lr``, which stays apart when the schedule ends every rate at 0)
    would be replayed at one of them, without a word."""
    model = ToyLM()
    parameters = list(model.parameters())
    optimizer = torch.optim.AdamW(
        [{"params": parameters[:1], "lr": 1e-3}, {"params": parameters[1:], "lr": 1e-4}]
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: max(0.0, 1 - step))
    optimizer.step()
    schedule.step()
    assert {group["lr"] for group in optimizer.param_groups} == {0.0}
    with pytest.raises(ValueError, match="different learning rates"):
        AdamWSettings.from_optimizer(optimizer, model, max_grad_norm=None)


def test_initial_state_replaces_the_module_weights_and_leaves_them() -> None:
    model = ToyLM()
    fresh = method(model, TOY_RUN, TOY_QUERIES, "window_mean", 0.1, None)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # as if the module held the trained weights
    moved = {n: p.detach().clone() for n, p in model.named_parameters()}
    again = method(model, TOY_RUN, TOY_QUERIES, "window_mean", 0.1, None, initial_state=start)
    assert torch.equal(again.values, fresh.values)
    assert all(torch.equal(p, moved[n]) for n, p in model.named_parameters())


def test_progress_bars_over_the_steps(capsys: pytest.CaptureFixture[str]) -> None:
    model = ToyLM()
    method(model, TOY_RUN, TOY_QUERIES, "window_mean", 0.1, None, progress=True)
    err = capsys.readouterr().err
    assert "metagradient: replay" in err and "metagradient: backward" in err
    assert f"{len(TOY_RUN.steps)}/{len(TOY_RUN.steps)}" in err


class CountingLoss:
    """The default loss, counting its calls (a refusal must come before any)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
        self.calls += 1
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        return causal_lm_example_losses(model(**inputs).logits, batch["labels"])


def unlabeled_last_step(labels: Tensor | None) -> TrainingTrajectory:
    batch = TOY_RUN.steps[-1].micro_batches[0]
    inputs = {"x": batch.inputs["x"]} if labels is None else {**batch.inputs, "labels": labels}
    last = TrainingStep([MicroBatch(batch.example_ids, inputs)], 0.01)
    return TrainingTrajectory([*TOY_RUN.steps, last])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"run": unlabeled_last_step(None)}, "has no 'labels'"),
        ({"run": unlabeled_last_step(torch.full((3, 5), -100))}, "has no label token"),
        ({"adam_denominator": "exactly"}, "unknown adam_denominator"),
        ({"loss_convention": "mean"}, "unknown loss convention"),
        ({"queries": []}, "no query example"),
        (
            {"initial_state": {"head.weight": torch.zeros(5, 4, dtype=torch.float64)}},
            "lacks trainable parameters",
        ),
        (
            {"optimizer": AdamWSettings(weight_decay={"hiden.weight": 0.1}, max_grad_norm=None)},
            "not trainable",
        ),
    ],
)
def test_refusals_come_before_the_first_step(change: dict[str, object], message: str) -> None:
    model = ToyLM()
    loss = CountingLoss()
    options: dict[str, object] = {
        "optimizer": toy_settings(model),
        "loss_convention": "micro_batch_mean",
        "loss_fn": loss,
    }
    options.update({k: v for k, v in change.items() if k not in ("run", "queries")})
    run = change.get("run", TOY_RUN)
    queries = change.get("queries", TOY_QUERIES)
    with pytest.raises(ValueError, match=message):
        loss_weight_derivatives(model, run, queries, **options)  # type: ignore[arg-type]
    assert loss.calls == 0


class OnceDifferentiableTanh(torch.autograd.Function):
    """``tanh`` whose backward cannot itself be differentiated: autograd would silently
    count its second derivatives as zero."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        y = torch.tanh(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        (y,) = ctx.saved_tensors
        return grad * (1 - y * y)


class TanhBackward(torch.autograd.Function):
    """``tanh``'s backward as its own function, without a backward of its own (as
    PyTorch's fused attention kernels)."""

    @staticmethod
    def forward(ctx: Any, grad: Tensor, y: Tensor) -> Tensor:
        return grad * (1 - y * y)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor]:
        raise RuntimeError("derivative for fused_tanh_backward is not implemented")


class FusedTanh(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        y = torch.tanh(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        (y,) = ctx.saved_tensors
        return TanhBackward.apply(grad, y)


class KernelToyLM(ToyLM):
    def __init__(self, tanh: type[torch.autograd.Function]):
        super().__init__()
        self.tanh = tanh

    def forward(self, x: Tensor) -> SimpleNamespace:
        return SimpleNamespace(logits=self.head(self.tanh.apply(self.hidden(x))))


@pytest.mark.parametrize(
    ("tanh", "message"),
    [
        (OnceDifferentiableTanh, r"gradients of \['hidden.weight', 'hidden.bias'\] .* again"),
        (FusedTanh, "cannot be differentiated twice .*fused_tanh_backward"),
    ],
)
def test_a_model_without_second_derivatives_is_refused_before_the_replay(
    tanh: type[torch.autograd.Function], message: str
) -> None:
    model = KernelToyLM(tanh)
    loss = CountingLoss()
    with pytest.raises(RuntimeError, match=message):
        loss_weight_derivatives(
            model,
            TOY_RUN,
            TOY_QUERIES,
            optimizer=toy_settings(model),
            loss_convention="sum",
            loss_fn=loss,
        )
    assert 1 <= loss.calls <= 2  # the probe's forwards, no step of the replay


def test_refusals_of_the_inputs() -> None:
    with pytest.raises(ValueError, match="one id per row"):
        MicroBatch(torch.tensor([0, 1]), {"x": torch.zeros(3, 2)})
    with pytest.raises(ValueError, match="integer tensor"):
        MicroBatch(torch.tensor([0.0]), {})
    with pytest.raises(ValueError, match="at least one micro-batch"):
        TrainingStep([], 0.1)
    with pytest.raises(ValueError, match="learning rate"):
        TrainingStep([TOY_QUERIES], float("nan"))
    with pytest.raises(ValueError, match="no step"):
        TrainingTrajectory([])
    model = ToyLM()
    with pytest.raises(ValueError, match=r"torch\.optim\.Adam's weight_decay"):
        AdamWSettings.from_optimizer(
            torch.optim.Adam(model.parameters()), model, max_grad_norm=None
        )
    with pytest.raises(ValueError, match="amsgrad"):
        AdamWSettings.from_optimizer(
            torch.optim.AdamW(model.parameters(), amsgrad=True), model, max_grad_norm=None
        )
    frozen = ToyLM().requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameter"):
        loss_weight_derivatives(
            frozen, TOY_RUN, TOY_QUERIES, optimizer=toy_settings(model), loss_convention="sum"
        )
    with pytest.raises(ValueError, match=r"per-example losses, got \(\)"):
        loss_weight_derivatives(
            model,
            TOY_RUN,
            TOY_QUERIES,
            optimizer=toy_settings(model),
            loss_convention="sum",
            loss_fn=lambda m, b: CountingLoss()(m, b).sum(),
        )


class SavedBytes:
    """Bytes of the tensors autograd graphs hold for their backward, live and at peak
    (``saved_tensors_hooks``: each saved tensor is counted until its graph lets it go)."""

    def __init__(self) -> None:
        self.live = self.peak = 0

    def pack(self, tensor: Tensor) -> Held:
        return Held(tensor, self)

    def unpack(self, held: Held) -> Tensor:
        return held.tensor


class Held:
    def __init__(self, tensor: Tensor, owner: SavedBytes):
        self.tensor, self.owner = tensor, owner
        self.size = tensor.numel() * tensor.element_size()
        owner.live += self.size
        owner.peak = max(owner.peak, owner.live)

    def __del__(self) -> None:
        self.owner.live -= self.size


def peak_graph_bytes(compute: Callable[[], object]) -> int:
    saved = SavedBytes()
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
        compute()
    return saved.peak


def test_the_backward_holds_one_micro_batch_graph_not_the_run() -> None:
    """The graphs alive at once do not grow with the number of steps (the whole run as one
    graph does)."""
    model = ToyLM()
    runs = {n: trajectory(TOY, steps=n, micro=2, size=3, lrs=[0.01] * n) for n in (2, 6)}
    ours = {
        n: peak_graph_bytes(
            lambda run=run: method(model, run, TOY_QUERIES, "window_mean", 0.1, None)
        )
        for n, run in runs.items()
    }
    whole = {
        n: peak_graph_bytes(
            lambda run=run: unrolled(
                model, run, TOY_QUERIES, "window_mean", 0.1, None, detach_v=False
            )
        )
        for n, run in runs.items()
    }
    assert ours[6] == ours[2] > 0
    assert whole[6] > 2 * whole[2]
