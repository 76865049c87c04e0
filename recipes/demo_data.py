"""The data selection demo's mixture, built offline from text every CPython install has.

* **Target task**: continue the Python language reference. Each example is one prose
  paragraph of a ``pydoc_data.topics`` section: the prompt names the section and gives the
  paragraph's first words, the completion is the words that follow. Sections are split
  three ways, so that no paragraph of the held-out evaluation appears in training or in
  the target pool the selection scores against.
* **Useful off-target data**: the same task on the standard library's module docstrings
  (read from the source files with :mod:`ast`, nothing is imported).
* **Planted corrupted examples** (``corrupted=True``): *wrong answers* (a reference
  prompt completed with a paragraph of another section) and *shuffled text* (a reference
  prompt whose correct completion has its words permuted).

Everything is deterministic given ``seed`` and the Python version.
"""

from __future__ import annotations

import ast
import functools
import inspect
import random
import re
import sysconfig
import tokenize
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from pydoc_data.topics import topics

#: The kinds of training example, in the order the mixture lists them.
KINDS = ("target", "off_target", "wrong_answer", "shuffled")
CORRUPTED_KINDS = frozenset({"wrong_answer", "shuffled"})


@dataclass(frozen=True)
class Passage:
    """One prose paragraph and the section (or module) it comes from."""

    source: str
    text: str


@dataclass(frozen=True)
class DemoExample:
    """A prompt/completion pair (TRL trains on the completion only) and what it is."""

    prompt: str
    completion: str
    kind: str

    @property
    def corrupted(self) -> bool:
        return self.kind in CORRUPTED_KINDS

    def row(self) -> dict[str, str]:
        """The dataset row ``SFTTrainer`` tokenizes."""
        return {"prompt": self.prompt, "completion": self.completion}


@dataclass(frozen=True)
class MixtureSizes:
    """How many examples of each part the mixture holds, and how long they are.

    Attributes:
        target_train: clean target-task training examples.
        off_target: clean off-target training examples (module docstrings).
        wrong_answers: corrupted: a reference prompt answered with unrelated source code.
        shuffled: corrupted: a reference prompt whose continuation has its letters shuffled.
        target_pool: target examples the selection scores against (never trained on).
        eval: held-out target examples the evaluation loss is measured on.
        prompt_words: words of the passage that go into the prompt.
        min_words: fewest words of a passage (prompt and completion together).
        max_words: most words of a passage; a passage is whole sentences.
        code_chars: most characters of a wrong answer's code snippet (code takes more
            tokens per character than prose: this keeps the examples about as long).
    """

    target_train: int = 128
    off_target: int = 64
    wrong_answers: int = 96
    shuffled: int = 96
    target_pool: int = 16
    eval: int = 32
    prompt_words: int = 8
    min_words: int = 14
    max_words: int = 28
    code_chars: int = 100


@dataclass(frozen=True)
class DemoMixture:
    """The training set (shuffled, with kinds), the target pool and the evaluation split."""

    train: list[DemoExample]
    target_pool: list[DemoExample]
    eval: list[DemoExample]

    def counts(self) -> dict[str, int]:
        """Training examples per kind."""
        return {kind: sum(e.kind == kind for e in self.train) for kind in KINDS}


# -- real text on the machine ----------------------------------------------------------------


def _clean(text: str) -> str:
    return " ".join(text.split())


def _prose_paragraphs(text: str, min_words: int) -> Iterator[str]:
    """Paragraphs of running text: no headings, grammar, code or indented blocks."""
    for block in re.split(r"\n\s*\n", text):
        if not block.strip() or block.startswith((" ", "\t")):
            continue
        if re.search(r"^[*=\-~^]{3,}\s*$", block, flags=re.MULTILINE):
            continue
        words = _clean(block)
        if len(words.split()) >= min_words and "::=" not in words and ">>>" not in words:
            yield words


def reference_passages(min_words: int) -> dict[str, list[Passage]]:
    """``pydoc_data.topics``: section title -> its prose paragraphs (sections without any
    are left out)."""
    sections: dict[str, list[Passage]] = {}
    for key in sorted(topics):
        text = topics[key]
        title = _clean(text.splitlines()[0]) if text.strip() else key
        paragraphs = [Passage(title, p) for p in _prose_paragraphs(text, min_words)]
        if paragraphs:
            sections[title] = paragraphs
    return sections


def _stdlib_sources() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo", "encodings"}
    return sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))


def module_docstring(path: Path) -> str | None:
    """The module docstring of a source file, read from its first tokens (no full parse)."""
    try:
        with path.open(encoding="utf-8") as source:
            for token in tokenize.generate_tokens(source.readline):
                if token.type in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE):
                    continue
                if token.type != tokenize.STRING:
                    return None
                value = ast.literal_eval(token.string)
                return inspect.cleandoc(value) if isinstance(value, str) else None
    except (SyntaxError, UnicodeDecodeError, ValueError, tokenize.TokenError):
        return None
    return None


@functools.cache
def module_docstring_passages(min_words: int) -> tuple[Passage, ...]:
    """Prose paragraphs of the standard library's module docstrings (read, not imported)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    passages = []
    for path in _stdlib_sources():
        docstring = module_docstring(path)
        if not docstring:
            continue
        module = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        passages.extend(Passage(module, p) for p in _prose_paragraphs(docstring, min_words))
    return tuple(passages)


def code_snippets(max_chars: int) -> list[str]:
    """One snippet per standard-library file: the code from its first ``def`` (comment and
    docstring lines left out), cut at a space to at most ``max_chars`` characters."""
    snippets: list[str] = []
    for path in _stdlib_sources():
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except UnicodeDecodeError:
            continue
        start = next((i for i, line in enumerate(lines) if line.lstrip().startswith("def ")), None)
        if start is None:
            continue
        code = " ".join(
            line.strip()
            for line in lines[start:]
            if line.strip() and not line.lstrip().startswith(("#", '"', "'"))
        )
        if len(code) <= max_chars:
            continue
        snippet = " ".join(code[: max_chars + 1].split()[:-1])
        if snippet not in snippets:
            snippets.append(snippet)
    return snippets


# -- examples ---------------------------------------------------------------------------------


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"*(])")


def opening_window(passage: Passage, min_words: int, max_words: int) -> Passage | None:
    """The paragraph's opening sentences, ``min_words`` to ``max_words`` words in all, so
    that every completion ends where a sentence ends; None if no such window exists."""
    sentences: list[str] = []
    for sentence in _SENTENCE_END.split(passage.text):
        sentences.append(sentence)
        count = len(" ".join(sentences).split())
        if count >= min_words:
            if count > max_words:
                return None
            return Passage(passage.source, " ".join(sentences))
    return None


def _split(passage: Passage, sizes: MixtureSizes) -> tuple[str, str]:
    words = passage.text.split()
    return " ".join(words[: sizes.prompt_words]), " " + " ".join(words[sizes.prompt_words :])


def reference_example(passage: Passage, sizes: MixtureSizes) -> DemoExample:
    """Continue a paragraph of the language reference (the target task)."""
    head, tail = _split(passage, sizes)
    return DemoExample(f'Python reference, "{passage.source}":\n{head}', tail, "target")


def module_example(passage: Passage, sizes: MixtureSizes) -> DemoExample:
    """Continue a paragraph of a module docstring (useful, off the target task)."""
    head, tail = _split(passage, sizes)
    return DemoExample(f"Python module {passage.source}:\n{head}", tail, "off_target")


def wrong_answer(passage: Passage, code: str, sizes: MixtureSizes) -> DemoExample:
    """A reference prompt "answered" with a snippet of unrelated source code (a misaligned
    prompt/answer pair, as a scrape that mixes up documentation and code produces)."""
    prompt = reference_example(passage, sizes).prompt
    return DemoExample(prompt, " " + code, "wrong_answer")


def shuffled(passage: Passage, sizes: MixtureSizes, rng: random.Random) -> DemoExample:
    """A reference prompt whose correct continuation has the letters of every word shuffled."""
    clean = reference_example(passage, sizes)
    words = []
    for word in clean.completion.split():
        letters = list(word)
        rng.shuffle(letters)
        words.append("".join(letters))
    return DemoExample(clean.prompt, " " + " ".join(words), "shuffled")


def _take(pool: list[Passage], count: int, what: str) -> list[Passage]:
    """The first ``count`` passages of ``pool``, removed from it."""
    if len(pool) < count:
        raise ValueError(f"this Python's text yields {len(pool)} {what} passages, {count} needed")
    taken = pool[:count]
    del pool[:count]
    return taken


def _windows(passages: list[Passage], sizes: MixtureSizes) -> list[Passage]:
    found = (opening_window(p, sizes.min_words, sizes.max_words) for p in passages)
    return [w for w in found if w is not None]


def build_mixture(seed: int = 0, sizes: MixtureSizes | None = None) -> DemoMixture:
    """The demo's data, deterministic in ``seed``.

    Reference sections are shuffled and split into evaluation sections (a quarter),
    target-pool sections and training sections; corrupted examples use training sections
    only, each paragraph at most once in the whole mixture.
    """
    sizes = sizes or MixtureSizes()
    rng = random.Random(seed)
    sections = reference_passages(sizes.min_words)
    titles = sorted(sections)
    rng.shuffle(titles)
    held_out = len(titles) // 4
    groups = titles[:held_out], titles[held_out : held_out + 8], titles[held_out + 8 :]

    def passages_of(group: list[str]) -> list[Passage]:
        found = _windows([p for t in group for p in sections[t]], sizes)
        rng.shuffle(found)
        return found

    eval_passages, pool_passages, train_passages = (passages_of(g) for g in groups)
    evaluation = [reference_example(p, sizes) for p in _take(eval_passages, sizes.eval, "eval")]
    pool = [reference_example(p, sizes) for p in _take(pool_passages, sizes.target_pool, "pool")]
    target = [
        reference_example(p, sizes) for p in _take(train_passages, sizes.target_train, "target")
    ]
    code = code_snippets(sizes.code_chars)
    rng.shuffle(code)
    wrong = [
        wrong_answer(p, snippet, sizes)
        for p, snippet in zip(
            _take(train_passages, sizes.wrong_answers, "reference"), code, strict=False
        )
    ]
    permuted = [shuffled(p, sizes, rng) for p in _take(train_passages, sizes.shuffled, "reference")]
    modules = _windows(list(module_docstring_passages(sizes.min_words)), sizes)
    rng.shuffle(modules)
    off_target = [module_example(p, sizes) for p in _take(modules, sizes.off_target, "docstring")]
    train = target + off_target + wrong + permuted
    rng.shuffle(train)
    return DemoMixture(train, pool, evaluation)
