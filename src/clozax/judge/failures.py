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


class WorstSlots:
    """The ``k`` valid slots with the lowest target probability over a set scored chunk by
    chunk (ties: set order): at most ``k`` candidates kept per chunk and overall, so memory is
    bounded by ``k`` whatever the set's size."""

    def __init__(self, k: int):
        self.k, self.kept = k, []  # (nll, set index, slot, fields)

    def add(self, masks: EvalMasks, slots: SlotOutputs, offset: int) -> None:
        """Offer a chunk: ``masks`` entries ``offset..`` of the set, scored as ``slots``."""
        if self.k == 0:
            return
        mask_idx, slot = np.nonzero(masks.valid)
        nll = slots.nll[mask_idx, slot].astype(np.float64)
        for o in np.lexsort((slot, mask_idx, -nll))[: self.k]:
            i, j = int(mask_idx[o]), int(slot[o])
            self.kept.append((float(nll[o]), offset + i, j, {
                "row": int(masks.rows[i]), "position": int(masks.positions[i, j]),
                "nll": float(slots.nll[i, j]), "rank": int(slots.rank[i, j]),
                "top_ids": slots.top_ids[i, j].tolist(),
                "top_probs": slots.top_probs[i, j].tolist(),
                "kind": int(masks.kinds[i, j]), "input_id": int(masks.slot_inputs[i, j])}))
        self.kept = sorted(self.kept, key=lambda c: (-c[0], c[1], c[2]))[: self.k]

    def cases(self, tokenizer, split, special_ids) -> list[dict]:
        """The kept slots in their context, worst first."""
        cases = []
        for _, _, _, c in self.kept:
            row, position = c["row"], c["position"]
            tokens = np.asarray(split.tokens[row])
            target = int(tokens[position])
            cases.append({
                "row": row,
                "position": position,
                "text": marked_context(tokenizer, tokens, np.asarray(split.segments[row]),
                                       position, special_ids),
                "target": token_piece(tokenizer, target),
                "target_id": target,
                "target_probability": float(np.exp(-c["nll"])),
                "target_rank": c["rank"],
                "top5": [[token_piece(tokenizer, t), float(p)]
                         for t, p in zip(c["top_ids"], c["top_probs"], strict=True)],
                "kind": KIND_NAMES[Kind(c["kind"])],
                "input_token": token_piece(tokenizer, c["input_id"]),
            })
        return cases
