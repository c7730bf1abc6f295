"""Training checkpoints with orbax: params, optimiser state and step; never pickle.

A step holds three items: ``params`` and ``opt_state`` (orbax's standard arrays, restorable
separately, so commands that only read a model restore only the parameters) and ``meta`` (JSON:
the step, the config). Saves are asynchronous: ``save`` returns once the arrays are copied off
the device and orbax writes them in the background while training goes on; the next ``save``,
``wait`` or ``close`` waits for it. Each save is committed atomically by orbax (written to a
temporary directory, renamed when complete); older checkpoints are removed only after the new
one is committed, keeping the last ``keep``.

Orbax does not notice damaged bytes (a flipped byte in an array file restores as a different
number, silently), so once a save has committed, the sha256 of every file of the step is
recorded in ``RUN/checkpoint_digests/STEP.json``, and a step is *intact* only when its files
still match (a step killed before its digest was written is not). Restoring the latest
checkpoint falls back to the newest intact one, saying so.

Any failure of a save (disk full, I/O error, orbax's own errors) becomes one ``CheckpointError``
line naming the directory and its free space; orbax's temporary directory is removed and the
previous checkpoint stays loadable.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from clozax.core import files
from clozax.train import distributed

# orbax logs every save at INFO/WARNING through absl; keep the console for our own lines.
logging.getLogger("absl").setLevel(logging.ERROR)

CHECKPOINT_DIR = "checkpoints"
DIGEST_DIR = "checkpoint_digests"
_TMP_MARK = ".orbax-checkpoint-tmp"


class CheckpointError(ValueError):
    """A checkpoint could not be saved or restored; the message names the fix."""


class Checkpointer:
    """Every process of a job saves and restores (orbax writes each process's shards and
    commits once); only the primary process (``primary``) records digests, removes temporaries
    and sets damaged steps aside."""

    def __init__(self, run_dir: Path, keep: int = 3, primary: bool = True):
        self.directory = Path(run_dir).absolute() / CHECKPOINT_DIR
        self.digests = Path(run_dir).absolute() / DIGEST_DIR
        self.primary = primary
        self._remove_temporaries()  # left by a process killed while saving
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep, create=True, enable_async_checkpointing=True),
        )
        self._pending: int | None = None  # a save still being written
        self._failed = False  # a save failed (and was reported)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, step: int, state, meta: dict) -> None:
        """Start saving ``state`` (a ``TrainState``) as step ``step``; returns once the arrays
        are off the device. The previous save is finished first."""
        self.wait()
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

    def wait(self) -> None:
        """Finish the save in flight (if any) and record its digest; a failure of the
        background write surfaces here as ``CheckpointError``."""
        if self._pending is None:
            return
        step, self._pending = self._pending, None
        try:
            self.manager.wait_until_finished()
            self._record_digest(step)
        except Exception as e:
            raise self._save_error(step, e) from None

    def _save_error(self, step: int, e: Exception) -> CheckpointError:
        self._failed = True
        try:  # let orbax's background work on the failed step stop before cleaning up after it
            self.manager.wait_until_finished()
        except Exception:  # noqa: BLE001  (the error being reported is ``e``)
            pass
        self._remove_temporaries()
        intact = [s for s in self.all_steps() if s != step and self.damage(s) is None]
        kept = f"step {intact[-1]}" if intact else "none yet"
        free = shutil.disk_usage(self.directory).free / 2**20
        reason = (getattr(e, "strerror", None) or str(e).splitlines()[0] or
                  type(e).__name__)[:160]
        return CheckpointError(
            f"could not save the checkpoint at step {step} in {self.directory} ({reason}; "
            f"{free:,.0f} MiB free there); the last good checkpoint ({kept}) is intact: "
            "free disk space and run the same command again to resume")

    def damage(self, step: int) -> str | None:
        """Why step ``step`` is not intact (None when every file matches its digest)."""
        record = files.read_json(self.digests / f"{step}.json")
        if record is None:
            return "no digest was recorded (the save did not finish)"
        found = _file_digests(self.directory / str(step))
        changed = sorted(set(found.items()) ^ set(record.items()))
        if changed:
            return f"{len({name for name, _ in changed})} file(s) differ from their digest, " \
                   f"e.g. {changed[0][0]}"
        return None

    def restore(self, step: int, abstract_state, params_only: bool = False):
        """Restore step ``step`` (it must be intact) onto the shardings/dtypes of
        ``abstract_state`` (a ``TrainState`` of ShapeDtypeStructs). Returns ``(state, meta)``;
        with ``params_only`` the optimizer state is not read (``state.opt_state`` is None)."""
        damage = self.damage(step)
        if damage is not None:
            raise CheckpointError(f"checkpoint at step {step} in {self.directory} is damaged "
                                  f"({damage}); restore an earlier step")
        items = {"params": ocp.args.StandardRestore(abstract_state.params),
                 "meta": ocp.args.JsonRestore()}
        if not params_only:
            items["opt_state"] = ocp.args.StandardRestore(abstract_state.opt_state)
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(**items))
        except Exception as e:  # orbax raises bare Exception, ValueError, KeyError, OSError
            raise CheckpointError(
                f"checkpoint at step {step} in {self.directory} could not be restored "
                f"({str(e).splitlines()[0][:200] if str(e) else type(e).__name__}); it may be "
                "from a different model config"
            ) from None
        counter = jnp.asarray(step, jnp.int32)
        if getattr(abstract_state.step, "sharding", None) is not None:
            counter = jax.device_put(counter, abstract_state.step.sharding)
        state = type(abstract_state)(counter, restored["params"],
                                     None if params_only else restored["opt_state"])
        return state, restored["meta"]

    def restore_latest(self, abstract_state, say: Callable[[str], None] = print,
                       set_aside: bool = False, params_only: bool = False):
        """``(state, meta, step)`` of the newest intact step, or None when there is no
        checkpoint; each damaged newer step is skipped with one line to ``say``. With
        ``set_aside`` (training, which will save those steps again) a damaged step is moved to
        ``RUN/checkpoints_damaged/`` rather than deleted."""
        steps = self.all_steps()
        for step in reversed(steps):
            try:
                state, meta = self.restore(step, abstract_state, params_only)
            except CheckpointError as e:
                older = [s for s in steps if s < step]
                if not older:
                    raise CheckpointError(f"{e}; no intact earlier checkpoint is left: start a "
                                          "new run (choose a new --out)") from None
                where = ""
                if set_aside:
                    where = f", set aside in {self._set_aside(step)}"
                    distributed.barrier(f"clozax-set-aside-{step}")  # the move is seen by all
                    self.manager.reload()
                say(f"checkpoint at step {step} is damaged ({str(e).split('(', 1)[1][:-1]}"
                    f"{where}); falling back to step {older[-1]}")
                continue
            return state, meta, step
        return None

    def close(self) -> None:
        """Finish any save in flight (raising its failure) and release orbax."""
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
        if not self.primary:
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
        if self.primary:
            aside.mkdir(exist_ok=True)
            (self.directory / str(step)).rename(dest)
            (self.digests / f"{step}.json").unlink(missing_ok=True)
        return dest

    def _remove_temporaries(self) -> None:
        if self.primary and self.directory.is_dir():
            for tmp in self.directory.glob(f"*{_TMP_MARK}*"):
                shutil.rmtree(tmp, ignore_errors=True)


def _file_digests(step_dir: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file of a committed step."""
    return {p.relative_to(step_dir).as_posix(): files.file_sha256(p)
            for p in sorted(step_dir.rglob("*")) if p.is_file()}


def abstract_like(tree, sharding=None):
    """ShapeDtypeStructs for restoring onto the layout of ``tree`` (arrays or ShapeDtypeStructs),
    or, given ``sharding``, onto that one for every leaf."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=sharding or getattr(x, "sharding", None)),
        tree,
    )
