"""The small-budget sweep: each candidate recipe pretrains for the same wall-clock on the built-in
corpus (``clozax train --minutes M``: the step count fixed once from the measured pace), then is
judged downstream as ``benchmarks/downstream.py`` judges an encoder — the built-in task on the
honest split and WordNet's categories, each beside its random-init control, TF-IDF and the
constant predictor, and retrieval beside BM25, as mean differences with 95 % intervals over
seeds. A choice is kept in ``clozax train --recipe budget`` only if it pays here.

    python benchmarks/budget.py --minutes 8 --candidates budget,mask15,modern
    python benchmarks/budget.py --minutes 8 --candidates budget --tasks builtin --epochs 10

Candidates (``CANDIDATES``): a preset, a recipe, the dataset's row length, vocabulary and case,
and ``--set`` overrides (a ``--set`` that contradicts the recipe is refused, as in ``clozax
train``); each
trains into ``OUT/NAME/run`` (an existing finished run is reused: rerun with another ``--out``
to retrain). Prints one line per candidate and task, and writes ``OUT/budget.json``.
Run it on a quiet machine: the step count each candidate gets is its measured pace.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import downstream

ROOT = Path(__file__).resolve().parents[1]


VOCAB = 8192  # the demo's BPE vocabulary, the candidates' default


@dataclass(frozen=True)
class Candidate:
    what: str
    preset: str = "small"
    recipe: str | None = "budget"
    seq_len: int = 128
    sets: tuple[str, ...] = field(default_factory=tuple)
    vocab_size: int = VOCAB  # the dataset's BPE vocabulary
    lowercase: bool = True  # the tokenizer lowercases (the demo's); False: cased


CANDIDATES = {
    "budget": Candidate("--recipe budget (the demo's): small (4 x 256), 128-token rows, masking "
                        "0.4, AdamW peak 1e-3, linear decay"),
    "mask15": Candidate("the preset's own: masking 0.15 (the recipe's control)", recipe=None,
                        sets=("train.microbatches=2",)),
    "rows64": Candidate("budget, 64-token rows, batch 64 (the same tokens a step)", seq_len=64,
                        sets=("train.batch_size=64",)),
    "wsd": Candidate("budget + StableAdamW and warmup-stable-decay (the last 20 % decaying "
                     "1-sqrt to 0.02)", sets=("optim.optimizer=stable_adamw",
                                              "optim.schedule=1-sqrt", "optim.decay_fraction=0.2",
                                              "optim.end_lr_fraction=0.02")),
    "vocab4k": Candidate("budget on a 4,096-token vocabulary (each embedding row seen twice as "
                         "often in the minutes)", vocab_size=4096),
    "cased": Candidate("budget on a cased tokenizer (the demo's lowercases)", lowercase=False),
    "narrow-deep": Candidate("budget, 6 x 192 (heads 3, MLP 768)",
                             sets=("model.layers=6", "model.hidden=192", "model.heads=3",
                                   "model.intermediate=768")),
    "modern": Candidate("modern-small (6 x 256, GeGLU, RoPE) with --recipe budget",
                        preset="modern-small"),
    "modern-lr3e-3": Candidate("modern, peak 3e-3", preset="modern-small",
                               sets=("optim.learning_rate=3e-3",)),
    "modern-init": Candidate("modern, ModernBERT's initialisation (truncated normals, output "
                             "projections scaled by 1/sqrt(2 x layers))", preset="modern-small",
                             sets=('model.init="modernbert"',)),
    "modern-mask15": Candidate("modern, masking 0.15 (the preset's own) instead of the "
                               "recipe's 0.4", preset="modern-small", recipe=None,
                               sets=("train.microbatches=2",)),
    # The window may not exceed the row (train refuses it since 2026-12-05): the preset's 128
    # covered these rows whole when the lever table's row was measured.
    "modern-rows64": Candidate("modern, 64-token rows, batch 64 (the same tokens a step)",
                               preset="modern-small", seq_len=64,
                               sets=("train.batch_size=64", "model.local_window=64")),
    "modern-shallow": Candidate("modern, 4 layers instead of 6 (small's depth: more steps in "
                                "the minutes)", preset="modern-small", sets=("model.layers=4",)),
}
DATA = {"corpus": "stdlib", "heldout_fraction": 0.05, "seed": 0}


def prepared(out: Path, seq_len: int, vocab_size: int = VOCAB, lowercase: bool = True) -> Path:
    """The built-in corpus at ``seq_len``-token rows on a ``vocab_size`` BPE vocabulary, lowercased
    or cased (the demo's split, ``DATA``)."""
    name = f"data-{seq_len}" + ("" if vocab_size == VOCAB else f"-v{vocab_size}") + \
        ("" if lowercase else "-cased")
    target = out / name
    if not (target / "manifest.json").is_file():
        subprocess.run([*downstream.clozax_command(), "prepare", "--corpus",
                        "stdlib", "--out", str(target), "--seq-len", str(seq_len),
                        "--vocab-size", str(vocab_size),
                        "--lowercase" if lowercase else "--no-lowercase", "--heldout-fraction",
                        str(DATA["heldout_fraction"]), "--seed", str(DATA["seed"])], check=True)
    return target


def pretrain(name: str, candidate: Candidate, out: Path,
             length: tuple[str, float]) -> tuple[Path, dict]:
    """``clozax train`` of ``candidate`` for ``length`` (``("--minutes", M)`` or ``("--steps",
    N)``) into ``OUT/NAME/run`` (reused when done)."""
    run = out / name / "run"
    data = prepared(out, candidate.seq_len, candidate.vocab_size, candidate.lowercase)
    started = time.perf_counter()
    command = [*downstream.clozax_command(), "train", "--data", str(data),
               "--out", str(run), "--preset", candidate.preset, length[0], str(length[1])]
    for s in candidate.sets:
        command += ["--set", s]
    if candidate.recipe:
        command += ["--recipe", candidate.recipe]
    # A --steps run is always given its command: it resumes a stopped run and trains nothing
    # on a finished one. A --minutes run is reused once it exists (its length was set by its
    # first pace).
    if length[0] == "--steps" or not (run / "config.json").is_file():
        subprocess.run(command, check=True, env={**os.environ, "COLUMNS": "120"})
    config = json.loads((run / "config.json").read_text())
    return run, {"steps": config["train"]["steps"],
                 "seconds": round(time.perf_counter() - started, 1)}


def main() -> None:
    from clozax.train import compile_cache

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=8.0,
                        help="each candidate's pretraining wall-clock (the demo's 8)")
    parser.add_argument("--candidates", default="budget,mask15,rows64,wsd",
                        help=f"any of {', '.join(CANDIDATES)}")
    downstream.add_finetune_options(parser)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out" / "budget")
    args = parser.parse_args()
    unknown = set(args.candidates.split(",")) - set(CANDIDATES)
    if unknown:
        parser.error(f"unknown candidates {sorted(unknown)}; choose from {', '.join(CANDIDATES)}")
    compile_cache.enable()
    protocol = downstream.protocol_from(args)
    results = {}
    for name in args.candidates.split(","):
        candidate = CANDIDATES[name]
        print(f"── {name}: {candidate.what}", flush=True)
        run, trained = pretrain(name, candidate, args.out, ("--minutes", args.minutes))
        rows = downstream.measure([run], args.tasks.split(","), protocol, args.out,
                                  args.per_class, args.seeds, args.retrieval_steps)
        results[name] = {"candidate": candidate.__dict__ | {"sets": list(candidate.sets)},
                         "pretraining": trained, "rows": rows}
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "budget.json").write_text(json.dumps(
            {"minutes": args.minutes, "protocol": vars(protocol), "results": results},
            indent=2, default=str))
    print()
    for name, r in results.items():
        for row in r["rows"]:
            if row["encoder"] in ("trained", "trained_stage"):
                print(f"{name:14s} {r['pretraining']['steps']:5d} steps  {row['task']:9s} "
                      + summary(row))


def summary(row: dict) -> str:
    words = downstream.difference_words
    if row["task"] == "retrieval":
        n = row["ndcg@10"]
        return (f"nDCG@10 {n['trained_stage']:.3f} (random init {n['random_init_stage']:.3f}, "
                f"BM25 {n['bm25']:.3f}); − random init {words(row['minus_random_init'])}")
    return (f"{row['mean']:.4f} (TF-IDF {row['tfidf']:.4f}, constant {row['constant']:.4f}); "
            f"− random init {words(row['minus_random_init'])}; − TF-IDF "
            f"{words(row['minus_tfidf'])}")


if __name__ == "__main__":
    main()
