"""The data selection demo's mixture, built offline from text every CPython install has.

* **Two target tasks**, each with its own held-out evaluation split and its half of the
  target pool the selection scores against:

  - ``reference``: continue the Python language reference. The prompt names a
    ``pydoc_data.topics`` section and gives a prose paragraph's first words, the
    completion is the words that follow.
  - ``docstring``: document a standard-library function from its signature. The prompt
    is ``Docstring of module.name(arguments):``, the completion the opening sentences of
    its docstring (read from the source files with :mod:`ast`, nothing is imported).

  Each task's sources (sections, modules) are split three ways, so that no held-out
  evaluation example shares its section or module with training or the target pool.
* **Useful off-target data**: continuing the standard library's module docstrings.
* **Planted corrupted examples** (``corrupted=True``), half on each task's prompts:
  *wrong answers* (a task prompt answered with a snippet of unrelated source code) and
  *shuffled text* (a task prompt whose correct completion has the letters of every word
  shuffled).

Everything is deterministic given ``seed`` and the Python version.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import gc
import inspect
import random
import re
import sysconfig
import tokenize
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from pydoc_data.topics import topics

#: The target tasks, each a kind of clean training example too.
TASKS = ("reference", "docstring")
#: The kinds of training example, in the order the mixture lists them.
KINDS = (*TASKS, "off_target", "wrong_answer", "shuffled")
CORRUPTED_KINDS = frozenset({"wrong_answer", "shuffled"})


@dataclass(frozen=True)
class Passage:
    """One prose paragraph and the section (or module) it comes from."""

    source: str
    text: str


@dataclass(frozen=True)
class DemoExample:
    """A prompt/completion pair (TRL trains on the completion only), what it is, and the
    task whose prompt it has (``None`` for off-target text)."""

    prompt: str
    completion: str
    kind: str
    task: str | None = None

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
        target_train: clean training examples of each target task.
        off_target: clean off-target training examples (module docstrings).
        wrong_answers: corrupted, per task: a task prompt answered with unrelated code.
        shuffled: corrupted, per task: a task prompt whose answer has its letters shuffled.
        target_pool: target examples of each task the selection scores against (never
            trained on).
        eval: held-out examples of each task the evaluation loss is measured on.
        prompt_words: words of a reference passage that go into the prompt.
        min_words: fewest words of a reference passage (prompt and completion together).
        max_words: most words of a passage or docstring answer; whole sentences.
        min_doc_words: fewest words of a docstring answer.
        max_signature: most characters of a function's arguments in a docstring prompt.
        code_chars: most characters of a wrong answer's code snippet (code takes more
            tokens per character than prose: this keeps the examples about as long).
    """

    target_train: int = 96
    off_target: int = 64
    wrong_answers: int = 48
    shuffled: int = 48
    target_pool: int = 8
    eval: int = 24
    prompt_words: int = 8
    min_words: int = 14
    max_words: int = 28
    min_doc_words: int = 8
    max_signature: int = 60
    code_chars: int = 100


@dataclass(frozen=True)
class DemoMixture:
    """The training set (shuffled, with kinds), the target pool (both tasks) and each
    task's evaluation split."""

    train: list[DemoExample]
    target_pool: list[DemoExample]
    eval: dict[str, list[DemoExample]]

    def counts(self) -> dict[str, int]:
        """Training examples per kind."""
        return {kind: sum(e.kind == kind for e in self.train) for kind in KINDS}

    def clean(self) -> list[DemoExample]:
        """The training set without the planted corrupted examples (the ceiling's data)."""
        return [e for e in self.train if not e.corrupted]


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


@functools.cache
def _stdlib_root() -> Path:
    """The standard library's folder (``sysconfig`` rebuilds its paths on each call)."""
    return Path(sysconfig.get_paths()["stdlib"])


@functools.cache
def _stdlib_sources() -> tuple[Path, ...]:
    """The standard library's source files, sorted (listed once per process)."""
    root = _stdlib_root()
    skip = {"site-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo", "encodings"}
    return tuple(sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts)))


#: The nodes that can hold a statement: a function definition is never inside an expression.
_STATEMENT_HOLDERS = (ast.stmt, ast.excepthandler, ast.match_case)


def _function_definitions(tree: ast.Module) -> Iterator[ast.FunctionDef]:
    """Every ``def`` of ``tree`` in :func:`ast.walk`'s breadth-first order, visiting only
    statements (a tenth of the nodes: the expressions can hold no ``def``)."""
    queue: deque[ast.AST] = deque([tree])
    while queue:
        node = queue.popleft()
        if isinstance(node, ast.FunctionDef):
            yield node
        queue.extend(c for c in ast.iter_child_nodes(node) if isinstance(c, _STATEMENT_HOLDERS))


def _module_name(path: Path) -> str:
    """The dotted module name of a standard-library source file (a package's ``__init__``
    is the package)."""
    parts = path.relative_to(_stdlib_root()).with_suffix("").parts
    return ".".join(parts).removesuffix(".__init__")


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
    passages = []
    for path in _stdlib_sources():
        docstring = module_docstring(path)
        if docstring:
            module = _module_name(path)
            passages.extend(Passage(module, p) for p in _prose_paragraphs(docstring, min_words))
    return tuple(passages)


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block, then as it was. Parsing the
    standard library makes millions of AST nodes, each creation counting towards the next
    collection, and every full collection walks all the objects of the recipe's imports
    (torch, transformers: about half a million): with the collector on, the parse took
    about 3x as long on a 2-core machine. The trees hold no cycles; reference counting
    frees each one."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@functools.cache
def function_docstrings() -> tuple[tuple[str, str, str], ...]:
    """``(module, "name(arguments)", docstring)`` of every public function and method of the
    standard library that has a docstring (parsed with :mod:`ast`, nothing imported;
    several seconds, once per process)."""
    with _collector_paused():
        found = []
        for path in _stdlib_sources():
            try:
                tree = ast.parse(path.read_text(encoding="utf-8"))
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
            module = _module_name(path)
            for node in _function_definitions(tree):
                if node.name.startswith("_"):
                    continue
                docstring = ast.get_docstring(node)
                if docstring:
                    signature = f"{node.name}({ast.unparse(node.args)})"
                    found.append((module, signature, docstring))
        return tuple(found)


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


def reference_example(passage: Passage, sizes: MixtureSizes) -> DemoExample:
    """Continue a paragraph of the language reference (target task ``reference``)."""
    words = passage.text.split()
    head, tail = " ".join(words[: sizes.prompt_words]), " " + " ".join(words[sizes.prompt_words :])
    prompt = f'Python reference, "{passage.source}":\n{head}'
    return DemoExample(prompt, tail, "reference", "reference")


def docstring_example(passage: Passage) -> DemoExample:
    """Document a function from its signature (target task ``docstring``); the passage's
    source is ``module.name(arguments)``, its text the docstring's opening sentences."""
    prompt = f"Docstring of {passage.source}:\n"
    return DemoExample(prompt, passage.text, "docstring", "docstring")


def module_example(passage: Passage, sizes: MixtureSizes) -> DemoExample:
    """Continue a paragraph of a module docstring (useful, off the target tasks)."""
    words = passage.text.split()
    head, tail = " ".join(words[: sizes.prompt_words]), " " + " ".join(words[sizes.prompt_words :])
    return DemoExample(f"Python module {passage.source}:\n{head}", tail, "off_target")


def wrong_answer(clean: DemoExample, code: str) -> DemoExample:
    """A task prompt "answered" with a snippet of unrelated source code (a misaligned
    prompt/answer pair, as a scrape that mixes up documentation and code produces)."""
    return DemoExample(clean.prompt, " " + code, "wrong_answer", clean.task)


def shuffled(clean: DemoExample, rng: random.Random) -> DemoExample:
    """A task prompt whose correct answer has the letters of every word shuffled."""
    words = []
    for word in clean.completion.split():
        letters = list(word)
        rng.shuffle(letters)
        words.append("".join(letters))
    return DemoExample(clean.prompt, " " + " ".join(words), "shuffled", clean.task)


def _take(pool: list[Passage], count: int, what: str) -> list[Passage]:
    """The first ``count`` passages of ``pool``, removed from it."""
    if len(pool) < count:
        raise ValueError(f"this Python's text yields {len(pool)} {what} passages, {count} needed")
    taken = pool[:count]
    del pool[:count]
    return taken


def _windows(passages: list[Passage], min_words: int, max_words: int) -> list[Passage]:
    found = (opening_window(p, min_words, max_words) for p in passages)
    return [w for w in found if w is not None]


def _three_ways(
    sources: dict[str, list[Passage]], rng: random.Random, pool_sources: int
) -> tuple[list[Passage], list[Passage], list[Passage]]:
    """Sources shuffled and split into evaluation (a quarter), target pool
    (``pool_sources`` of them) and training; each part's passages shuffled."""
    titles = sorted(sources)
    rng.shuffle(titles)
    held_out = len(titles) // 4
    groups = (
        titles[:held_out],
        titles[held_out : held_out + pool_sources],
        titles[held_out + pool_sources :],
    )
    parts = []
    for group in groups:
        found = [p for t in group for p in sources[t]]
        rng.shuffle(found)
        parts.append(found)
    return parts[0], parts[1], parts[2]


def reference_splits(
    sizes: MixtureSizes, rng: random.Random
) -> tuple[list[Passage], list[Passage], list[Passage]]:
    """Task ``reference``: evaluation, pool and training passages, split by section."""
    sections = {
        title: _windows(passages, sizes.min_words, sizes.max_words)
        for title, passages in reference_passages(sizes.min_words).items()
    }
    return _three_ways(sections, rng, pool_sources=8)


def docstring_splits(
    sizes: MixtureSizes, rng: random.Random
) -> tuple[list[Passage], list[Passage], list[Passage]]:
    """Task ``docstring``: evaluation, pool and training passages, split by top-level
    module (a function and its near-twins in one module never straddle two splits); one
    function per module and name."""
    by_module: dict[str, list[Passage]] = {}
    seen = set()
    for module, signature, docstring in function_docstrings():
        name = signature.split("(", 1)[0]
        arguments = signature[len(name) :]
        first = _clean(docstring.split("\n\n", 1)[0])
        window = opening_window(Passage("", first), sizes.min_doc_words, sizes.max_words)
        if window is None or len(arguments) > sizes.max_signature or (module, name) in seen:
            continue
        seen.add((module, name))
        passage = Passage(f"{module}.{signature}", window.text)
        by_module.setdefault(module.split(".")[0], []).append(passage)
    return _three_ways(by_module, rng, pool_sources=8)


def build_mixture(seed: int = 0, sizes: MixtureSizes | None = None) -> DemoMixture:
    """The demo's data, deterministic in ``seed``.

    Each task's sources are shuffled and split into evaluation, target-pool and training
    sources (:func:`reference_splits`, :func:`docstring_splits`); the corrupted examples
    use training sources only, each passage at most once in the whole mixture.
    """
    sizes = sizes or MixtureSizes()
    rng = random.Random(seed)
    code = code_snippets(sizes.code_chars)
    rng.shuffle(code)
    train: list[DemoExample] = []
    pool: list[DemoExample] = []
    evaluation: dict[str, list[DemoExample]] = {}
    makers = {
        "reference": (reference_splits, lambda p: reference_example(p, sizes)),
        "docstring": (docstring_splits, docstring_example),
    }
    for task in TASKS:
        splits, make = makers[task]
        held_out, pool_passages, train_passages = splits(sizes, rng)
        evaluation[task] = [make(p) for p in _take(held_out, sizes.eval, f"{task} eval")]
        pool += [make(p) for p in _take(pool_passages, sizes.target_pool, f"{task} pool")]
        clean = [make(p) for p in _take(train_passages, sizes.target_train, task)]
        wrong = [make(p) for p in _take(train_passages, sizes.wrong_answers, task)]
        permuted = [make(p) for p in _take(train_passages, sizes.shuffled, task)]
        train += clean
        train += [wrong_answer(e, code.pop()) for e in wrong]
        train += [shuffled(e, rng) for e in permuted]
    modules = _windows(
        list(module_docstring_passages(sizes.min_words)), sizes.min_words, sizes.max_words
    )
    rng.shuffle(modules)
    train += [module_example(p, sizes) for p in _take(modules, sizes.off_target, "docstring")]
    rng.shuffle(train)
    return DemoMixture(train, pool, evaluation)
