"""A fine-tuned model on disk: what ``clozax finetune`` writes and ``export`` / ``--predict``
read. No pickle: ``model.safetensors`` holds the parameter tree flattened with ``/`` between
keys (``encoder/layers/attention/query/kernel``, ``head/out/kernel``), ``finetuned.json`` the
model config, the task (kind, label names, head style, pooling) and where it came from, and
``tokenizer.json`` is the run's, byte for byte."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import NamedTuple

import numpy as np
from safetensors.numpy import load_file, save_file

from clozax.core import files
from clozax.core.files import staged_dir
from clozax.train import config as config_lib

META_FILE = "finetuned.json"
WEIGHTS_FILE = "model.safetensors"


class Finetuned(NamedTuple):
    path: Path
    params: dict  # {"encoder": encoder params, "head": head params}
    model_config: object  # ModelConfig
    meta: dict  # finetuned.json
    tokenizer_path: Path


def flatten(tree: dict, prefix: str = "") -> dict[str, np.ndarray]:
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "/"))
        else:
            out[name] = np.ascontiguousarray(np.asarray(value, np.float32))
    return out


def unflatten(flat: dict[str, np.ndarray]) -> dict:
    tree: dict = {}
    for name, value in flat.items():
        node = tree
        *parents, leaf = name.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return tree


def is_finetuned(path: Path) -> bool:
    return (Path(path) / META_FILE).is_file()


def write(out: Path, params: dict, model_config, meta: dict, tokenizer_path: Path) -> Path:
    """Write a fine-tuned model directory atomically (replacing one that is there)."""
    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    with staged_dir(out) as tmp:
        save_file(flatten(params), str(tmp / WEIGHTS_FILE), metadata={"format": "clozax"})
        files.write_json(tmp / META_FILE, {**meta, "model": dataclasses.asdict(model_config)},
                         sort_keys=True)
        shutil.copyfile(tokenizer_path, tmp / "tokenizer.json")
    return out


def load(path: Path) -> Finetuned:
    """Read a fine-tuned model directory; one-line ``ValueError`` when it is not one."""
    path = Path(path)
    if not is_finetuned(path):
        raise ValueError(f"{path} is not a fine-tuned model (no {META_FILE}); pass "
                         "RUN/finetune/TASK/model as `clozax finetune` wrote it")
    meta = files.read_json(path / META_FILE)
    try:
        params = unflatten(load_file(str(path / WEIGHTS_FILE)))
    except Exception as e:  # noqa: BLE001 - any unreadable weights file is the same problem
        raise ValueError(f"{path / WEIGHTS_FILE} cannot be read ({e}); fine-tune again") from None
    model_config = config_lib.from_dict({"model": meta["model"]}).model
    return Finetuned(path, params, model_config, meta, path / "tokenizer.json")
