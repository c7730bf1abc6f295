"""Fill in the blanks: the trained model's top-k predictions at each mask in a text.

The text is encoded with the run's frozen tokenizer as ``[CLS] text [SEP]``; the mask is the
tokenizer's own mask string (``[MASK]`` for BERT-style tokenizers, ``<mask>`` for RoBERTa's),
one of its special tokens, so it becomes the mask id (and only its exact spelling does).
Probabilities are the model's softmax over the whole vocabulary.
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np

from clozax.core import model as model_lib
from clozax.data.tokenizer import load_tokenizer
from clozax.judge.failures import token_piece
from clozax.train.run_dir import load_run


def encode(tokenizer, specials: dict[str, int], text: str, max_positions: int) -> np.ndarray:
    """(seq,) int32 ids of ``[CLS] text [SEP]``; ValueError without a mask or when too long."""
    mask = tokenizer.id_to_token(specials["mask"])
    if mask not in text:
        raise ValueError(f"text has no {mask} (this run's mask token); write {mask} exactly "
                         "where the model should fill in a token")
    body = tokenizer.encode(text, add_special_tokens=False).ids
    ids = np.asarray([specials["cls"], *body, specials["sep"]], np.int32)
    if ids.size > max_positions:
        raise ValueError(f"text is {ids.size} tokens with [CLS]/[SEP], longer than the model's "
                         f"{max_positions} positions; shorten it")
    if not np.any(ids == specials["mask"]):
        raise ValueError(f"the run's tokenizer did not turn {mask} into its mask id; the "
                         f"tokenizer must declare {mask} as a special token")
    return ids


def fill(run_dir: Path, text: str, top_k: int = 5, step: int | None = None) -> list[dict]:
    """For each mask in ``text`` (in order): its token position and the ``top_k`` predictions
    of checkpoint ``step`` (default: the latest) as ``{"token", "id", "probability"}``, most
    probable first."""
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k={top_k!r} must be a positive integer")
    run = load_run(Path(run_dir), step)
    run.require_mlm_head("fill")
    cfg = run.config.model
    if top_k > cfg.vocab_size:
        raise ValueError(f"top_k={top_k} exceeds the vocabulary of {cfg.vocab_size}; lower it")
    tokenizer = load_tokenizer(run.tokenizer_path)
    specials = run.specials
    ids = encode(tokenizer, specials, text, cfg.max_positions)
    run.check_length(ids.size, "text")
    positions = np.nonzero(ids == specials["mask"])[0].astype(np.int32)

    @jax.jit
    def predict(params, inputs, positions):
        segments = np.ones(inputs.shape, np.int32)  # one document, no padding
        logits = model_lib.logits_at(params, cfg, inputs, segments, positions)
        return jax.lax.top_k(jax.nn.softmax(logits, axis=-1), top_k)  # (1, masks, k)

    probs, top_ids = predict(run.params, ids[None], positions[None])
    probs, top_ids = np.asarray(probs[0], np.float64), np.asarray(top_ids[0])
    out = []
    for n, position in enumerate(positions):
        out.append({
            "mask": n,
            "position": int(position),
            "predictions": [
                {"token": token_piece(tokenizer, int(t)), "id": int(t), "probability": float(p)}
                for t, p in zip(top_ids[n], probs[n], strict=True)
            ],
        })
    return out


def summary_table(results: list[dict], step: int | None = None):
    """A rich table of ``fill``'s result: one row per [MASK] and rank."""
    from rich.table import Table

    table = Table(title="predictions at each [MASK]" + (f", step {step}" if step else ""))
    for name, justify in (("[MASK]", "right"), ("rank", "right"), ("token", "left"),
                          ("probability", "right")):
        table.add_column(name, justify=justify)
    for r in results:
        for rank, p in enumerate(r["predictions"], 1):
            table.add_row(str(r["mask"] + 1) if rank == 1 else "", str(rank), repr(p["token"]),
                          f"{p['probability']:.4f}")
        table.add_section()
    return table
