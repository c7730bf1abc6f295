"""Reading the files of a ``save_pretrained`` directory: its JSON, its safetensors weights
(never pickle), and the checks that name what is wrong and how to re-save it; and the
tokenizer files an export writes beside its weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy, so safetensors can return it)
import numpy as np
from tokenizers import Tokenizer

from clozax.core import files
from clozax.core.vocab import SPECIAL_NAMES

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def read_json(path: Path, what: str) -> dict:
    """A JSON object from ``path``; ``ValueError`` naming ``what`` when it is not one."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{what} {path} is not readable JSON ({str(e).splitlines()[0]}); "
                         "re-save the model with save_pretrained") from None
    if not isinstance(data, dict):
        raise ValueError(f"{what} {path} is not a JSON object; re-save it with save_pretrained")
    return data


def config_int(cfg: dict, key: str) -> int:
    """A positive integer from ``config.json``."""
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"config.json {key}={value!r} is missing or not a positive integer; "
                         "re-save the model with save_pretrained")
    return value


def weight_files(hf_dir: Path) -> list[Path]:
    """The safetensors files of ``hf_dir`` (one, or the shards of an index); pickle refused."""
    single, index = hf_dir / "model.safetensors", hf_dir / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        weight_map = read_json(index, "safetensors index").get("weight_map", {})
        return sorted({hf_dir / name for name in weight_map.values()})
    pickles = sorted(p.name for p in hf_dir.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise ValueError(
            f"{hf_dir} has only pickle weights ({', '.join(pickles)}); clozax does not load "
            "pickle files because unpickling can execute arbitrary code: convert them to "
            "safetensors (model.save_pretrained(dir, safe_serialization=True)) and import that")
    raise ValueError(f"{hf_dir} has no model.safetensors; pass a directory written by "
                     "save_pretrained(..., safe_serialization=True)")


def read_safetensors(files: list[Path]) -> dict[str, np.ndarray]:
    """All tensors of ``files`` as float32 numpy arrays (bfloat16 widened exactly), read with
    safetensors' own ``safe_open``; ``ValueError`` on a damaged file."""
    from safetensors import safe_open

    tensors = {}
    for path in files:
        try:
            with safe_open(str(path), framework="np") as f:
                for key in f.keys():
                    tensors[key] = np.asarray(f.get_tensor(key), np.float32)
        except Exception as e:  # safetensors raises its own error type, or OSError/TypeError
            raise ValueError(
                f"{path} is not a valid safetensors file ({str(e).splitlines()[0][:160]}); it "
                "may be truncated: re-download it or re-save with safe_serialization=True"
            ) from None
    return tensors


def check_fresh_output(out: Path, what: str) -> None:
    """``out`` must be absent or an empty directory (``staged_dir`` then replaces it)."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{what} directory {out} already exists and is not empty; choose a new "
                         "output directory or remove it")


def special_tokens(tokenizer_path: Path, specials: dict) -> dict[str, str]:
    tok = Tokenizer.from_file(str(tokenizer_path))
    return {name: tok.id_to_token(int(specials[name])) for name in SPECIAL_NAMES}


def write_tokenizer(tmp: Path, tokenizer_path: Path, tokens: dict, max_length: int) -> None:
    """tokenizer.json (byte for byte), special_tokens_map.json, tokenizer_config.json."""
    shutil.copyfile(tokenizer_path, tmp / "tokenizer.json")
    token_fields = {f"{name}_token": tokens[name] for name in SPECIAL_NAMES}
    files.write_json(tmp / "special_tokens_map.json", token_fields, sort_keys=True)
    files.write_json(tmp / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **token_fields,
        "model_max_length": max_length,
        "padding_side": "right",  # RoBERTa-PreLayerNorm parity needs right padding
        "clean_up_tokenization_spaces": False,
    }, sort_keys=True)
