"""Memory plans of capture with K-FAC statistics at 7B and 70B, from configs on the meta
device (no weights, no GPU): what ``CaptureSession`` computes at its start.

* Llama-2-7B (hidden 4096, intermediate 11008, 32 layers, 32 heads, vocab 32000), bf16,
  PEFT LoRA r=16 on all linear layers (fp32 adapters, PEFT's default), 8 ranks under FSDP.
* Llama-70B-shaped (hidden 8192, intermediate 28672, 80 layers, 64 heads, 8 KV heads,
  vocab 32000), bf16 parameters, gradients and Adam moments, full fine-tuning of every
  linear layer, 8 ranks under FSDP.

One micro-batch of 1 x 4096 tokens per rank and step. For each, the per-rank table of
statistics (owner schedule when they do not fit replicated, reduction buffers included),
per-example records of one micro-batch and store shards per step, against the training
step's own per-rank memory (parameters, gradients, Adam; divided by 8 under FSDP), for the
default settings and the settings a user can switch on; the target is an extra (statistics
plus records) within 10% of the training step. ``--write`` replaces its section in
``benchmarks/results/memory_plan.md``.

    python benchmarks/memory_plan.py [--write]
"""

from __future__ import annotations

import argparse
import logging
import platform
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import torch
from common import write_section
from torch import nn

from tda_plugins import LayerSelection, ProjectionConfig
from tda_plugins.precondition import (
    CapturePlan,
    CurvatureBudgetError,
    PlanInputs,
    plan_capture,
    require_within_budget,
)
from tda_plugins.precondition.plan import GIB

RESULTS = Path(__file__).resolve().parent / "results" / "memory_plan.md"
WORLD, TOKENS, TARGET = 8, 4096, 0.10


def llama(lora: bool, **shape: int) -> nn.Module:
    """A Llama built on the meta device from its config (bf16), LoRA r=16 on all linear
    layers when asked."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=32000, tie_word_embeddings=False, **shape)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return get_peft_model(model, LoraConfig(r=16, target_modules="all-linear")) if lora else model


def size(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB / 10 else f"{n / 2**20:.1f} MiB"


def fits(model: nn.Module, inputs: PlanInputs) -> bool:
    plan = plan_capture(model, inputs)
    return plan.extra_bytes <= TARGET * plan.training_bytes


def settings_table(model: nn.Module, base: PlanInputs) -> tuple[list[str], list[str]]:
    """Rows for the default settings and the options a user can switch on, and the
    largest ``last_n_blocks`` and projection ``k`` within the target."""
    training = plan_capture(model, base).training_bytes
    base = replace(base, budget_gb=TARGET * training / GIB)
    blocks = len(max((m for m in model.modules() if isinstance(m, nn.ModuleList)), key=len))

    def last(n: int) -> PlanInputs:
        return replace(base, selection=replace(base.selection, last_n_blocks=n))

    def projected(k: int) -> PlanInputs:
        return replace(base, projection=ProjectionConfig("factor", k_a=k, k_g=k))

    candidates = [("default (exact; the head's output factor diagonal)", base)]
    candidates += [(f"last_n_blocks={n} of {blocks}", last(n)) for n in (1, 2, 4, 8)]
    candidates += [(f"projection='factor', k_a=k_g={k}", projected(k)) for k in (256, 64, 16, 8)]
    rows = [
        "| settings | schedule | statistics / rank | records / micro-batch | store / step "
        "| extra / training | within 10% |",
        "|---|---|---:|---:|---:|---:|:-:|",
    ]
    for label, inputs in candidates:
        plan = plan_capture(model, inputs)
        ratio = plan.extra_bytes / plan.training_bytes
        rows.append(
            f"| {label} | {plan.schedule} | {size(plan.statistics_bytes())} | "
            f"{size(plan.records_bytes)} | {size(plan.shard_bytes_per_step)} | "
            f"{100 * ratio:.1f}% | {'yes' if ratio <= TARGET else 'no'} |"
        )
    within = []
    n = max((n for n in range(1, blocks + 1) if fits(model, last(n))), default=None)
    if n is not None:
        within.append(f"`last_n_blocks={n}` (exact gradients and curvature of the last {n})")
    k = max((2**e for e in range(2, 11) if fits(model, projected(2**e))), default=None)
    if k is not None:
        within.append(f"`projection='factor'` with `k_a=k_g={k}` or less (all layers)")
    return rows, within


def section(name: str, model: nn.Module, inputs: PlanInputs) -> list[str]:
    plan: CapturePlan = plan_capture(model, inputs)
    rows, within = settings_table(model, inputs)
    try:
        require_within_budget(model, plan)
        refusal = "accepted under the default budget (8 GiB per rank)"
    except CurvatureBudgetError as error:
        refusal = f"refused at the start with the default budget (8 GiB per rank):\n\n> {error}"
    return [
        f"### {name}",
        "",
        f"Training step per rank: {size(plan.training_bytes)} (parameters, gradients and Adam "
        f"moments, sharded over {WORLD} ranks); 10% of it: {size(TARGET * plan.training_bytes)}. "
        f"Default settings {refusal}",
        "",
        f"Reduction schedules for the default settings: every layer's sums on every rank "
        f"(`local`) would take {size(plan.all_bytes)} per rank and send {size(plan.all_bytes)} "
        f"per commit; each rank's owned share (`owner`) takes "
        f"{size(replace(plan, schedule='owner').statistics_bytes())} (one 64 MiB reduction "
        f"block included) and sends {size(plan.all_bytes)} per micro-batch.",
        "",
        "Default plan (what `CaptureSession` logs; schedule for the default 8 GiB budget):",
        "",
        "```",
        plan.table(),
        "```",
        "",
        "Settings against the 10% target (the budget set to 10% of the training step, so "
        "the schedule is `owner` wherever replicated statistics exceed it):",
        "",
        *rows,
        "",
        f"Within 10% of the training step: {' or '.join(within)}."
        if within
        else "No setting listed stays within 10% of the training step.",
        "",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--write", action="store_true", help="replace the section in results/memory_plan.md"
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    common = dict(world_size=WORLD, sharded=True, tokens_per_example=TOKENS)
    seven = llama(
        True,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
    )
    seventy = llama(
        False,
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
    )
    lines = [
        "## Memory plans at 7B and 70B (benchmarks/memory_plan.py)",
        "",
        "Command: `.venv/bin/python benchmarks/memory_plan.py --write`",
        "",
        f"Date: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC. Machine: {platform.machine()}, "
        f"torch {torch.__version__}; models built from configs on the meta device (shapes "
        f"only), {WORLD} ranks under FSDP, one micro-batch of 1 x {TOKENS} tokens per rank "
        "and step. Extra = K-FAC statistics per rank (the most loaded rank, reduction "
        "buffers included) + per-example records of one micro-batch (inputs shared by "
        "q/k/v counted per layer: an upper bound); store shards are written to disk.",
        "",
        *section(
            "Llama-2-7B, LoRA r=16 on all linear layers",
            seven,
            PlanInputs(LayerSelection("auto"), **common),  # type: ignore[arg-type]
        ),
        *section(
            "Llama-70B-shaped, full fine-tuning of every linear layer",
            seventy,
            PlanInputs(LayerSelection("linear"), **common),  # type: ignore[arg-type]
        ),
    ]
    text = "\n".join(lines)
    print(text)
    if args.write:
        write_section(RESULTS, lines[0], text)


if __name__ == "__main__":
    main()
