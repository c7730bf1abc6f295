"""Training checkpoints with orbax: params, optimiser state, step and keys; never pickle.

Each save is committed atomically by orbax (written to a temporary directory, renamed when
complete); older checkpoints are removed only after the new one is committed, keeping the last
``keep``. Orbax does not notice damaged bytes (a flipped byte in an array file restores as a
different number, silently), so after each commit the sha256 of every file of the step is
recorded in ``RUN/checkpoint_digests/STEP.json``, and a step is *intact* only when its files
still match. Restoring the latest checkpoint falls back to the newest intact one, saying so.

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
import orbax.checkpoint as ocp

from clozax.core import files

# orbax logs every save at INFO/WARNING through absl; keep the console for our own lines.
logging.getLogger("absl").setLevel(logging.ERROR)

CHECKPOINT_DIR = "checkpoints"
DIGEST_DIR = "checkpoint_digests"
_TMP_MARK = ".orbax-checkpoint-tmp"


class CheckpointError(ValueError):
    """A checkpoint could not be saved or restored; the message names the fix."""


class Checkpointer:
    def __init__(self, run_dir: Path, keep: int = 3):
        self.directory = Path(run_dir).absolute() / CHECKPOINT_DIR
        self.digests = Path(run_dir).absolute() / DIGEST_DIR
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep,
                create=True,
                # Synchronous saves: when save() returns, the checkpoint is committed.
                enable_async_checkpointing=False,
            ),
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, step: int, state, meta: dict) -> None:
        previous = self.latest_step()
        try:
            self.manager.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)
                ),
                force=True,
            )
            self.manager.wait_until_finished()
            self._record_digest(step)
        except Exception as e:  # orbax raises OSError, ValueError("RESOURCE_EXHAUSTED..."), ...
            self._remove_temporaries()
            kept = f"step {previous}" if previous is not None else "none yet"
            free = shutil.disk_usage(self.directory).free / 2**20
            reason = (getattr(e, "strerror", None) or str(e).splitlines()[0] or
                      type(e).__name__)[:160]
            raise CheckpointError(
                f"could not save the checkpoint at step {step} in {self.directory} ({reason}; "
                f"{free:,.0f} MiB free there); the last good checkpoint ({kept}) is intact: "
                "free disk space and run the same command again to resume"
            ) from None

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

    def restore(self, step: int, abstract_state):
        """Restore step ``step`` (it must be intact) onto the shardings/dtypes of
        ``abstract_state`` (ShapeDtypeStructs)."""
        damage = self.damage(step)
        if damage is not None:
            raise CheckpointError(f"checkpoint at step {step} in {self.directory} is damaged "
                                  f"({damage}); restore an earlier step")
        try:
            restored = self.manager.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()
                ),
            )
        except Exception as e:  # orbax raises bare Exception, ValueError, KeyError, OSError
            raise CheckpointError(
                f"checkpoint at step {step} in {self.directory} could not be restored "
                f"({str(e).splitlines()[0][:200] if str(e) else type(e).__name__}); it may be "
                "from a different model config"
            ) from None
        return restored["state"], restored["meta"]

    def restore_latest(self, abstract_state, say: Callable[[str], None] = print,
                       set_aside: bool = False):
        """``(state, meta, step)`` of the newest intact step, or None when there is no
        checkpoint; each damaged newer step is skipped with one line to ``say``. With
        ``set_aside`` (training, which will save those steps again) a damaged step is moved to
        ``RUN/checkpoints_damaged/`` rather than deleted."""
        steps = self.all_steps()
        for step in reversed(steps):
            try:
                state, meta = self.restore(step, abstract_state)
            except CheckpointError as e:
                older = [s for s in steps if s < step]
                if not older:
                    raise CheckpointError(f"{e}; no intact earlier checkpoint is left: start a "
                                          "new run (choose a new --out)") from None
                where = ""
                if set_aside:
                    where = f", set aside in {self._set_aside(step)}"
                say(f"checkpoint at step {step} is damaged ({str(e).split('(', 1)[1][:-1]}"
                    f"{where}); falling back to step {older[-1]}")
                continue
            return state, meta, step
        return None

    def close(self) -> None:
        self.manager.close()

    def _record_digest(self, step: int) -> None:
        self.digests.mkdir(parents=True, exist_ok=True)
        files.write_json(self.digests / f"{step}.json",
                         _file_digests(self.directory / str(step)), sort_keys=True)
        kept = {str(s) for s in self.manager.all_steps()}
        for stale in self.digests.glob("*.json"):
            if stale.stem not in kept:
                stale.unlink(missing_ok=True)

    def _set_aside(self, step: int) -> Path:
        aside = self.directory.parent / f"{CHECKPOINT_DIR}_damaged"
        aside.mkdir(exist_ok=True)
        dest = aside / f"{step}-{time.strftime('%Y%m%d-%H%M%S')}"
        (self.directory / str(step)).rename(dest)
        (self.digests / f"{step}.json").unlink(missing_ok=True)
        self.manager.reload()
        return dest

    def _remove_temporaries(self) -> None:
        if self.directory.is_dir():
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
