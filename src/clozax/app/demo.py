"""``clozax demo``: the whole product on the built-in corpus, end to end, resumably.

prepare (stdlib docstrings → ``OUT/data``) → train the ``small`` preset for ``DEMO_STEPS`` steps
(``OUT/run``) → evaluate → probe → finetune (``DEMO_FINETUNE``) → audit → report, then print
the report's path, the headline numbers and whether each claim holds. Re-running continues: the
dataset is reused when it was prepared with the same settings, training resumes from its latest
checkpoint, and evaluate / probe / finetune / audit are skipped when their JSON already
describes the latest checkpoint (a finetune stage cut short resumes at its next job).
"""

from __future__ import annotations

import gc
import json
import re
import resource
import sys
import time
from pathlib import Path

import jax
from rich.console import Console

from clozax.data import prepare
from clozax.judge import audit as audit_lib
from clozax.judge import evaluate as evaluate_lib
from clozax.judge import overlap as overlap_lib
from clozax.judge import probe as probe_lib
from clozax.judge.claims import claims, difference_words, downstream_claims
from clozax.judge.finetune import protocol as finetune_lib
from clozax.judge.retrieval import compare as retrieval_lib
from clozax.report import page as report_lib
from clozax.train import config as config_lib
from clozax.train import loop as train_lib
from clozax.train.contrastive.stage import StageSettings
from clozax.train.interrupts import Interrupts
from clozax.train.recipes import apply_recipe

# The demo's training budget: the small preset (4 layers x 256, batch 32 x 128 tokens) for
# DEMO_STEPS steps with the budget recipe (masking rate 0.4: train/recipes.py): 468 s of
# training at about 5,470 tokens/s on this 2-core CPU machine on 2026-12-04, nothing else
# running, with the kept arena (train/hostmem.py, which `clozax demo` applies); the machine's
# pace moves (docs/how-to/demo.md has the whole demo's stages).
# Why not the 5 minutes (300 steps at rate 0.15) first planned: at 300 steps the trained encoder
# did not beat the random-init encoder on the probe (29.8 % vs 31.0 %, paired difference
# -1.2 pp [-5.0, +2.6]); measured alternatives on the same data: lr 3e-3 worse (26.2 %), batch 16
# x 600 steps 28.8 %, rate 0.4 x 300 steps 31.6 %, rate 0.15 x 900 steps 42.3 % [38.0, 46.7],
# rate 0.4 x 600 steps 43.7 % [39.4, 48.3] (+12.7 pp [+8.2, +17.1]) — the cheapest that holds.
# Wettig et al. found rates up to 0.4 better than 0.15 for MLM pretraining.
DEMO_STEPS = 600
QUICK_STEPS = 4

# Prepare settings: the built-in corpus with the default vocabulary and row length; `quick`
# shrinks them so the end-to-end smoke test runs in seconds.
DATA_SETTINGS = {"corpus": "stdlib", "vocab_size": 8192, "seq_len": 128,
                 "heldout_fraction": 0.05, "seed": 0, "tokenizer_model": "bpe",
                 "lowercase": True}
QUICK_DATA_SETTINGS = {**DATA_SETTINGS, "vocab_size": 1024, "seq_len": 64}
AUDIT_BATCHES, QUICK_AUDIT_BATCHES = 200, 2
QUICK_PROBE_PER_CLASS = 30  # the probe's minimum examples per class
QUICK_TRAIN = ["train.batch_size=8", "train.eval_rows=32", "optim.warmup_steps=2"]
# The fine-tuning stage: the probe's task (a docstring's package; trained on the train split's
# documents, tested on the held-out split's), at one learning rate (no grid: the demo's time)
# over 3 seeds, trained and random-init.
DEMO_FINETUNE = finetune_lib.Protocol(learning_rates=(3e-4,), seeds=3, epochs=3)
# The retrieval stage: a short contrastive stage on the demo's encoder and on its random init,
# 3 seeds each, on the held-out first-sentence→rest set beside BM25 (clozax retrieval).
# 40 steps of 32 pairs of 32 tokens: about 4 minutes for the 7 rows on 2 cores (100 steps of 64
# tokens took 17; docs/tutorials/retriever.md has both).
DEMO_STAGE, DEMO_STAGE_SEEDS, DEMO_QUERIES = StageSettings(steps=40, batch_size=32,
                                                           seq_len=32), 3, 300
QUICK_STAGE, QUICK_STAGE_SEEDS, QUICK_QUERIES = StageSettings(steps=2, batch_size=8,
                                                              seq_len=24), 2, 40
QUICK_FINETUNE = finetune_lib.Protocol(learning_rates=(1e-3,), seeds=2, epochs=1, batch_size=8)


def _manifest_settings(manifest: dict) -> dict:
    tok = manifest.get("tokenizer", {})
    return {"corpus": manifest.get("corpus", {}).get("source"),
            "vocab_size": tok.get("vocab_size"), "seq_len": manifest.get("seq_len"),
            "heldout_fraction": manifest.get("heldout_fraction"), "seed": manifest.get("seed"),
            "tokenizer_model": tok.get("model"), "lowercase": tok.get("lowercase")}


def prepare_data(data_dir: Path, settings: dict, say) -> Path:
    """Prepare the built-in corpus into ``data_dir``, or reuse it if it has ``settings``."""
    manifest_path = data_dir / "manifest.json"
    if manifest_path.is_file():
        found = _manifest_settings(json.loads(manifest_path.read_text(encoding="utf-8")))
        if found != settings:
            diffs = [f"{k} {found.get(k)!r} (want {v!r})" for k, v in settings.items()
                     if found.get(k) != v]
            raise ValueError(f"{data_dir} was prepared with other settings ({'; '.join(diffs)});"
                             " choose another --out or delete that directory")
        say(f"[dim]reusing prepared dataset {data_dir}[/]")
        return data_dir
    if data_dir.exists() and any(data_dir.iterdir()):
        raise ValueError(f"{data_dir} exists and is not a prepared dataset; choose another --out")
    say(f"preparing the built-in corpus into {data_dir}")
    prepare(data_dir, quiet=True, overwrite=data_dir.exists(), **settings)
    return data_dir


def _is_current(path: Path, step: int) -> bool:
    try:
        return json.loads(path.read_text(encoding="utf-8")).get("step") == step
    except (OSError, json.JSONDecodeError):
        return False

def _reuse_or_run(path: Path, step: int, say, compute, also: Path | None = None,
                  judged: bool = False) -> dict:
    """The stage's JSON if it already describes checkpoint ``step`` (and ``also`` exists; and,
    ``judged``, its task was checked for pretraining overlap under today's rule, copies and
    containment — older results were not);
    otherwise run ``compute`` (which writes it) and return its result."""
    if _is_current(path, step) and (also is None or also.is_file()):
        result = json.loads(path.read_text(encoding="utf-8"))
        overlap = result.get("task", {}).get("pretraining_overlap", {})
        if not judged or overlap.get("rule") == overlap_lib.RULE:  # today's rule, exactly
            say(f"[dim]{path.name} is up to date[/]")
            return result
    return compute()



def run_demo(out: Path, *, steps: int | None = None, preset: str = "small",
             quick: bool = False) -> dict:
    """Run (or continue) the demo in ``out``; print the headline and return a summary dict:
    ``report`` (path), ``run``, ``data``, ``step``, ``seconds`` per stage, ``eval``/``probe``/
    ``audit`` headline numbers and ``claims`` (see ``clozax.judge.claims``)."""
    steps = steps if steps is not None else (QUICK_STEPS if quick else DEMO_STEPS)
    if steps < 1:
        raise ValueError(f"--steps {steps} must be >= 1")
    with Interrupts(1) as stop:  # a signal stops the demo between stages (training: its own)
        return _stages(Path(out), steps, preset, quick, stop)


def _stages(out: Path, steps: int, preset: str, quick: bool, stop: Interrupts) -> dict:
    console = Console(highlight=False)
    say = console.print
    out.mkdir(parents=True, exist_ok=True)
    data_dir, run_dir = out / "data", out / "run"
    seconds: dict[str, float] = {}

    def stage(name: str):
        stop.raise_if_requested(f"before the {name} stage; the finished stages are kept in "
                                f"{out}: run the same command to continue")
        seconds[name] = time.perf_counter()
        say(f"[bold]── {name}[/]")

    def done(name: str):
        seconds[name] = round(time.perf_counter() - seconds[name], 1)
        _release()

    stage("prepare")
    prepare_data(data_dir, QUICK_DATA_SETTINGS if quick else DATA_SETTINGS, say)
    done("prepare")

    stage("train")
    # Six held-out points on the curves and a checkpoint every 50 steps to resume from; quick
    # evaluates and saves only at the end (each costs seconds in the smoke test).
    overrides = [f"train.steps={steps}",
                 f"train.eval_every={steps if quick else max(1, steps // 6)}",
                 f"train.save_every={steps if quick else max(1, min(50, steps // 2))}"]
    # The budget recipe: masking at 0.4 and two microbatches (speed-only, the same numbers,
    # tested: they halve the step's activation memory, peak RSS 2.8 GB -> 1.5 GB for the step
    # alone, measured).
    cfg = apply_recipe("budget", config_lib.resolve(
        preset=preset, overrides=overrides + (QUICK_TRAIN if quick else [])))
    result = train_lib.train(data_dir, run_dir, cfg)
    step = int(result.steps)
    done("train")

    stage("evaluate")
    evaluation = _reuse_or_run(run_dir / evaluate_lib.EVAL_FILE, step, say,
                               lambda: evaluate_lib.evaluate_run(run_dir),
                               also=run_dir / evaluate_lib.FAILURES_FILE)
    done("evaluate")

    stage("probe")
    kwargs = {"max_per_class": QUICK_PROBE_PER_CLASS} if quick else {}
    probe = _reuse_or_run(run_dir / probe_lib.PROBE_FILE, step, say,
                          lambda: probe_lib.probe_run(run_dir, **kwargs), judged=True)
    done("probe")

    stage("finetune")
    finetune = _reuse_or_run(
        run_dir / "finetune" / "labels" / finetune_lib.RESULT_FILE, step, say,
        lambda: finetune_lib.finetune_run(run_dir, protocol=QUICK_FINETUNE if quick
                                          else DEMO_FINETUNE, say=say), judged=True)
    done("finetune")

    stage("retrieval")
    retrieval = _reuse_or_run(
        run_dir / retrieval_lib.RESULT_FILE, step, say,
        lambda: retrieval_lib.retrieval_run(
            run_dir, QUICK_STAGE if quick else DEMO_STAGE,
            QUICK_STAGE_SEEDS if quick else DEMO_STAGE_SEEDS,
            max_queries=QUICK_QUERIES if quick else DEMO_QUERIES, say=say))
    done("retrieval")

    stage("audit")
    batches = QUICK_AUDIT_BATCHES if quick else AUDIT_BATCHES
    audit = _reuse_or_run(run_dir / audit_lib.AUDIT_FILE, step, say,
                          lambda: audit_lib.audit_run(run_dir, batches=batches))
    done("audit")

    stage("report")
    report_path = report_lib.write_report(run_dir)
    done("report")

    stop.raise_if_requested(f"after the last stage; everything is kept in {out}")
    summary = _summary(report_path, run_dir, data_dir, step, seconds, evaluation, probe, audit)
    summary["finetune"] = _finetune_headline(finetune)
    summary["claims"] += downstream_claims(finetune)
    summary["retrieval"] = _retrieval_headline(retrieval)
    summary["peak_rss_gb"] = peak_rss_gb()
    print_summary(summary, console)
    return summary


def _release() -> None:
    """Drop what a finished stage compiled and loaded, so the next one reuses the memory."""
    jax.clear_caches()
    gc.collect()


def peak_rss_gb() -> float:
    """This process's peak resident memory so far, in GB: Linux's ``VmHWM`` (the high-water
    mark of this program's own memory). ``ru_maxrss`` is only the fallback (other systems): on
    Linux it survives ``exec``, so a demo started by a large process would report its
    parent's peak."""
    try:
        status = Path("/proc/self/status").read_text()
        peak = int(re.search(r"^VmHWM:\s+(\d+) kB", status, re.MULTILINE).group(1)) * 1024
    except (OSError, AttributeError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # bytes on macOS
        peak *= 1 if sys.platform == "darwin" else 1024  # KiB elsewhere
    return peak / 1e9


def _summary(report_path, run_dir, data_dir, step, seconds, evaluation, probe, audit) -> dict:
    res = probe["results"]
    checks = audit.get("checks", [])
    return {
        "report": str(report_path),
        "run": str(run_dir),
        "data": str(data_dir),
        "step": step,
        "seconds": seconds,
        "eval": {k: evaluation[k]["accuracy"] for k in ("trained", "unigram", "random_init")},
        "probe": {k: {"accuracy": res[k]["accuracy"], "ci95": res[k]["ci95"]}
                  for k in ("trained", "random_init", "tfidf")},
        "audit": {"passed": bool(audit.get("passed")),
                  "pass_count": sum(1 for c in checks if c.get("passed")
                                    and not c.get("skipped")),
                  "skipped": sum(1 for c in checks if c.get("skipped")),
                  "total": len(checks)},
        "claims": claims(evaluation, probe, audit),
    }


def _finetune_headline(result: dict) -> dict:
    metric = result["task"]["metric"]
    out = {name: {k: r["selected"]["test"][metric][k] for k in ("mean", "std", "worst")}
           for name, r in result["encoders"].items()}
    out["tfidf"] = result["tfidf"]["test"][metric]
    out["metric"] = metric
    out["trained_minus_random_init"] = result["trained_minus_random_init"]
    return out


def _retrieval_headline(result: dict) -> dict:
    rows = result["rows"]
    return {"ndcg@10": {k: rows[k]["ndcg@10"] for k in ("bm25", "raw", "random_init_stage",
                                                        "trained_stage")},
            "differences": result["differences_ndcg@10"]}


def print_summary(summary: dict, console) -> None:
    """The report path, the headline numbers and one line per claim."""
    ev, pr, au = summary["eval"], summary["probe"], summary["audit"]

    def pct(x):
        return f"{100 * x:.1f} %"

    def ci(c):
        return f"[{100 * c[0]:.1f}, {100 * c[1]:.1f}]"

    total = sum(v for v in summary["seconds"].values())
    console.print()
    console.print(f"[bold]report:[/] {summary['report']}")
    console.print(f"step {summary['step']}; stages {summary['seconds']} ({total:.0f} s); "
                  f"peak RSS {summary['peak_rss_gb']:.2f} GB")
    console.print(f"held-out masked-token accuracy: trained {pct(ev['trained'])}, unigram "
                  f"{pct(ev['unigram'])}, random init {pct(ev['random_init'])}")
    console.print(f"probe accuracy (95 % CI): trained {pct(pr['trained']['accuracy'])} "
                  f"{ci(pr['trained']['ci95'])}, random init {pct(pr['random_init']['accuracy'])}"
                  f" {ci(pr['random_init']['ci95'])}, TF-IDF {pct(pr['tfidf']['accuracy'])} "
                  f"{ci(pr['tfidf']['ci95'])}")
    if "finetune" in summary:
        f = summary["finetune"]

        def spread(r):
            return f"{pct(r['mean'])} ± {pct(r['std'])} (worst {pct(r['worst'])})"

        console.print(f"fine-tuned {f['metric']} over seeds: trained {spread(f['trained'])}, "
                      f"random init {spread(f['random_init'])}, TF-IDF {pct(f['tfidf'])}; "
                      "trained − random init "
                      f"{difference_words(f['trained_minus_random_init'])}")
    if "retrieval" in summary:
        n, d = summary["retrieval"]["ndcg@10"], summary["retrieval"]["differences"]
        console.print(f"retrieval nDCG@10 (held-out first sentence → rest): BM25 "
                      f"{n['bm25']:.3f}, raw {n['raw']:.3f}, random init + stage "
                      f"{n['random_init_stage']:.3f}, trained + stage {n['trained_stage']:.3f};"
                      " trained + stage − random init + stage "
                      f"{difference_words(d['trained_stage_minus_random_init_stage'])}")
    console.print(f"audit: {au['pass_count']}/{au['total']} PASS"
                  + (f" ({au['skipped']} skipped)" if au["skipped"] else ""))
    for c in summary["claims"]:
        mark = ("[green]holds[/]" if c["holds"] else "[bold red]does not hold[/]"
                if c["holds"] is not None else "[yellow]not run[/]")
        console.print(f"  {mark}: {c['claim']} — {c['detail']}")
