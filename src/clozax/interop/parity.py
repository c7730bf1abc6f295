"""Logit parity with ``transformers`` itself: the check behind ``clozax export --verify`` and
the interop tests. Needs torch + transformers (imported only when called)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from clozax.core import model as model_lib
from clozax.train.run_dir import load_run


def hf_parity(run_dir: Path, hf_dir: Path, texts: list[str]) -> float:
    """Max |clozax - transformers| MLM logit (hidden state for an encoder-only run) over the
    non-pad positions of ``texts``, right-padded into one batch. Needs torch + transformers."""
    try:
        import torch
        import transformers
    except ImportError:
        raise ValueError("the parity check needs torch and transformers; install the "
                         "'bench' extra or drop --verify") from None
    run = load_run(run_dir)
    ids, mask = encode_batch(run.tokenizer_path, texts, run.specials["pad"])
    c = run.config.model
    run.check_length(ids.shape[1], "the longest text")
    segments = mask.astype(np.int32)  # one document per row
    with_head = run.has_mlm_head
    auto = transformers.AutoModelForMaskedLM if with_head else transformers.AutoModel
    hf = auto.from_pretrained(str(hf_dir)).eval()
    with torch.no_grad():
        out = hf(input_ids=torch.from_numpy(ids).long(),
                 attention_mask=torch.from_numpy(mask).long())
    if with_head:
        positions = np.broadcast_to(np.arange(ids.shape[1]), ids.shape)
        ours = np.asarray(model_lib.logits_at(run.params, c, ids, segments, positions))
        theirs = out.logits.numpy()
    else:
        ours = np.asarray(model_lib.apply(run.params, c, ids, mask, segments))
        theirs = out.last_hidden_state.numpy()
    return float(np.abs(ours - theirs)[mask].max())


def encode_batch(tokenizer_path: Path, texts: list[str], pad_id: int):
    """(ids, mask): (batch, seq) int32 right-padded token ids and bool real-token mask."""
    tok = Tokenizer.from_file(str(tokenizer_path))
    tok.no_padding()
    tok.no_truncation()
    rows = [tok.encode(t).ids for t in texts]
    seq = max(len(r) for r in rows)
    ids = np.full((len(rows), seq), pad_id, np.int32)
    mask = np.zeros((len(rows), seq), bool)
    for i, r in enumerate(rows):
        ids[i, :len(r)], mask[i, :len(r)] = r, True
    return ids, mask
