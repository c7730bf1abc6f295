"""Failure cases: the held-out positions the model got most confidently wrong, shown in their
context with the target marked, and how token ids are shown as text."""

from __future__ import annotations

import numpy as np

from clozax.core.masking import KIND_NAMES, Kind
from clozax.judge.slots import SlotOutputs
from clozax.train.heldout import EvalMasks

CONTEXT_TOKENS = 30  # failure-case context on each side, within the target's own segment


def token_piece(tokenizer, token_id: int) -> str:
    """How a token id is shown: its vocabulary piece, with the tokenizer's own word-start or
    continuation mark (``▁a`` starts a word, ``a`` continues one; WordPiece's ``##a``). Two ids
    never look alike, as their decoded text can ("a" for both)."""
    piece = tokenizer.id_to_token(int(token_id))
    return piece if piece is not None else f"<id {int(token_id)}>"


def marked_context(tokenizer, tokens: np.ndarray, segments: np.ndarray, position: int,
                   special_ids, width: int = CONTEXT_TOKENS) -> str:
    """The target's segment around ``position`` (at most ``width`` tokens each side) decoded,
    with the target marked ``⟦target⟧``."""
    same = np.nonzero(segments == segments[position])[0]
    lo, hi = max(int(same[0]), position - width), min(int(same[-1]), position + width)
    specials = set(int(i) for i in special_ids)
    left = [int(t) for t in tokens[lo:position] if int(t) not in specials]
    right = [int(t) for t in tokens[position + 1 : hi + 1] if int(t) not in specials]
    target = int(tokens[position])
    # Decode growing prefixes so spacing between pieces is the tokenizer's own.
    text_left = tokenizer.decode(left)
    text_with = tokenizer.decode(left + [target])
    text_all = tokenizer.decode(left + [target] + right)
    if text_with.startswith(text_left) and text_all.startswith(text_with):
        piece, rest = text_with[len(text_left):], text_all[len(text_with):]
    else:
        piece, rest = " " + tokenizer.decode([target]), " " + tokenizer.decode(right)
    space = piece[: len(piece) - len(piece.lstrip())]
    first_real = next((int(i) for i in same if int(tokens[i]) not in specials), lo)
    last_real = max((int(i) for i in same if int(tokens[i]) not in specials), default=hi)
    head = "… " if lo > first_real else ""
    tail = " …" if hi < last_real else ""
    return f"{head}{text_left}{space}⟦{piece.strip()}⟧{rest}{tail}".strip()


def failure_cases(tokenizer, split, masks: EvalMasks, slots: SlotOutputs, special_ids,
                  k: int) -> list[dict]:
    """The ``k`` valid slots with the lowest target probability (ties: mask-set order)."""
    mask_idx, slot = np.nonzero(masks.valid)
    nll = slots.nll[mask_idx, slot]
    order = np.lexsort((slot, mask_idx, -nll.astype(np.float64)))[:k]
    cases = []
    for o in order:
        i, j = int(mask_idx[o]), int(slot[o])
        row, position = int(masks.rows[i]), int(masks.positions[i, j])
        tokens = np.asarray(split.tokens[row])
        target = int(tokens[position])
        cases.append({
            "row": row,
            "position": position,
            "text": marked_context(tokenizer, tokens, np.asarray(split.segments[row]), position,
                                   special_ids),
            "target": token_piece(tokenizer, target),
            "target_id": target,
            "target_probability": float(np.exp(-float(slots.nll[i, j]))),
            "target_rank": int(slots.rank[i, j]),
            "top5": [[token_piece(tokenizer, t), float(p)]
                     for t, p in zip(slots.top_ids[i, j], slots.top_probs[i, j], strict=True)],
            "kind": KIND_NAMES[Kind(int(masks.kinds[i, j]))],
            "input_token": token_piece(tokenizer, int(masks.inputs[i, position])),
        })
    return cases
