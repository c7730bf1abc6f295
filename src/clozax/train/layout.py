"""The names in a run directory, importable without JAX (``clozax status`` reads a live run
with nothing heavier than these and JSON)."""

CONFIG_FILE = "config.json"  # the resolved run config
RUN_FILE = "run.json"  # the dataset, tokenizer, specials and seeds it was trained with
TOKENIZER_FILE = "tokenizer.json"  # the frozen tokenizer
METRICS_FILE = "metrics.jsonl"  # one line per logged step
CHECKPOINT_DIR = "checkpoints"  # orbax's committed steps
DIGEST_DIR = "checkpoint_digests"  # a committed step's file digests: verified
EVAL_STEM = "eval_masks"  # the run's frozen held-out set: eval_masks.npz / .json
FIXED_EVAL_STEM = "eval_masks_15"  # the fixed-15 % set beside it


def phase_eval_stem(phase: str) -> str:
    """The frozen held-out set of a phase on its own dataset (``eval_masks_NAME``)."""
    return f"{EVAL_STEM}_{phase}"
