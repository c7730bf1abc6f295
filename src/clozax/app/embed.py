"""``clozax embed`` and ``clozax retrieval``'s command lines (registered by ``clozax.app.cli``):
they parse and call ``clozax.train.contrastive.stage`` and ``clozax.judge.retrieval.compare``.
The stage's options are declared once, below, and shared by both commands."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

Opt = typer.Option
Pairs = Annotated[str, Opt(help="Pairs: 'first-sentence' (a document's first sentence ↔ the "
                                "rest), 'simcse' (a text twice, dropout the only noise), "
                                "'crops' (two crops of a document) — from the run's train "
                                "split — or a JSONL file of query/positive(/negative).")]
Steps = Annotated[int, Opt(help="Updates of the stage (the warm-up is a tenth of them).")]
BatchSize = Annotated[int, Opt(help="Pairs per step: the contrastive batch, gathered over "
                                    "every device.")]
Chunks = Annotated[int, Opt(help="Gradient-cache chunks: the encoder runs on batch/chunks "
                                 "pairs at a time (memory); the same numbers for any chunks.")]
Temperature = Annotated[float, Opt(help="InfoNCE temperature (SimCSE's 0.05).")]
LearningRate = Annotated[float, Opt(help="AdamW's peak learning rate.")]
Symmetric = Annotated[bool, Opt(help="Also score each positive choosing its query.")]
Pooling = Annotated[str, Opt(help="'mean' (the real tokens' mean) or 'cls'.")]
SeqLen = Annotated[int, Opt(help="Tokens per text, [CLS] and [SEP] included.")]
Dropout = Annotated[float, Opt(help="Encoder dropout during the stage.")]
AttentionDropout = Annotated[float, Opt(help="Dropout on the attention probabilities during "
                                             "the stage (BERT's attention_probs_dropout_prob, "
                                             "which sentence-transformers keeps: MiniLM's "
                                             "0.1); it runs the dense einsum attention path.")]
Seed = Annotated[int, Opt(help="The stage's seed (pair order, dropout; retrieval's first).")]
MaxPairs = Annotated[int | None, Opt(help="At most this many corpus pairs (a keyed "
                                          "sample).")]


Negatives = Annotated[str, Opt(help="'bm25': a hard negative per corpus pair, mined by BM25 "
                                    "from the pairs' own positives (recorded in "
                                    "OUT/negatives.jsonl); 'none': in-batch negatives only.")]
Pack = Annotated[bool, Opt(help="Pack several texts into a row, each attending only to itself "
                                 "(fewer rows when texts are short; with --dropout 0 the "
                                 "unpacked stage's numbers). Needs --steps and --chunks 1.")]
NegativesSkip = Annotated[int, Opt(help="With --negatives bm25: BM25's best-ranked documents "
                                        "passed over as likely positives.")]
Data = Annotated[Path | None, Opt(help="An imported encoder's corpus (it has none of its "
                                       "own): a dataset `clozax prepare --tokenizer "
                                       "RUN/tokenizer.json` wrote; its train split gives the "
                                       "pairs, its held-out split the retrieval set.")]


def _data(data: Path | None) -> str | None:
    return None if data is None else str(data.absolute())


def _rates(given: str | None) -> tuple[float, ...]:
    """``--learning-rates``' peaks, each a positive number; () without it."""
    if given is None:
        return ()
    try:
        rates = tuple(float(x) for x in given.split(","))
    except ValueError:
        rates = ()
    if not rates or not all(0 < r < float("inf") for r in rates):
        raise ValueError(f"--learning-rates {given!r}: give positive peaks separated by commas, "
                         "e.g. 2e-5,5e-5,1e-4")
    return rates


def embed(
    run: Annotated[Path, typer.Argument(help="Run directory (clozax train or import-hf).")],
    out: Annotated[Path, Opt(help="The stage's run directory (new, or one to resume).")],
    pairs: Pairs = "first-sentence",
    steps: Steps = 200,
    minutes: Annotated[float | None, Opt(help="Instead of --steps: as many updates as fit "
                                              "in this many minutes (set before the first "
                                              "from a few timed steps, the warm-up a tenth "
                                              "of it; re-estimated as it runs).")] = None,
    batch_size: BatchSize = 64, chunks: Chunks = 1, temperature: Temperature = 0.05,
    learning_rate: LearningRate = 1e-4, symmetric: Symmetric = False,
    pooling: Pooling = "mean", seq_len: SeqLen = 64, dropout: Dropout = 0.1,
    attention_dropout: AttentionDropout = 0.0, seed: Seed = 0, max_pairs: MaxPairs = None,
    negatives: Negatives = "none", negatives_skip: NegativesSkip = 3,
    pack: Pack = False, data: Data = None,
    save_every: Annotated[int, Opt(help="A checkpoint every this many updates (and at the "
                                        "end).")] = 100,
    save_every_minutes: Annotated[float | None, Opt(help="Also a checkpoint when this many "
                                                         "minutes have passed since the "
                                                         "last.")] = None,
):
    """Turn an encoder into an embedder: a contrastive stage (InfoNCE, in-batch negatives).

    Several processes join one job as `clozax train`'s do, from CLOZAX_COORDINATOR,
    CLOZAX_NUM_PROCESSES and CLOZAX_PROCESS_ID: the contrastive batch is then the batch of
    every device of every process."""
    from clozax.train import compile_cache, distributed

    distributed.initialize()  # a multi-process job when the environment names one
    compile_cache.enable()
    from clozax.train.contrastive.stage import StageSettings
    from clozax.train.contrastive.stage import embed as run_stage

    settings = StageSettings(pairs=pairs, steps=steps, minutes=minutes, batch_size=batch_size,
                             chunks=chunks, temperature=temperature,
                             learning_rate=learning_rate, symmetric=symmetric, pooling=pooling,
                             seq_len=seq_len, dropout=dropout,
                             attention_dropout=attention_dropout, seed=seed, max_pairs=max_pairs,
                             negatives=negatives, negatives_skip=negatives_skip, pack=pack,
                             data=_data(data), save_every=save_every,
                             save_every_minutes=save_every_minutes)
    result = run_stage(run, out, settings)
    if result["trained"]:
        print(f"trained {result['trained']} contrastive steps into {out}; final loss "
              f"{result['loss']:.4f} (clozax retrieval {out}: how it retrieves)")
    else:
        print(f"{out} already has its {result['steps']} steps: nothing trained")


def retrieval(
    run: Annotated[Path, typer.Argument(help="A run (clozax train, import-hf) or a stage's "
                                             "(clozax embed).")],
    beir: Annotated[Path | None, Opt(help="A retrieval set in BEIR's layout (corpus.jsonl, "
                                          "queries.jsonl, qrels/SPLIT.tsv); default: the "
                                          "held-out split's first-sentence→rest set.")] = None,
    split: Annotated[str, Opt(help="With --beir: the qrels file's split.")] = "test",
    seeds: Annotated[int, Opt(help="Stage seeds per encoder (the interval is over them).")] = 3,
    max_queries: Annotated[int, Opt(help="Queries of the held-out set (a keyed sample).")]
    = 500,
    out: Annotated[Path | None, Opt(help="Where to write the JSON (default: "
                                         "RUN/retrieval.json).")] = None,
    pairs: Pairs = "first-sentence", steps: Steps = 200, batch_size: BatchSize = 64,
    chunks: Chunks = 1, temperature: Temperature = 0.05, learning_rate: LearningRate = 1e-4,
    symmetric: Symmetric = False, pooling: Pooling = "mean", seq_len: SeqLen = 64,
    dropout: Dropout = 0.1, attention_dropout: AttentionDropout = 0.0, seed: Seed = 0,
    max_pairs: MaxPairs = None, negatives: Negatives = "none",
    negatives_skip: NegativesSkip = 3, pack: Pack = False,
    data: Data = None,
    learning_rates: Annotated[str | None, Opt(help="Instead of --learning-rate: peaks to "
                                                   "choose from (e.g. 2e-5,5e-5,1e-4), on "
                                                   "retrieval over the train split's "
                                                   "validation tenth, which every stage then "
                                                   "leaves out of its pairs; the held-out set "
                                                   "is scored with the chosen one only.")]
    = None,
    control: Annotated[bool, Opt(help="Also run the random-init control through the stage "
                                      "(as costly as the stage itself).")] = True,
):
    """Score retrieval: BM25, the raw encoder, and random-init vs trained through the stage."""
    from clozax.train import compile_cache

    compile_cache.enable()
    from clozax.judge.claims import difference_words
    from clozax.judge.retrieval.compare import retrieval_run
    from clozax.train.contrastive.stage import StageSettings

    if seeds < 1:
        raise ValueError(f"--seeds {seeds}: give at least 1 (2 or more for an interval)")
    settings = StageSettings(pairs=pairs, steps=steps, batch_size=batch_size, chunks=chunks,
                             temperature=temperature, learning_rate=learning_rate,
                             symmetric=symmetric, pooling=pooling, seq_len=seq_len,
                             dropout=dropout, attention_dropout=attention_dropout, seed=seed,
                             max_pairs=max_pairs, negatives=negatives,
                             negatives_skip=negatives_skip, pack=pack, data=_data(data))
    result = retrieval_run(run, settings, seeds, beir, split, max_queries, out,
                           learning_rates=_rates(learning_rates), control=control)
    for name, d in result["differences_ndcg@10"].items():
        print(f"nDCG@10 {name.replace('_', ' ')}: {difference_words(d)}")
    print(f"wrote {result['path']} ({result['seconds']:.0f} s)")
