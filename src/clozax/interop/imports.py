"""``clozax import-hf``: a local ``save_pretrained`` directory of a supported family (or its
bare encoder) as a clozax run directory with a step-0 checkpoint.

Safetensors only, never pickle. A bare encoder imports with ``"has_mlm_head": false`` in
``run.json`` and an identity head with zero bias, so MLM outputs (fill, evaluate) are meaningless
but ``probe`` works. HF has no document-local attention: a run with
``attention_within_segments`` exports exactly for one document per sequence, which is how such a
model is used downstream.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
from tokenizers import Tokenizer
from tokenizers.implementations import BertWordPieceTokenizer

from clozax.core.files import file_sha256, staged_dir
from clozax.core.optim import make_optimizer
from clozax.core.train_state import new_state
from clozax.core.vocab import SPECIAL_NAMES
from clozax.interop.families import for_hf_config, special_strings
from clozax.interop.hf_files import (
    check_fresh_output,
    config_int,
    read_json,
    read_safetensors,
    weight_files,
)
from clozax.train import checkpoint as ckpt
from clozax.train import config as config_lib
from clozax.train.run_dir import write_run_files


def _hf_special_strings(hf_dir: Path) -> dict[str, list[str]]:
    """Candidate token strings per special name: the HF files' declarations first."""
    candidates = {name: [] for name in SPECIAL_NAMES}
    for fname in ("special_tokens_map.json", "tokenizer_config.json"):
        path = hf_dir / fname
        if not path.is_file():
            continue
        data = read_json(path, fname)
        for name in SPECIAL_NAMES:
            value = data.get(f"{name}_token")
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str):
                candidates[name].append(value)
    for name in SPECIAL_NAMES:
        candidates[name] += special_strings(name)
    return candidates


def _import_tokenizer(hf_dir: Path, dest: Path):
    """Copy (or build from vocab.txt) the tokenizer into ``dest``; return it loaded and the
    list of changes made to it (padding/truncation switched off)."""
    source = hf_dir / "tokenizer.json"
    if source.is_file():
        try:
            tok = Tokenizer.from_file(str(source))
        except Exception as e:  # tokenizers raises a bare Exception
            raise ValueError(f"{source} is not a valid tokenizer.json "
                             f"({str(e).splitlines()[0][:160]})") from None
        changes = [name for name, on in (("padding", tok.padding), ("truncation", tok.truncation))
                   if on]
        if changes:  # clozax pads and truncates itself; a fixed-length tokenizer breaks packing
            tok.no_padding()
            tok.no_truncation()
            tok.save(str(dest))
        else:
            shutil.copyfile(source, dest)  # byte for byte: `prepare --tokenizer` hashes match
        return tok, [f"{name} disabled" for name in changes]
    vocab = hf_dir / "vocab.txt"
    if not vocab.is_file():
        raise ValueError(f"{hf_dir} has neither tokenizer.json nor vocab.txt; save the "
                         "tokenizer next to the model (tokenizer.save_pretrained)")
    tok_cfg = hf_dir / "tokenizer_config.json"
    lower = read_json(tok_cfg, "tokenizer config").get("do_lower_case", True) \
        if tok_cfg.is_file() else True
    BertWordPieceTokenizer(str(vocab), lowercase=bool(lower)).save(str(dest))
    return Tokenizer.from_file(str(dest)), ["built from vocab.txt"]


def _find_specials(tok, hf_dir: Path) -> dict[str, int]:
    specials, missing = {}, []
    for name, strings in _hf_special_strings(hf_dir).items():
        ids = [tok.token_to_id(s) for s in strings]
        found = [i for i in ids if i is not None]
        if found:
            specials[name] = int(found[0])
        else:
            missing.append(strings[0])
    if missing:
        raise ValueError(f"the tokenizer in {hf_dir} lacks special token(s) "
                         f"{', '.join(missing)}; clozax needs pad/unk/cls/sep/mask tokens")
    return specials


def import_hf(hf_dir: Path, out_run: Path) -> Path:
    """Import a local HF ``BertForMaskedLM`` / ``RobertaPreLayerNormForMaskedLM`` /
    ``ModernBertForMaskedLM`` (or their bare encoders) into a new clozax run directory
    ``out_run`` with a step-0 checkpoint. Returns ``out_run``."""
    hf_dir, out_run = Path(hf_dir), Path(out_run)
    if not hf_dir.is_dir():
        raise ValueError(f"{hf_dir} is not a directory; pass a local save_pretrained directory")
    if not (hf_dir / "config.json").is_file():
        raise ValueError(f"{hf_dir} has no config.json; pass a save_pretrained directory")
    cfg = read_json(hf_dir / "config.json", "config")
    family, arch = for_hf_config(cfg, hf_dir)
    weights = weight_files(hf_dir)
    check_fresh_output(out_run, "run")
    with staged_dir(out_run) as tmp:
        tok, tokenizer_changes = _import_tokenizer(hf_dir, tmp / "tokenizer.json")
        specials = _find_specials(tok, hf_dir)
        vocab = config_int(cfg, "vocab_size")
        if vocab != tok.get_vocab_size():
            raise ValueError(f"config.json vocab_size={vocab} disagrees with the tokenizer's "
                             f"{tok.get_vocab_size()} tokens; use the tokenizer the model was "
                             "trained with")
        pad = specials["pad"]
        if family.positions_after_pad and int(cfg.get("pad_token_id", pad)) != pad:
            raise ValueError(f"config.json pad_token_id={cfg.get('pad_token_id')} is not the "
                             f"tokenizer's pad id {pad}; RoBERTa position ids depend on it")
        params, fields, has_head = family.from_hf_tensors(read_safetensors(weights), cfg, pad)
        write_run(tmp, params, fields, {
            "specials": specials,
            "imported_from": str(hf_dir.absolute()),
            "imported_architecture": arch if has_head else family.encoder,
            "has_mlm_head": has_head,
            "tokenizer_changes": tokenizer_changes,
        })
    return out_run


def write_run(run_dir: Path, params: dict, model_fields: dict, extra: dict) -> None:
    """config.json, run.json (train's keys + ``extra``) and a step-0 checkpoint of ``params``
    (a run directory ``load_run`` and ``train --init-from`` accept)."""
    config = config_lib.from_dict({"model": model_fields})
    write_run_files(run_dir, config, {
        "dataset": None,
        "dataset_fingerprint": None,
        "tokenizer_sha256": file_sha256(run_dir / "tokenizer.json"),
        "seq_len": config.model.max_positions,
        "seed": config.train.seed,
        "eval_seed": config.train.eval_seed,
        "init_from": None,
        **extra,
    })
    params = jax.tree.map(jnp.asarray, params)
    optimizer, _ = make_optimizer(config.optim, config.train.steps, params)
    state = new_state(params, optimizer)
    checkpointer = ckpt.Checkpointer(run_dir, keep=config.train.keep_checkpoints)
    try:
        checkpointer.save(0, state, {"step": 0, "config": config.to_dict(),
                                     "imported_from": extra.get("imported_from")})
    finally:
        checkpointer.close()
