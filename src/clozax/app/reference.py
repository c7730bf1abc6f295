"""The documentation's reference pages, generated from the code so that they cannot drift.

* ``cli_markdown()``: every command of ``clozax`` and every option, from the typer app (its
  click commands): flags, type, default, help.
* ``config_markdown()``: every key of a run's config (``[model]``, ``[masking]``, ``[optim]``,
  ``[train]``, ``[[phases]]``) from the frozen dataclasses: type, default, whether it is
  speed-only (``SPEED_ONLY``), the comment written beside it in the source, and the values it
  accepts, which is what its validator answers to an out-of-range value (so it is the rule the
  code enforces, worded as the error a user would see).
* ``errors_markdown()``: every one-line error message raised in ``src/clozax``, read from the
  source with ``ast`` and grouped by module (an f-string's fields shown as ``{…}``).

``docs/hooks.py`` replaces the markers ``<!-- reference:cli -->``, ``<!-- reference:config -->``
and ``<!-- reference:errors -->`` in the pages with these when MkDocs builds the site;
``tests/test_docs.py`` checks that every option and key reaches the built pages.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import math
import tokenize
import typing
from pathlib import Path

MARKERS = ("cli", "config", "errors")
PACKAGE = Path(__file__).resolve().parent


# --- the command line ---------------------------------------------------------------------

def cli_commands() -> dict:
    """Command name -> its click command, for every command of the ``clozax`` app (typer
    brings its own copy of click, so these are read by their attributes)."""
    import typer.main

    from clozax.app.cli import app

    group = typer.main.get_command(app)
    return {name: group.commands[name] for name in sorted(group.commands)}


def cli_options(command) -> list:
    """The command's arguments and options as the command line shows them (not ``--help``)."""
    return [p for p in command.params if p.name != "help"]


def _is_argument(param) -> bool:
    return param.param_type_name == "argument"


def _option_name(param) -> str:
    if _is_argument(param):
        return param.name.upper()
    names = [*param.opts, *param.secondary_opts]
    return " / ".join(names)


def _option_default(param) -> str:
    if param.required:
        return "required"
    default = param.default
    if default is None or callable(default):
        return "—"
    if isinstance(default, bool) and param.secondary_opts:
        return param.opts[0] if default else param.secondary_opts[0]
    if isinstance(default, (list, tuple)):
        return ", ".join(map(str, default)) or "—"
    return f"`{default}`"


def _cell(text: str | None) -> str:
    """One table cell: one line, pipes and brackets escaped (``[MASK]`` is not a link)."""
    text = " ".join((text or "").split())
    return text.replace("|", "\\|").replace("[", "\\[").replace("]", "\\]")


def cli_markdown() -> str:
    import typer._click.core as click_core

    out = []
    for name, command in cli_commands().items():
        context = click_core.Context(command)
        out.append(f"### clozax {name}\n")
        doc = inspect.cleandoc(command.help or "").split("\n\n")[0]
        out.append(_cell(doc) + "\n")
        params = cli_options(command)
        if not params:
            out.append("No options.\n")
            continue
        out.append("| option | type | default | what it does |\n|---|---|---|---|")
        for p in params:
            kind = p.display_type(context).strip("<>") + (" argument" if _is_argument(p) else "")
            out.append(f"| `{_option_name(p)}` | {kind} | {_option_default(p)} | "
                       f"{_cell(getattr(p, 'help', None))} |")
        out.append("")
    return "\n".join(out)


# --- the run's config --------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Key:
    section: str  # "model", "masking", "optim", "train", "phases"
    name: str
    type: str
    default: object
    speed_only: bool
    doc: str
    accepts: str

    @property
    def dotted(self) -> str:
        return f"{self.section}.{self.name}"


def _comments(cls) -> dict[str, str]:
    """Field name -> the comment beside it in ``cls``'s source: the comment lines just above
    the field, then the one at the end of its line."""
    source = inspect.getsource(cls)
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    by_line: dict[int, str] = {}
    for t in tokens:
        if t.type == tokenize.COMMENT:
            by_line[t.start[0]] = t.string.lstrip("#").strip()
    lines = source.splitlines()
    out = {}
    for node in ast.parse(source).body[0].body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above, line = [], node.lineno - 1
        while line >= 1 and lines[line - 1].strip().startswith("#"):
            above.insert(0, by_line.get(line, ""))
            line -= 1
        beside = by_line.get(node.lineno)
        out[node.target.id] = " ".join([*above, *([beside] if beside else [])])
    return out


def _type_name(annotation) -> str:
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
    return text.replace("typing.", "").replace("tuple[PhaseConfig, ...]", "tables")


_PROBES = {int: (-1, 0, 2**40), float: (-1.0, 1e30, 0.0, math.nan), str: ("?not-a-choice",),
           bool: ("yes",)}


def _base_type(annotation: str) -> type | None:
    for t in (bool, int, float, str):
        if annotation.split("|")[0].strip() == t.__name__:
            return t
    return None


def _accepts(build, name: str, annotation: str) -> str:
    """The validator's answer to out-of-range values of ``name``: what it accepts, in the
    words of the error a user would get (the field's own error, or "any ...")."""
    base = _base_type(annotation)
    if base is None:
        return "see the comment"
    for probe in _PROBES[base]:
        try:
            build(name, probe)
        except (ValueError, TypeError) as e:
            message = str(e).split("\n")[0]
            if name in message:
                message = message.replace(repr(probe), "…").replace(str(probe), "…")
                head, _, rest = message.partition("=… ")
                return rest if head.endswith(name) and rest else message
    return f"any {base.__name__}" + (" or none" if "None" in annotation else "")


def config_keys() -> list[Key]:
    """Every key of a run's config, section by section, in the order of the source."""
    from clozax.train import config as config_lib
    from clozax.train.phase_config import PhaseConfig

    keys = []
    sections = {**config_lib.SECTIONS, "phases": PhaseConfig}
    for section, cls in sections.items():
        hints = typing.get_type_hints(cls)
        comments = _comments(cls)
        raw = {f.name: f.type for f in dataclasses.fields(cls)}
        if section == "phases":
            base = {"steps": 10}

            def build(name, value, cls=cls, base=base):
                values = {**base, name: value}
                if name == "tokens":
                    values.pop("steps")
                return cls(**values)
        else:
            def build(name, value, section=section):
                return config_lib.from_dict({section: {name: value}})
        default = (config_lib.RunConfig().__getattribute__(section) if section != "phases"
                   else None)
        for f in dataclasses.fields(cls):
            annotation = raw[f.name] if isinstance(raw[f.name], str) else str(hints[f.name])
            value = (getattr(default, f.name) if default is not None
                     else f.default if f.default is not dataclasses.MISSING else None)
            keys.append(Key(section, f.name, _type_name(annotation), value,
                            f"{section}.{f.name}" in config_lib.SPEED_ONLY,
                            comments.get(f.name, ""), _accepts(build, f.name, annotation)))
    return keys


def _value(value) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, tuple):
        return "[]" if not value else str(list(value))
    return str(value)


def config_markdown() -> str:
    out = []
    section = None
    for key in config_keys():
        if key.section != section:
            section = key.section
            title = "[[phases]]" if section == "phases" else f"[{section}]"
            out.append(f"\n### `{title}`\n")
            out.append("| key | type | default | speed-only | accepts | what it is |\n"
                       "|---|---|---|---|---|---|")
        out.append(f"| `{key.dotted}` | {_cell(key.type)} | `{_value(key.default)}` | "
                   f"{'yes' if key.speed_only else ''} | {_cell(key.accepts)} | "
                   f"{_cell(key.doc)} |")
    return "\n".join(out) + "\n"


# --- the errors --------------------------------------------------------------------------

_ERRORS = ("ValueError", "RuntimeError", "FileNotFoundError", "FileExistsError", "OSError",
           "BadParameter", "Exit", "UsageError")


def _template(node: ast.AST) -> str | None:
    """A message's text, an f-string's fields shown as ``{…}``; None if it is not literal."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{…}" for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _template(node.left), _template(node.right)
        return left + right if left is not None and right is not None else None
    return None


def error_messages() -> dict[str, list[str]]:
    """Module (relative path) -> the literal messages its ``raise`` statements carry."""
    out: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        found = []
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)):
                continue
            func = node.exc.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if not node.exc.args or not (name in _ERRORS or name.endswith("Error")):
                continue
            text = _template(node.exc.args[0])
            if text and len(text) > 20 and text not in found:
                found.append(text)
        if found:
            out[str(path.relative_to(PACKAGE.parent))] = found
    return out


def errors_markdown() -> str:
    out = []
    for module, messages in error_messages().items():
        out.append(f"\n### `{module}`\n")
        out.extend(f"- `error: {' '.join(m.split()).replace('`', '')}`" for m in messages)
    return "\n".join(out) + "\n"


def render(marker: str) -> str:
    """The generated markdown for ``<!-- reference:MARKER -->``."""
    return {"cli": cli_markdown, "config": config_markdown, "errors": errors_markdown}[marker]()
