"""The ``clozax`` command line. It only parses arguments and calls library functions.

Errors: bad arguments and any ``ValueError`` from the library print one line
(``error: ...``) and exit 2; ``--debug`` (anywhere on the line) shows the traceback instead.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from typer.exceptions import TyperException

app = typer.Typer(
    name="clozax",
    help="Masked-language-model pretraining in JAX, with an objective you can audit.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _root() -> None:
    """Masked-language-model pretraining in JAX, with an objective you can audit.

    Add --debug anywhere to see a traceback instead of the one-line error.
    """


@app.command()
def lesson(
    out: Annotated[
        Path | None,
        typer.Option(help="Directory for lesson.json and the two PNG figures."),
    ] = None,
):
    """Reproduce the lesson's one-head fixture and run every check it makes."""
    from clozax import lesson as lesson_mod

    lesson_mod.run(out=out)


# New commands go above this line (one function each, parsing only).


def _fail(message: str) -> None:
    from rich.console import Console

    Console(stderr=True, highlight=False).print(f"[bold red]error:[/] {message}", soft_wrap=True)
    raise SystemExit(2)


def main(argv: list[str] | None = None) -> None:
    """Entry point: one-line errors with exit code 2 unless ``--debug`` is given."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    try:
        app(args=argv, prog_name="clozax", standalone_mode=False)
    except typer.Exit as e:  # --help and friends
        raise SystemExit(e.exit_code) from None
    except typer.Abort:
        _fail("interrupted")
    except TyperException as e:  # usage errors: unknown option, bad value, missing argument
        if debug:
            raise
        if type(e).__name__ == "NoArgsIsHelpError":  # typer has already printed the help
            raise SystemExit(0) from None
        message = e.format_message() if hasattr(e, "format_message") else str(e)
        _fail((message.splitlines() or [type(e).__name__])[0])
    except (ValueError, FileNotFoundError, NotADirectoryError, PermissionError) as e:
        if debug:
            raise
        _fail(str(e).splitlines()[0] if str(e) else type(e).__name__)


if __name__ == "__main__":
    main()
