"""Training checkpoints with orbax: params, optimiser state and step; never pickle.

A step holds three items: ``params`` and ``opt_state`` (orbax's standard arrays, restorable
separately, so commands that only read a model restore only the parameters) and ``meta`` (JSON:
the step, the config). Saves are asynchronous: ``save`` returns once the arrays are copied off
the device and orbax writes them in the background while training goes on; the next ``save``,
``wait`` or ``close`` waits for it. Each save is committed atomically by orbax (written to a
temporary directory, renamed when complete); older checkpoints are removed only after the new
one is committed, keeping the last ``keep``.

Crash consistency: a step is restorable as soon as orbax has committed it. Orbax does not
notice damaged bytes (a flipped byte in an array file restores as a different number,
silently), so a background waiter records the sha256 of every file of a step in
``RUN/checkpoint_digests/STEP.json`` the moment its commit lands. A committed step is then
*verified* (its files match), *damaged* (they do not: skipped, and set aside by training) or
*unverified* (killed between the commit and its digest): restored, then digested by the
trainer — never refused for a missing digest.

Readers (``evaluate``, ``fill``, ``probe``, ``audit``, ``report``, ``export``) open checkpoints
with ``read_only``: no temporary-directory cleanup, no digest writes, nothing set aside; a step
removed by a live trainer while a reader restores it makes the reader take the newest one.

Any failure of a save (disk full, I/O error, orbax's own errors) becomes one ``CheckpointError``
line naming the directory, the cause and its free space; orbax's temporary directory is removed
and the previous checkpoint stays loadable. Nothing else is printed: orbax writes a step's
arrays as asyncio tasks over tensorstore futures, and when one write fails its event loop closes
while the others are still in flight. Each of those then reports into the closed loop
(``RuntimeError: Event loop is closed``, through ``sys.unraisablehook``) and asyncio logs every
failed task or future nobody awaited ("... exception was never retrieved"): dozens of
tracebacks, some after the process began to exit, echoes of the one failure already reported.
``_silence_failed_save_echoes`` (from the first save on: the echoes start in the background,
before the failure reaches the main thread) drops exactly those two kinds — they arise only from
a loop closed over unfinished writes, that is from a failed save; any other unraisable exception
or asyncio error still prints.
"""

from __future__ import annotations

import errno
import logging
import shutil
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from clozax.core import files, locks
from clozax.train import distributed
from clozax.train.layout import CHECKPOINT_DIR, DIGEST_DIR

# orbax logs every save through absl, and a failing background write as a traceback: the one
# CheckpointError line is what the user sees.
logging.getLogger("absl").setLevel(logging.CRITICAL)

_TMP_MARK = ".orbax-checkpoint-tmp"
OPT_STATE = "opt_state"  # the item a parameters-only restore leaves unread
UNVERIFIED = "unverified"  # committed, no digest recorded yet


class CheckpointError(ValueError):
    """A checkpoint could not be saved or restored; the message names the fix."""


class Checkpointer:
    """Every process of a job saves and restores (orbax writes each process's shards and
    commits once); only the primary process (``primary``) of a writer records digests, removes
    temporaries and sets damaged steps aside. ``read_only`` (every command that only reads a
    run) writes nothing at all."""

    def __init__(self, run_dir: Path, keep: int = 3, primary: bool = True,
                 read_only: bool = False):
        self.run_dir = Path(run_dir).absolute()
        self.directory = self.run_dir / CHECKPOINT_DIR
        self.digests = Path(run_dir).absolute() / DIGEST_DIR
        self.read_only = read_only
        self.writes = primary and not read_only
        if self.writes:
            self._remove_temporaries()  # left by a process killed while saving
        self.manager = None
        if not read_only or self.directory.is_dir():
            options = ocp.CheckpointManagerOptions(
                max_to_keep=None if read_only else keep, create=not read_only,
                enable_async_checkpointing=not read_only, read_only=read_only,
                # The temporary directory exists once ``save`` returns, so a failed save's
                # cleanup finds it (created in the background, it could appear after).
                async_options=ocp.AsyncOptions(create_directories_asynchronously=False))
            self.manager = _beside_a_trainer(
                lambda: ocp.CheckpointManager(self.directory, options=options))
        self._pending: int | None = None  # a save still being written
        self._waiter: threading.Thread | None = None  # records its digest once committed
        self._waiter_error: BaseException | None = None
        self._failed = False  # a save failed (and was reported)

    def latest_step(self) -> int | None:
        return self.manager.latest_step() if self.manager is not None else None

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps()) if self.manager is not None else []

    def save(self, step: int, state, meta: dict) -> None:
        """Start saving ``state`` (a ``TrainState``) as step ``step``; returns once the arrays
        are off the device. The previous save is finished first; a holder whose lock was
        taken over stops here (``LockLost``, one line), before writing beside the new one."""
        assert not self.read_only, "a read-only checkpointer never saves"
        self.wait()
        locks.check_held(self.run_dir)
        _silence_failed_save_echoes()  # a write failing in the background echoes at once
        try:
            self.manager.save(
                step,
                args=ocp.args.Composite(
                    params=ocp.args.StandardSave(state.params),
                    opt_state=ocp.args.StandardSave(state.opt_state),
                    meta=ocp.args.JsonSave({**meta, "step": step}),
                ),
                force=True,
            )
        except Exception as e:  # orbax raises OSError, ValueError("RESOURCE_EXHAUSTED..."), ...
            raise self._save_error(step, e) from None
        self._pending = step
        self._waiter_error = None
        self._waiter = threading.Thread(target=self._commit_then_digest, args=(step,),
                                        name=f"clozax-digest-{step}", daemon=True)
        self._waiter.start()

    def saving(self) -> bool:
        """Whether a save has been started and not yet committed and digested."""
        return self._waiter is not None and self._waiter.is_alive()

    def wait(self) -> None:
        """Finish the save in flight (if any), its digest included; a failure of the
        background write surfaces here as ``CheckpointError``."""
        if self._pending is None:
            return
        step, self._pending = self._pending, None
        self._waiter.join()
        if self._waiter_error is not None:
            raise self._save_error(step, self._waiter_error) from None

    def _commit_then_digest(self, step: int) -> None:
        try:
            self.manager.wait_until_finished()
            self._record_digest(step)
        except BaseException as e:  # noqa: BLE001  (reported by ``wait`` on the main thread)
            self._waiter_error = e

    def _save_error(self, step: int, e: BaseException) -> CheckpointError:
        self._failed = True
        try:  # let orbax's background work on the failed step stop before cleaning up after it
            self.manager.wait_until_finished()
        except Exception:  # noqa: BLE001  (the error being reported is ``e``)
            pass
        self._remove_temporaries()
        intact = [s for s in self.all_steps() if s != step and self.damage(s) is None]
        kept = f"step {intact[-1]}" if intact else "none yet"
        free = shutil.disk_usage(self.directory).free / 2**20
        reason = describe_error(e)
        full = _is_disk_full(e)
        fix = ("free disk space and run the same command again to resume" if full else
               "fix the cause and run the same command again to resume")
        return CheckpointError(
            f"could not save the checkpoint at step {step} in {self.directory} ({reason}; "
            f"{free:,.0f} MiB free there); the last good checkpoint ({kept}) is intact: {fix}")

    def damage(self, step: int, params_only: bool = False) -> str | None:
        """Why step ``step`` is damaged: its files differ from their recorded digest. None when
        it is intact or unverified (no digest yet: see ``verified``). ``params_only`` (a
        reader): only the files a parameters-only restore reads are hashed and compared, so
        damaged optimizer state never keeps intact parameters from being evaluated."""
        record = files.read_json(self.digests / f"{step}.json")
        if record is None:
            return None
        step_dir = self.directory / str(step)
        skip = (f"{OPT_STATE}/",) if params_only else ()
        try:
            found = _file_digests(step_dir, skip)
        except FileNotFoundError:
            found = None
        if found is None or not step_dir.is_dir():
            raise Vanished(step)
        record = {k: v for k, v in record.items() if not k.startswith(skip)} if skip else record
        changed = sorted(set(found.items()) ^ set(record.items()))
        if changed:
            return f"{len({name for name, _ in changed})} file(s) differ from their digest, " \
                   f"e.g. {changed[0][0]}"
        return None

    def verified(self, step: int) -> bool:
        """Whether a digest of step ``step`` was recorded (its bytes can be checked)."""
        return (self.digests / f"{step}.json").is_file()

    def restore(self, step: int, abstract_state, params_only: bool = False,
                checked: bool = False):
        """Restore step ``step`` (committed, not damaged) onto the shardings/dtypes of
        ``abstract_state`` (a ``TrainState`` of ShapeDtypeStructs). Returns ``(state, meta)``;
        with ``params_only`` the optimizer state is not read (``state.opt_state`` is None).
        ``checked``: the caller has just compared its digest (each file is hashed once). An
        unverified step is digested after it is restored (by a writer)."""
        damage = None if checked else self.damage(step, params_only)
        if damage is not None:
            raise CheckpointError(f"checkpoint at step {step} in {self.directory} is damaged "
                                  f"({damage}); restore an earlier step")
        unverified = not self.verified(step)
        items = {"params": ocp.args.StandardRestore(abstract_state.params),
                 "meta": ocp.args.JsonRestore()}
        if not params_only:
            items[OPT_STATE] = ocp.args.StandardRestore(abstract_state.opt_state)
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(**items))
        except Exception as e:  # orbax raises bare Exception, ValueError, KeyError, OSError
            if not (self.directory / str(step)).is_dir():
                raise Vanished(step) from None
            raise Unrestorable(step, self.directory, describe_error(e)[:200]) from None
        if unverified and self.writes:
            self._record_digest(step)  # its bytes as restored, checked from now on
        counter = jnp.asarray(step, jnp.int32)
        if getattr(abstract_state.step, "sharding", None) is not None:
            counter = jax.device_put(counter, abstract_state.step.sharding)
        state = type(abstract_state)(counter, restored["params"],
                                     None if params_only else restored["opt_state"])
        return state, restored["meta"]

    def restore_latest(self, abstract_state, say: Callable[[str], None] = print,
                       set_aside: bool = False, params_only: bool = False):
        """``(state, meta, step)`` of the newest committed step that is not damaged, or None
        when there is no checkpoint; each damaged newer step is skipped with one line to
        ``say``. With ``set_aside`` (training, which will save those steps again) a damaged
        step is moved to ``RUN/checkpoints_damaged/`` rather than deleted. A step a live
        trainer removes meanwhile (a reader's race) is passed over for the newest one."""
        stale = False
        for _ in range(20):  # each retry follows a step deleted by a concurrent trainer
            try:
                if stale:
                    self.manager.reload()  # orbax may raise FileNotFoundError here too
                return self._restore_newest(abstract_state, say, set_aside, params_only)
            except (Vanished, FileNotFoundError):
                stale = True
        raise CheckpointError(f"the checkpoints in {self.directory} kept disappearing while "
                              "being read; retry once the run has finished")

    def _restore_newest(self, abstract_state, say, set_aside: bool, params_only: bool):
        steps = self.all_steps()
        for step in reversed(steps):
            damage = self.damage(step, params_only)
            if damage is None:
                try:
                    state, meta = self.restore(step, abstract_state, params_only, checked=True)
                    return state, meta, step
                except Unrestorable as e:  # bytes orbax itself cannot read (a truncated file)
                    damage = f"orbax could not read it: {e.reason}"
            older = [s for s in steps if s < step]
            if not older:
                raise CheckpointError(
                    f"checkpoint at step {step} in {self.directory} is damaged ({damage}) and "
                    "no earlier checkpoint is left: start a new run (choose a new --out)")
            where = ""
            if set_aside:
                where = f", set aside in {self._set_aside(step)}"
                distributed.barrier(f"clozax-set-aside-{step}")  # the move is seen by all
                self.manager.reload()
            say(f"checkpoint at step {step} is damaged ({damage}{where}); falling back to "
                f"step {older[-1]}")
        return None

    def close(self) -> None:
        """Finish any save in flight (raising its failure) and release orbax."""
        if self.manager is None:
            return
        try:
            self.wait()
        finally:
            try:
                self.manager.close()  # waits for orbax's background threads
            except Exception:
                if not self._failed:  # after a reported failure, its echoes are not news
                    raise
            self._remove_temporaries()  # a failed step's, written after the failure surfaced

    def _record_digest(self, step: int) -> None:
        if not self.writes:
            return
        self.digests.mkdir(parents=True, exist_ok=True)
        files.write_json(self.digests / f"{step}.json",
                         _file_digests(self.directory / str(step)), sort_keys=True)
        kept = {str(s) for s in self.manager.all_steps()}
        for stale in self.digests.glob("*.json"):
            if stale.stem not in kept:
                stale.unlink(missing_ok=True)

    def _set_aside(self, step: int) -> Path:
        aside = self.directory.parent / f"{CHECKPOINT_DIR}_damaged"
        dest = aside / f"{step}-{time.strftime('%Y%m%d-%H%M%S')}"
        if self.writes:
            aside.mkdir(exist_ok=True)
            (self.directory / str(step)).rename(dest)
            (self.digests / f"{step}.json").unlink(missing_ok=True)
        return dest

    def _remove_temporaries(self) -> None:
        if self.writes and self.directory.is_dir():
            for tmp in self.directory.glob(f"*{_TMP_MARK}*"):
                shutil.rmtree(tmp, ignore_errors=True)


_echoes_silenced = False


def _silence_failed_save_echoes() -> None:
    """From now on in this process, drop the echoes of a failed orbax save (the module's
    docstring), which surface in orbax's and tensorstore's threads, not as exceptions we
    catch: an unraisable ``RuntimeError("Event loop is closed")`` and asyncio's "Task (or
    Future) exception was never retrieved" for orbax's writes. Installed once; every other
    unraisable exception and log record goes where it went."""
    global _echoes_silenced
    if _echoes_silenced:
        return
    _echoes_silenced = True
    previous = sys.unraisablehook

    def unraisable(u):
        if isinstance(u.exc_value, RuntimeError) and str(u.exc_value) == "Event loop is closed":
            return
        previous(u)

    def from_orbax(record: logging.LogRecord) -> bool:  # False: drop it
        message = record.getMessage()
        return not ("exception was never retrieved" in message.split("\n", 1)[0]
                    and "orbax" in message)  # a Task's or a Future's

    sys.unraisablehook = unraisable
    logging.getLogger("asyncio").addFilter(from_orbax)


def _beside_a_trainer(read: Callable, tries: int = 20):
    """``read()`` (orbax opening a manager: it lists the steps, then reads each one's
    metadata), again when a live trainer's ``keep`` removed a step between the two (orbax's
    FileNotFoundError). ``restore_latest`` retries its own reloads the same way."""
    for _ in range(tries - 1):
        try:
            return read()
        except FileNotFoundError:
            time.sleep(0.05)
    return read()


class Unrestorable(CheckpointError):
    """Orbax could not restore a step (unreadable bytes, or another model's config)."""

    def __init__(self, step: int, directory: Path, reason: str):
        self.reason = reason
        super().__init__(f"checkpoint at step {step} in {directory} could not be restored "
                         f"({reason}); it may be from a different model config")


class Vanished(CheckpointError):
    """A step was removed (by a live trainer's ``keep``) while it was being restored."""

    def __init__(self, step: int):
        super().__init__(f"checkpoint at step {step} was removed while being read")


def describe_error(e: BaseException) -> str:
    """One line naming what went wrong: the OS's own words for an ``OSError`` (with its
    errno's name), else the exception's first line."""
    if isinstance(e, OSError) and e.strerror:
        name = errno.errorcode.get(e.errno, "")
        return f"{e.strerror}{f' ({name})' if name else ''}"
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:160]


def _is_disk_full(e: BaseException) -> bool:
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return "no space left" in str(e).lower() or "quota exceeded" in str(e).lower()


def _file_digests(step_dir: Path, skip: tuple[str, ...] = ()) -> dict[str, str]:
    """Relative path -> sha256 of every file of a committed step (but those under ``skip``)."""
    out = {}
    for p in sorted(step_dir.rglob("*")):
        name = p.relative_to(step_dir).as_posix()
        if p.is_file() and not (skip and name.startswith(skip)):
            out[name] = files.file_sha256(p)
    return out


def abstract_like(tree, sharding=None):
    """ShapeDtypeStructs for restoring onto the layout of ``tree`` (arrays or ShapeDtypeStructs),
    or, given ``sharding``, onto that one for every leaf."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=sharding or getattr(x, "sharding", None)),
        tree,
    )
