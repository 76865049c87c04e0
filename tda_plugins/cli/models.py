"""The model ``tda capture`` runs: a transformers model directory, or a PEFT adapter on
its base.

An adapter directory (``adapter_config.json``, what ``trainer.save_model()`` writes for a
LoRA run, and what each of its ``checkpoint-<n>`` folders holds) is accepted as
``--model`` itself, its base resolved from ``base_model_name_or_path``, or as
``--adapter`` beside ``--model BASE``. The adapter is loaded trainable, so its
``lora_A``/``lora_B`` layers are the ones captured by default: the layers the training
run's store holds.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ADAPTER_CONFIG = "adapter_config.json"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True)
class ModelSource:
    """Where the weights come from: a base model directory and an optional adapter."""

    base: Path
    adapter: Path | None

    @classmethod
    def resolve(cls, model: str, adapter: str | None) -> ModelSource:
        """``--model`` (a model or an adapter directory) and ``--adapter`` -> the source;
        refuses a directory that is neither, naming what is missing."""
        path = Path(model)
        if adapter is not None:
            adapter_dir = Path(adapter)
            if not (adapter_dir / ADAPTER_CONFIG).is_file():
                raise FileNotFoundError(
                    f"--adapter {adapter_dir} holds no PEFT adapter (missing {ADAPTER_CONFIG})"
                )
            if (path / ADAPTER_CONFIG).is_file():
                raise ValueError(
                    f"--model {path} is an adapter too; give the base model's directory as "
                    "--model, or the adapter alone as --model"
                )
            return cls(_model_dir(path, "--model"), adapter_dir)
        if (path / ADAPTER_CONFIG).is_file():
            return cls(_adapter_base(path), path)
        return cls(_model_dir(path, "--model"), None)

    def metadata(self) -> dict[str, str]:
        """What ``store.json`` records of the model."""
        out = {"model": str(self.base)}
        if self.adapter is not None:
            out["adapter"] = str(self.adapter)
        return out

    def load(
        self,
        dtype: torch.dtype,
        device: torch.device,
        device_map: str | None,
        adapter_name: str = "default",
    ) -> tuple[Any, Any]:
        """The model in eval mode on ``device`` (or spread by transformers' ``device_map``)
        with its adapter attached trainable under ``adapter_name`` (a store's, whose layer
        names hold it), and the tokenizer of the adapter directory, else of the base
        directory (``None`` when neither has one)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # the command has its own progress bar
        model: Any = AutoModelForCausalLM.from_pretrained(
            self.base, dtype=dtype, device_map=device_map
        )
        if self.adapter is not None:
            from peft import PeftModel

            model = PeftModel.from_pretrained(
                model, self.adapter, adapter_name=adapter_name, is_trainable=True
            )
        if device_map is None:
            model = model.to(device)
        model = model.eval()
        folders = [d for d in (self.adapter, self.base) if d is not None]
        with_tokenizer = next(
            (d for d in folders if any((d / f).exists() for f in _TOKENIZER_FILES)), None
        )
        tokenizer = AutoTokenizer.from_pretrained(with_tokenizer) if with_tokenizer else None
        return model, tokenizer


def _model_dir(path: Path, option: str) -> Path:
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"no transformers model at {option} {path} (missing config.json; a PEFT adapter "
            f"directory has {ADAPTER_CONFIG})"
        )
    return path


def _adapter_base(adapter: Path) -> Path:
    """The local base model directory an adapter names."""
    try:
        config = json.loads((adapter / ADAPTER_CONFIG).read_text())
    except ValueError as error:
        raise ValueError(f"{adapter / ADAPTER_CONFIG} is not valid JSON ({error})") from error
    base = config.get("base_model_name_or_path") if isinstance(config, dict) else None
    if not isinstance(base, str) or not base:
        raise ValueError(
            f"the adapter at {adapter} does not name its base model; pass --model BASE "
            f"--adapter {adapter}"
        )
    base_dir = Path(base)
    if not (base_dir / "config.json").is_file():
        raise FileNotFoundError(
            f"the adapter at {adapter} names its base model {base!r}, which is not a local "
            f"model directory; pass --model BASE_DIR --adapter {adapter}"
        )
    return base_dir
