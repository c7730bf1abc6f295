"""Files and directories that appear whole or not at all.

``write_text`` / ``write_json`` write a temporary sibling and rename it over the target, so a
reader never sees half a file (used for every file a later step reads). ``staged_dir`` fills
a hidden temporary sibling directory (``.NAME.partial-s.HOST.PID.START``) and renames it into
place when done; on any failure (an exception, Ctrl-C) the temporary directory is removed, and an
existing ``out`` is kept until the new one is complete. A SIGKILL leaves only the hidden
partial, which the next ``staged_dir`` of the same ``out`` on that host clears once its
process is gone.
(``clozax prepare`` keeps a resumable partial of its own: ``data/partial.py``.)
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def staged_dir(out: Path) -> Iterator[Path]:
    """Yield an empty temporary sibling of ``out``; publish it as ``out`` if the block succeeds."""
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(out)
    host, pid, start = process_identity()
    tmp = out.parent / f".{out.name}.partial-s.{host}.{pid}.{start}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        publish_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def remove_stale_partials(out: Path) -> None:
    """Delete ``staged_dir`` partials of ``out`` whose writer no longer runs: judged as a lock
    holder is, by (host, pid, process start) — a partial of another host is never judged from
    here (its pid means nothing here), and a later process given the same pid is not its
    writer."""
    for stale in out.parent.glob(f".{out.name}.partial-s.*"):
        try:
            host, pid, start = stale.name[len(f".{out.name}.partial-s."):].rsplit(".", 2)
        except ValueError:
            continue
        if host == socket.gethostname() and pid.isdigit() and \
                not process_runs(int(pid), start):
            shutil.rmtree(stale, ignore_errors=True)


def publish_dir(tmp: Path, out: Path) -> None:
    """Rename into place; an old directory is kept until the new one is complete."""
    _sync_tree(tmp)  # a host crash after the rename finds the files whole
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        out.rename(old)
    tmp.rename(out)
    sync_dir(out.parent)
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
    """Write ``data`` to ``path`` atomically (temporary sibling, then rename) and durably:
    the file's bytes are synced before the rename and the directory's entry after it, so a
    host crash (power loss, a kernel panic) leaves the old file or the new one, never an
    empty or torn one. A process kill needs only the rename.

    A file that already holds exactly ``data`` is left alone (not rewritten, its modification
    time kept): whatever watches a run's or a job's directory sees a change only where there
    is one."""
    path = Path(path)
    if _holds(path, data):
        return path
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with tmp.open("wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path)
        sync_dir(path.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def _holds(path: Path, data: bytes) -> bool:
    """Whether ``path`` is a file of exactly ``data`` (its size checked first)."""
    try:
        if path.stat().st_size != len(data):
            return False
        return path.read_bytes() == data
    except OSError:
        return False


def sync_dir(directory: Path) -> None:
    """Make a rename or a new entry in ``directory`` durable (where the filesystem can)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # a filesystem that cannot sync a directory: the rename is still atomic
    finally:
        os.close(fd)


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


def identity(path: Path) -> tuple[str, tuple[int, ...]]:
    """``(str(path), (device, inode, size, modification ns))``: a cache key that changes when
    a file is written again at the same path (atomically: a new inode; in place: its size or
    modification time)."""
    st = os.stat(path)
    return str(path), (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def process_identity() -> tuple[str, int, str]:
    """(host, pid, start in kernel ticks since boot): one process, never a later one given
    the same pid."""
    return socket.gethostname(), os.getpid(), process_start(os.getpid())


def process_runs(pid: int, start: str) -> bool:
    """Whether process ``pid`` of this host runs and is the one that started at ``start``."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    return not start or process_start(pid) in ("", start)


def process_start(pid: int) -> str:
    """The start of process ``pid`` in kernel ticks since boot ("" off Linux or when it does
    not run): with the pid, it names one process, never a later one given the same pid."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def _sync_tree(root: Path) -> None:
    """Sync every file and directory under ``root`` before it is published by a rename."""
    for directory, _, names in os.walk(root):
        for name in names:
            try:
                fd = os.open(os.path.join(directory, name), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        sync_dir(Path(directory))


def json_objects(path: Path):
    """``(line number, object)`` of each non-blank line of a JSON-lines file; a line that is
    not a JSON object is a ``ValueError`` naming ``path:line`` and the fix."""
    with Path(path).open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n} is not valid JSON ({e.msg}); write one JSON "
                                 "object per line") from None
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{n} is not a JSON object; write one object per "
                                 "line")
            yield n, record
