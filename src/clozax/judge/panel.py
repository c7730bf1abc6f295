"""The report's probability panel: the trained model's target probability and top predictions
at a fixed, result-independent choice of held-out positions (inference; the report renders)."""

from __future__ import annotations

import numpy as np
from tokenizers import Tokenizer

from clozax.core.masking import KIND_NAMES, Kind
from clozax.judge.failures import marked_context, token_piece
from clozax.judge.slots import make_slot_fn, slot_outputs
from clozax.train.heldout import EvalMasks, load_eval_masks
from clozax.train.run_dir import open_run_dataset

PANEL_EXAMPLES = 6
PANEL_TOP = 5


def panel_positions(masks, n: int = PANEL_EXAMPLES) -> list[tuple[int, int]]:
    """(mask-set index, slot) of ``n`` positions chosen without looking at any prediction: evenly
    spaced eval rows, in each the first selected slot replaced by [MASK] (else the first one)."""
    chosen = []
    for i in np.unique(np.linspace(0, masks.rows.size - 1, n).round().astype(int)):
        valid = np.nonzero(masks.valid[i])[0]
        if valid.size == 0:
            continue
        masked = [j for j in valid if int(masks.kinds[i, j]) == Kind.MASK]
        chosen.append((int(i), int(masked[0] if masked else valid[0])))
    return chosen


def probability_panel(run, n: int = PANEL_EXAMPLES) -> list[dict]:
    """The trained model's target probability and top predictions at ``panel_positions``."""
    dataset = open_run_dataset(run)
    masks, _ = load_eval_masks(run.path)
    chosen = panel_positions(masks, n)
    if not chosen:
        return []
    idx = np.array([i for i, _ in chosen])
    sub = EvalMasks(*(a[idx] for a in masks))
    slot_fn = make_slot_fn(run.config.model, PANEL_TOP)
    out = slot_outputs(run.params, run.config.model, dataset.heldout, sub,
                       batch_size=len(chosen), slot_fn=slot_fn)
    tokenizer = Tokenizer.from_file(str(run.tokenizer_path))
    special_ids = sorted(set(dataset.specials.values()))
    examples = []
    for k, (_, j) in enumerate(chosen):
        row, position = int(sub.rows[k]), int(sub.positions[k, j])
        tokens = np.asarray(dataset.heldout.tokens[row])
        examples.append({
            "row": row,
            "position": position,
            "kind": KIND_NAMES[Kind(int(sub.kinds[k, j]))],
            "target": token_piece(tokenizer, int(tokens[position])),
            "target_probability": float(np.exp(-out.nll[k, j])),
            "target_rank": int(out.rank[k, j]),
            "top": [[token_piece(tokenizer, t), float(p)]
                    for t, p in zip(out.top_ids[k, j], out.top_probs[k, j], strict=True)],
            "text": marked_context(tokenizer, tokens, np.asarray(dataset.heldout.segments[row]),
                                   position, special_ids, width=20),
        })
    return examples
