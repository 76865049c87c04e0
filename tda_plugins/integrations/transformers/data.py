"""Examples -> padded causal-LM batches: ``tda capture``'s JSONL, and the queries and
targets the callbacks take (a JSONL path, a ``datasets.Dataset`` or a list of dicts).

Each line (row) is one example, in one of these forms (an optional integer ``"id"`` becomes its
example id; without it the engine hashes the unpadded token ids):

* ``{"text": "..."}`` -- loss on every token;
* ``{"prompt": "...", "completion": "..."}`` -- loss on the completion tokens only;
* ``{"messages": [{"role": ..., "content": ...}, ...]}`` -- the tokenizer's chat template,
  loss on every token;
* ``{"prompt": [messages], "completion": [messages]}`` -- a conversation in TRL's
  prompt-completion form: the chat template of both, the prompt's with the generation
  prompt, loss on the completion tokens only;
* ``{"input_ids": [...], "labels": [...]?}`` -- already tokenized (no tokenizer needed).

Those are the losses of TRL's ``SFTTrainer`` by default; :class:`LossTokens` changes them
as its ``completion_only_loss`` and ``assistant_only_loss`` do, so that a row is scored on
the tokens it was trained on.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from numbers import Integral
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from tda_plugins.capture.identity import content_hash
from tda_plugins.integrations.transformers.sft import is_sft_config

#: Examples as callers give them: a JSONL path, a ``datasets.Dataset`` or a list of dicts.
Examples = str | Path | Iterable[Mapping[str, Any]]


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


def _conversation(row: dict[str, Any], key: str, line: int) -> list[dict[str, str]]:
    """``row[key]`` checked to be a list of ``{role, content}`` strings."""
    value = row[key]
    if not isinstance(value, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in value
    ):
        raise ValueError(f"line {line}: {key!r} must be a list of {{role, content}} strings")
    return value


@dataclass(frozen=True)
class LossTokens:
    """Which tokens a text row has and which of them carry its loss: TRL ``SFTConfig``'s
    two switches, by their names, and the end-of-sequence token ``SFTTrainer`` appends, so
    that a query or a training row captured again is scored on the tokens the run trained
    it on.

    Attributes:
        completion_only_loss: a prompt-completion row's loss on its completion alone (TRL's
            default for such rows); ``False``: on every token.
        assistant_only_loss: a conversation's loss on the assistant's tokens alone (the
            chat template's ``{% generation %}`` markers, or TRL's training template where
            the template has none, as TRL does); text rows keep every token.
        eos: text and completion rows end in the tokenizer's end-of-sequence token, as
            ``SFTTrainer`` appends it (a conversation ends as its chat template ends it).
        max_length: the run cut longer rows to their first ``max_length`` tokens, as
            ``SFTConfig(max_length=...)`` does (``None``: no cut recorded).
        keep_end: the run cut them to their last ``max_length`` tokens instead (TRL's
            deprecated ``truncation_mode="keep_end"``), which a capture does not reproduce.
        eos_token: the end-of-sequence token the run appended where it is not the
            tokenizer's own (``SFTConfig(eos_token=...)``, which TRL sets on its tokenizer
            in place, unlike a tokenizer loaded again to capture queries).
        text_field: the column a text row's text is read from (``SFTConfig``'s
            ``dataset_text_field``).
        completion_mask: an ``input_ids`` row's ``completion_mask`` column carries its
            loss, as TRL reads it where ``completion_only_loss=True`` is set (left unset,
            TRL turns it on for prompt-completion rows alone).
    """

    completion_only_loss: bool = True
    assistant_only_loss: bool = False
    eos: bool = False
    max_length: int | None = None
    keep_end: bool = False
    eos_token: str | None = None
    text_field: str = "text"
    completion_mask: bool = False

    @classmethod
    def of_trainer(cls, args: Any) -> LossTokens:
        """What a trainer trains on: an ``SFTConfig``'s switches (``completion_only_loss``
        unset: on, for prompt-completion rows, as TRL decides) and the end-of-sequence
        token ``SFTTrainer`` appends; the defaults otherwise (transformers' ``Trainer``
        trains the rows its collator is given)."""
        if not is_sft_config(args):
            return cls()
        return cls(
            completion_only_loss=getattr(args, "completion_only_loss", None) is not False,
            assistant_only_loss=bool(getattr(args, "assistant_only_loss", False)),
            eos=True,
            max_length=getattr(args, "max_length", None),
            keep_end=getattr(args, "truncation_mode", "keep_start") == "keep_end",
            eos_token=getattr(args, "eos_token", None),
            text_field=getattr(args, "dataset_text_field", None) or "text",
            completion_mask=getattr(args, "completion_only_loss", None) is True,
        )

    def truncation(self, max_length: int | None) -> int | None:
        """The length to cut rows to: ``max_length`` where given, else the run's.

        Raises:
            ValueError: the run cut rows to their last tokens and no length is given.
        """
        if max_length is not None or self.max_length is None:
            return max_length
        if self.keep_end:
            raise ValueError(
                f"the run cut rows longer than {self.max_length} tokens to their last "
                f"{self.max_length} (truncation_mode='keep_end'), which a capture does not "
                "reproduce: give rows within that length and max_length (--max-length) "
                "explicitly"
            )
        return self.max_length

    def as_json(self) -> dict[str, bool | int | None]:
        """The form a store's metadata keeps (``loss_tokens``)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, value: Any) -> LossTokens:
        """From :meth:`as_json` (the defaults for ``None``, and for ``eos`` where a store
        written before it was recorded lacks it)."""
        return cls() if value is None else cls(**value)


def _chat(
    tokenizer: Any, messages: list[dict[str, str]], template: str | None, **options: Any
) -> dict[str, list[int]]:
    """``messages`` through the chat ``template`` (``None``: the tokenizer's), as TRL's
    ``SFTTrainer`` tokenizes a conversation: ``input_ids`` (and ``assistant_masks`` when
    asked for; ``return_dict``: the same form whatever the transformers version returns by
    default)."""
    out = tokenizer.apply_chat_template(
        messages, tokenize=True, return_dict=True, chat_template=template, **options
    )
    return {key: list(value) for key, value in out.items() if key != "attention_mask"}


def _chat_options(row: dict[str, Any], line: int) -> dict[str, Any]:
    """What a row adds to its chat template's call, as TRL passes it: its ``tools`` (a
    list, or its JSON) and its ``chat_template_kwargs`` (``enable_thinking``, ...)."""
    options: dict[str, Any] = {}
    tools = row.get("tools")
    if tools is not None:
        try:
            options["tools"] = json.loads(tools) if isinstance(tools, str) else tools
        except ValueError as error:
            raise ValueError(f"line {line}: 'tools' is not JSON ({error})") from error
    extra = row.get("chat_template_kwargs")
    if extra is not None:
        if not isinstance(extra, dict):
            raise ValueError(f"line {line}: 'chat_template_kwargs' must be an object")
        options.update(extra)
    return options


def _assistant_template(tokenizer: Any) -> str | None:
    """The chat template that marks the assistant's tokens, as TRL's ``SFTTrainer`` picks
    it under ``assistant_only_loss``: the tokenizer's own where it has ``{% generation %}``
    markers (``None``), else TRL's training template for it."""
    from trl.chat_template_utils import get_training_chat_template, has_generation_markers

    if has_generation_markers(getattr(tokenizer, "chat_template", None) or ""):
        return None
    try:
        return get_training_chat_template(tokenizer)
    except ValueError as error:
        raise ValueError(
            f"assistant_only_loss needs a chat template that marks the assistant's tokens "
            f"({{% generation %}}), and TRL has none for this tokenizer's ({error}); add the "
            "markers to its template, or capture with assistant_only_loss=False "
            "(tda: --no-assistant-only-loss)"
        ) from error


def _masked(labels: list[int], keep: list[int], line: int) -> list[int]:
    """``labels`` with -100 where ``keep`` (the assistant mask) is 0; a row left with no
    assistant token is refused."""
    if not any(keep):
        raise ValueError(
            f"line {line}: no assistant token under assistant_only_loss (no assistant turn, "
            "or a chat template whose generation markers hold none)"
        )
    return [label if k else -100 for label, k in zip(labels, keep, strict=True)]


def _chat_text(messages: list[dict[str, str]]) -> str:
    return "\n".join(f"{m['role']}: {m['content']}" for m in messages)


def _with_eos(text: str, tokenizer: Any, line: int, loss: LossTokens) -> str:
    """``text`` ending in the run's end-of-sequence token (``loss.eos_token``, else the
    tokenizer's; added if missing), as TRL's ``SFTTrainer`` makes non-conversational
    rows."""
    eos = loss.eos_token or getattr(tokenizer, "eos_token", None)
    if not isinstance(eos, str) or not eos:
        raise ValueError(f"line {line}: the tokenizer has no end-of-sequence token to append")
    return text if text.endswith(eos) else text + eos


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _tokenize(
    row: dict[str, Any],
    tokenizer: Any,
    max_length: int,
    line: int,
    vocab: int | None,
    loss: LossTokens,
    assistant_template: Callable[[], str | None],
) -> Example:
    """One row as an :class:`Example`, cut to ``max_length`` tokens (the text of a cut
    row is then its kept tokens, decoded: what the scores are of); ``assistant_template()``
    gives the chat template that marks the assistant's tokens (asked for only where
    ``assistant_only_loss`` needs it, and the same for every row: :func:`tokenize_rows`
    resolves it once).

    A row holding several forms is read as TRL's ``SFTTrainer`` reads it: ``input_ids``
    first, then ``prompt`` + ``completion``, then ``messages``, then ``text``; keys a
    ``datasets.Dataset`` fills with ``None`` for rows that lack them count as absent."""
    if not isinstance(row, dict):
        raise ValueError(f"line {line}: an example must be a JSON object")
    row = {key: value for key, value in row.items() if value is not None}
    example_id = _example_id(row.get("id"), line)
    full = _whole_example(row, tokenizer, line, vocab, loss, assistant_template)
    if len(full.input_ids) <= max_length:
        return dataclasses.replace(full, example_id=example_id)
    ids, labels = full.input_ids[:max_length], full.labels[:max_length]
    text = tokenizer.decode(ids) if tokenizer is not None else " ".join(map(str, ids))
    return Example(ids, labels, text, example_id)


def _example_id(value: Any, line: int) -> int | None:
    """A row's ``id``: an integer (a numpy or 0-d torch integer too) within int64."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_floating_point():
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise ValueError(f"line {line}: 'id' must be an integer, got {value!r}")
    if not -(2**63) <= int(value) < 2**63:
        raise ValueError(
            f"line {line}: 'id' {value} is outside the 64-bit integers the store keeps ids in"
        )
    return int(value)


def _masked_labels(row: dict[str, Any], ids: list[int], line: int, loss: LossTokens) -> list[int]:
    """A tokenized row's labels without a ``labels`` column, as TRL builds them: ``-100``
    where its ``assistant_masks`` is 0, or its ``completion_mask`` where the run set
    ``completion_only_loss``; the ids themselves elsewhere."""
    columns = [c for c in ("completion_mask", "assistant_masks") if c in row]
    if not loss.completion_mask:
        columns = [c for c in columns if c != "completion_mask"]
    masks = [row[c] for c in columns]
    for column, mask in zip(columns, masks, strict=True):
        if not isinstance(mask, list | tuple) or len(mask) != len(ids):
            raise ValueError(
                f"line {line}: {column!r} must hold one 0/1 entry per input_id ({len(ids)})"
            )
    return [t if all(m[i] for m in masks) else -100 for i, t in enumerate(ids)]


def _whole_example(
    row: dict[str, Any],
    tokenizer: Any,
    line: int,
    vocab: int | None,
    loss: LossTokens,
    assistant_template: Callable[[], str | None],
) -> Example:
    """One row's tokens, labels and text, whole (no id: :func:`_tokenize` adds it)."""
    if "input_ids" in row:
        ids = _token_list(row["input_ids"], "input_ids", line, vocab, ignore=False)
        labels = _token_list(
            row["labels"] if "labels" in row else _masked_labels(row, ids, line, loss),
            "labels",
            line,
            vocab,
            ignore=True,
        )
        if len(labels) != len(ids):
            raise ValueError(
                f"line {line}: 'labels' has {len(labels)} entries for {len(ids)} input_ids; "
                "give one label per token (-100 for no loss)"
            )
        _refuse_masked_tokens(row.get("attention_mask"), len(ids), line)
        text = tokenizer.decode(ids) if tokenizer is not None else " ".join(map(str, ids))
        return Example(ids, labels, text, None)
    field = loss.text_field
    if not ({field, "messages"} & set(row) or {"prompt", "completion"} <= set(row)):
        raise ValueError(
            f"line {line}: an example needs {field!r}, 'prompt'+'completion', 'messages' or "
            f"'input_ids'; got keys {sorted(row)}"
        )
    if field in row:
        _text(row, field, line)
    if tokenizer is None:
        raise ValueError(
            f"line {line}: text examples need a tokenizer; save one in the model directory "
            "or give pre-tokenized input_ids"
        )
    conversation = "messages" in row or isinstance(row.get("prompt"), list)
    assistant = assistant_template() if loss.assistant_only_loss and conversation else None
    if "prompt" in row and "completion" in row:
        # TRL appends its end-of-sequence token to a row's text where it has one, which
        # this form then leaves unused: the completion goes without
        pair_loss = dataclasses.replace(loss, eos=False) if field in row else loss
        prompt, ids, text, keep = _prompt_completion(row, tokenizer, line, pair_loss, assistant)
        # As TRL does: prompt and completion tokenized together (tokens may merge across
        # the boundary); the loss starts where the prompt's own tokens stop matching.
        start = _common_prefix(prompt, ids) if loss.completion_only_loss else 0
        labels = [-100] * start + ids[start:]
        labels = labels if keep is None else _masked(labels, keep, line)
        return Example(ids, labels, text, None)
    if "messages" in row:
        messages, chat = _conversation(row, "messages", line), _chat_options(row, line)
        if not loss.assistant_only_loss:
            ids = _chat(tokenizer, messages, None, **chat)["input_ids"]
            return Example(ids, list(ids), _chat_text(messages), None)
        out = _chat(tokenizer, messages, assistant, return_assistant_tokens_mask=True, **chat)
        labels = _masked(out["input_ids"], out["assistant_masks"], line)
        return Example(out["input_ids"], labels, _chat_text(messages), None)
    text = _text(row, field, line)
    text = _with_eos(text, tokenizer, line, loss) if loss.eos else text
    ids = tokenizer(text)["input_ids"]
    return Example(ids, list(ids), text, None)


def _refuse_masked_tokens(mask: Any, length: int, line: int) -> None:
    """An ``input_ids`` row's ``attention_mask`` may only keep every token: the capture
    pads its batches itself, and a masked token would be scored as a real one."""
    if mask is None:
        return
    if not isinstance(mask, list) or len(mask) != length or any(m not in (0, 1) for m in mask):
        raise ValueError(f"line {line}: 'attention_mask' must be a list of 0/1, one per input_id")
    if 0 in mask:
        raise ValueError(
            f"line {line}: 'attention_mask' masks {mask.count(0)} of its {length} tokens, "
            "which would be scored as real ones: give the row's tokens without padding "
            "(the capture pads its batches itself)"
        )


def _prompt_completion(
    row: dict[str, Any],
    tokenizer: Any,
    line: int,
    loss: LossTokens,
    assistant: str | None,
) -> tuple[list[int], list[int], str, list[int] | None]:
    """``(prompt ids, prompt + completion ids, text, assistant mask)`` of a
    prompt-completion row: two strings (``loss.eos``: the completion ends in the
    end-of-sequence token; no mask), or a conversation through the chat template (the
    prompt's with the generation prompt; ``assistant``, the template marking the
    assistant's tokens, and their mask under ``assistant_only_loss``)."""
    if isinstance(row["prompt"], list):
        prompt, completion = (
            _conversation(row, "prompt", line),
            _conversation(row, "completion", line),
        )
        text, chat = _chat_text(prompt + completion), _chat_options(row, line)
        prompt_ids = _chat(tokenizer, prompt, assistant, add_generation_prompt=True, **chat)
        if not loss.assistant_only_loss:
            whole = _chat(tokenizer, prompt + completion, None, **chat)
            return prompt_ids["input_ids"], whole["input_ids"], text, None
        out = _chat(
            tokenizer, prompt + completion, assistant, return_assistant_tokens_mask=True, **chat
        )
        return prompt_ids["input_ids"], out["input_ids"], text, out["assistant_masks"]
    prompt_text, completion_text = _text(row, "prompt", line), _text(row, "completion", line)
    completion_text = (
        _with_eos(completion_text, tokenizer, line, loss) if loss.eos else completion_text
    )
    ids = tokenizer(prompt_text + completion_text)["input_ids"]
    return tokenizer(prompt_text)["input_ids"], ids, prompt_text + completion_text, None


def jsonl_rows(path: str | Path) -> list[tuple[int, Any]]:
    """``(line number, parsed row)`` of every non-empty line of a JSONL file, read as
    UTF-8 whatever the platform's locale (a leading byte-order mark, as Windows tools
    write it, skipped; ``\r\n`` line ends taken)."""
    source = Path(path)
    if not source.exists():
        raise FileNotFoundError(f"no data file at {source}")
    if not source.is_file():
        raise ValueError(f"{source} is not a file (give a JSONL file)")
    try:
        text = source.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as exc:
        line = source.read_bytes()[: exc.start].count(b"\n") + 1
        raise ValueError(
            f"{source}:{line}: not UTF-8 ({exc.reason} at byte {exc.start}): JSON Lines "
            "files are UTF-8; convert it (e.g. iconv -f <its encoding> -t utf-8)"
        ) from exc
    rows = []
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            rows.append((number, json.loads(raw)))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{source}:{number}: not valid JSON ({exc.msg})") from exc
    return rows


def numbered_rows(examples: Examples) -> list[tuple[int, Any]]:
    """``(line or row number, row)`` of a JSONL path, a ``datasets.Dataset`` or a list of
    dicts (rows are checked when tokenized)."""
    if isinstance(examples, str | Path):
        return jsonl_rows(examples)
    return list(enumerate(examples, start=1))


def tokenize_rows(
    rows: Iterable[tuple[int, Any]],
    tokenizer: Any,
    max_length: int,
    vocab_size: int | None = None,
    source: str = "examples",
    loss: LossTokens = LossTokens(),
) -> list[Example]:
    """Tokenize numbered rows (token ids checked against ``vocab_size`` when given);
    errors name ``source`` and the row. ``loss``: whether text and completion rows end in
    the tokenizer's end-of-sequence token (as TRL's ``SFTTrainer`` trains them) and which
    of their tokens carry the loss.

    Refused, naming the row: a row without a loss token (fewer than 2 tokens, or every
    label after the first -100: an empty completion, or one cut off by ``max_length``),
    whose gradient is zero and every score with it 0; and ids given to some rows only."""
    examples = []
    numbers = []
    # TRL's training template is found by rendering templates: once, not per row
    template = functools.cache(lambda: _assistant_template(tokenizer))
    for number, row in rows:
        try:
            example = _tokenize(row, tokenizer, max_length, number, vocab_size, loss, template)
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from exc
        if len(example.input_ids) < 2:
            raise ValueError(f"{source}:{number}: needs at least 2 tokens to have a loss")
        if all(label == -100 for label in example.labels[1:]):
            raise ValueError(
                f"{source}:{number}: has no loss token (an empty completion, one cut off at "
                f"max_length={max_length}, or labels all -100), so its gradient is zero and "
                "every score with it 0: give it a completion within the length, or raise "
                "max_length"
            )
        examples.append(example)
        numbers.append(number)
    if not examples:
        raise ValueError(f"{source} holds no example")
    refuse_partial_ids(source, numbers, [e.example_id for e in examples])
    return examples


def refuse_partial_ids(source: str, numbers: list[int], ids: list[int | None]) -> None:
    """Refuse ids (``None``: none given) on some of the rows ``numbers`` only, naming a
    row of each kind."""
    given = [i is not None for i in ids]
    if any(given) and not all(given):
        with_id, without = numbers[given.index(True)], numbers[given.index(False)]
        raise ValueError(
            f"{source}:{without} has no 'id' while {source}:{with_id} has one: give every "
            "example an 'id', or none (each is then named by a content hash of its tokens)"
        )


def read_examples(
    path: str | Path, tokenizer: Any, max_length: int, vocab_size: int | None = None
) -> list[Example]:
    """Parse and tokenize a JSONL file; errors name the line."""
    return tokenize_rows(jsonl_rows(path), tokenizer, max_length, vocab_size, str(path))


class ExamplePool:
    """Examples a callback scores against (influence queries, a selection target).

    Args:
        examples: a JSONL path, a ``datasets.Dataset`` or a list of dicts; each row in any
            form above (texts are tokenized with the trainer's tokenizer and
            :class:`LossTokens` when training starts: under ``SFTTrainer`` text and
            completion rows end in its EOS, as it trains them).
        owner: the callback's name, for errors.

    Rows are cut as the run cuts its own (``SFTConfig.max_length``), else text rows at
    :data:`UNCUT_LENGTH` tokens.
    """

    def __init__(self, examples: Examples, owner: str):
        self.rows = numbered_rows(examples)
        if not self.rows:
            raise ValueError(f"{owner} needs at least one example")
        self.owner = owner
        self.tokenized = all(isinstance(r, dict) and "input_ids" in r for _, r in self.rows)
        self.given_ids = self._given_ids()

    def _given_ids(self) -> list[int] | None:
        """The rows' integer ``id``s (numpy and 0-d tensor integers too, as
        :func:`tokenize_rows` reads them), or ``None`` where no row has one; ids of another
        type, on some rows only, or repeated are refused."""
        try:
            ids = [
                _example_id(row.get("id") if isinstance(row, dict) else None, number)
                for number, row in self.rows
            ]
        except ValueError as error:
            raise ValueError(f"{self.owner}: {error}") from None
        refuse_partial_ids(self.owner, [number for number, _ in self.rows], ids)
        if ids[0] is None:
            return None
        repeated = next((i for i, n in Counter(ids).items() if n > 1), None)
        if repeated is not None:
            raise ValueError(f"{self.owner}: the 'id' {repeated} is given to two examples")
        return [int(i) for i in ids if i is not None]

    def ids(self, batch: Mapping[str, Tensor]) -> Tensor:
        """``(B,)`` ids of the examples of :meth:`batch`: the rows' ``id``s, else a content
        hash of each one's tokens (as a store names examples)."""
        if self.given_ids is not None:
            return torch.tensor(self.given_ids, dtype=torch.long)
        return content_hash(batch["input_ids"], batch["attention_mask"])

    def batch(
        self, tokenizer: Any = None, loss: LossTokens = LossTokens()
    ) -> dict[str, torch.Tensor]:
        """The pool as one right-padded batch (``input_ids``, ``attention_mask``,
        ``labels``; pad id from the tokenizer, else 0), its rows' losses on the tokens
        ``loss`` says (the trainer's: :meth:`LossTokens.of_trainer`) and cut as the run
        cuts its rows; tokenized rows keep their ``labels``, else TRL's masks make them.
        A row without a loss token is refused, naming it."""
        pad_id = getattr(tokenizer, "pad_token_id", None) or 0
        examples = tokenize_rows(
            self.rows, tokenizer, self._cut_length(loss), source=self.owner, loss=loss
        )
        if loss.keep_end and loss.max_length is not None:
            _refuse_cut_starts(self.owner, self.rows, examples, loss.max_length)
        inputs, _, _ = next(batches(examples, len(examples), pad_id))
        return inputs

    def _cut_length(self, loss: LossTokens) -> int:
        """The run's length (a run that keeps rows' ends cuts nothing here: its longer
        rows are refused instead), else none for tokenized rows and :data:`UNCUT_LENGTH`
        for text."""
        if loss.max_length is not None and not loss.keep_end:
            return loss.max_length
        if self.tokenized:
            return max(len(row["input_ids"]) for _, row in self.rows)
        return UNCUT_LENGTH


#: The length an :class:`ExamplePool` cuts text rows to where the run sets none.
UNCUT_LENGTH = 4096


def _refuse_cut_starts(
    owner: str, rows: list[tuple[int, Any]], examples: list[Example], max_length: int
) -> None:
    """Refuse a row longer than ``max_length``: the run cut such rows to their last
    ``max_length`` tokens (``truncation_mode="keep_end"``), which its queries cannot be."""
    for (number, _), example in zip(rows, examples, strict=True):
        if len(example.input_ids) > max_length:
            raise ValueError(
                f"{owner}:{number}: {len(example.input_ids)} tokens, longer than the run's "
                f"max_length {max_length}, and the run cuts such rows to their last tokens "
                "(truncation_mode='keep_end'), which its examples here are not cut to: "
                "give rows within that length"
            )


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
