"""One writer per directory: the lock a whole ``clozax train`` (process 0 of a job) or ``clozax
prepare`` holds on its output.

The lock is a hidden sibling file, ``.NAME.lock`` beside the directory ``NAME`` (so it exists
before the directory does, and survives ``prepare``'s rename into place), locked with the
kernel's ``flock`` — the standard library's ``fcntl`` — which the kernel releases when its
holder dies, however it dies: on one host a lock is never stale. The file holds a JSON record
of its holder (host, pid, the process's start, the time it took the lock, the command), so a
second writer is refused in one line naming the holder, and the holder touches the file every
``HEARTBEAT_SECONDS`` from a background thread.

Shared filesystems: ``flock`` reaches other hosts on NFS (through its lock manager) and on most
parallel filesystems, but not on every mount. So a lock is taken only when ``flock`` succeeds
(or is not supported) *and* the record left in the file does not name a live holder: a holder
on this host is alive when its pid runs with the recorded start time; a holder on another host
is alive while its heartbeat is younger than ``STALE_SECONDS``. A holder found dead is taken
over, and said so.

The file is deleted by its holder on release, while still locked; a process that locks a file
which is no longer at the lock's path (deleted meanwhile) starts again, so two writers can
never hold two different files of one path.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

HEARTBEAT_SECONDS = 10.0
# A record on another host whose heartbeat is older than this is a dead holder's (six missed
# beats: a loaded machine's thread is late by seconds, not by a minute).
STALE_SECONDS = 60.0
_UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class Locked(ValueError):
    """Another live process holds the lock; the message names it."""


@dataclass(frozen=True)
class Holder:
    """Who holds (or held) a lock."""

    host: str
    pid: int
    process_start: str  # the process's start in kernel ticks since boot ("" where unknown)
    boot: str  # this host's boot id: a pid of an earlier boot is nobody
    since: str  # when the lock was taken (local time, ISO 8601)
    command: str
    heartbeat: float = 0.0  # the lock file's modification time (seconds since the epoch)

    def describe(self) -> str:
        return f'"{self.command}" (pid {self.pid} on {self.host}, since {self.since})'

    def alive(self, now: float | None = None) -> bool:
        """Whether this holder may still be writing (see the module docstring)."""
        if self.host != socket.gethostname():
            return (now or time.time()) - self.heartbeat < STALE_SECONDS
        if self.boot and self.boot != _boot_id():
            return False
        return _process_start(self.pid) == self.process_start if self.process_start else \
            _pid_runs(self.pid)


def lock_path(directory: Path) -> Path:
    """The lock file of ``directory``: ``.NAME.lock`` beside it."""
    directory = Path(directory).absolute()
    return directory.parent / f".{directory.name}.lock"


def read_holder(directory: Path) -> Holder | None:
    """The holder recorded in ``directory``'s lock file, or None when there is none (the lock
    is free, or its record is unreadable)."""
    try:
        fd = os.open(lock_path(directory), os.O_RDONLY)
    except OSError:
        return None
    try:
        return _record(fd)
    finally:
        os.close(fd)


def _record(fd: int) -> Holder | None:
    """The holder recorded in the open lock file ``fd`` (None: empty, or cut short by a kill,
    so its holder is gone)."""
    try:
        raw = os.pread(fd, 1 << 16, 0)
        record = json.loads(raw) if raw.strip() else None
        return Holder(**{**record, "heartbeat": os.fstat(fd).st_mtime}) \
            if isinstance(record, dict) else None
    except (OSError, ValueError, TypeError):
        return None


def current_holder(directory: Path) -> Holder | None:
    """The live holder of ``directory``'s lock, or None (free, or left by a dead holder)."""
    try:
        fd = os.open(lock_path(directory), os.O_RDONLY)
    except OSError:
        return None
    try:
        holder = _record(fd)
        if holder is None:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return holder  # locked, by the kernel's word
        except OSError:
            pass  # flock unsupported here: the record decides
        else:
            fcntl.flock(fd, fcntl.LOCK_UN)
        return holder if holder.alive() else None
    finally:
        os.close(fd)


@contextmanager
def hold(directory: Path, what: str, say: Callable[[str], None] | None = None,
         command: str | None = None) -> Iterator[Holder]:
    """Hold ``directory``'s lock for the block; ``Locked`` (one line naming the holder) when a
    live process holds it. ``what`` names the directory in messages (e.g. "run runs/x");
    ``say`` hears that a dead holder's lock was taken over."""
    path = lock_path(directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, previous = _acquire(path, what)
    me = Holder(host=socket.gethostname(), pid=os.getpid(),
                process_start=_process_start(os.getpid()), boot=_boot_id(),
                since=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                command=command if command is not None else _command())
    record = {k: v for k, v in asdict(me).items() if k != "heartbeat"}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(record).encode(), 0)
    os.fsync(fd)
    if previous is not None and say is not None:
        say(f"took over the lock of {what} from {previous.describe()}, which is no longer "
            "running")
    stop = threading.Event()
    beat = threading.Thread(target=_heartbeat, args=(fd, stop), daemon=True,
                            name=f"clozax-lock-{path.name}")
    beat.start()
    try:
        yield me
    finally:
        stop.set()
        beat.join()
        try:
            path.unlink()  # still locked: nobody can hold this file meanwhile
        except FileNotFoundError:
            pass
        os.close(fd)  # releases the kernel's lock


def _acquire(path: Path, what: str) -> tuple[int, Holder | None]:
    """An open, locked descriptor of ``path`` and the dead holder it replaces (if any)."""
    attempts = 0
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _record(fd)
            os.close(fd)
            attempts += 1
            if (holder is None or not holder.alive()) and attempts < 40:
                # a new holder between its lock and its record, or a reader's brief look
                time.sleep(0.05)
                continue
            raise Locked(_refusal(what, holder)) from None
        except OSError as e:
            if e.errno not in _UNSUPPORTED:
                os.close(fd)
                raise
            # flock does not reach this filesystem: the record alone decides
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if not same:  # released and deleted between our open and our lock: try again
            os.close(fd)
            continue
        previous = _record(fd)
        # Alive by the record although we hold the kernel's lock: on another host whose
        # filesystem does not share flock, or on this one where flock is not supported.
        if previous is not None and previous.pid != os.getpid() and previous.alive():
            os.close(fd)
            raise Locked(_refusal(what, previous))
        return fd, previous


def _refusal(what: str, holder: Holder | None) -> str:
    who = holder.describe() if holder is not None else "another process"
    return (f"{what} is being written by {who}; wait for it to finish or stop it (its lock "
            "is released when it exits)")


def _heartbeat(fd: int, stop: threading.Event) -> None:
    while not stop.wait(HEARTBEAT_SECONDS):
        try:
            os.utime(fd)
        except OSError:
            return  # the file is gone or the filesystem refuses: the kernel's lock still holds


def _command() -> str:
    argv = [Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "python", *sys.argv[1:]]
    return " ".join(argv)[:300]


def _pid_runs(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    return True


def _process_start(pid: int) -> str:
    """The start of process ``pid`` in kernel ticks since boot ("" off Linux or when it does
    not run): with the pid, it names one process, never a later one given the same pid."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""
