"""``clozax ARGV`` run in the pytest process through the real entry point (``clozax.app.cli.main``):
its exit code and what it printed, with no interpreter start-up, imports or compiles to pay.

A test starts a real process only where the behaviour needs one: a signal or a kill, locks or
writers in two processes, several JAX processes or devices, a fresh interpreter (the glibc
allocator, the no-traceback exit of the installed entry point) or a browser. Error messages,
exit codes and the files a command writes are tested here.
"""

from __future__ import annotations

from typing import NamedTuple

from clozax.app.cli import main


class Ran(NamedTuple):
    code: int  # the exit code the process would have had
    out: str
    err: str


def clozax(capsys, *argv) -> Ran:
    """Run ``clozax ARGV`` (each item turned into a string); what was printed before is dropped."""
    capsys.readouterr()
    try:
        main([str(a) for a in argv])
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    out, err = capsys.readouterr()
    return Ran(code, out, err)


def one_line_error(capsys, *argv, code: int = 2) -> str:
    """``clozax ARGV`` must fail with exit ``code`` and one line ``error: ...`` on stderr, no
    traceback anywhere; returns that line."""
    ran = clozax(capsys, *argv)
    assert ran.code == code, ran
    lines = [line for line in ran.err.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), ran
    assert "Traceback" not in ran.out + ran.err
    return lines[0]
