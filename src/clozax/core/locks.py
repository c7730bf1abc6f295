"""One writer per directory: the lock a whole ``clozax train`` (process 0 of a job), ``clozax
prepare`` or ``clozax finetune`` holds on its output.

The lock is a hidden sibling file, ``.NAME.lock`` beside the directory ``NAME`` (so it exists
before the directory does, and survives ``prepare``'s rename into place). It holds a JSON
record of its holder (host, pid, the process's start, the time it took the lock, the command),
so a second writer is refused in one line naming the holder, and the holder touches the file
every ``HEARTBEAT_SECONDS`` from a background thread.

Two mechanisms, because filesystems differ:

- **the soft lock, everywhere**: the file is written whole under a private name and put in
  place with ``link(2)``, which fails when a lock file is already there — atomic on local
  filesystems and on NFS, so of two writers that start together exactly one holds. A holder
  found dead is replaced by an atomic rename, by one taker at a time (``.NAME.lock.takeover``,
  created exclusively), after re-reading that the file is still the dead holder's. This is the
  idiom of ``filelock``'s ``SoftFileLock`` and of ``fasteners``; neither judges a holder dead
  (host, pid and start; a heartbeat on another host), which is the part a requeue needs, so
  the few lines are here;
- **the kernel's ``flock``** on the file, where the filesystem has it: the kernel releases it
  when its holder dies, however it dies, so on one host a lock is never stale, and a locked
  file is a live holder's by the kernel's word.

Is a holder dead? On this host: its pid no longer runs with the recorded start (or the host
rebooted). On another host: its heartbeat — the file's modification time, read against the
*filesystem's* clock (a file created beside it), never this host's — stops advancing for
``STALE_SECONDS``. A fresh remote holder is waited for, polling, and said so ("held by … on
HOST, last heartbeat N s ago"): a beat seen meanwhile means it lives (refused), none for
``STALE_SECONDS`` that it died (taken over, and said so) — a requeue after an OOM kill on
another node waits, then runs.

The file is deleted by its holder on release; a process holding a descriptor of a file no
longer at the lock's path starts again, so two writers never hold two files of one path. A
process leaving by ``os._exit`` (no ``finally`` runs) first calls ``release_held``.

A holder judged dead while it lives (its heartbeat stalled on a filesystem without ``flock``)
finds, at its next heartbeat or at ``check_held`` before a commit, that the file at the lock's
path is not its own: it stops writing in one line (``LockLost``; from the heartbeat, ``error:
…`` and exit 2 at once, as a kill would leave it: what it committed stays).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass
from pathlib import Path

from clozax.core.files import process_runs, process_start

HEARTBEAT_SECONDS = 10.0
# A record on another host whose heartbeat is older than this is a dead holder's (six missed
# beats: a loaded machine's thread is late by seconds, not by a minute).
STALE_SECONDS = 60.0
POLL_SECONDS = 1.0  # how often a wait for a remote holder looks again
_UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class Locked(ValueError):
    """Another live process holds the lock; the message names it."""


class LockLost(ValueError):
    """This process's lock was taken over by another (its heartbeat judged stale): it must
    write nothing more; the message names the taker."""


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
        return process_runs(self.pid, self.process_start)


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
    """The live holder of ``directory``'s lock, or None (free, or left by a dead holder). For
    readers, which write nothing: a remote heartbeat is aged on this host's clock here (the
    writer's decision, in ``hold``, uses the filesystem's)."""
    look = _look(lock_path(directory))
    if look is None or look[0] is None:
        return None
    holder, kernel_held, _ = look
    return holder if kernel_held or holder.alive() else None


@contextmanager
def hold(directory: Path, what: str, say: Callable[[str], None] | None = None,
         command: str | None = None,
         on_lost: Callable[[str], None] | None = None) -> Iterator[Holder]:
    """Hold ``directory``'s lock for the block; ``Locked`` (one line naming the holder) when a
    live process holds it. ``what`` names the directory in messages (e.g. "run runs/x");
    ``say`` hears a wait for a remote holder and a dead holder's lock taken over; ``on_lost``
    the heartbeat's finding that it was taken over (default: ``error: …`` and exit 2)."""
    path = lock_path(directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    me = Holder(host=socket.gethostname(), pid=os.getpid(),
                process_start=process_start(os.getpid()), boot=_boot_id(),
                since=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                command=command if command is not None else _command())
    fd, previous = _acquire(path, what, me, say or (lambda _: None))
    if previous is not None and say is not None:
        say(f"took over the lock of {what} from {previous.describe()}, which is no longer "
            "running")
    held = _Held(path, fd, what, me)
    with _REGISTRY:
        _HELD[path] = held
    beat = threading.Thread(target=_heartbeat, args=(held, on_lost or _leave), daemon=True,
                            name=f"clozax-lock-{path.name}")
    beat.start()
    try:
        yield me
    finally:
        held.stop.set()
        beat.join()
        held.release()


def check_held(directory: Path) -> None:
    """Before a commit into ``directory``: ``LockLost`` (one line naming the taker) when this
    process's lock on it was taken over; nothing when it still holds it (or holds none)."""
    with _REGISTRY:
        held = _HELD.get(lock_path(directory))
    lost = held.lost() if held is not None else None
    if lost is not None:
        raise LockLost(lost)


def release_held() -> None:
    """Release every lock this process holds, now: for a process about to leave by
    ``os._exit``, which runs no ``finally`` (so no record of it stays for the next writer)."""
    with _REGISTRY:
        held = list(_HELD.values())
    for h in held:
        h.stop.set()
        h.release()


class _Held:
    """A lock this process holds: its path, its descriptor, and the record it wrote."""

    def __init__(self, path: Path, fd: int, what: str, me: Holder):
        self.path, self.fd, self.what, self.me, self.open = path, fd, what, me, True
        self.stop, self._once = threading.Event(), threading.Lock()

    def lost(self) -> str | None:
        """None while the file at the lock's path is ours with our record; else the one-line
        message of its loss (naming who holds it now)."""
        try:
            here, ours = os.stat(self.path), os.fstat(self.fd)
        except FileNotFoundError:
            taker = "nobody: its lock file was deleted"
        except OSError:
            return None  # the filesystem did not answer: the next look decides
        else:
            record, me = _record(self.fd), self.me
            if (here.st_ino, here.st_dev) == (ours.st_ino, ours.st_dev) and record is not None \
                    and (record.pid, record.host, record.since) == (me.pid, me.host, me.since):
                return None
            look = _look(self.path)
            taker = look[0].describe() if look and look[0] else "another process"
        return (f"{self.what}: this process's lock was taken over by {taker} (its heartbeat "
                "was judged stale, on a filesystem without flock or a host that stalled); it "
                "stops here and writes nothing more: let one job at a time write it")

    def release(self) -> None:
        """Delete the lock file if it is still ours, and close it (once)."""
        with self._once:
            if not self.open:
                return
            self.open = False
            with _REGISTRY:
                if _HELD.get(self.path) is self:
                    del _HELD[self.path]
            with suppress(FileNotFoundError):  # ours: locked, so nobody holds it meanwhile
                if os.stat(self.path).st_ino == os.fstat(self.fd).st_ino:
                    self.path.unlink()
            os.close(self.fd)  # releases the kernel's lock


_HELD: dict[Path, _Held] = {}  # the locks this process holds, by lock file
_REGISTRY = threading.Lock()


def _acquire(path: Path, what: str, me: Holder, say) -> tuple[int, Holder | None]:
    """An open descriptor of the lock file now at ``path`` (``me``'s record; locked by the
    kernel where the filesystem can) and the dead holder it replaced, if any."""
    mine = path.with_name(f"{path.name}.{me.host}.{me.pid}")
    fd = os.open(mine, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _flock(fd, fcntl.LOCK_EX)  # nobody else knows this name yet
        os.pwrite(fd, json.dumps({k: v for k, v in asdict(me).items()
                                  if k != "heartbeat"}).encode(), 0)
        os.fsync(fd)
        previous, waited_for = None, None
        while True:
            try:
                os.link(mine, path)  # atomic: fails while a lock file is there
                mine.unlink()
                return fd, previous
            except FileExistsError:
                pass
            look = _look(path)
            if look is None:
                continue  # released between our link and our look: try again
            holder, kernel_held, inode = look
            now = _fs_now(path.parent)
            if kernel_held or (holder is not None and holder.host == me.host
                               and holder.alive(now)):
                raise Locked(_refusal(what, holder))
            if holder is None:  # a record cut short by a kill, or a writer's first instant
                if now - _mtime(path, now) < STALE_SECONDS:
                    time.sleep(0.05)
                    continue
            elif holder.alive(now):  # on another host, its heartbeat fresh
                if waited_for is not None and holder.heartbeat > waited_for:
                    raise Locked(_refusal(what, holder))  # it beat meanwhile: it lives
                if waited_for is None:
                    say(f"{what}: held by {holder.describe()}, last heartbeat "
                        f"{now - holder.heartbeat:.0f} s ago; waiting until that is "
                        f"{STALE_SECONDS:.0f} s (a live holder beats every "
                        f"{HEARTBEAT_SECONDS:.0f} s)")
                    waited_for = holder.heartbeat
                time.sleep(min(POLL_SECONDS, max(0.01, STALE_SECONDS - (now - holder.heartbeat))))
                continue
            if _take_over(path, mine, holder, inode):
                return fd, holder
            time.sleep(0.05)  # another taker was first: its record now decides
    except BaseException:
        os.close(fd)
        mine.unlink(missing_ok=True)
        raise


def _take_over(path: Path, mine: Path, dead: Holder | None, inode: int) -> bool:
    """Replace the dead holder's file with ours, one taker at a time; False when another
    taker holds the take-over, or the file changed meanwhile."""
    mutex = path.with_name(f"{path.name}.takeover")
    try:
        os.close(os.open(mutex, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    except FileExistsError:
        now = _fs_now(path.parent)
        if now - _mtime(mutex, now) > STALE_SECONDS:  # its taker died while taking over
            mutex.unlink(missing_ok=True)
        return False
    try:
        look = _look(path)
        if look is None or look[2] != inode or look[0] != dead or look[1]:
            return False
        os.replace(mine, path)
        return True
    finally:
        mutex.unlink(missing_ok=True)


def _look(path: Path) -> tuple[Holder | None, bool, int] | None:
    """(the record at ``path``, whether a process holds the kernel's lock on it, its inode),
    or None when there is no file."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        held = False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)
        except BlockingIOError:
            held = True
        except OSError:
            pass  # flock does not reach this filesystem: the record decides
        return _record(fd), held, os.fstat(fd).st_ino
    finally:
        os.close(fd)


def _flock(fd: int, operation: int) -> bool:
    """Take the kernel's lock where the filesystem has one; False where it does not."""
    try:
        fcntl.flock(fd, operation | fcntl.LOCK_NB)
        return True
    except OSError as e:
        if e.errno in _UNSUPPORTED:
            return False
        raise


def _fs_now(directory: Path) -> float:
    """The filesystem's clock: the modification time of a file created in ``directory`` now
    (on a shared filesystem, its server's), so heartbeats are aged on one clock."""
    try:
        fd, name = tempfile.mkstemp(prefix=".clozax-clock-", dir=directory)
    except OSError:
        return time.time()
    try:
        return os.fstat(fd).st_mtime
    finally:
        os.close(fd)
        os.unlink(name)


def _mtime(path: Path, default: float) -> float:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return default


def _refusal(what: str, holder: Holder | None) -> str:
    who = holder.describe() if holder is not None else "another process"
    return (f"{what} is being written by {who}; wait for it to finish or stop it (its lock "
            "is released when it exits)")


def _heartbeat(held: _Held, on_lost: Callable[[str], None]) -> None:
    while not held.stop.wait(HEARTBEAT_SECONDS):
        lost = held.lost()
        if lost is not None:
            if not held.stop.is_set():  # not released meanwhile
                on_lost(lost)
            return
        try:
            os.utime(held.fd)
        except OSError:
            return  # the filesystem refuses: the kernel's lock still holds


def _leave(message: str) -> None:
    """A holder whose lock was taken over: one line, and out at once (as a kill leaves it)."""
    sys.stdout.flush()
    print(f"error: {message}", file=sys.stderr, flush=True)
    os._exit(2)


def _command() -> str:
    argv = [Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "python", *sys.argv[1:]]
    return " ".join(argv)[:300]


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""
