"""Weights & Biases beside TensorBoard: ``train.wandb_project`` (the optional ``wandb`` extra).

``TrainLog`` (``train/observe.py``) starts one W&B run per ``clozax train`` process that
reports (process 0) and hands it exactly the scalars TensorBoard gets (``train/loss``,
``train/lr``, ..., ``eval/accuracy``, ...) at the same steps. The W&B run carries the run's
config (``config.json``, the resolved config the run directory records) and its identity: the
name is the run directory's name, its files go under ``RUN/wandb/``, and its id is recorded in
``RUN/wandb/clozax-run-id`` the first time (a short hash of the directory's absolute path and
that moment, so a new run written to a reused path is a new W&B run), so a resumed run
continues the same W&B run (``resume="allow"``).

Mode: ``WANDB_MODE`` when set; otherwise online when an API key is configured
(``WANDB_API_KEY``, or a ``~/.netrc`` entry for the W&B host that ``wandb login`` writes), else
offline, which says once where the run's files are and the ``wandb sync`` command that uploads
them. W&B's service runs in a session of its own, so a SIGTERM or Ctrl-C meant for the job
reaches only ``clozax train``, which saves and then finishes the W&B run in ``stop``.

Cost, measured here (wandb 0.31.0, 2 CPU cores shared, load 3-4), once per ``clozax train``:
``import wandb`` 0.8-1.3 s, an offline ``wandb.init`` 0.9-1.3 s (it starts W&B's service
process), ``finish`` under 0.05 s (the service closes the run's files just after; the
interpreter's exit waits for it, ``wandb.teardown()`` does too); a logged line about 5 ms.
"""

from __future__ import annotations

import hashlib
import netrc
import os
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

from clozax.core import files
from clozax.train.interrupts import Interrupted

ID_FILE = Path("wandb") / "clozax-run-id"  # in the run directory, beside W&B's own files
MISSING = "train.wandb_project is set but wandb is not installed; pip install 'clozax[wandb]'"


def require():
    """The ``wandb`` module, or a one-line ``ValueError`` saying how to install it."""
    try:
        import wandb
    except ImportError:
        raise ValueError(MISSING) from None
    return wandb


def new_id(run_dir: Path, now_ns: int) -> str:
    """A W&B run id for ``run_dir`` first logged at ``now_ns``: 12 hex digits of a hash."""
    key = f"{Path(run_dir).absolute()}\n{now_ns}".encode()
    return hashlib.sha256(key).hexdigest()[:12]


def run_id(run_dir: Path) -> str:
    """The run directory's W&B run id: the recorded one, else a new one, recorded."""
    path = Path(run_dir) / ID_FILE
    if path.is_file() and (recorded := path.read_text().strip()):
        return recorded
    made = new_id(run_dir, time.time_ns())
    path.parent.mkdir(parents=True, exist_ok=True)
    files.write_text(path, made + "\n")
    return made


def has_api_key() -> bool:
    """Whether W&B could log in: ``WANDB_API_KEY`` or a netrc entry for its host."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlsplit(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).netloc
    path = Path(os.environ.get("NETRC") or "~/.netrc").expanduser()
    try:
        entry = netrc.netrc(path).authenticators(host)
    except (OSError, netrc.NetrcParseError):
        return False
    return bool(entry and entry[2])


def mode() -> str:
    """``WANDB_MODE`` when the user set it; otherwise online with an API key, else offline."""
    return os.environ.get("WANDB_MODE") or ("online" if has_api_key() else "offline")


class WandbLog:
    """One W&B run of a run directory: ``log`` scalars at a step, ``finish`` once."""

    def __init__(self, wandb, run_dir: Path, project: str, config: dict, say):
        run_dir = Path(run_dir)
        self.run = wandb.init(
            project=project, id=run_id(run_dir), name=run_dir.absolute().name,
            dir=str(run_dir), config=config, resume="allow", mode=mode(),
            reinit="create_new",  # never hand back another run still open in this process
        )
        if self.run.settings._offline:
            sync_dir = self.run.settings.sync_dir
            say(f"W&B offline: run files in {sync_dir}; upload with: wandb sync {sync_dir}")

    def log(self, scalars: dict[str, float], step: int) -> None:
        if scalars:
            self.run.log(scalars, step=step)

    def finish(self) -> None:
        """Close the run: finished, or failed when an exception is on its way out (``stop``
        runs in the loop's ``finally``), or preempted when a signal stopped it (it resumes)."""
        error = sys.exc_info()[1]
        if isinstance(error, Interrupted):
            self.run.mark_preempting()
        self.run.finish(exit_code=0 if error is None else 1)
