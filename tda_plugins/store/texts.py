"""Example texts beside a store, for reports: ``{"id": ..., "text": ...}`` lines.

``tda capture`` saves its texts once at the end (``examples.jsonl`` at the store's root);
a training run appends the texts of each step's new examples to its rank's
``rank-<r>/examples.jsonl`` (:class:`TextRecorder`), so a run killed mid-way keeps the
texts of what it committed. A reader merges them all.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tda_plugins.capture.consumer import CaptureConsumer
from tda_plugins.capture.records import MicroBatchRecord
from tda_plugins.store.layout import EXAMPLES_FILE, StoreError, rank_dir


class TextRecorder(CaptureConsumer):
    """Appends the decoded text of every example the run sees for the first time.

    Each micro-batch's real tokens (``input_ids`` where the attention mask is set) are
    decoded with ``tokenizer.decode``: the text the model was trained on, special tokens
    and chat template included. Lines are appended at each optimizer step (no fsync: a
    text is for reading, and a torn last line is skipped on read).
    """

    def __init__(self, root: str | Path, rank: int, tokenizer: Any):
        self.path = rank_dir(Path(root), rank) / EXAMPLES_FILE
        self.decode = tokenizer.decode
        self._seen: set[int] = set()
        self._lines: list[str] = []

    def on_micro_batch(self, record: MicroBatchRecord) -> None:
        if record.input_ids is None or record.input_ids.is_floating_point():
            return
        ids = record.example_ids.tolist()
        tokens = record.input_ids.cpu()
        mask = None if record.token_mask is None else record.token_mask.cpu()
        for row, example_id in enumerate(ids):
            if example_id in self._seen:
                continue
            self._seen.add(example_id)
            real = tokens[row] if mask is None else tokens[row][mask[row]]
            text = self.decode(real.tolist())
            self._lines.append(json.dumps({"id": example_id, "text": text}) + "\n")

    def on_optimizer_step(self, step: int, records: list[MicroBatchRecord]) -> None:
        self._append()

    def on_end(self) -> None:
        self._append()

    def _append(self) -> None:
        """Append the texts gathered since the last call."""
        if not self._lines:
            return
        with self.path.open("a", encoding="utf-8") as out:
            out.writelines(self._lines)
        self._lines = []


def read_texts(root: Path) -> dict[int, str]:
    """Example id -> text from the store's root file and every rank's file (empty when
    no capture saved texts). A rank file's unfinished last line (a killed run) is
    skipped; any other damaged line is refused."""
    texts: dict[int, str] = {}
    files = [root / EXAMPLES_FILE, *sorted(root.glob(f"rank-*/{EXAMPLES_FILE}"))]
    for path in files:
        if not path.is_file():
            continue
        lines = path.read_text(encoding="utf-8").split("\n")
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                texts[int(row["id"])] = str(row["text"])
            except (ValueError, KeyError, TypeError) as error:
                if number == len(lines):  # no newline after it: an append cut short
                    continue
                raise StoreError(
                    f"{path}:{number} is not an example text line ({error}); delete the "
                    "file to read the store without texts"
                ) from error
    return texts
