"""The names in a run directory, importable without JAX (``clozax status`` reads a live run
with nothing heavier than these and JSON)."""

CONFIG_FILE = "config.json"  # the resolved run config
RUN_FILE = "run.json"  # the dataset, tokenizer, specials and seeds it was trained with
TOKENIZER_FILE = "tokenizer.json"  # the frozen tokenizer
METRICS_FILE = "metrics.jsonl"  # one line per logged step
CHECKPOINT_DIR = "checkpoints"  # orbax's committed steps
DIGEST_DIR = "checkpoint_digests"  # a committed step's file digests: verified
