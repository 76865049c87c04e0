"""The training setups the transformers callbacks refuse before step 0, one check each.

Per-example capture needs each example's whole forward and backward through every
captured module in one process, with the module hooks running. Data parallelism (DDP,
FSDP2 and HSDP, whose ``fully_shard`` gathers each parameter whole before the module
computes) keeps that; these setups do not, and would store wrong gradients or none:

* TRL's trainers other than ``SFTTrainer`` (DPO, KTO, GRPO, RLOO, GKD, ...), whose
  objectives are not each example's next-token loss; models that are not text-only
  causal LMs (classifiers, encoder-decoders, multimodal models);
* batches that mix examples in one sequence (TRL's ``packing``, ``padding_free``, a
  flattening data collator);
* losses whose normalization the callbacks cannot read, or that are not a sum of the
  examples' own token losses: label smoothing (computed outside the model), TRL's
  ``loss_type="dft"`` (each token weighted by its detached probability), and an MoE
  router's load-balancing loss (a term of the whole batch);
* fp16 mixed precision on an accelerator, whose loss scaler skips the steps that
  overflow (accelerate keeps no scaler on the CPU);
* DeepSpeed, however it is enabled (``TrainingArguments.deepspeed``, accelerate's config
  or state, ``ACCELERATE_USE_DEEPSPEED``, a ZeRO-3 partitioned model);
* FSDP1 (``FullyShardedDataParallel``): flat parameters outside the modules' own;
* tensor, context, sequence and expert parallelism (accelerate's ``ParallelismConfig``,
  transformers' ``DistributedConfig``, DTensor parameters sharded by anything but
  FSDP2): each example's gradient, or its tokens, split over ranks;
* pipeline parallelism (transformers' ``pp_size``, ``torch.distributed.pipelining``);
* a model spread over several devices of one process (``device_map``): every module still
  runs whole in this process, but a captured module that accelerate dispatches on its own
  (``lm_head`` on another device than the last block) receives its input before
  accelerate moves it, so its factors would sit on two devices, and each layer's records
  stay on its device where scores sum over the layers; load the model on one device, or
  shard it with FSDP2;
* compiled models (``torch.compile``, ``Module.compile``, ``torch_compile=True``),
  whose graphs do not run the hooks as eager modules do;
* PEFT prompt learning (prompt tuning, prefix tuning, P-tuning), whose virtual tokens
  reach the model beside the batch, not through a captured layer's per-example call;
* several launched processes that the trainer runs each alone: ``torchrun`` on a machine
  without GPUs and ``use_cpu`` unset, where accelerate falls back to one process's
  training (``parallel_mode`` ``not_parallel``, ``world_size`` 1) with only a warning. Every
  process would then train on all the data, call itself rank 0 and write the same files.

Each check returns a one-line refusal (the cause and the way out) or ``None``;
:data:`TRAINER_CHECKS` is the table ``check_trainer_setup`` runs, in order.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType, parse_flag_from_env
from torch import nn
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
from torch.distributed.pipelining import Pipe
from torch.distributed.tensor import DTensor, Replicate, Shard
from transformers import TrainingArguments

from tda_plugins.capture.packing import PACKED_ROWS_FIX
from tda_plugins.integrations.transformers.sft import is_sft_config

Refusal = str | None


@dataclass(frozen=True)
class SetupCheck:
    """One unsupported setup: ``refuse(args, model)`` says why and what to do instead,
    or returns ``None`` when the run does not use it."""

    name: str
    refuse: Callable[[TrainingArguments, nn.Module], Refusal]


def _packing(args: TrainingArguments, model: nn.Module) -> Refusal:
    if getattr(args, "packing", False):
        return (
            "packing=True concatenates several examples into one sequence, so gradients can no "
            "longer be split per example; set packing=False in SFTConfig"
        )
    return None


def _padding_free(args: TrainingArguments, model: nn.Module) -> Refusal:
    if getattr(args, "padding_free", False):
        return "padding_free=True flattens the batch into one sequence; set padding_free=False"
    return None


def flattening_collator(collator: Any) -> Refusal:
    """The refusal of a padding-free collator given as the trainer's ``data_collator``
    (transformers' ``DataCollatorWithFlattening``, or one with ``padding_free`` set, as
    TRL's): it packs the batch into one row. The engine refuses any other packed batch at
    its first forward (:mod:`~tda_plugins.capture.packing`)."""
    flattening = type(collator).__name__ == "DataCollatorWithFlattening"
    if flattening or getattr(collator, "padding_free", False) is True:
        return (
            f"the data collator ({type(collator).__name__}) packs each batch into one "
            f"sequence, so gradients can no longer be split per example; {PACKED_ROWS_FIX}"
        )
    return None


def _loss_outside_model(args: TrainingArguments, model: nn.Module) -> Refusal:
    factor = getattr(args, "label_smoothing_factor", 0)
    if factor:
        return (
            f"label_smoothing_factor={factor} makes the trainer compute the loss from the logits "
            "outside the model (LabelSmoother), where the callbacks cannot read how it is "
            "normalized; set label_smoothing_factor=0"
        )
    return None


def _trl_objective(args: TrainingArguments, model: nn.Module) -> Refusal:
    """A TRL trainer other than ``SFTTrainer``: the first of TRL's classes the arguments'
    class derives from is not ``SFTConfig`` (``DPOConfig``, ``GRPOConfig``, ``GKDConfig``,
    a user's subclass of one of them; a user's subclass of ``SFTConfig`` is an SFT run):
    preference, reinforcement-learning and distillation objectives are not a sum of each
    example's next-token losses."""
    trl_class = next((c for c in type(args).__mro__ if c.__module__.split(".")[0] == "trl"), None)
    if trl_class is None or trl_class.__name__ == "SFTConfig":
        return None
    return (
        f"TRL's {trl_class.__name__} trains its trainer's own objective (a preference, "
        "reinforcement-learning or distillation loss), not each example's next-token "
        "loss, which the callbacks split per example: its per-example gradients are not "
        "supported; fine-tune with SFTTrainer (SFTConfig) or transformers' Trainer"
    )


def _loss_type(args: TrainingArguments, model: nn.Module) -> Refusal:
    loss_type = getattr(args, "loss_type", "nll")  # TRL's configs (SFTConfig: "nll")
    if loss_type in ("nll", "chunked_nll"):
        return None
    why = (
        "weights each token's loss by its detached probability, so the normalization read "
        "from its gradient would be off by each micro-batch's mean token weight"
        if loss_type == "dft"
        else "is not the token negative log-likelihood the callbacks split per example"
    )
    return f"loss_type={loss_type!r} {why}; set loss_type='nll'"


#: Why a model whose transformers loss is not the causal LM's cannot be split per example,
#: by the config keys that make it multimodal, else by its loss type.
_TOWERS = ("vision_config", "audio_config", "speech_config")
_NOT_CAUSAL = {
    "ForSequenceClassification": "a mean over the micro-batch, whatever the trainer's token "
    "count: per-example gradients would be scaled wrongly under gradient accumulation",
    "ForTokenClassification": "a mean over the micro-batch's tokens, whatever the trainer's "
    "token count: per-example gradients would be scaled wrongly under gradient accumulation",
}


def _task_head(args: TrainingArguments, model: nn.Module) -> Refusal:
    """A transformers model that is not a text-only causal LM: a classifier (its loss a
    mean over the micro-batch, which ignores the accumulation window's
    ``num_items_in_batch`` the normalization reads), an encoder-decoder, or a multimodal
    model (its vision or audio tower's rows are images, patches or frames, not examples)."""
    get_base = getattr(model, "get_base_model", None)  # a PEFT model: the wrapped one
    base = get_base() if callable(get_base) else model
    loss_type = getattr(base, "loss_type", None)
    tower = next((k for k in _TOWERS if getattr(getattr(base, "config", None), k, None)), None)
    if loss_type in (None, "ForCausalLM") and tower is None:
        return None
    if tower is not None:
        why = (
            f"a multimodal model ({tower}): its tower's rows are images, patches or "
            "frames, not the examples, so the callbacks cannot split its gradients per "
            "example"
        )
    else:
        kind = str(loss_type).removeprefix("For")
        detail = _NOT_CAUSAL.get(str(loss_type), "not a decoder-only causal LM's next-token loss")
        why = f"trains its {kind} loss ({detail})"
    fix = (
        "fine-tune its language model alone (the *ForCausalLM class of its text_config, "
        "such as Gemma3ForCausalLM), or a text-only causal LM"
        if tower is not None
        else "fine-tune a causal LM (AutoModelForCausalLM)"
    )
    return f"{type(base).__name__} {why}; the callbacks support text-only causal LMs: {fix}"


def _router_aux_loss(args: TrainingArguments, model: nn.Module) -> Refusal:
    config = getattr(model, "config", None)
    coefficient = getattr(config, "router_aux_loss_coef", 0)
    if getattr(config, "output_router_logits", False) and coefficient:
        # TRL's SFTTrainer turns output_router_logits back on from its own coefficient
        fix = (
            "set SFTConfig(router_aux_loss_coef=0.0)"
            if is_sft_config(args)
            else "set model.config.output_router_logits=False (or router_aux_loss_coef=0)"
        )
        return (
            f"the model adds its MoE router's load-balancing loss (output_router_logits=True, "
            f"router_aux_loss_coef={coefficient}), a term of the whole batch whose gradient is "
            f"no one example's, so each stored gradient would carry a share of it; {fix}"
        )
    return None


def _fp16_loss_scaling(args: TrainingArguments, model: nn.Module) -> Refusal:
    if getattr(args, "fp16", False) and args.device.type != "cpu":
        return (
            "fp16 mixed precision on an accelerator trains under a loss scaler that skips each "
            "step whose gradients overflow, and that step's non-finite per-example gradients "
            "would stop the store, poison the influence totals or be selected on, however "
            "far into the run; train in bf16 (bf16=True) or fp32"
        )
    return None


def _deepspeed_source(args: TrainingArguments, model: nn.Module) -> str | None:
    """How DeepSpeed is enabled for this run, if it is."""
    if getattr(args, "deepspeed", None):
        return "TrainingArguments(deepspeed=...)"
    if parse_flag_from_env("ACCELERATE_USE_DEEPSPEED"):
        return "ACCELERATE_USE_DEEPSPEED in the environment"
    # accelerate's state as the trainer's Accelerator left it, read without constructing
    # it again (a new AcceleratorState() copies PartialState's fields over its own)
    for shared in (AcceleratorState._shared_state, PartialState._shared_state):
        if shared.get("distributed_type") == DistributedType.DEEPSPEED:
            return "accelerate's distributed_type DEEPSPEED"
    if AcceleratorState._shared_state.get("deepspeed_plugins") is not None:
        return "accelerate's deepspeed_plugin"
    if any(hasattr(p, "ds_id") for p in model.parameters()):
        return "a ZeRO-3 partitioned model"
    return None


def _deepspeed(args: TrainingArguments, model: nn.Module) -> Refusal:
    source = _deepspeed_source(args, model)
    return (
        None
        if source is None
        else (
            f"DeepSpeed (enabled by {source}) is not supported: its engine steps the optimizer "
            "inside backward and ZeRO-3 partitions parameters outside the modules; train with DDP "
            "or FSDP2 (accelerate fsdp_version: 2) instead"
        )
    )


def _fsdp1(args: TrainingArguments, model: nn.Module) -> Refusal:
    if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        return (
            "FSDP1 (FullyShardedDataParallel) is not supported: it replaces the modules' "
            "parameters by flat shards; use FSDP2 (fully_shard, accelerate fsdp_version: 2)"
        )
    return None


def _sizes_over_one(config: Any, fields: tuple[str, ...]) -> list[str]:
    return [f"{f}={getattr(config, f)}" for f in fields if (getattr(config, f, None) or 1) > 1]


def _split_layouts(model: nn.Module) -> Iterator[str]:
    """Parameters whose DTensor layout splits each example's gradient over ranks: any
    sharding of a parameter that no FSDP2 module gathers whole before computing, or more
    than one sharded mesh dimension (FSDP2 over a tensor-parallel layout)."""
    gathered = {id(p) for m in model.modules() if isinstance(m, FSDPModule) for p in m.parameters()}
    for name, p in model.named_parameters():
        if not isinstance(p, DTensor):
            continue
        split = [pl for pl in p.placements if not isinstance(pl, Replicate)]
        by_fsdp = id(p) in gathered and len(split) == 1 and isinstance(split[0], Shard)
        if split and not by_fsdp:
            yield f"{name} {tuple(p.placements)}"


def _tensor_parallel(args: TrainingArguments, model: nn.Module) -> Refusal:
    config = getattr(getattr(model, "config", None), "distributed_config", None)
    sizes: list[str] = []
    # set in the training arguments, or by `accelerate launch` (its state, or the
    # environment it exports: TrainingArguments never reads those)
    for accelerate in (
        getattr(args, "parallelism_config", None),
        AcceleratorState._shared_state.get("parallelism_config"),
    ):
        sizes += _sizes_over_one(accelerate, ("tp_size", "cp_size", "sp_size"))
    if parse_flag_from_env("ACCELERATE_USE_PARALLELISM_CONFIG"):
        for size in ("tp_size", "cp_size", "sp_size"):
            value = int(os.environ.get(f"PARALLELISM_CONFIG_{size.upper()}", "1") or 1)
            if value > 1:
                sizes.append(f"{size}={value}")
    sizes += _sizes_over_one(config, ("tp_size", "ep_size"))
    where = ", ".join(sizes) or next(_split_layouts(model), None)
    if where is None:
        return None
    return (
        f"tensor/context/expert parallelism ({where}) splits each example's gradient or tokens "
        "over ranks, so no rank sees an example whole; train data-parallel only (DDP or "
        "FSDP2/HSDP: tp_size, cp_size, sp_size and ep_size 1, no tp_plan)"
    )


def _pipeline_parallel(args: TrainingArguments, model: nn.Module) -> Refusal:
    config = getattr(getattr(model, "config", None), "distributed_config", None)
    staged = getattr(model, "_pp_stage", None) is not None or _sizes_over_one(config, ("pp_size",))
    if staged or any(isinstance(m, Pipe) for m in model.modules()):
        return (
            "pipeline parallelism gives each rank some of the layers, so no rank sees an "
            "example's whole gradient; train with pp_size=1 (DDP or FSDP2 shard the model "
            "instead)"
        )
    return None


def _split_devices(args: TrainingArguments, model: nn.Module) -> Refusal:
    device_map = getattr(model, "hf_device_map", None) or {}
    devices = sorted({str(d) for d in device_map.values()})
    if len(devices) > 1:
        return (
            f"the model is spread over devices {devices} by device_map, across which "
            "per-example capture is not supported; load it on one device "
            "(device_map={'': device}) or shard it with FSDP2"
        )
    return None


def _compiled(args: TrainingArguments, model: nn.Module) -> Refusal:
    compiled = [
        name or type(model).__name__
        for name, m in model.named_modules()
        if type(m).__name__ == "OptimizedModule" or getattr(m, "_compiled_call_impl", None)
    ]
    if compiled:
        return (
            f"the model is torch.compile'd ({compiled[0]}), which bypasses module hooks; pass "
            "the uncompiled model (no torch.compile, no Module.compile)"
        )
    if getattr(args, "torch_compile", False):
        return (
            "torch_compile=True makes the trainer run a torch.compile'd model, which bypasses "
            "module hooks; set torch_compile=False"
        )
    return None


def _prompt_learning(args: TrainingArguments, model: nn.Module) -> Refusal:
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, dict):
        return None
    for name, config in configs.items():
        if getattr(config, "is_prompt_learning", False):
            kind = getattr(getattr(config, "peft_type", None), "value", type(config).__name__)
            return (
                f"the PEFT adapter {name!r} is {kind}, whose trained virtual tokens enter the "
                "model beside the batch rather than through a layer's per-example call, so "
                "their per-example gradients are not captured; train a LoRA adapter "
                "(LoraConfig), or capture without PEFT prompt learning"
            )
    return None


def _launched_processes() -> int:
    """How many processes the launcher started: the process group's size once one is
    made, else ``WORLD_SIZE`` from the environment ``torchrun`` gives its ranks."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def _processes_run_alone(args: TrainingArguments, model: nn.Module) -> Refusal:
    launched = _launched_processes()
    if launched > 1 and args.world_size == 1:
        return (
            f"{launched} processes were launched, but the trainer runs each one alone "
            f"(parallel_mode {args.parallel_mode.value}, world_size 1: without a GPU accelerate "
            "falls back to one process unless use_cpu=True), so each would train on all the "
            "data and write the same files as rank 0; on a CPU machine pass use_cpu=True "
            "(accelerate then trains data-parallel over gloo), or launch one process"
        )
    return None


#: The refusals ``check_trainer_setup`` runs before step 0, in this order.
TRAINER_CHECKS: tuple[SetupCheck, ...] = (
    SetupCheck("trl_objective", _trl_objective),
    SetupCheck("packing", _packing),
    SetupCheck("padding_free", _padding_free),
    SetupCheck("loss_outside_model", _loss_outside_model),
    SetupCheck("loss_type", _loss_type),
    SetupCheck("task_head", _task_head),
    SetupCheck("router_aux_loss", _router_aux_loss),
    SetupCheck("fp16_loss_scaling", _fp16_loss_scaling),
    SetupCheck("deepspeed", _deepspeed),
    SetupCheck("fsdp1", _fsdp1),
    SetupCheck("tensor_parallel", _tensor_parallel),
    SetupCheck("pipeline_parallel", _pipeline_parallel),
    SetupCheck("split_devices", _split_devices),
    SetupCheck("compiled", _compiled),
    SetupCheck("prompt_learning", _prompt_learning),
    SetupCheck("processes_run_alone", _processes_run_alone),
)
