"""The house: imports run one way through the layers ARCHITECTURE.md describes, with no cycle;
no module is longer than ~400 lines without saying why; ARCHITECTURE.md names every module.

The import graph is read from the source with ``ast`` (every import statement, at module level
or inside a function), so a function-level import cannot hide an upward edge or a cycle.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast  # make test-fast; tests marked slow stay out

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
PACKAGE = SRC / "clozax"

# The layer table, lowest first: a module may import modules of its own layer or of a layer
# with a lower rank. Layers of equal rank (interop, report) may not import each other. Interop
# sits above judge because ``clozax export`` of a fine-tuned model reads the form judge writes
# (``judge/finetune/saved.py``).
# ``clozax`` itself (``__version__``) sits in the core layer.
LAYERS = {
    "core": (0, ("clozax", "clozax.core")),
    "data": (1, ("clozax.data",)),
    "train": (2, ("clozax.train",)),
    "judge": (3, ("clozax.judge",)),
    "interop": (4, ("clozax.interop",)),
    "report": (4, ("clozax.report",)),
    "app": (5, ("clozax.app",)),
}
MAX_LINES = 400
LONG_REASON = "Longer than 400 lines because"  # what a longer module's docstring must say


def module_files(package: Path = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file under ``package``."""
    out = {}
    for f in sorted(package.rglob("*.py")):
        parts = list(f.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def import_graph(files: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the package modules it imports anywhere in its source. ``from a import b``
    counts as importing ``a``, and ``a.b`` too when ``a.b`` is a module."""
    edges: dict[str, set[str]] = {m: set() for m in files}
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            edges[module] |= {n for n in names if n in files and n != module}
    return edges


def layer_of(module: str) -> str:
    """The layer whose prefix matches ``module`` most specifically."""
    best, best_len = None, -1
    for name, (_, prefixes) in LAYERS.items():
        for p in prefixes:
            exact_root = p == "clozax"
            if module == p or (not exact_root and module.startswith(p + ".")):
                if len(p) > best_len:
                    best, best_len = name, len(p)
    if best is None:
        raise AssertionError(f"{module} is in no layer of LAYERS; add it to the table")
    return best


def upward_edges(edges: dict[str, set[str]]) -> list[str]:
    bad = []
    for a, targets in edges.items():
        la = layer_of(a)
        for b in sorted(targets):
            lb = layer_of(b)
            if lb != la and LAYERS[lb][0] >= LAYERS[la][0]:
                bad.append(f"{a} ({la}) imports {b} ({lb})")
    return bad


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


@pytest.fixture(scope="module")
def graph():
    return import_graph(module_files())


def test_every_module_belongs_to_a_layer(graph):
    for module in graph:
        layer_of(module)


def test_no_module_imports_a_higher_layer(graph):
    assert upward_edges(graph) == []


def test_the_import_graph_has_no_cycle(graph):
    assert cycles(graph) == []


def test_the_checks_catch_a_planted_cycle_and_upward_edge(tmp_path):
    pkg = tmp_path / "clozax"
    (pkg / "core").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "core" / "__init__.py").write_text("")
    (pkg / "core" / "a.py").write_text("def f():\n    from clozax.core import b\n")
    (pkg / "core" / "b.py").write_text("from clozax.core.a import f\nimport clozax.app.cli\n")
    (pkg / "app").mkdir()
    (pkg / "app" / "__init__.py").write_text("")
    (pkg / "app" / "cli.py").write_text("")
    edges = import_graph(module_files(pkg))
    assert cycles(edges) == [["clozax.core.a", "clozax.core.b"]]
    assert upward_edges(edges) == ["clozax.core.b (core) imports clozax.app.cli (app)"]


def test_modules_are_at_most_400_lines_or_say_why():
    long = []
    for path in module_files().values():
        text = path.read_text()
        doc = ast.get_docstring(ast.parse(text)) or ""
        if len(text.splitlines()) > MAX_LINES and LONG_REASON not in doc:
            long.append(f"{path.relative_to(ROOT)}: {len(text.splitlines())} lines")
    assert long == []


def test_architecture_md_names_every_module_and_only_existing_ones():
    doc = (ROOT / "ARCHITECTURE.md").read_text()
    files = {p.relative_to(PACKAGE).as_posix() for p in module_files().values()
             if p.name != "__init__.py"}
    named = set(re.findall(r"[a-z0-9_]+(?:/[a-z0-9_]+)*\.py", doc))
    assert sorted(files - named) == [], "modules ARCHITECTURE.md does not name"
    assert sorted(n for n in named if n not in files and not (ROOT / n).exists()) == []
