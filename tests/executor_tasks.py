"""A task for the executor tests, importable in a worker without importing the suite."""

import json
import os
import time
from pathlib import Path


def busy(seconds: float, log: str, name: str) -> None:
    """Hold a worker for ``seconds``; append which process ran ``name``, and when."""
    start = time.monotonic()
    time.sleep(seconds)
    with Path(log).open("a") as f:
        f.write(json.dumps({"name": name, "pid": os.getpid(), "start": start,
                            "end": time.monotonic()}) + "\n")


def mark(tmp: str, name: str) -> None:
    """A prepare-like task: writes ``name`` into its partial directory ``tmp``."""
    (Path(tmp) / name).write_text(name)
