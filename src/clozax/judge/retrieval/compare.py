"""``clozax retrieval RUN``: retrieval scored side by side, on the same queries.

Rows: BM25 (``data/bm25.py``); the encoder as pretrained ("raw": the
stage's pooling, no stage); the random-init encoder through the contrastive stage; the trained
encoder through the same stage — the last two once per seed (the stage's seed: its pairs' order, its
dropout and, for the control, the initialisation), compared as a mean difference with its 95 %
interval over seeds (``judge/claims.py`` ``seed_difference``). Given a stage's own run (``clozax
embed``'s ``--out``), its source is the trained encoder, its settings the stage's, and the run
itself is scored as one more row.

``learning_rates`` (``--learning-rates A,B,...``): the stage's peak chosen on validation, never
on the set it is scored on. Every stage then leaves the train split's validation tenth out of
its pairs (``withhold_validation``); each candidate trains once (the first seed) and is scored
on that tenth's first-sentence→rest set (``heldout_set(split="validation")``); the best nDCG@10
(the first on a tie) is the stage's peak, its first-seed model kept as the first seed's, and only
then is the held-out set scored. ``control=False`` (``--no-control``) leaves out the random-init
control, which costs as much as the stage and says little of a published encoder.

The set: the user's in BEIR's layout (``--beir DIR``), or the held-out construction of
``judge/retrieval/heldout_set.py``. Dense search is exact, in blocks (``top_k``), cosine similarity.
Every row is scored as BEIR scores it (``EvaluateRetrieval.evaluate`` with its defaults): a
document whose id is the query's is always dropped from the query's ranking, ``DEPTH`` others
kept (``search.py`` ``as_run``, ``bm25.py``); BM25 ranks only the documents that match; the
metrics are ``trec_eval``'s, averaged over every judged query (``metrics.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from clozax.core import files
from clozax.data.bm25 import bm25_run
from clozax.data.pairs import tokenize
from clozax.data.tokenizer import load_tokenizer
from clozax.judge.claims import seed_difference
from clozax.judge.retrieval import metrics as metrics_lib
from clozax.judge.retrieval.beir import RetrievalSet, read_beir
from clozax.judge.retrieval.heldout_set import heldout_set
from clozax.judge.retrieval.search import as_run, blocks, top_k
from clozax.train.contrastive.stage import StageSettings, train_in_memory
from clozax.train.contrastive.step import make_embedder
from clozax.train.run_dir import LoadedRun, load_run

ENCODE_BATCH = 64
NARROWEST = 16  # the fewest columns an encoding batch runs at
DEPTH = 100  # documents ranked per query (Recall@100)
BLOCK = 4096  # documents scored at a time
DOCUMENT_LENGTH = 512  # documents are cut to the run's trained length, at most this


def encode(params, model_config, run: LoadedRun, texts: list[str], seq_len: int,
           pooling: str) -> np.ndarray:
    """Unit-length embeddings [N, H] of ``texts`` cut to ``seq_len`` tokens. Longest first,
    ``ENCODE_BATCH`` at a time, each batch cut to the next power of two (at least
    ``NARROWEST``, at most ``seq_len``) that holds its longest text, as sentence-transformers
    sorts by length: short texts are not run at a long collection's length, and a few
    compiled programs serve every batch (the cut columns are padding, which attention and
    pooling mask)."""
    s = run.specials
    ids = tokenize(load_tokenizer(run.tokenizer_path), texts, seq_len, s["cls"], s["sep"],
                   s["pad"])
    apply = _jitted_encoder(dataclasses.replace(model_config, dropout=0.0), pooling, s["pad"])
    lengths = (ids != s["pad"]).sum(axis=1)
    order = np.argsort(-lengths, kind="stable")
    out = np.empty((len(ids), model_config.hidden), np.float32)  # [N, H]
    for start in range(0, len(ids), ENCODE_BATCH):
        chosen = order[start:start + ENCODE_BATCH]
        block = ids[chosen, :width_for(int(lengths[chosen].max()), seq_len)]
        padded = np.pad(block, ((0, ENCODE_BATCH - len(block)), (0, 0)),
                        constant_values=s["pad"])
        out[chosen] = np.asarray(apply(params, jnp.asarray(padded)))[:len(block)]
    return out


def width_for(longest: int, seq_len: int) -> int:
    """The columns a batch whose longest text has ``longest`` tokens runs at."""
    return min(seq_len, max(NARROWEST, 1 << max(longest - 1, 0).bit_length()))


@functools.lru_cache(maxsize=4)
def _jitted_encoder(model_config, pooling: str, pad: int):
    embedder = make_embedder(model_config, pooling)
    return jax.jit(lambda p, x: embedder(p, x, x != pad, None))


def dense_scores(params, model_config, run: LoadedRun, found: RetrievalSet, seq_len: int,
                 pooling: str) -> dict[str, float]:
    """nDCG@10, MRR@10 and Recall@100 of an encoder on ``found``: queries cut to ``seq_len``
    tokens (the stage's), documents to the run's trained length (at most
    ``DOCUMENT_LENGTH``), as BM25 reads them whole."""
    doc_ids, query_ids = list(found.documents), list(found.queries)
    docs = encode(params, model_config, run, [found.documents[d] for d in doc_ids],
                  max(seq_len, min(run.trained_length, DOCUMENT_LENGTH)), pooling)
    queries = encode(params, model_config, run, [found.queries[q] for q in query_ids],
                     seq_len, pooling)
    scores, index = top_k(queries, blocks(docs, BLOCK), DEPTH + 1)  # [Q, DEPTH + 1]
    ranking = as_run(query_ids, doc_ids, scores, index, k=DEPTH)  # the self-hit dropped
    return metrics_lib.mean(metrics_lib.per_query(found.qrels, ranking))


RESULT_FILE = "retrieval.json"


def retrieval_run(run_dir: Path, settings: StageSettings, seeds: int, beir: Path | None = None,
                  split: str = "test", max_queries: int = 500, out: Path | None = None,
                  say=print, learning_rates: tuple[float, ...] = (),
                  control: bool = True) -> dict:
    """``compare``, written to ``out`` (default ``RUN/retrieval.json``, which the report
    reads) with its path under ``"path"``."""
    result = compare(run_dir, settings, seeds, beir, split, max_queries, say, learning_rates,
                     control)
    target = Path(out) if out is not None else Path(run_dir) / RESULT_FILE
    files.write_json(target, result)
    return {**result, "path": str(target)}


def compare(run_dir: Path, settings: StageSettings, seeds: int, beir: Path | None = None,
            split: str = "test", max_queries: int = 500, say=print,
            learning_rates: tuple[float, ...] = (), control: bool = True) -> dict:
    """Every row (see the module docstring) and the differences, as a JSON-ready dict."""
    started = time.perf_counter()
    given = load_run(run_dir)
    stage_info = given.info.get("stage")
    source = load_run(Path(stage_info["source_run"])) if stage_info else given
    if stage_info:
        if settings.data is not None and settings.data != stage_info.get("data"):
            trained_on = stage_info.get("data") or "its source run's dataset"
            raise ValueError(f"--data {settings.data}: stage {run_dir} trained on "
                             f"{trained_on}, which its retrieval set is built from; leave "
                             "--data out")
        if learning_rates:
            raise ValueError(f"--learning-rates: stage {run_dir} has its own peak "
                             f"({stage_info['learning_rate']:g}); choose one for the encoder it "
                             "was trained from (clozax retrieval SOURCE_RUN --learning-rates ...)")
        settings = _recorded(stage_info, settings, given.config.train.steps)
    chosen = None
    if learning_rates:
        if beir is not None:
            raise ValueError("--learning-rates chooses the peak on the corpus's validation "
                             "tenth, for its held-out set; with --beir give one --learning-rate")
        settings = dataclasses.replace(settings, withhold_validation=True)
        chosen = choose_learning_rate(source, settings, learning_rates, max_queries, say)
        settings = dataclasses.replace(settings, learning_rate=chosen["learning_rate"])
    found, described = _the_set(source, beir, split, max_queries, settings.data)
    say(f"retrieval set: {described['queries']:,} queries, {described['documents']:,} "
        f"documents ({described['construction']})")
    rows = {"bm25": metrics_lib.mean(metrics_lib.per_query(
        found.qrels, bm25_run(found.documents, found.queries, DEPTH)))}
    say(_line("BM25", rows["bm25"]))
    rows["raw"] = dense_scores(source.params, source.config.model, source, found,
                               settings.seq_len, settings.pooling)
    say(_line(f"raw encoder ({settings.pooling} pooling, no stage)", rows["raw"]))
    if stage_info:
        rows["this_stage"] = dense_scores(given.params, given.config.model, given, found,
                                          settings.seq_len, settings.pooling)
        say(_line(f"{run_dir} (this stage)", rows["this_stage"]))
    per_seed = {"random_init_stage": [], "trained_stage": []}
    for i in range(seeds):
        for name, random_init in (("random_init_stage", True), ("trained_stage", False)):
            if random_init and not control:
                continue
            s = dataclasses.replace(settings, seed=settings.seed + i, random_init=random_init)
            kept = chosen is not None and i == 0 and not random_init
            params = chosen.pop("params") if kept else train_in_memory(source, s)[0]
            per_seed[name].append(dense_scores(params, source.config.model, source, found,
                                               s.seq_len, s.pooling))
            say(_line(f"{name.replace('_', ' ')} (seed {s.seed})", per_seed[name][-1]))
    return _summary(rows, per_seed, described, settings, seeds, source, started, chosen)


def choose_learning_rate(source: LoadedRun, settings: StageSettings,
                         learning_rates: tuple[float, ...], max_queries: int, say) -> dict:
    """The peak of ``learning_rates`` whose first-seed stage (the validation tenth withheld)
    scores the best nDCG@10 on that tenth's set, the first on a tie: ``{"learning_rate",
    "on" (the set's description), "raw" (the encoder's own scores there, no stage),
    "candidates": {rate: scores}, "params" (the chosen first-seed model)}``."""
    if len(set(learning_rates)) != len(learning_rates):
        raise ValueError(f"--learning-rates {','.join(map(str, learning_rates))}: a peak is "
                         "given twice; give each once")
    found, described = heldout_set(source, max_queries=max_queries, data=settings.data,
                                   split="validation")
    say(f"choosing the peak on validation: {described['queries']:,} queries, "
        f"{described['documents']:,} documents of the train split's validation tenth")
    raw = dense_scores(source.params, source.config.model, source, found, settings.seq_len,
                       settings.pooling)  # what the stage is for: beating this
    say(_line("validation, raw encoder (no stage)", raw))
    candidates, best = {}, None
    for rate in learning_rates:
        params, _ = train_in_memory(source, dataclasses.replace(settings, learning_rate=rate))
        scores = dense_scores(params, source.config.model, source, found, settings.seq_len,
                              settings.pooling)
        candidates[f"{rate:g}"] = scores
        say(_line(f"validation, peak {rate:g} (seed {settings.seed})", scores))
        if best is None or scores["ndcg@10"] > best[1]:
            best = (rate, scores["ndcg@10"], params)
    say(f"peak chosen on validation: {best[0]:g}")
    return {"learning_rate": best[0], "on": described, "raw": raw, "candidates": candidates,
            "params": best[2]}


def _recorded(stage_info: dict, settings: StageSettings, steps: int) -> StageSettings:
    """A stage run's own settings (its length as trained), the command's seeds kept."""
    fields = {f.name for f in dataclasses.fields(StageSettings)} - {"random_init", "seed"}
    recorded = {k: v for k, v in stage_info.items() if k in fields}
    return dataclasses.replace(settings, **recorded, steps=steps, minutes=None,
                               seed=stage_info.get("seed", settings.seed))


def _the_set(run: LoadedRun, beir: Path | None, split: str, max_queries: int,
             data: str | None):
    if beir is not None:
        found = read_beir(beir, split)
        return found, {"construction": f"BEIR layout {beir} ({split})",
                       "queries": len(found.queries), "documents": len(found.documents)}
    return heldout_set(run, max_queries=max_queries, data=data)


def _summary(rows, per_seed, described, settings, seeds, source, started, chosen) -> dict:
    def mean_of(results):
        return {m: float(np.mean([r[m] for r in results])) for m in results[0]}

    for name, results in per_seed.items():
        if results:  # the control is left out under control=False
            rows[name] = {**mean_of(results), "per_seed": results}
    ndcg = {name: [r["ndcg@10"] for r in results] for name, results in per_seed.items()}
    trained = ndcg["trained_stage"]
    differences = {
        "trained_stage_minus_random_init_stage": seed_difference(
            trained, ndcg["random_init_stage"]) if ndcg["random_init_stage"] else None,
        "trained_stage_minus_bm25": seed_difference(trained, rows["bm25"]["ndcg@10"]),
        "trained_stage_minus_raw": seed_difference(trained, rows["raw"]["ndcg@10"]),
    }
    return {
        "set": described, "encoder": str(source.path), "step": source.step,
        "stage": {**dataclasses.asdict(settings), "seeds": seeds}, "rows": rows,
        "differences_ndcg@10": {k: v for k, v in differences.items() if v is not None},
        **({} if chosen is None else {"learning_rate_choice": {
            k: v for k, v in chosen.items() if k != "params"}}),
        "seconds": round(time.perf_counter() - started, 1),
    }


def _line(name: str, scores: dict) -> str:
    return (f"{name}: nDCG@10 {scores['ndcg@10']:.4f}  MRR@10 {scores['mrr@10']:.4f}  "
            f"Recall@100 {scores['recall@100']:.4f}")
