"""Example texts beside a store, for reports: ``{"id": ..., "text": ...}`` lines.

A store kept with per-token factors (``keep_tokens``) also saves each example's tokens,
so that token-level scores can be shown on them: ``"tokens"`` (each real token decoded
alone) and ``"positions"`` (its index in the captured row, where its score sits).

``tda capture`` saves its texts once at the end (``examples.jsonl`` at the store's root);
a training run appends the texts of each step's new examples to its rank's
``rank-<r>/examples.jsonl`` (:class:`TextRecorder`), so a run killed mid-way keeps the
texts of what it committed. A reader merges them all.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import Tensor

from tda_plugins.capture.consumer import CaptureConsumer
from tda_plugins.capture.records import MicroBatchRecord
from tda_plugins.store.layout import EXAMPLES_FILE, StoreError, rank_dir


@dataclass(frozen=True)
class TokenTexts:
    """An example's real tokens, each decoded alone, and their positions in its row.

    Attributes:
        pieces: the decoded tokens, in order.
        positions: the index of each in the captured (padded) row: the token axis of its
            per-token scores.
    """

    pieces: list[str]
    positions: list[int]


def token_texts(tokenizer: Any, input_ids: Tensor, mask: Tensor | None) -> list[TokenTexts]:
    """Per row of ``(B, T)`` ``input_ids``: its real tokens (``mask`` set; all without a
    mask), each decoded alone."""
    out = []
    for row in range(input_ids.shape[0]):
        positions = (
            list(range(input_ids.shape[1])) if mask is None else mask[row].nonzero()[:, 0].tolist()
        )
        ids = input_ids[row, positions].tolist()
        out.append(TokenTexts([tokenizer.decode([t]) for t in ids], positions))
    return out


def example_line(example_id: int, text: str, tokens: TokenTexts | None = None) -> str:
    """One ``examples.jsonl`` line (newline included)."""
    row: dict[str, Any] = {"id": example_id, "text": text}
    if tokens is not None:
        row["tokens"], row["positions"] = tokens.pieces, tokens.positions
    return json.dumps(row) + "\n"


class TextRecorder(CaptureConsumer):
    """Appends the decoded text of every example the run sees for the first time.

    Each micro-batch's real tokens (``input_ids`` where the attention mask is set) are
    decoded with ``tokenizer.decode``: the text the model was trained on, special tokens
    and chat template included; with ``tokens``, each token decoded alone too. Lines are
    appended at each optimizer step (no fsync: a text is for reading, and a torn last line
    is skipped on read).
    """

    def __init__(self, root: str | Path, rank: int, tokenizer: Any, *, tokens: bool = False):
        self.path = rank_dir(Path(root), rank) / EXAMPLES_FILE
        self.tokenizer = tokenizer
        self.tokens = tokens
        self._seen: set[int] = set()
        self._lines: list[str] = []
        #: Whether an unfinished last line of an earlier run was cut.
        self._tidied = False

    def on_micro_batch(self, record: MicroBatchRecord) -> None:
        if record.input_ids is None or record.input_ids.is_floating_point():
            return
        ids = record.example_ids.tolist()
        tokens = record.input_ids.cpu()
        mask = None if record.token_mask is None else record.token_mask.cpu()
        pieces = token_texts(self.tokenizer, tokens, mask) if self.tokens else None
        for row, example_id in enumerate(ids):
            if example_id in self._seen:
                continue
            self._seen.add(example_id)
            real = tokens[row] if mask is None else tokens[row][mask[row]]
            text = self.tokenizer.decode(real.tolist())
            self._lines.append(
                example_line(example_id, text, None if pieces is None else pieces[row])
            )

    def on_optimizer_step(self, step: int, records: list[MicroBatchRecord]) -> None:
        self._append()

    def on_end(self) -> None:
        self._append()

    def _append(self) -> None:
        """Append the texts gathered since the last call (the first time, after cutting
        an unfinished last line a killed run left, which the new lines would otherwise
        complete into a damaged one)."""
        if not self._lines:
            return
        if not self._tidied:
            _cut_unfinished_line(self.path)
            self._tidied = True
        with self.path.open("a", encoding="utf-8") as out:
            out.writelines(self._lines)
        self._lines = []


def _cut_unfinished_line(path: Path) -> None:
    """Truncate ``path`` after its last newline (nothing to do without a file, or when it
    ends in one)."""
    if not path.is_file():
        return
    with path.open("rb+") as f:
        size = f.seek(0, 2)
        if size == 0:
            return
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return
        block, end = 1 << 16, size
        while end > 0:  # the last newline, read backwards a block at a time
            start = max(0, end - block)
            f.seek(start)
            at = f.read(end - start).rfind(b"\n")
            if at >= 0:
                f.truncate(start + at + 1)
                return
            end = start
        f.truncate(0)


def _rows(root: Path, ids: Collection[int] | None = None) -> Iterator[dict[str, Any]]:
    """Every example line of the store's root file and of every rank's file (only those
    of ``ids`` when given), read a line at a time. A rank file's unfinished last line (a
    killed run) is skipped; any other damaged line is refused."""
    files = [root / EXAMPLES_FILE, *sorted(root.glob(f"rank-*/{EXAMPLES_FILE}"))]
    for path in files:
        if not path.is_file():
            continue
        with path.open(encoding="utf-8") as lines:
            for number, line in enumerate(lines, start=1):
                if not line.strip():
                    continue
                try:
                    row = _parsed(line)
                except (ValueError, KeyError, TypeError) as error:
                    if not line.endswith("\n"):  # the last line, an append cut short
                        continue
                    raise StoreError(
                        f"{path}:{number} is not an example text line ({error}); delete the "
                        "file to read the store without texts"
                    ) from error
                if ids is None or row["id"] in ids:
                    yield row


def _parsed(line: str) -> dict[str, Any]:
    """One ``examples.jsonl`` line, its fields checked."""
    row = json.loads(line)
    row["id"], row["text"] = int(row["id"]), str(row["text"])
    if "tokens" in row:
        row["tokens"] = [str(piece) for piece in row["tokens"]]
        row["positions"] = [int(i) for i in row["positions"]]
        if len(row["tokens"]) != len(row["positions"]):
            raise ValueError("its tokens and positions differ in number")
    return row


def read_texts(root: Path, ids: Collection[int] | None = None) -> dict[int, str]:
    """Example id -> text from the store's root file and every rank's file (empty when
    no capture saved texts); only the examples ``ids`` names, when given."""
    return {row["id"]: row["text"] for row in _rows(root, ids)}


def read_token_texts(root: Path, ids: Collection[int] | None = None) -> dict[int, TokenTexts]:
    """Example id -> its tokens, for the examples saved with them (``keep_tokens``); only
    those ``ids`` names, when given."""
    return {
        row["id"]: TokenTexts(row["tokens"], row["positions"])
        for row in _rows(root, ids)
        if "tokens" in row
    }


class StoreTexts(Mapping[int, str]):
    """A store's example texts, read when asked for: :meth:`select` reads the few a
    report shows (a pass over the text files that keeps only those), and the mapping
    itself reads them all on its first use (``Scores.to_pandas``), so that scoring a
    large store holds only the texts it shows."""

    def __init__(self, root: Path):
        self.root = root
        self._all: dict[int, str] | None = None

    def select(self, ids: Iterable[int]) -> dict[int, str]:
        """The texts of ``ids`` (those the store has)."""
        wanted = set(ids)
        if self._all is not None:
            return {i: self._all[i] for i in wanted if i in self._all}
        return read_texts(self.root, wanted)

    def _texts(self) -> dict[int, str]:
        if self._all is None:
            self._all = read_texts(self.root)
        return self._all

    def __getitem__(self, example_id: int) -> str:
        return self._texts()[example_id]

    def __iter__(self) -> Iterator[int]:
        return iter(self._texts())

    def __len__(self) -> int:
        return len(self._texts())


def texts_of(texts: Mapping[int, str], ids: Iterable[int]) -> dict[int, str]:
    """The texts of ``ids`` from ``texts`` (a :class:`StoreTexts` reads only those)."""
    if isinstance(texts, StoreTexts):
        return texts.select(ids)
    return {i: texts[i] for i in ids if i in texts}
