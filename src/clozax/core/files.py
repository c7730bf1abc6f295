"""Files and directories that appear whole or not at all.

``write_text`` / ``write_json`` write a temporary sibling and rename it over the target, so a
reader never sees half a file (used for every file a later step reads). ``staged_dir`` fills
a hidden temporary sibling directory (``.NAME.partial-PID``) and renames it into place when
done; on any failure (an exception, Ctrl-C) the temporary directory is removed, and an
existing ``out`` is kept until the new one is complete. A SIGKILL leaves only the hidden
partial, which the next ``staged_dir`` of the same ``out`` clears once its process is gone.
(``clozax prepare`` keeps a resumable partial of its own: ``data/partial.py``.)
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
    remove_stale_partials(out)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        publish_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def remove_stale_partials(out: Path) -> None:
    """Delete ``.NAME.partial-PID`` directories of ``out`` whose writer no longer runs."""
    for stale in out.parent.glob(f".{out.name}.partial-*"):
        suffix = stale.name.rsplit("-", 1)[1]
        if not suffix.isdigit():
            continue  # not a staged_dir's (prepare's resumable partials are kept)
        try:
            os.kill(int(suffix), 0)
        except ProcessLookupError:
            shutil.rmtree(stale, ignore_errors=True)
        except PermissionError:
            pass  # another user's live process


def publish_dir(tmp: Path, out: Path) -> None:
    """Rename into place; an old directory is kept until the new one is complete."""
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        out.rename(old)
    tmp.rename(out)
    if old is not None:
        shutil.rmtree(old)


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
