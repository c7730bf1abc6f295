"""The built-in corpus: docstrings of the running interpreter's standard library (modules,
classes and functions), one document each; group = module file, label = top-level package."""

from __future__ import annotations

import ast
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from clozax.data.readers import RawDocument, Record, Skip

# Directories of the stdlib that hold tests, fixtures or third-party code, not documentation.
_STDLIB_SKIP_DIRS = {
    "site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__",
    "test_support", "testdata",
}
_DOCSTRING_NODES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)



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
