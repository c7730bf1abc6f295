"""Output directories that appear whole or not at all.

Writers fill a hidden temporary sibling (``.NAME.partial-PID``) and rename it into place when
done; on any failure (an exception, Ctrl-C) the temporary directory is removed, and an existing
``out`` is kept until the new one is complete. A SIGKILL leaves only the hidden partial, which
``remove_stale_partials`` clears once its process is gone.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def staged_dir(out: Path) -> Iterator[Path]:
    """Yield an empty temporary sibling of ``out``; publish it as ``out`` if the block succeeds."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def remove_stale_partials(out: Path) -> None:
    """Delete temporary directories left by killed writers (their process no longer exists)."""
    for stale in out.parent.glob(f".{out.name}.partial-*"):
        try:
            os.kill(int(stale.name.rsplit("-", 1)[1]), 0)
        except ProcessLookupError:
            shutil.rmtree(stale, ignore_errors=True)
        except (ValueError, PermissionError):
            pass  # not ours to judge: a foreign name, or another user's live process


def _publish(tmp: Path, out: Path) -> None:
    """Rename into place; an old directory is kept until the new one is complete."""
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        out.rename(old)
    tmp.rename(out)
    if old is not None:
        shutil.rmtree(old)
