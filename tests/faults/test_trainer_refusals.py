"""Training setups the transformers callbacks cannot follow are refused at ``on_train_begin``.

Each case builds the setup with the real objects a user's run would have, in this one
process: DTensor parameters from transformers' own tensor-parallel plan and ``fully_shard``
on a 1-rank gloo group (a ``FileStore``), FSDP1's ``FullyShardedDataParallel``,
transformers' pipeline split and a ``torch.distributed.pipelining`` ``Pipe``, a model that
accelerate dispatches over two devices, accelerate's state as ``Trainer`` creates it with
a ``DeepSpeedPlugin`` in it (the package itself is not installed here, so accelerate
cannot build a DeepSpeed state on its own), the environment variable accelerate reads,
and compiled modules. Every one of the three callbacks (capture, influence logging, data
selection) must raise ``UnsupportedTrainingSetup`` at its first event, with one line
naming the cause and the way out, and leave nothing behind: no hook on the model, no
store. One case runs the real ``Trainer`` to show the refusal comes before any step.
Data-parallel layouts (FSDP2, HSDP) are accepted.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from accelerate import Accelerator, dispatch_model
from accelerate.state import AcceleratorState
from accelerate.utils import DeepSpeedPlugin, DistributedType
from datasets import Dataset
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
from torch.distributed.pipelining import SplitPoint, pipeline
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.distributed.pipeline_parallel import apply_pipeline_parallelism
from transformers.distributed.tensor_parallel import apply_tensor_parallelism

from tda_plugins.integrations.transformers import (
    DataSelectionCallback,
    GradientCaptureCallback,
    InfluenceLoggingCallback,
    pad_examples,
)
from tda_plugins.integrations.transformers.setup import check_trainer_setup
from tda_plugins.session.capture import UnsupportedTrainingSetup
from tests.models import tiny_causal_lm
from tests.trainers import token_rows, training_args

EXAMPLES = [{"input_ids": r} for r in token_rows(2)]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DeviceMesh]:
    """A 1-rank gloo process group (``FileStore``) and its CPU device mesh."""
    store = dist.FileStore(str(tmp_path_factory.mktemp("group") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


@pytest.fixture
def accelerate_state(tmp_path: Path) -> Iterator[tuple[TrainingArguments, AcceleratorState]]:
    """Arguments, then accelerate's state as ``Trainer`` creates it from them (building
    ``TrainingArguments`` resets that state); reset afterwards."""
    args = training_args(tmp_path / "out")
    Accelerator(cpu=True)
    try:
        yield args, AcceleratorState()
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def llama() -> nn.Module:
    return tiny_causal_lm("llama", torch.float32)


def hooks(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def assert_refused(
    tmp_path: Path,
    model: nn.Module,
    *named: str,
    training: TrainingArguments | None = None,
    **args: Any,
) -> None:
    """Each callback's ``on_train_begin`` (with ``training``, else ``training_args(**args)``)
    raises one line holding every phrase of ``named`` (the cause and the fix), and leaves
    no hook and no store behind."""
    store = tmp_path / "store"
    callbacks = [
        GradientCaptureCallback(store_dir=str(store), layers="all"),
        InfluenceLoggingCallback(EXAMPLES, layers="all"),
        DataSelectionCallback(EXAMPLES, layers="all"),
    ]
    before = hooks(model)
    training = training or training_args(tmp_path / "out", **args)
    for callback in callbacks:
        with pytest.raises(UnsupportedTrainingSetup) as refused:
            callback.on_train_begin(training, TrainerState(), TrainerControl(), model=model)
        message = str(refused.value)
        assert "\n" not in message
        for phrase in named:
            assert phrase in message, (type(callback).__name__, message)
    assert hooks(model) == before
    assert not store.exists()


# -- tensor parallelism --------------------------------------------------------------------


def test_transformers_tensor_parallel_plan_is_refused(tmp_path: Path, mesh: DeviceMesh) -> None:
    """transformers' own TP plan for Llama (colwise q/k/v, rowwise o/down, vocab-sharded
    embedding): DTensor parameters that FSDP does not gather, refused by name."""
    model = llama()
    # what from_pretrained(distributed_config=DistributedConfig(tp_size=...)) applies
    apply_tensor_parallelism(model, mesh, model._expand_parallel_plan(model._tp_plan))
    assert_refused(tmp_path, model, "tensor/context/expert parallelism", "Shard(dim=0)", "DDP")


def test_tensor_parallel_sizes_are_refused(tmp_path: Path, mesh: DeviceMesh) -> None:
    """accelerate's ``ParallelismConfig(tp_size=2)`` in the arguments (the Trainer's TP)."""
    from accelerate.parallelism_config import ParallelismConfig

    config = ParallelismConfig(tp_size=2)
    assert_refused(tmp_path, llama(), "tp_size=2", "tp_size", parallelism_config=config)


def test_fsdp2_and_hsdp_layouts_are_accepted(mesh: DeviceMesh) -> None:
    """``fully_shard`` (``Shard(0)``) and HSDP (``Replicate, Shard(0)`` on a 2-D mesh) gather
    each parameter whole before the module computes: not refused."""
    args = TrainingArguments(output_dir="unused", use_cpu=True, report_to=[])
    for device_mesh in (mesh, init_device_mesh("cpu", (1, 1), mesh_dim_names=("rep", "shard"))):
        model = llama()
        for layer in model.model.layers:
            fully_shard(layer, mesh=device_mesh)
        fully_shard(model, mesh=device_mesh)
        assert check_trainer_setup(args, model) is model


# -- DeepSpeed -----------------------------------------------------------------------------


def test_deepspeed_plugin_in_accelerate_state_is_refused(
    tmp_path: Path,
    accelerate_state: tuple[TrainingArguments, AcceleratorState],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What ``Trainer.is_deepspeed_enabled`` reads: a ``DeepSpeedPlugin`` in accelerate's
    state, with no ``deepspeed`` argument."""
    args, state = accelerate_state
    monkeypatch.setattr(state, "deepspeed_plugins", {"zero2": DeepSpeedPlugin(zero_stage=2)})
    named = ("DeepSpeed (enabled by accelerate's deepspeed_plugin)", "FSDP2")
    assert_refused(tmp_path, llama(), *named, training=args)


def test_deepspeed_distributed_type_is_refused(
    tmp_path: Path,
    accelerate_state: tuple[TrainingArguments, AcceleratorState],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    args, state = accelerate_state
    monkeypatch.setattr(state, "distributed_type", DistributedType.DEEPSPEED)
    assert_refused(tmp_path, llama(), "distributed_type DEEPSPEED", "DDP or FSDP2", training=args)


def test_deepspeed_from_the_environment_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``ACCELERATE_USE_DEEPSPEED=true``, what ``accelerate launch`` sets from its config
    (set after the arguments: without the package, transformers refuses to build them)."""
    args = training_args(tmp_path / "out")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    assert_refused(tmp_path, llama(), "ACCELERATE_USE_DEEPSPEED", "FSDP2", training=args)


# -- FSDP1, pipeline parallelism, compiled models -------------------------------------------


def test_fsdp1_is_refused(tmp_path: Path, mesh: DeviceMesh) -> None:
    """FSDP1 as ``Trainer`` hands it to the callbacks: the wrapped model."""
    model = FullyShardedDataParallel(llama(), device_id=torch.device("cpu"))
    assert_refused(tmp_path, model, "FSDP1 (FullyShardedDataParallel)", "fsdp_version: 2")


def test_transformers_pipeline_parallel_is_refused(tmp_path: Path, mesh: DeviceMesh) -> None:
    """transformers' pipeline split (``DistributedConfig(pp_size=...)`` applies it)."""
    model = apply_pipeline_parallelism(llama(), mesh)
    assert_refused(tmp_path, model, "pipeline parallelism", "pp_size=1")


def test_torch_pipelining_pipe_is_refused(tmp_path: Path) -> None:
    """A model split by ``torch.distributed.pipelining.pipeline``."""
    mlp = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    pipe = pipeline(mlp, mb_args=(torch.randn(2, 4),), split_spec={"2": SplitPoint.BEGINNING})
    assert_refused(tmp_path, pipe, "pipeline parallelism", "pp_size=1")


def test_model_spread_over_devices_is_refused(tmp_path: Path) -> None:
    """accelerate's ``dispatch_model`` over two devices (``lm_head`` offloaded to disk: the
    second device a CPU-only machine has)."""
    model = dispatch_model(
        llama(), device_map={"model": "cpu", "lm_head": "disk"}, offload_dir=str(tmp_path / "off")
    )
    assert_refused(tmp_path, model, "spread over devices ['cpu', 'disk']", "load it on one device")


@pytest.mark.parametrize("how", ["torch.compile", "Module.compile"])
def test_compiled_models_are_refused(tmp_path: Path, how: str) -> None:
    """A compiled root, or one decoder layer compiled in place."""
    model = llama()
    if how == "torch.compile":
        assert_refused(tmp_path, torch.compile(model), "torch.compile'd", "uncompiled model")
    else:
        model.model.layers[1].compile()
        assert_refused(tmp_path, model, "(model.layers.1)", "no Module.compile")


def test_trainer_told_to_compile_is_refused_before_any_step(tmp_path: Path) -> None:
    """``torch_compile=True``: the real ``Trainer`` raises at ``on_train_begin``, before
    any step, with no store and the weights untouched."""
    assert_refused(
        tmp_path, llama(), "torch_compile=True", "torch_compile=False", torch_compile=True
    )
    steps = StepCounter()
    store = tmp_path / "trainer-store"
    model = llama()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = Trainer(
        model=model,
        args=training_args(tmp_path / "trainer-out", torch_compile=True),
        train_dataset=Dataset.from_list(EXAMPLES * 4),
        data_collator=pad_examples,
        callbacks=[steps, GradientCaptureCallback(store_dir=str(store))],
    )
    with pytest.raises(UnsupportedTrainingSetup, match="torch_compile=True"):
        trainer.train()
    assert steps.begun == 0 and trainer.state.global_step == 0
    assert not store.exists()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in initial.items())


class StepCounter(TrainerCallback):
    def __init__(self) -> None:
        self.begun = 0

    def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
        self.begun += 1


def test_context_parallelism_set_by_accelerate_launch_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`accelerate launch` with a parallelism config exports it to the environment, which
    the training arguments never read: under FSDP2 each rank would see part of each
    sequence while the parameter layout looks data-parallel."""
    args = training_args(tmp_path / "out")
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    monkeypatch.setenv("PARALLELISM_CONFIG_CP_SIZE", "2")
    with pytest.raises(UnsupportedTrainingSetup, match="cp_size=2"):
        check_trainer_setup(args, tiny_causal_lm("llama", torch.float32))


# -- losses the callbacks cannot split per example ------------------------------------------


def test_label_smoothing_is_refused(tmp_path: Path) -> None:
    """``label_smoothing_factor``: the ``Trainer`` (and TRL's) pops the labels and computes
    the loss from the logits outside the model, so the model returns no loss to read the
    normalization from. Without the check the first forward failed with a message
    about missing labels."""
    named = ("label_smoothing_factor=0.1", "LabelSmoother", "set label_smoothing_factor=0")
    assert_refused(tmp_path, llama(), *named, label_smoothing_factor=0.1)


@pytest.mark.parametrize("head", ["LlamaForSequenceClassification", "LlamaForTokenClassification"])
@pytest.mark.parametrize("lora", [False, True])
def test_a_task_heads_own_loss_is_refused(tmp_path: Path, head: str, lora: bool) -> None:
    """A classifier's loss is a mean over the micro-batch that ignores the accumulation
    window's token count the normalization reads: with gradient accumulation 2 every
    stored gradient came out 2x its example's own. Refused, PEFT-wrapped or not; the
    causal LM of the same config is accepted."""
    import transformers
    from peft import LoraConfig, TaskType, get_peft_model

    config = tiny_causal_lm("llama").config
    model = getattr(transformers, head)(config)
    if lora:
        task = TaskType.SEQ_CLS if "Sequence" in head else TaskType.TOKEN_CLS
        model = get_peft_model(model, LoraConfig(task_type=task, r=2, target_modules=["q_proj"]))
    kind = head.removeprefix("Llama").removeprefix("For")
    assert_refused(tmp_path, model, head, f"trains its {kind} loss", "AutoModelForCausalLM")
    assert check_trainer_setup(training_args(tmp_path / "out"), llama()) is not None


def test_trl_dft_loss_is_refused_and_nll_accepted(tmp_path: Path) -> None:
    """TRL's ``loss_type="dft"`` weights each token by its detached probability: the
    gradient at the fused head's log-probabilities is no longer ``-c/N`` everywhere, so
    the normalization read from it would scale each micro-batch by its mean probability."""
    from trl import SFTConfig

    dft = training_args(tmp_path / "out", SFTConfig, loss_type="dft")
    named = ("loss_type='dft'", "mean token weight", "set loss_type='nll'")
    assert_refused(tmp_path, llama(), *named, training=dft)
    nll = training_args(tmp_path / "out", SFTConfig, loss_type="nll")
    assert check_trainer_setup(nll, llama()) is not None


@pytest.mark.parametrize("config", ["DPOConfig", "KTOConfig", "GRPOConfig", "RLOOConfig"])
def test_trl_trainers_other_than_sft_are_refused_by_their_config(
    tmp_path: Path, config: str
) -> None:
    """A preference, reinforcement-learning or reward objective is not each example's
    next-token loss: refused by TRL's config class before any other check (whose ways out,
    such as loss_type='nll', do not apply to those trainers); a user's SFTConfig subclass
    is an SFT run and passes."""
    import trl

    options = {"num_generations": 2} if config in ("GRPOConfig", "RLOOConfig") else {}
    args = training_args(tmp_path / "out", getattr(trl, config), **options)
    named = (f"TRL's {config} trains its trainer's own objective", "fine-tune with SFTTrainer")
    assert_refused(tmp_path, llama(), *named, training=args)

    class MySFTConfig(trl.SFTConfig):
        pass

    class MyConfig(getattr(trl, config)):  # type: ignore[misc]
        pass

    assert check_trainer_setup(training_args(tmp_path / "out", MySFTConfig), llama()) is not None
    mine = training_args(tmp_path / "out", MyConfig, **options)
    assert_refused(tmp_path, llama(), f"TRL's {config} trains", training=mine)


def test_a_multimodal_model_is_refused_naming_its_tower(tmp_path: Path) -> None:
    """A model whose config has a vision (or audio) tower: its rows there are images or
    patches, whose count can match the batch's; refused for that reason, not its loss."""
    model = llama()
    model.config.vision_config = {"hidden_size": 8}
    named = ("a multimodal model (vision_config)", "its language model alone")
    assert_refused(tmp_path, model, *named)


def tiny_mixtral(**config: Any) -> nn.Module:
    """A one-block Mixtral of two experts, one per token (``config``: more settings)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(
        MixtralConfig(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            num_local_experts=2,
            num_experts_per_tok=1,
            **config,
        )
    )


@pytest.mark.parametrize("coefficient", [0.02, 0.0])
def test_an_moe_router_load_balancing_loss_is_refused(tmp_path: Path, coefficient: float) -> None:
    """A Mixtral whose forward adds ``router_aux_loss_coef * aux_loss`` (a balance term of
    the whole batch) to the loss is refused; with the coefficient at 0, or the router
    logits off, nothing is added and the model is accepted."""

    def mixtral(router_logits: bool) -> nn.Module:
        return tiny_mixtral(output_router_logits=router_logits, router_aux_loss_coef=coefficient)

    args = training_args(tmp_path / "out")
    assert check_trainer_setup(args, mixtral(router_logits=False)) is not None
    if coefficient:
        named = ("output_router_logits=True", "router_aux_loss_coef=0.02", "no one example's")
        assert_refused(tmp_path, mixtral(router_logits=True), *named)
        # TRL's SFTTrainer turns the router logits back on from its own coefficient
        from trl import SFTConfig

        sft = training_args(tmp_path / "out", SFTConfig)
        fix = "set SFTConfig(router_aux_loss_coef=0.0)"
        assert_refused(tmp_path, mixtral(router_logits=True), *named, fix, training=sft)
    else:
        assert check_trainer_setup(args, mixtral(router_logits=True)) is not None


def test_fp16_loss_scaling_on_an_accelerator_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU, ``fp16=True`` trains under a ``GradScaler`` that skips each overflowing
    step, whose non-finite per-example gradients the callbacks would store, score or
    select on. No GPU here: the arguments' device is set to CUDA (what the check reads).
    On the CPU, where accelerate keeps no scaler, the same arguments are accepted (the
    control)."""
    args = training_args(tmp_path / "out", fp16=True)
    assert check_trainer_setup(args, llama()) is not None
    monkeypatch.setattr(TrainingArguments, "device", property(lambda self: torch.device("cuda")))
    named = ("fp16 mixed precision on an accelerator", "(bf16=True)")
    assert_refused(tmp_path, llama(), *named, training=args)


# -- PEFT LoRA variants without a per-example call ---------------------------------------

#: LoRA variants whose ``lora_A``/``lora_B`` do not see each example's input once, each
#: with the refusal's pattern (cause and way out); ``None``: the plain-LoRA control.
LORA_VARIANTS = {
    "dora": ({"target_modules": "all-linear", "use_dora": True}, r"DoRA adapter .*use_dora=False"),
    "target_parameters": (
        {"target_modules": ["q_proj"], "target_parameters": ["mlp.down_proj.weight"]},
        r"LoRA on a parameter .*target_modules=\['down_proj'\]",
    ),
    "plain": ({"target_modules": "all-linear"}, None),
}


@pytest.mark.parametrize("variant", LORA_VARIANTS)
def test_lora_without_a_per_example_call_is_refused_before_any_step(
    tmp_path: Path, variant: str
) -> None:
    """``LoraConfig(use_dora=True)``: PEFT calls ``lora_A``/``lora_B`` on an identity matrix
    besides the batch, and its magnitude vector has no per-example capture;
    ``target_parameters`` (PEFT's ``ParamWrapper``) adds ``lora_B @ lora_A`` to a weight
    without calling them. Every callback, through the real ``Trainer``, and
    ``capture_examples`` refuse both before any step, with the way out; plain LoRA
    trains (the control)."""
    from peft import LoraConfig, get_peft_model

    from tda_plugins import capture_examples
    from tda_plugins.capture.layers import LayerSelectionError

    options, refusal = LORA_VARIANTS[variant]

    def model() -> nn.Module:
        return get_peft_model(llama(), LoraConfig(r=4, **options))

    rows = [{"input_ids": r} for r in token_rows(4)]
    for name, callback in (
        ("capture", GradientCaptureCallback(store_dir=str(tmp_path / "store"))),
        ("influence", InfluenceLoggingCallback(EXAMPLES)),
        ("selection", DataSelectionCallback(EXAMPLES)),
    ):
        steps = StepCounter()
        trainer = Trainer(
            model=model(),
            args=training_args(tmp_path / f"out-{name}", max_steps=1),
            train_dataset=Dataset.from_list(rows),
            data_collator=pad_examples,
            callbacks=[steps, callback],
        )
        if refusal is None:
            trainer.train()
            assert steps.begun == 1
            continue
        with pytest.raises(LayerSelectionError, match=refusal):
            trainer.train()
        assert steps.begun == 0, name
        assert not (tmp_path / "store").exists()
    if refusal is not None:
        with pytest.raises(LayerSelectionError, match=refusal):
            capture_examples(model(), rows, tmp_path / "queries")
        assert not (tmp_path / "queries").exists()


def test_lora_on_an_moe_router_names_a_way_out_that_exists() -> None:
    """PEFT's ``all-linear`` wraps a Mixtral router's weight as a parameter LoRA (its router
    is no ``nn.Linear``), as it does ``target_modules=["gate"]``: the refusal does not send
    the user to that, but to leaving the router out."""
    from peft import LoraConfig, get_peft_model

    from tda_plugins import LayerSelection
    from tda_plugins.capture.layers import LayerSelectionError

    model = get_peft_model(tiny_mixtral(), LoraConfig(r=4, target_modules="all-linear"))
    with pytest.raises(LayerSelectionError) as refused:
        LayerSelection().resolve(model)
    assert "MixtralTopKRouter is not a linear layer" in str(refused.value)
    assert "target_modules=['gate']" not in str(refused.value)


def _other_tuner(kind: str) -> nn.Module:
    from peft import IA3Config, LoHaConfig, LoKrConfig, get_peft_model

    configs = {
        "IA3": IA3Config(target_modules=["v_proj", "down_proj"], feedforward_modules=["down_proj"]),
        "LoHa": LoHaConfig(r=4, target_modules=["q_proj", "v_proj"]),
        "LoKr": LoKrConfig(r=4, target_modules=["q_proj", "v_proj"]),
    }
    return get_peft_model(llama(), configs[kind])


@pytest.mark.parametrize("kind", ["IA3", "LoHa", "LoKr"])
def test_peft_adapters_other_than_lora_are_refused_by_name(tmp_path: Path, kind: str) -> None:
    """No layer adapter captures IA3, LoHa or LoKr parameters: refused before any step, by
    the trainer's callback and ``capture_examples``, naming the adapter type and the way
    out (the refusal used to say only that no layer matched, and to widen the layers)."""
    from tda_plugins import capture_examples
    from tda_plugins.capture.layers import LayerSelectionError

    refusal = rf"PEFT {kind} adapters have no per-example capture.*LoraConfig"
    steps = StepCounter()
    trainer = Trainer(
        model=_other_tuner(kind),
        args=training_args(tmp_path / "out", max_steps=1),
        train_dataset=Dataset.from_list([{"input_ids": r} for r in token_rows(4)]),
        data_collator=pad_examples,
        callbacks=[steps, GradientCaptureCallback(store_dir=str(tmp_path / "store"))],
    )
    with pytest.raises(LayerSelectionError, match=refusal):
        trainer.train()
    assert steps.begun == 0
    rows = [{"input_ids": r} for r in token_rows(4)]
    with pytest.raises(LayerSelectionError, match=refusal):
        capture_examples(_other_tuner(kind), rows, tmp_path / "queries")


def test_a_trainable_adapter_that_is_not_active_is_refused_before_any_step(
    tmp_path: Path,
) -> None:
    """A second LoRA adapter left trainable but not active gets no gradient (PEFT does
    not call it): it used to stop the first step with 'received no gradient', blaming a
    fused head; it is refused at the start, naming the adapter and both ways out."""
    from peft import LoraConfig, get_peft_model

    from tda_plugins.capture.layers import LayerSelectionError

    model = get_peft_model(llama(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    model.add_adapter("second", LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    steps = StepCounter()
    trainer = Trainer(
        model=model,
        args=training_args(tmp_path / "out", max_steps=1),
        train_dataset=Dataset.from_list([{"input_ids": r} for r in token_rows(4)]),
        data_collator=pad_examples,
        callbacks=[steps, GradientCaptureCallback(store_dir=str(tmp_path / "store"))],
    )
    with pytest.raises(LayerSelectionError, match=r"'second' is not active.*set_adapter"):
        trainer.train()
    assert steps.begun == 0
