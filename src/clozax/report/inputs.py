"""What the report reads from a run directory besides JSON files (``files.read_json``): JSON
lines that may be cut short, and the training curves in ``metrics.jsonl``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def read_jsonl(path: Path) -> list[dict]:
    """The JSON lines at ``path`` (none when missing); a line cut by a kill is left out."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by a kill mid-write
            continue
    return out


def training_curves(records: list[dict]) -> dict[str, np.ndarray]:
    """Train loss and held-out loss/accuracy against tokens; a resumed run may log a step twice,
    the last record of a step wins."""
    by_step = {int(r["step"]): r for r in records if "step" in r}
    steps = sorted(by_step)
    train = [by_step[s] for s in steps if "loss" in by_step[s] and "tokens" in by_step[s]]
    held = [by_step[s] for s in steps if isinstance(by_step[s].get("eval"), dict)
            and "loss" in by_step[s]["eval"]]
    return {
        "train_tokens": np.array([r["tokens"] for r in train], float),
        "train_loss": np.array([r["loss"] for r in train], float),
        "eval_tokens": np.array([r["tokens"] for r in held], float),
        "eval_loss": np.array([r["eval"]["loss"] for r in held], float),
        "eval_accuracy": np.array([r["eval"]["accuracy"] for r in held], float),
    }
