"""Results of every checkpoint a judge command scored: ``RUN/history/{name}-{step}.json``
beside ``RUN/{name}.json``, which holds the newest step scored (a judgement of an older step
never replaces a newer one's). The report draws the curves over checkpoints from them."""

from __future__ import annotations

import re
from pathlib import Path

from clozax.core import files

HISTORY_DIR = "history"


def committed_steps(run_dir: Path) -> list[int]:
    """The run's committed checkpoint steps, oldest first (``--every-checkpoint``); a
    one-line error when there is none."""
    from clozax.train.checkpoint import Checkpointer

    checkpointer = Checkpointer(Path(run_dir), read_only=True)
    try:
        steps = checkpointer.all_steps()
    finally:
        checkpointer.close()
    if not steps:
        raise ValueError(f"run {run_dir} has no checkpoint yet; train it (or let a save "
                         "complete) first")
    return steps


def record_lines(run_dir: Path, name: str, step: int, lines: list[dict]) -> None:
    """``history/{name}-{step}.jsonl``: per-step lines (the failure cases of each step)."""
    (Path(run_dir) / HISTORY_DIR).mkdir(exist_ok=True)
    files.write_jsonl(Path(run_dir) / HISTORY_DIR / f"{name}-{step}.jsonl", lines)


def record(run_dir: Path, name: str, result: dict) -> bool:
    """Write ``result`` (which names its ``step``) into the history, and as ``{name}.json``
    unless that holds a later step; returns whether ``{name}.json`` was written."""
    run_dir = Path(run_dir)
    (run_dir / HISTORY_DIR).mkdir(exist_ok=True)
    files.write_json(run_dir / HISTORY_DIR / f"{name}-{result['step']}.json", result)
    current = files.read_json(run_dir / f"{name}.json")
    if current is not None and int(current.get("step", -1)) > int(result["step"]):
        return False
    files.write_json(run_dir / f"{name}.json", result)
    return True


def at_step(run_dir: Path, name: str, step: int) -> dict | None:
    """The recorded result of ``name`` at ``step`` (None: that step was not scored)."""
    return files.read_json(Path(run_dir) / HISTORY_DIR / f"{name}-{step}.json")


def recorded(run_dir: Path, name: str) -> list[dict]:
    """Every recorded result of ``name``, by step."""
    found = {}
    for path in (Path(run_dir) / HISTORY_DIR).glob(f"{name}-*.json"):
        if re.fullmatch(rf"{re.escape(name)}-\d+\.json", path.name) and \
                (result := files.read_json(path)) is not None:
            found[int(result["step"])] = result
    return [found[s] for s in sorted(found)]
