"""The default model's training text: English that ships with Python itself.

Owns collecting, cleaning, deduplicating and splitting it. Two sources:
- `pydoc_data.topics`: the language reference topics that `help("assert")` shows;
- docstrings of the standard library: parsed with `ast` from the `.py` sources (nothing is
  imported, so no module runs), plus, for the built-in and C extension modules that have
  no source, their `__doc__` strings read after a guarded import of an allow-list.

Every document has an id ("topic:assert", "module:json", "cmodule:math"); the held-out
split hashes that id, so it does not move when other documents come or go, and a module's
docstrings all land on the same side. The result depends on the Python version (its
stdlib), which is why the tests use a committed sample of the held-out text.

    python tools/build_corpus.py --out /tmp/corpus   # writes train.txt, heldout.txt, stats
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import importlib
import inspect
import json
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

HELDOUT_PERCENT = 5

# Whole directories of the stdlib that are test suites, demos or vendored tooling: code
# samples and fixtures, not prose.
_SKIP_PARTS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "turtledemo", "ensurepip",
               "__phello__", "encodings"}
_SKIP_MODULES = {"this", "antigravity", "__hello__", "_sysconfigdata__linux_x86_64-linux-gnu"}
# Modules with no Python source whose docstrings are worth having; each is imported, which
# for these runs no user-visible code.
_C_MODULES = ("builtins", "sys", "gc", "itertools", "marshal", "time", "errno", "atexit", "posix",
              "math", "cmath", "array", "binascii", "zlib", "select", "unicodedata", "mmap", "resource",
              "_io", "_collections", "_functools", "_thread")


@dataclass(frozen=True)
class Document:
    doc_id: str
    text: str

    @property
    def heldout(self) -> bool:
        return is_heldout(self.doc_id)


@dataclass(frozen=True)
class Entry:
    """One documented name: what a user would look up, and its docstring."""

    name: str  # "json.dumps(obj, *, skipkeys=False, ...)" as a header line
    short_name: str  # "json.dumps", for questions about it
    doc: str


def is_heldout(doc_id: str) -> bool:
    digest = hashlib.blake2b(doc_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % 100 < HELDOUT_PERCENT


def clean(doc: str) -> str:
    text = inspect.cleandoc(doc).replace("\r\n", "\n")
    # Strip trailing spaces per line; they are noise for the tokenizer.
    return "\n".join(line.rstrip() for line in text.split("\n")).strip()


# ---- sources ---------------------------------------------------------------------------
def topic_documents() -> list[Document]:
    from pydoc_data.topics import topics
    return [Document(f"topic:{key}", clean(topics[key])) for key in sorted(topics)]


def stdlib_source_files(root: Path | None = None) -> list[tuple[str, Path]]:
    """(dotted module name, path) for every stdlib .py file we read, sorted by name."""
    root = root or Path(sysconfig.get_paths()["stdlib"])
    found = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if _SKIP_PARTS & set(rel.parts[:-1]) or rel.parts[0].startswith("config-"):
            continue
        parts = list(rel.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        if not parts or parts[-1].startswith("test_") or parts[0] in _SKIP_MODULES:
            continue
        found.append((".".join(parts), path))
    return sorted(found)


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    try:
        return f"({ast.unparse(node.args)})"
    except (ValueError, AttributeError):
        return "(...)"


def source_entries(module: str, source: str) -> list[Entry]:
    """The module docstring, then every class and function docstring, in source order."""
    try:
        tree = ast.parse(source)
    except SyntaxError:  # lib2to3 fixtures and friends written in old syntax
        return []
    entries = []
    doc = ast.get_docstring(tree, clean=False)
    if doc:
        entries.append(Entry(f"Module {module}", module, doc))

    def visit(body, prefix: str) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef):
                qual = f"{prefix}.{node.name}"
                doc = ast.get_docstring(node, clean=False)
                if doc:
                    entries.append(Entry(f"class {qual}", qual, doc))
                visit(node.body, qual)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                qual = f"{prefix}.{node.name}"
                doc = ast.get_docstring(node, clean=False)
                if doc:
                    entries.append(Entry(f"{qual}{_signature(node)}", qual, doc))
    visit(tree.body, module)
    return entries


def c_module_entries(module: str) -> list[Entry]:
    try:
        mod = importlib.import_module(module)
    except ImportError:
        return []
    entries = []
    if mod.__doc__:
        entries.append(Entry(f"Module {module}", module, mod.__doc__))
    for name in sorted(vars(mod)):
        if name.startswith("_"):
            continue
        obj = getattr(mod, name)
        if not (inspect.isbuiltin(obj) or inspect.isclass(obj)) or not isinstance(obj.__doc__, str):
            continue
        qual = f"{module}.{name}"
        entries.append(Entry(f"class {qual}" if inspect.isclass(obj) else qual, qual, obj.__doc__))
        if inspect.isclass(obj):
            for attr in sorted(vars(obj)):
                member = vars(obj)[attr]
                doc = getattr(member, "__doc__", None)
                if attr.startswith("_") or not callable(member) or not isinstance(doc, str):
                    continue
                entries.append(Entry(f"{qual}.{attr}", f"{qual}.{attr}", doc))
    return entries


# ---- assembly --------------------------------------------------------------------------
def _render(entries: list[Entry], seen: set[str]) -> tuple[str, list[Entry]]:
    """One document from a module's entries, skipping docstrings already seen anywhere."""
    parts, kept = [], []
    for entry in entries:
        doc = clean(entry.doc)
        if len(doc) < 20 or doc in seen:  # one-liners like "Return x." repeat and teach little
            continue
        seen.add(doc)
        parts.append(f"{entry.name}\n\n{doc}")
        kept.append(Entry(entry.name, entry.short_name, doc))
    return "\n\n".join(parts), kept


_QUESTIONS = ("What does {} do?", "Explain {}.", "Tell me about {}.", "How do I use {}?")


def chat_turns(doc_id: str, entries: list[Entry]) -> list[tuple[str, str]]:
    """(question, answer) pairs taught in chat form: ask about a name, answer with the first
    paragraph of its docstring. Gives the chat template something to mean."""
    pairs = []
    for entry in entries:
        answer = entry.doc.split("\n\n")[0].strip()
        if len(answer) < 40:
            continue
        pick = hashlib.blake2b(f"{doc_id}/{entry.short_name}".encode(), digest_size=2).digest()[0]
        pairs.append((_QUESTIONS[pick % len(_QUESTIONS)].format(entry.short_name), answer))
    return pairs


@dataclass
class Corpus:
    documents: list[Document]  # plain text
    chats: dict[str, list[tuple[str, str]]]  # doc id -> question/answer pairs from it

    def split(self, heldout: bool) -> list[Document]:
        return [d for d in self.documents if d.heldout == heldout]

    def chat_split(self, heldout: bool) -> list[tuple[str, str]]:
        return [pair for doc_id in sorted(self.chats) if is_heldout(doc_id) == heldout
                for pair in self.chats[doc_id]]


def build_corpus() -> Corpus:
    seen: set[str] = set()
    documents, chats = [], {}
    for doc in topic_documents():
        if doc.text not in seen:
            seen.add(doc.text)
            documents.append(doc)
    sources = [(f"module:{name}", source_entries(name, path.read_text(encoding="utf-8", errors="replace")))
               for name, path in stdlib_source_files()]
    sources += [(f"cmodule:{name}", c_module_entries(name)) for name in _C_MODULES]
    for doc_id, entries in sources:
        text, kept = _render(entries, seen)
        if text:
            documents.append(Document(doc_id, text))
            chats[doc_id] = chat_turns(doc_id, kept)
    return Corpus(documents, chats)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    corpus = build_corpus()
    args.out.mkdir(parents=True, exist_ok=True)
    stats = {"python": sys.version.split()[0]}
    for name, heldout in (("train", False), ("heldout", True)):
        docs = corpus.split(heldout)
        (args.out / f"{name}.txt").write_text("\n\n".join(d.text for d in docs))
        stats[name] = {"documents": len(docs), "characters": sum(len(d.text) for d in docs),
                       "chat_pairs": len(corpus.chat_split(heldout))}
    (args.out / "stats.json").write_text(json.dumps(stats, indent=2))
    print(json.dumps(stats, indent=2))


if __name__ == "__main__":
    main()
