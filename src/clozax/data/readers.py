"""Corpus readers: each yields ``RawDocument`` or ``Skip`` records, streaming, in a fixed order.

Directory corpora: a ``.txt``/``.md`` file's group is its path relative to the corpus root and
its label the top-level subdirectory (none for files at the root); a JSONL/parquet row's group
is ``--group-field`` or else ``file:line`` (each row its own group).

Readers never hold a whole corpus: files are walked in sorted order and read one at a time
(a ``.txt``/``.md`` file is one document, so it is read whole; JSONL is read line by line,
parquet batch by batch). Anything unreadable becomes a ``Skip`` with a reason, or a
``ValueError`` when ``strict`` is set.
"""

from __future__ import annotations

import ast
import json
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

TEXT_SUFFIXES = (".txt", ".md")
SUPPORTED_SUFFIXES = (*TEXT_SUFFIXES, ".jsonl", ".parquet")

# Directories of the stdlib that hold tests, fixtures or third-party code, not documentation.
_STDLIB_SKIP_DIRS = {
    "site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__",
    "test_support", "testdata",
}
_DOCSTRING_NODES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


@dataclass(frozen=True)
class RawDocument:
    """One document as read, before cleaning. ``source`` locates it for messages."""

    text: str
    group: str
    label: str | None
    source: str


@dataclass(frozen=True)
class Skip:
    """A document (or a file that would have been one) that was not used, and why."""

    source: str
    reason: str


@dataclass(frozen=True)
class FieldNames:
    """Which JSONL/parquet fields hold the text, the group and the label."""

    text: str = "text"
    group: str | None = None
    label: str | None = None


Record = RawDocument | Skip


def read_corpus(corpus: str, fields: FieldNames, strict: bool) -> Iterator[Record]:
    """Every record of ``corpus``: ``"stdlib"``, a directory, or one supported file.

    The path is checked now (not on first iteration), so a bad path fails before any work.
    """
    if corpus == "stdlib":
        stdlib_root_checked()
        return _guard(read_stdlib(), strict)
    root = Path(corpus)
    if not root.exists():
        raise ValueError(f"corpus path {corpus} does not exist; pass an existing file or "
                         "directory, or --corpus stdlib")
    if root.is_file():
        if root.suffix not in SUPPORTED_SUFFIXES:
            raise ValueError(f"corpus file {corpus} has unsupported suffix {root.suffix!r}; "
                             f"use one of {', '.join(SUPPORTED_SUFFIXES)}")
        files = [root]
        base = root.parent
    else:
        files = sorted(p for p in root.rglob("*") if p.suffix in SUPPORTED_SUFFIXES
                       and p.is_file())
        base = root
        if not files:
            raise ValueError(f"corpus directory {corpus} has no supported files; "
                             f"add {', '.join(SUPPORTED_SUFFIXES)} files")
    parquet = [p for p in files if p.suffix == ".parquet"]
    if parquet:
        _import_pyarrow(parquet[0])  # fail now, not after reading the other files
    return _guard(_read_files(files, base, fields), strict)


def _import_pyarrow(path: Path):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"reading {path.name} and other .parquet files needs pyarrow; "
                         "pip install 'clozax[parquet]'") from None
    return pq


def _guard(records: Iterator[Record], strict: bool) -> Iterator[Record]:
    for record in records:
        if strict and isinstance(record, Skip):
            raise ValueError(f"{record.source}: {record.reason} (--strict is set; fix or remove "
                             "the input, or drop --strict to skip it)")
        yield record


def _read_files(files: list[Path], base: Path, fields: FieldNames) -> Iterator[Record]:
    for path in files:
        rel = path.relative_to(base).as_posix()
        if path.suffix in TEXT_SUFFIXES:
            yield _read_text_file(path, rel)
        elif path.suffix == ".jsonl":
            yield from _read_jsonl(path, rel, fields)
        else:
            yield from _read_parquet(path, rel, fields)


def _decode(data: bytes) -> str:
    """Decode UTF-8 or raise ``_BadBytes`` with a reason naming the first problem."""
    nul = data.find(b"\x00")
    if nul >= 0:
        raise _BadBytes(f"binary content (NUL byte at offset {nul})")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _BadBytes(f"invalid UTF-8 at byte {e.start}") from None


class _BadBytes(Exception):
    pass


def _read_text_file(path: Path, rel: str) -> Record:
    try:
        data = path.read_bytes()
    except OSError as e:
        return Skip(rel, f"unreadable ({e.strerror or type(e).__name__})")
    try:
        text = _decode(data)
    except _BadBytes as e:
        return Skip(rel, str(e))
    top = rel.split("/")[0] if "/" in rel else None
    return RawDocument(text=text, group=rel, label=top, source=rel)


def _from_row(row: object, where: str, fields: FieldNames) -> Record:
    if not isinstance(row, dict):
        return Skip(where, f"not a JSON object (got {type(row).__name__})")
    text = row.get(fields.text)
    if not isinstance(text, str):
        missing = fields.text not in row or row.get(fields.text) is None
        what = "lacks" if missing else "has a non-string"
        return Skip(where, f"{what} text field {fields.text!r}")
    found = {}  # the optional group and label fields that were asked for
    for kind, name in (("group", fields.group), ("label", fields.label)):
        if name is not None:
            if row.get(name) is None:
                return Skip(where, f"lacks {kind} field {name!r}")
            found[kind] = str(row[name])
    return RawDocument(text=text, group=found.get("group", where), label=found.get("label"),
                       source=where)


def _read_jsonl(path: Path, rel: str, fields: FieldNames) -> Iterator[Record]:
    try:
        handle = path.open("rb")
    except OSError as e:
        yield Skip(rel, f"unreadable ({e.strerror or type(e).__name__})")
        return
    with handle:
        for number, line in enumerate(handle, start=1):
            where = f"{rel}:{number}"
            if not line.strip():
                continue  # blank lines separate nothing; they are not documents
            try:
                row = json.loads(_decode(line))
            except _BadBytes as e:
                yield Skip(where, str(e))
                continue
            except json.JSONDecodeError as e:
                yield Skip(where, f"not valid JSON ({e.msg})")
                continue
            yield _from_row(row, where, fields)


def _read_parquet(path: Path, rel: str, fields: FieldNames) -> Iterator[Record]:
    pq = _import_pyarrow(path)
    try:
        parquet = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises its own error types for corrupt files
        yield Skip(rel, f"unreadable parquet ({type(e).__name__}: {e})".splitlines()[0])
        return
    columns = [c for c in (fields.text, fields.group, fields.label) if c is not None]
    present = set(parquet.schema_arrow.names)
    if fields.text not in present:
        yield Skip(rel, f"lacks text column {fields.text!r}")
        return
    number = 0
    for batch in parquet.iter_batches(batch_size=4096, columns=[c for c in columns
                                                                if c in present]):
        for row in batch.to_pylist():
            number += 1
            yield _from_row(row, f"{rel}:{number}", fields)


def stdlib_root() -> Path:
    """The running interpreter's standard-library source directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_root_checked() -> Path:
    root = stdlib_root()
    if not (root / "os.py").is_file():
        raise ValueError(f"stdlib source {root} is missing; install the Python source files "
                         "or pass --corpus PATH")
    return root


def _is_stdlib_test(rel: str) -> bool:
    parts = rel.split("/")
    name = parts[-1]
    return (any(p in _STDLIB_SKIP_DIRS for p in parts[:-1]) or name.startswith("test_")
            or name == "__main__.py" and parts[0] == "test")


def stdlib_files(root: Path | None = None) -> Iterator[tuple[Path, str]]:
    """``(path, relative name)`` of every non-test ``.py`` file of the stdlib, sorted."""
    root = stdlib_root_checked() if root is None else root
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _STDLIB_SKIP_DIRS
                             and not d.startswith("test_"))
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            path = Path(dirpath) / name
            rel = path.relative_to(root).as_posix()
            if not _is_stdlib_test(rel):
                yield path, rel


def read_stdlib(root: Path | None = None) -> Iterator[Record]:
    """Docstrings of modules, classes and functions; group = module file, label = package."""
    for path, rel in stdlib_files(root):
        label = rel.split("/")[0].removesuffix(".py")
        try:
            tree = ast.parse(path.read_bytes(), filename=rel)
        except (SyntaxError, ValueError) as e:
            yield Skip(rel, f"not parseable as Python ({type(e).__name__})")
            continue
        except OSError as e:
            yield Skip(rel, f"unreadable ({e.strerror or type(e).__name__})")
            continue
        for node, qualname in _docstring_nodes(tree, ""):
            doc = ast.get_docstring(node, clean=True)
            if doc is not None:
                yield RawDocument(text=doc, group=rel, label=label,
                                  source=f"{rel}:{qualname or '<module>'}")


def _docstring_nodes(node: ast.AST, prefix: str) -> Iterator[tuple[ast.AST, str]]:
    """Depth-first, in source order, so documents keep the order a reader sees."""
    if isinstance(node, _DOCSTRING_NODES):
        yield node, prefix
    for child in ast.iter_child_nodes(node):
        name = getattr(child, "name", None)
        child_prefix = f"{prefix}.{name}" if prefix and name else (name or prefix)
        yield from _docstring_nodes(child, child_prefix)
