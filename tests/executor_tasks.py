"""A task for the executor tests, importable in a worker without importing the suite."""

import json
import os
import time
from pathlib import Path


def busy(seconds: float, log: str, name: str, ready: str | None = None,
         workers: int = 0) -> None:
    """Hold a worker for ``seconds``; append which process ran ``name``, and when. With
    ``ready`` (a folder), first wait until ``workers`` processes have registered there, so a
    worker that started late (spawn and imports on a loaded machine) does not look idle."""
    if ready is not None:
        (Path(ready) / str(os.getpid())).touch()
        deadline = time.monotonic() + 120
        while len(list(Path(ready).iterdir())) < workers:
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {len(list(Path(ready).iterdir()))} of {workers} "
                                   "workers started in 120 s")
            time.sleep(0.01)
    start = time.monotonic()
    time.sleep(seconds)
    with Path(log).open("a") as f:
        f.write(json.dumps({"name": name, "pid": os.getpid(), "start": start,
                            "end": time.monotonic()}) + "\n")


def mark(tmp: str, name: str) -> None:
    """A prepare-like task: writes ``name`` into its partial directory ``tmp``."""
    (Path(tmp) / name).write_text(name)
