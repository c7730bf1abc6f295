"""Files and directories that appear whole or not at all.

``write_text`` / ``write_json`` write a temporary sibling and rename it over the target, so a
reader never sees half a file (used for every file a later step reads). ``staged_dir`` fills
a hidden temporary sibling directory (``.NAME.partial-PID``) and renames it into place when
done; on any failure (an exception, Ctrl-C) the temporary directory is removed, and an
existing ``out`` is kept until the new one is complete. A SIGKILL leaves only the hidden
partial, which ``remove_stale_partials`` clears once its process is gone. A resumable writer
(``clozax prepare``) names its partial ``.NAME.partial-rKEY`` instead, owns it through a
``lock`` file (``claim_dir``) and publishes it with ``publish_dir``; a killed run's partial is
kept for the next run with the same key.
"""

from __future__ import annotations

import hashlib
import json
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
        publish_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def remove_stale_partials(out: Path, keep: Path | None = None) -> None:
    """Delete temporary directories left by killed writers (their process no longer exists):
    ``.NAME.partial-PID``, or a resumable ``.NAME.partial-rKEY`` whose ``lock`` names the
    writer's pid. ``keep`` (the partial a caller is about to resume) is left alone."""
    for stale in out.parent.glob(f".{out.name}.partial-*"):
        if keep is not None and stale == keep:
            continue
        suffix = stale.name.rsplit("-", 1)[1]
        lock = read_json(stale / "lock") if suffix.startswith("r") else None
        if suffix.startswith("r") and lock is None:  # finished and killed before its rename
            shutil.rmtree(stale, ignore_errors=True)
            continue
        try:
            os.kill(int(lock["pid"] if isinstance(lock, dict) else suffix), 0)
        except ProcessLookupError:
            shutil.rmtree(stale, ignore_errors=True)
        except (ValueError, KeyError, TypeError, PermissionError):
            pass  # not ours to judge: a foreign name, or another user's live process


def publish_dir(tmp: Path, out: Path) -> None:
    """Rename into place; an old directory is kept until the new one is complete."""
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        out.rename(old)
    tmp.rename(out)
    if old is not None:
        shutil.rmtree(old)


def claim_dir(directory: Path, who: str) -> None:
    """Own ``directory`` (new, or left by a killed writer, whose work may be resumed) through
    its ``lock`` file; ``ValueError`` naming ``who`` when a live process holds it."""
    directory.mkdir(parents=True, exist_ok=True)
    lock = read_json(directory / "lock")
    if lock is not None and lock.get("pid") != os.getpid():
        try:
            os.kill(int(lock["pid"]), 0)
        except ProcessLookupError:
            pass  # its writer was killed
        else:
            raise ValueError(f"{who} (pid {lock['pid']}) is writing {directory}; wait for it "
                             "to finish")
    write_json(directory / "lock", {"pid": os.getpid()})


def read_json(path: Path):
    """The JSON value at ``path``, or None when the file is missing or not valid JSON (a file
    cut short by a kill reads as missing)."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None


def write_bytes(path: Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (temporary sibling, then rename)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_bytes(data)
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def write_text(path: Path, text: str) -> Path:
    """Write UTF-8 ``text`` to ``path`` atomically."""
    return write_bytes(path, text.encode("utf-8"))


def write_json(path: Path, data, *, sort_keys: bool = False) -> Path:
    """Write ``data`` as indented, strict JSON (no NaN or Infinity: ``ValueError``; non-ASCII
    kept as is) to ``path`` atomically."""
    return write_text(path, json.dumps(data, indent=2, sort_keys=sort_keys, ensure_ascii=False,
                                       allow_nan=False) + "\n")


def write_jsonl(path: Path, records) -> Path:
    """Write one JSON object per line to ``path`` atomically."""
    return write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
