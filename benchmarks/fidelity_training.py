"""The training protocol of the fidelity benchmark: configuration, text, blocks, model,
the fine-tuning run, its optional pre-training, and the validation loss.

Every run here is deterministic: one torch thread, ``torch.use_deterministic_algorithms``
inside the loops, seeded draws; the same call gives the same weights bit for bit, in any
process. ``fidelity_truth.py`` builds the replicas and the cached retrains on top of it.
"""

from __future__ import annotations

import copy
import hashlib
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pydoc_data.topics import topics

import torch
from torch import Tensor, nn
from transformers import GPT2Config, GPT2LMHeadModel

from tda_plugins import causal_lm_example_losses
from tda_plugins.capture.identity import content_hash

VOCAB = 256
#: ``hook(step, model)``: called after each step's backward, before the optimizer step.
StepHook = Callable[[int, nn.Module], None]


@dataclass(frozen=True)
class AdamWSettings:
    """``torch.optim.AdamW``'s hyperparameters of a run: a constant learning rate, no
    schedule, no gradient clipping, the state fresh at the first step.

    Attributes:
        learning_rate: the constant learning rate.
        betas: the moments' decay rates.
        eps: added to the second moment's square root.
        weight_decay: decoupled weight decay (``theta -= lr * weight_decay * theta``).
    """

    learning_rate: float
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01

    def optimizer(self, model: nn.Module) -> torch.optim.AdamW:
        """A fresh AdamW over ``model``'s parameters with these settings."""
        return torch.optim.AdamW(
            model.parameters(),
            lr=self.learning_rate,
            betas=self.betas,
            eps=self.eps,
            weight_decay=self.weight_decay,
        )


@dataclass(frozen=True)
class Config:
    """One fine-tuning configuration (the run whose examples are attributed).

    Attributes:
        n_embd, n_layer, n_head: the GPT-2 shape (byte vocabulary, context ``block``).
        block: tokens (bytes) per block.
        train_blocks, val_blocks: training and held-out validation blocks.
        removed: training blocks retrained without, one at a time (and scored).
        batch: examples per AdamW step.
        learning_rate: AdamW's constant learning rate.
        model_seed: seed of the random init.
        data_seed: seed of the block draw, the removed blocks and the training order.
        bootstrap: resamples of the validation blocks for the intervals.
        subsets: LDS training runs, each on a random subset of the training blocks.
        subset_fraction: the share of the training blocks in each LDS subset.
    """

    n_embd: int = 128
    n_layer: int = 2
    n_head: int = 4
    block: int = 128
    train_blocks: int = 512
    val_blocks: int = 64
    removed: int = 50
    batch: int = 32
    learning_rate: float = 1e-3
    model_seed: int = 0
    data_seed: int = 0
    bootstrap: int = 2000
    subsets: int = 100
    subset_fraction: float = 0.5

    @property
    def steps(self) -> int:
        """Optimizer steps in the epoch (the last batch may be short)."""
        return -(-self.train_blocks // self.batch)

    @property
    def adamw(self) -> AdamWSettings:
        """The fine-tuning optimizer's settings (torch's defaults but the learning rate)."""
        return AdamWSettings(self.learning_rate)


# -- text and blocks ---------------------------------------------------------------------


def documentation_text(first: int = 0, stop: int | None = None) -> bytes:
    """UTF-8 of Python's reference documentation (``pydoc_data.topics``): the topics
    ``first:stop`` in sorted order, joined by blank lines."""
    return "\n\n".join(topics[name] for name in sorted(topics)[first:stop]).encode("utf-8")


def topic_split(share: float) -> int:
    """Index of the first sorted topic after the leading ``share`` of the text's bytes
    (the split of pre-training from fine-tuning text; topics are never cut)."""
    sizes = [len(topics[name].encode("utf-8")) for name in sorted(topics)]
    total, running = sum(sizes), 0
    for index, size in enumerate(sizes):
        running += size
        if running >= share * total:
            return index + 1
    return len(sizes)


def text_ids(text: bytes) -> Tensor:
    """``(L,)`` int64 byte ids of ``text``."""
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long()


@dataclass(frozen=True)
class Blocks:
    """The byte blocks of one configuration.

    Attributes:
        train: ``(N, T)`` int64 training blocks.
        validation: ``(M, T)`` int64 validation blocks.
        removed: ``(R,)`` int64 indices into ``train`` of the left-out blocks.
        order: ``(N,)`` int64 training order (batches are consecutive runs of it).
    """

    train: Tensor
    validation: Tensor
    removed: Tensor
    order: Tensor

    def fingerprint(self) -> str:
        """A short digest of every tensor (the cache key depends on the data)."""
        digest = hashlib.sha256()
        for t in (self.train, self.validation, self.removed, self.order):
            digest.update(t.numpy().tobytes())
        return digest.hexdigest()[:16]


def make_blocks(config: Config, text: bytes) -> Blocks:
    """Distinct ``block``-byte blocks of ``text`` (cut at multiples of ``block``), drawn
    without replacement with ``data_seed``."""
    count = len(text) // config.block
    blocks = text_ids(text[: count * config.block]).view(count, config.block)
    gen = torch.Generator().manual_seed(config.data_seed)
    picked, seen = [], set()
    for index in torch.randperm(count, generator=gen).tolist():
        key = int(content_hash(blocks[index : index + 1])[0])
        if key not in seen:
            seen.add(key)
            picked.append(index)
        if len(picked) == config.train_blocks + config.val_blocks:
            break
    if len(picked) < config.train_blocks + config.val_blocks:
        raise ValueError(f"the text has only {len(picked)} distinct blocks of {config.block}")
    chosen = blocks[torch.tensor(picked)]
    return Blocks(
        train=chosen[: config.train_blocks],
        validation=chosen[config.train_blocks :],
        removed=torch.randperm(config.train_blocks, generator=gen)[: config.removed].sort().values,
        order=torch.randperm(config.train_blocks, generator=gen),
    )


# -- model and runs ----------------------------------------------------------------------


def build_model(config: Config) -> nn.Module:
    """``GPT2LMHeadModel`` from a config: byte vocabulary, fp32, seeded init, no dropout."""
    gpt2 = GPT2Config(
        vocab_size=VOCAB,
        n_positions=config.block,
        n_embd=config.n_embd,
        n_layer=config.n_layer,
        n_head=config.n_head,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation="sdpa",
    )
    torch.manual_seed(config.model_seed)
    return GPT2LMHeadModel(gpt2).to(torch.float32)


def state_digest(state: dict[str, Tensor]) -> str:
    """A short digest of a state dict's names and values (in a cache key)."""
    digest = hashlib.sha256()
    for name in sorted(state):
        digest.update(name.encode())
        digest.update(state[name].detach().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


@contextmanager
def deterministic() -> Iterator[None]:
    """``torch.use_deterministic_algorithms(True)`` inside the block, restored after."""
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous)


def batches(
    config: Config,
    blocks: Blocks,
    skip: int | None = None,
    reverse_rows: bool = False,
    subset: Tensor | None = None,
) -> list[Tensor]:
    """Per optimizer step, the ``(B_s,)`` int64 indices into ``blocks.train`` of its rows
    in the order fed: consecutive runs of ``batch`` of ``blocks.order`` (restricted to the
    ``(N,)`` bool ``subset`` and batched anew: fewer steps), ``skip`` left out of its batch
    (one row fewer), each batch reversed with ``reverse_rows``."""
    order = blocks.order if subset is None else blocks.order[subset[blocks.order]]
    out = []
    for step in range(-(-order.numel() // config.batch)):
        rows = order[step * config.batch : (step + 1) * config.batch]
        rows = rows[rows != skip] if skip is not None else rows
        out.append(rows.flip(0) if reverse_rows else rows)
    return out


def train(
    config: Config,
    blocks: Blocks,
    model: nn.Module,
    skip: int | None = None,
    reverse_rows: bool = False,
    hook: StepHook | None = None,
    subset: Tensor | None = None,
    after_update: StepHook | None = None,
    optimizer: torch.optim.AdamW | None = None,
) -> torch.optim.AdamW:
    """One epoch of AdamW (``config.adamw``, fresh state) over :func:`batches`' rows of
    ``blocks.train``, transformers' mean token loss of each batch.

    ``reverse_rows`` (the same gradient in exact arithmetic) is the rounding noise probe.
    ``hook(step, model)`` runs after each backward, before the optimizer step;
    ``after_update(step, model)`` after the optimizer step, before ``.grad`` is cleared.
    ``optimizer``: a fresh ``config.adamw.optimizer(model)`` made by the caller (a
    recorder that reads its state); default: one made here. Returns the optimizer (its
    state after the epoch).
    """
    model.train()
    optimizer = optimizer if optimizer is not None else config.adamw.optimizer(model)
    with deterministic():
        for step, rows in enumerate(batches(config, blocks, skip, reverse_rows, subset)):
            ids = blocks.train[rows]
            model(input_ids=ids, labels=ids).loss.backward()
            if hook is not None:
                hook(step, model)
            optimizer.step()
            if after_update is not None:
                after_update(step, model)
            optimizer.zero_grad(set_to_none=True)
    return optimizer


def validation_losses(model: nn.Module, validation: Tensor) -> Tensor:
    """``(M,)`` fp64 mean token loss of each validation block, evaluated in fp64 (a copy
    of the model), so that evaluation adds no fp32 rounding to tiny differences."""
    exact = copy.deepcopy(model).double().eval()
    with torch.no_grad():
        logits = exact(input_ids=validation).logits
    return causal_lm_example_losses(logits, validation) / (validation.shape[1] - 1)


# -- pre-training --------------------------------------------------------------------------


@dataclass(frozen=True)
class Pretraining:
    """The pre-training that a replica's fine-tuning starts from.

    The same GPT-2 as the fine-tuning (its seeded random init), trained on the leading
    ``text_share`` of the documentation's bytes (whole topics in sorted order); the
    fine-tuning blocks come from the remaining topics, which pre-training never sees.

    Attributes:
        steps: AdamW steps, each on ``batch`` windows of ``block`` bytes at random offsets
            of the pre-training text (drawn with ``seed``): many epochs' worth of windows.
        learning_rate: the peak learning rate: linear warm-up over ``warmup`` steps, then
            cosine decay to 0 at ``steps`` (AdamW otherwise at torch's defaults).
        warmup: warm-up steps.
        text_share: share of the text's bytes pre-trained on.
        seed: the windows' draw (the probe windows use ``seed + 1``).
        probes: points, evenly spaced over the steps, where the loss on ``probe_windows``
            windows of the fine-tuning text (held out from pre-training) is measured.
        probe_windows: the held-out windows measured at each probe.
    """

    steps: int = 1000
    learning_rate: float = 3e-3
    warmup: int = 50
    text_share: float = 0.75
    seed: int = 0
    probes: int = 10
    probe_windows: int = 64

    def schedule(self, step: int) -> float:
        """The learning rate's multiple of its peak at ``step`` (0-based)."""
        warm = min(1.0, (step + 1) / self.warmup)
        return warm * 0.5 * (1 + math.cos(math.pi * step / self.steps))

    @property
    def split(self) -> int:
        """Index of the first sorted topic of the fine-tuning text."""
        return topic_split(self.text_share)


@dataclass(frozen=True)
class PretrainedWeights:
    """What a pre-training produced.

    Attributes:
        state: the weights after the last step.
        losses: ``(steps,)`` each step's training loss (mean token loss of its windows).
        probe_steps: ``(P + 1,)`` the steps after which the held-out loss was measured
            (0: the random init).
        probe_losses: ``(P + 1,)`` the mean token loss of the held-out windows there.
        seconds: wall seconds of the pre-training.
    """

    state: dict[str, Tensor]
    losses: Tensor
    probe_steps: Tensor
    probe_losses: Tensor
    seconds: float


def random_windows(ids: Tensor, count: int, length: int, gen: torch.Generator) -> Tensor:
    """``(count, length)`` windows of ``ids`` at uniform random offsets."""
    starts = torch.randint(0, ids.numel() - length + 1, (count,), generator=gen)
    return ids[starts[:, None] + torch.arange(length)]


def pretrain(config: Config, pretraining: Pretraining, model: nn.Module) -> PretrainedWeights:
    """Pre-train ``model`` (fresh from :func:`build_model`) in place: ``pretraining.steps``
    AdamW steps of ``config.batch`` random windows of the pre-training text, transformers'
    mean token loss; deterministic."""
    began = time.perf_counter()
    split = pretraining.split
    ids = text_ids(documentation_text(0, split))
    held_out = random_windows(
        text_ids(documentation_text(split)),
        pretraining.probe_windows,
        config.block,
        torch.Generator().manual_seed(pretraining.seed + 1),
    )
    probe_steps = torch.linspace(0, pretraining.steps, pretraining.probes + 1).round().long()
    gen = torch.Generator().manual_seed(pretraining.seed)
    optimizer = AdamWSettings(pretraining.learning_rate).optimizer(model)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, pretraining.schedule)
    losses, probes = [], [_mean_loss(model, held_out)]
    with deterministic():
        for step in range(pretraining.steps):
            model.train()
            windows = random_windows(ids, config.batch, config.block, gen)
            loss = model(input_ids=windows, labels=windows).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            schedule.step()
            losses.append(float(loss.detach()))
            if step + 1 in probe_steps[1:]:
                probes.append(_mean_loss(model, held_out))
    return PretrainedWeights(
        state={k: v.detach().clone() for k, v in model.state_dict().items()},
        losses=torch.tensor(losses, dtype=torch.float64),
        probe_steps=probe_steps,
        probe_losses=torch.tensor(probes, dtype=torch.float64),
        seconds=time.perf_counter() - began,
    )


def _mean_loss(model: nn.Module, ids: Tensor) -> float:
    """Mean token loss of ``(B, T)`` blocks (eval mode, no gradient)."""
    model.eval()
    with torch.no_grad():
        return float(model(input_ids=ids, labels=ids).loss)
