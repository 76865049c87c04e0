"""JSONL examples -> padded causal-LM batches, for `tda capture`.

Each line is one example, in one of these forms (an optional integer ``"id"`` becomes its
example id; without it the engine hashes the unpadded token ids):

* ``{"text": "..."}`` -- loss on every token;
* ``{"prompt": "...", "completion": "..."}`` -- loss on the completion tokens only;
* ``{"messages": [{"role": ..., "content": ...}, ...]}`` -- the tokenizer's chat template,
  loss on every token;
* ``{"input_ids": [...], "labels": [...]?}`` -- already tokenized (no tokenizer needed).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor


@dataclass
class Example:
    """One tokenized example: ``input_ids`` and ``labels`` (-100 = no loss) of equal length."""

    input_ids: list[int]
    labels: list[int]
    text: str
    example_id: int | None


def _token_list(value: Any, name: str, line: int, vocab: int | None, ignore: bool) -> list[int]:
    """A list of token ids in ``[0, vocab)`` (``ignore``: -100 allowed too)."""
    if not isinstance(value, list) or not all(type(t) is int for t in value):
        raise ValueError(f"line {line}: {name!r} must be a list of integer token ids")
    top = vocab if vocab is not None else None
    for t in value:
        if (t < 0 and not (ignore and t == -100)) or (top is not None and t >= top):
            allowed = f"0..{top - 1}" if top is not None else "0 or more"
            raise ValueError(
                f"line {line}: {name!r} holds the token id {t}, outside the model's "
                f"vocabulary ({allowed}{', or -100' if ignore else ''})"
            )
    return value


def _text(row: dict[str, Any], key: str, line: int) -> str:
    value = row[key]
    if not isinstance(value, str):
        raise ValueError(f"line {line}: {key!r} must be a string, got {type(value).__name__}")
    return value


def _tokenize(
    row: dict[str, Any], tokenizer: Any, max_length: int, line: int, vocab: int | None
) -> Example:
    if not isinstance(row, dict):
        raise ValueError(f"line {line}: an example must be a JSON object")
    example_id = row.get("id")
    if example_id is not None and type(example_id) is not int:
        raise ValueError(f"line {line}: 'id' must be an integer, got {example_id!r}")
    if "input_ids" in row:
        ids = _token_list(row["input_ids"], "input_ids", line, vocab, ignore=False)
        labels = _token_list(row.get("labels", ids), "labels", line, vocab, ignore=True)
        if len(labels) != len(ids):
            raise ValueError(
                f"line {line}: 'labels' has {len(labels)} entries for {len(ids)} input_ids; "
                "give one label per token (-100 for no loss)"
            )
        ids, labels = ids[:max_length], labels[:max_length]
        text = tokenizer.decode(ids) if tokenizer is not None else " ".join(map(str, ids))
        return Example(ids, labels, text, example_id)
    if not ({"text", "messages"} & set(row) or {"prompt", "completion"} <= set(row)):
        raise ValueError(
            f"line {line}: an example needs 'text', 'prompt'+'completion', 'messages' or "
            f"'input_ids'; got keys {sorted(row)}"
        )
    for key in ("text", "prompt", "completion"):
        if key in row:
            _text(row, key, line)
    if tokenizer is None:
        raise ValueError(
            f"line {line}: text examples need a tokenizer; save one in the model directory "
            "or give pre-tokenized input_ids"
        )
    if "text" in row:
        text = _text(row, "text", line)
        ids = tokenizer(text, truncation=True, max_length=max_length)["input_ids"]
        return Example(ids, list(ids), text, example_id)
    if "prompt" in row and "completion" in row:
        prompt_text, completion_text = _text(row, "prompt", line), _text(row, "completion", line)
        prompt = tokenizer(prompt_text)["input_ids"]
        completion = tokenizer(completion_text, add_special_tokens=False)["input_ids"]
        ids = (prompt + completion)[:max_length]
        labels = ([-100] * len(prompt) + completion)[:max_length]
        return Example(ids, labels, prompt_text + completion_text, example_id)
    messages = row["messages"]
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in messages
    ):
        raise ValueError(f"line {line}: 'messages' must be a list of {{role, content}} strings")
    ids = tokenizer.apply_chat_template(messages, tokenize=True)[:max_length]
    text = "\n".join(f"{m['role']}: {m['content']}" for m in messages)
    return Example(list(ids), list(ids), text, example_id)


def read_examples(
    path: str | Path, tokenizer: Any, max_length: int, vocab_size: int | None = None
) -> list[Example]:
    """Parse and tokenize a JSONL file (token ids checked against ``vocab_size`` when
    given); errors name the line."""
    source = Path(path)
    if not source.exists():
        raise FileNotFoundError(f"no data file at {source}")
    if not source.is_file():
        raise ValueError(f"--data {source} is not a file (give a JSONL file)")
    examples = []
    for number, raw in enumerate(source.read_text().splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            row = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{source}:{number}: not valid JSON ({exc.msg})") from exc
        try:
            example = _tokenize(row, tokenizer, max_length, number, vocab_size)
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from exc
        if len(example.input_ids) < 2:
            raise ValueError(f"{source}:{number}: needs at least 2 tokens to have a loss")
        examples.append(example)
    if not examples:
        raise ValueError(f"{source} holds no example")
    return examples


def batches(
    examples: list[Example], batch_size: int, pad_id: int
) -> Iterator[tuple[dict[str, Tensor], Tensor | None, list[Example]]]:
    """Right-padded batches: (model inputs with labels, explicit ids or None, examples)."""
    for start in range(0, len(examples), batch_size):
        group = examples[start : start + batch_size]
        length = max(len(e.input_ids) for e in group)
        ids = torch.full((len(group), length), pad_id, dtype=torch.long)
        labels = torch.full((len(group), length), -100, dtype=torch.long)
        mask = torch.zeros((len(group), length), dtype=torch.long)
        for row, e in enumerate(group):
            n = len(e.input_ids)
            ids[row, :n] = torch.tensor(e.input_ids)
            labels[row, :n] = torch.tensor(e.labels)
            mask[row, :n] = 1
        explicit = [e.example_id for e in group]
        given = None
        if all(i is not None for i in explicit):
            given = torch.tensor(explicit, dtype=torch.long)
        elif any(i is not None for i in explicit):
            raise ValueError("either every example has an 'id' or none does")
        yield {"input_ids": ids, "attention_mask": mask, "labels": labels}, given, group
