"""Training checkpoints with orbax: params, optimiser state, step and keys; never pickle.

Each save is committed atomically by orbax (written to a temporary directory, renamed when
complete); older checkpoints are removed only after the new one is committed, keeping the last
``keep``. A failed save (full disk, I/O error) leaves the previous checkpoint loadable.
"""

from __future__ import annotations

import logging
from pathlib import Path

import jax
import orbax.checkpoint as ocp

# orbax logs every save at INFO/WARNING through absl; keep the console for our own lines.
logging.getLogger("absl").setLevel(logging.ERROR)

CHECKPOINT_DIR = "checkpoints"


class CheckpointError(ValueError):
    """A checkpoint could not be saved or restored; the message names the fix."""


class Checkpointer:
    def __init__(self, run_dir: Path, keep: int = 3):
        self.directory = Path(run_dir).absolute() / CHECKPOINT_DIR
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
        return list(self.manager.all_steps())

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
        except OSError as e:
            kept = f"step {previous}" if previous is not None else "none yet"
            raise CheckpointError(
                f"could not save the checkpoint at step {step} ({e.strerror or e}); the last "
                f"good checkpoint ({kept}) is intact: free disk space and resume with --resume"
            ) from None

    def restore(self, step: int, abstract_state):
        """Restore onto the shardings/dtypes of ``abstract_state`` (ShapeDtypeStructs)."""
        try:
            restored = self.manager.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()
                ),
            )
        except (ValueError, KeyError, FileNotFoundError, OSError) as e:
            raise CheckpointError(
                f"checkpoint at step {step} in {self.directory} could not be restored "
                f"({str(e).splitlines()[0][:200]}); it may be from a different model config"
            ) from None
        return restored["state"], restored["meta"]

    def close(self) -> None:
        self.manager.close()


def abstract_like(tree, sharding=None):
    """ShapeDtypeStructs for restoring onto the layout of ``tree`` (arrays or ShapeDtypeStructs),
    or, given ``sharding``, onto that one for every leaf."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=sharding or getattr(x, "sharding", None)),
        tree,
    )
