"""Quality side by side: a ``clozax retrieval`` result's trained stage against
``sentence-transformers``' ``MultipleNegativesRankingLoss`` trained on the same pairs, in the same
batches, for the same steps at the same peak, scored on the same retrieval set by the same code.

    python benchmarks/mnrl_parity.py out/recipe-minilm.json
    python benchmarks/mnrl_parity.py RUN/retrieval.json --model path/to/hf-model --seeds 2

The clozax side is read from the JSON ``clozax retrieval`` wrote (its ``trained_stage`` per
seed, nDCG@10, MRR@10, Recall@100); this script trains the MNRL side once per seed of it:

- the encoder: the Hugging Face directory the run was imported from (``run.json``'s
  ``imported_from``, or ``--model``), as ``SentenceTransformer`` loads it — its own dropout
  (all-MiniLM-L6-v2: 0.1 on hidden states and on attention probabilities; clozax's stage
  drops attention probabilities only with ``--attention-dropout``, 0 by default), mean
  pooling;
- the pairs: the stage's own token rows (``train/contrastive/rows.py``: the same texts, BM25
  negatives and cut to ``--seq-len``), batch ``i`` of seed ``s`` the stage's (``pairs_at``),
  each side padded to its longest text as sentence-transformers' collator pads it; a negative
  column, when the stage has one, is MNRL's third column;
- the loss ``MultipleNegativesRankingLoss(scale=1/temperature)``; ``torch.optim.AdamW`` in the
  HF Trainer's two weight-decay groups (0.01), clipping at 1.0, the stage's schedule (linear
  warm-up over a tenth of the steps, linear decay to 0, the first update at rate 0, as
  ``stage_rate``), ``torch.manual_seed(seed)`` for the dropout.

Scoring: ``SentenceTransformer.encode`` (queries cut to ``--seq-len``, documents to the length
``clozax retrieval`` gives them), then ``judge/retrieval``'s exact search, self-hit rule and
``trec_eval`` metrics; the set is rebuilt and its digest checked against the JSON's. Prints each
seed, then MNRL's mean and clozax − MNRL with its 95 % interval over seeds; writes
``benchmarks/out/mnrl_parity.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_side import hf_adamw  # noqa: E402

from clozax.judge.claims import difference_words, seed_difference  # noqa: E402
from clozax.judge.retrieval import metrics as metrics_lib  # noqa: E402
from clozax.judge.retrieval.compare import DEPTH, DOCUMENT_LENGTH  # noqa: E402
from clozax.judge.retrieval.heldout_set import heldout_set  # noqa: E402
from clozax.judge.retrieval.search import as_run, blocks, top_k  # noqa: E402
from clozax.train.contrastive.settings import StageSettings  # noqa: E402
from clozax.train.contrastive.stage import make_stage, pairs_at  # noqa: E402
from clozax.train.contrastive.step import stage_rate  # noqa: E402
from clozax.train.run_dir import load_run  # noqa: E402

CLIP, WEIGHT_DECAY = 1.0, 0.01
OUT = Path(__file__).resolve().parent / "out" / "mnrl_parity.json"


def stage_settings(result: dict) -> StageSettings:
    """The stage ``clozax retrieval`` trained, as ``StageSettings``."""
    fields = {f.name for f in dataclasses.fields(StageSettings)}
    settings = StageSettings(**{k: v for k, v in result["stage"].items() if k in fields})
    if settings.symmetric or settings.pooling != "mean" or settings.budget_revisions:
        sys.exit("mnrl_parity: only a --steps stage, mean pooling, not --symmetric (MNRL's "
                 "setting) is compared")
    return settings


def rate(count: int, steps: int) -> float:
    """``stage_rate``'s multiplier of the peak at update ``count`` (0-based): the stage's own
    function, so the two sides cannot drift apart."""
    return float(stage_rate(1.0)(count, steps))


def torch_schedule(optimizer, steps: int):
    """The stage's schedule on a torch optimizer: ``step()`` it after each update."""
    import torch

    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda count: rate(count, steps))


def train_mnrl(model_dir: str, run, settings: StageSettings):
    """The MNRL side of one seed: a ``SentenceTransformer`` trained on the stage's batches."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import losses

    torch.manual_seed(settings.seed)
    stage = make_stage(run, dataclasses.replace(settings, pack=False), settings.steps)
    pad = run.specials["pad"]
    model = SentenceTransformer(model_dir, device="cpu")
    model.train()
    loss_fn = losses.MultipleNegativesRankingLoss(model, scale=1 / settings.temperature)
    optimizer = hf_adamw(model, settings.learning_rate, (0.9, 0.999), 1e-8, WEIGHT_DECAY,
                         fused=True)
    schedule = torch_schedule(optimizer, settings.steps)
    sides = [s for s in ("query", "positive", "negative") if s in stage.rows]
    losses_seen = []
    for i in range(settings.steps):
        chosen = pairs_at(stage, i)
        features = []
        for side in sides:
            rows = stage.rows[side][chosen]
            rows = torch.from_numpy(rows[:, :int((rows != pad).sum(axis=1).max())]
                                    .astype(np.int64))
            features.append({"input_ids": rows, "attention_mask": (rows != pad).long(),
                             "token_type_ids": torch.zeros_like(rows)})
        loss = loss_fn(features, None)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses_seen.append(float(loss.detach()))
    model.eval()
    return model, losses_seen


def scores(model, found, query_len: int, document_len: int) -> dict:
    """nDCG@10, MRR@10, Recall@100 of ``model`` as ``clozax retrieval`` scores a row."""
    doc_ids, query_ids = list(found.documents), list(found.queries)

    def encode(texts, length):
        model.max_seq_length = length
        return model.encode(texts, batch_size=64, normalize_embeddings=True,
                            convert_to_numpy=True).astype(np.float32)

    docs = encode([found.documents[d] for d in doc_ids], document_len)
    queries = encode([found.queries[q] for q in query_ids], query_len)
    top, index = top_k(queries, blocks(docs, 4096), DEPTH + 1)
    return metrics_lib.mean(metrics_lib.per_query(
        found.qrels, as_run(query_ids, doc_ids, top, index, k=DEPTH)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("result", type=Path, help="a clozax retrieval JSON (its trained stage)")
    ap.add_argument("--model", help="the HF directory the run was imported from (default: "
                                    "run.json's imported_from)")
    ap.add_argument("--seeds", type=int, help="MNRL seeds (default: the JSON's)")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(os.cpu_count())
    result = json.loads(args.result.read_text())
    settings = stage_settings(result)
    run = load_run(Path(result["encoder"]))
    model_dir = args.model or run.info.get("imported_from")
    if not model_dir:
        sys.exit(f"mnrl_parity: run {run.path} was not imported; give --model DIR")
    found, described = heldout_set(run, key=result["set"].get("key", 0),
                                   max_queries=result["set"]["queries"], data=settings.data)
    if described["sha256"] != result["set"]["sha256"]:
        sys.exit("mnrl_parity: the retrieval set rebuilt here is not the JSON's")
    clozax_rows = result["rows"]["trained_stage"]["per_seed"]
    seeds = args.seeds or len(clozax_rows)
    document_len = max(settings.seq_len, min(run.trained_length, DOCUMENT_LENGTH))
    per_seed, started = [], time.perf_counter()
    for i in range(seeds):
        s = dataclasses.replace(settings, seed=settings.seed + i)
        t = time.perf_counter()
        model, seen = train_mnrl(model_dir, run, s)
        per_seed.append({**scores(model, found, s.seq_len, document_len),
                         "first_loss": seen[0], "last_loss": seen[-1]})
        print(f"MNRL seed {s.seed}: nDCG@10 {per_seed[-1]['ndcg@10']:.4f}  MRR@10 "
              f"{per_seed[-1]['mrr@10']:.4f}  Recall@100 {per_seed[-1]['recall@100']:.4f}  "
              f"(loss {seen[0]:.3f} -> {seen[-1]:.3f}, {time.perf_counter() - t:.0f} s); "
              f"clozax {clozax_rows[i]['ndcg@10']:.4f}", flush=True)
    clozax_ndcg = [r["ndcg@10"] for r in clozax_rows[:seeds]]
    mnrl_ndcg = [r["ndcg@10"] for r in per_seed]
    diff = seed_difference(clozax_ndcg, mnrl_ndcg)
    print(f"nDCG@10 MNRL {np.mean(mnrl_ndcg):.4f}, clozax {np.mean(clozax_ndcg):.4f}; clozax "
          f"minus MNRL: {difference_words(diff)}")
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps({
        "result": str(args.result), "set": described, "stage": dataclasses.asdict(settings),
        "model": model_dir, "mnrl": per_seed, "clozax": clozax_rows[:seeds],
        "clozax_minus_mnrl_ndcg@10": diff, "seconds": round(time.perf_counter() - started, 1),
    }, indent=2))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
