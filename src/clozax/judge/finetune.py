"""``clozax finetune``: judge an encoder the way the field does — fine-tune it on a labelled task
with a learning-rate grid over several seeds, pick the rate on validation, report the test
metric's mean ± std and its worst seed, beside the same protocol on the random-init encoder
(the control) and, for classification, TF-IDF + logistic regression.

One job = one (encoder, learning rate, seed): AdamW (betas 0.9/0.98, eps 1e-6, weight decay
0.01 off biases and norms, clipping 1.0) with a linear warm-up over ``warmup_fraction`` of the
steps and a linear decay to 0, head dropout, length-bucketed batches (widths rounded up to
``WIDTH_MULTIPLE``, so a task compiles a few shapes once, shared by every job; the persistent
compilation cache keeps them), data parallel over the devices of this process. A job is a pure
function of (encoder, task, protocol, learning rate, seed): seeds repeat bitwise.

On disk (``RUN/finetune/TASK/``, one writer at a time): ``settings.json`` (what the jobs
depend on), ``jobs/*.json`` (each finished job; a rerun skips them, so a killed protocol loses
at most the job in flight), per learning rate the best-validation seed's parameters of the
trained encoder until selection, then ``model/`` (the selected fine-tuned model,
``clozax.train.finetuned``: what ``export`` and ``--predict`` read) and ``result.json``.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import jax
import numpy as np
from safetensors.numpy import load_file, save_file

from clozax.core import files, locks
from clozax.core.train_state import init_params
from clozax.data.tokenizer import load_tokenizer
from clozax.judge import finetune_glue as glue
from clozax.judge import finetune_heads as heads
from clozax.judge import finetune_jobs as jobs_lib
from clozax.judge import finetune_tasks as tasks
from clozax.judge import probe as probe_lib
from clozax.judge.claims import seed_difference
from clozax.judge.finetune_jobs import ADAM, Protocol
from clozax.train import finetuned
from clozax.train.run_dir import load_run, open_run_dataset

RESULT_FILE = "result.json"
ENCODERS = ("trained", "random_init")


@dataclass(frozen=True)
class TaskSpec:
    """Where a task's examples come from (see ``clozax.judge.finetune_tasks``)."""

    train: Path | None = None  # None: the run's dataset labels (or ``glue``)
    validation: Path | None = None
    test: Path | None = None
    kind: str = "classification"
    fields: tasks.Fields = field(default_factory=tasks.Fields)
    glue: str | None = None
    glue_dir: Path | None = None
    name: str | None = None
    metric: str | None = None
    split_seed: int = 0

    def __post_init__(self):
        if self.kind not in tasks.KINDS:
            raise ValueError(f"task kind {self.kind!r} is not one of {', '.join(tasks.KINDS)}")
        if self.glue is not None and self.glue_dir is None:
            raise ValueError("--glue-task needs --glue-dir, the local GLUE folder")

    def task_name(self) -> str:
        if self.name:
            return self.name
        if self.glue:
            return self.glue
        return Path(self.train).stem if self.train else "labels"


# --------------------------------------------------------------------------- the task


def load_task(spec: TaskSpec, run, tokenizer) -> tasks.Task:
    seq_len = run.trained_length
    args = (tokenizer, run.specials, seq_len)
    name = spec.task_name()
    if spec.glue:
        train, dev, kind, metric = glue.read_glue(spec.glue_dir, spec.glue)
        raws = {**tasks.carve(train, spec.split_seed,
                              {"validation": tasks.VALIDATION_FRACTION}), "test": dev}
        return tasks.build(name, kind, f"GLUE {spec.glue} ({spec.glue_dir}); test = dev",
                           spec.metric or metric, raws, *args, carved={"validation"})
    metric = spec.metric or tasks.default_metric(spec.kind)
    if spec.train is None:  # the run's dataset labels, split as the probe splits them
        task = probe_lib.dataset_task(open_run_dataset(run), tokenizer)
        parts, accounting = probe_lib.select_and_split(task, spec.split_seed,
                                                       probe_lib.MAX_PER_CLASS)
        raws = {}
        for split, part in zip(tasks.SPLITS, ("train", "val", "test"), strict=True):
            raws[split] = tasks.Raw(texts=[(task.text[i],) for i in parts[part]],
                                    targets=[task.label[i] for i in parts[part]],
                                    groups=[task.group[i] for i in parts[part]],
                                    where=[f"{task.source} #{i}" for i in parts[part]])
        out = tasks.build(name, "classification", task.source, metric, raws, *args,
                          carved=set(tasks.SPLITS))
        out.accounting["selection"] = {k: v for k, v in accounting.items() if k != "split"}
        return out
    raws = {"train": tasks.read_file(spec.train, spec.kind, spec.fields)}
    given = {s: getattr(spec, s) for s in ("validation", "test")}
    for split, path in given.items():
        if path is not None:
            raws[split] = tasks.read_file(path, spec.kind, spec.fields)
    missing = {s: {"validation": tasks.VALIDATION_FRACTION, "test": tasks.TEST_FRACTION}[s]
               for s, p in given.items() if p is None}
    if missing:
        raws.update(tasks.carve(raws["train"], spec.split_seed, missing))
    return tasks.build(name, spec.kind, str(spec.train), metric, raws, *args,
                       carved=set(missing))


def cap_train(task: tasks.Task, limit: int | None, seed: int) -> tasks.Task:
    split = task.splits["train"]
    if limit is None or len(split) <= limit:
        return task
    keep = sorted(np.random.default_rng([seed, 7]).permutation(len(split))[:limit].tolist())
    task.accounting["train_capped_to"] = limit
    return replace(task, splits={**task.splits, "train": split.select(keep)})


# --------------------------------------------------------------------------- baselines


def constant_baseline(task: tasks.Task) -> dict:
    """The best input-blind predictor from training: the majority class (tag), or the mean."""
    train, test = task.splits["train"], task.splits["test"]
    if task.kind == "regression":
        mean = float(np.mean(train.y))
        return heads.metrics("regression", test.y, [mean] * len(test))
    if task.kind == "tokens":
        common = Counter(int(t) for y in train.y for t in y if t >= 0).most_common(1)[0][0]
        y_true = [np.asarray(y)[np.asarray(y) >= 0] for y in test.y]
        return heads.metrics("tokens", y_true, [np.full_like(t, common) for t in y_true],
                             task.labels)
    common = Counter(train.y).most_common(1)[0][0]
    return heads.metrics(task.kind, test.y, [common] * len(test))


def tfidf_baseline(task: tasks.Task) -> dict:
    """TF-IDF + logistic regression, C chosen on validation (classification kinds)."""
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression
    from threadpoolctl import threadpool_limits

    s = task.splits
    vec = TfidfVectorizer(sublinear_tf=True).fit(s["train"].text)
    x = {k: vec.transform(v.text) for k, v in s.items()}
    best = None
    with threadpool_limits(limits=1):
        for c in probe_lib.C_GRID:
            clf = LogisticRegression(C=c, max_iter=2000).fit(x["train"], s["train"].y)
            val = heads.metrics(task.kind, s["validation"].y, clf.predict(x["validation"]))
            if best is None or val[task.metric] > best[1][task.metric]:
                best = (c, val, clf)
    c, val, clf = best
    return {"C": c, "validation": val,
            "test": heads.metrics(task.kind, s["test"].y, clf.predict(x["test"]))}


# --------------------------------------------------------------------------- the protocol


def _spread(values: list[float], higher_is_better: bool = True) -> dict:
    a = np.asarray(values, np.float64)
    return {"mean": float(a.mean()), "std": float(a.std(ddof=1)) if a.size > 1 else 0.0,
            "worst": float(a.min() if higher_is_better else a.max()),
            "per_seed": [float(v) for v in a]}


def summarise(records: list[dict], metric: str) -> dict:
    """Per learning rate: validation and test spreads; the rate chosen on mean validation. A
    rate where a seed diverged is recorded (each seed's step), never chosen; all: one line."""
    by_lr: dict[float, list[dict]] = {}
    for r in records:
        by_lr.setdefault(r["learning_rate"], []).append(r)
    settings, diverged = [], []
    for lr, rs in sorted(by_lr.items()):
        rs = sorted(rs, key=lambda r: r["seed"])
        if any("diverged" in r for r in rs):
            diverged.append({"learning_rate": lr, "seeds": {
                str(r["seed"]): r["diverged"] for r in rs if "diverged" in r}})
            continue
        names = sorted(rs[0]["test"])
        settings.append({"learning_rate": lr, "seeds": [r["seed"] for r in rs],
                         "validation": _spread([r["validation"][metric] for r in rs]),
                         "test": {m: _spread([r["test"][m] for r in rs]) for m in names},
                         "seconds_per_job": float(np.mean([r["seconds"] for r in rs]))})
    if not settings:
        rates = ", ".join(f"{d['learning_rate']:g}" for d in diverged)
        raise ValueError(f"fine-tuning diverged at every learning rate ({rates}); pass lower "
                         "rates with --lr")
    chosen = max(settings, key=lambda s: (s["validation"]["mean"], -s["learning_rate"]))
    return {"settings": settings, "selected": chosen, "diverged": diverged}


def _fingerprint(run, task: tasks.Task, protocol: Protocol) -> dict:
    digest = hashlib.sha256()
    for name in tasks.SPLITS:
        sp = task.splits[name]
        for ids, y in zip(sp.ids, sp.y, strict=True):
            digest.update(np.asarray(ids, np.int32).tobytes())
            digest.update(json.dumps(np.asarray(y).tolist()).encode())
    return {"run": str(Path(run.path).absolute()), "step": run.step,
            "task_sha256": digest.hexdigest(), "labels": task.labels, "kind": task.kind,
            "protocol": {**asdict(protocol),
                         "learning_rates": [float(x) for x in protocol.learning_rates]}}


def _job_name(encoder: str, lr: float, seed: int) -> str:
    return f"{encoder}-lr{lr:g}-seed{seed}"


def finetune_run(run_dir: Path, spec: TaskSpec | None = None, protocol: Protocol | None = None,
                 say=print, progress: bool = True, step: int | None = None) -> dict:
    """Run the protocol on ``run_dir``'s checkpoint ``step`` (default: the newest) into
    ``RUN/finetune/TASK`` (``TASK-step{step}`` for a given step); write and return
    ``result.json``."""
    if jax.process_count() > 1:
        raise ValueError("clozax finetune runs in one process (it uses every device of it); "
                         "launch it without --coordinator")
    spec, protocol = spec or TaskSpec(), protocol or Protocol()
    started = time.perf_counter()
    run_dir = Path(run_dir)
    run = load_run(run_dir, step)
    tokenizer = load_tokenizer(run.tokenizer_path)
    task = cap_train(load_task(spec, run, tokenizer), protocol.max_train_examples,
                     spec.split_seed)
    out = task_dir(run_dir, task.name, step)
    with locks.hold(out, f"fine-tuning {out}", say=say):
        return _protocol(run, task, protocol, out, say, progress, started)


def task_dir(run_dir: Path, task_name: str, step: int | None = None) -> Path:
    """``RUN/finetune/TASK``, or ``TASK-step{step}`` for a given checkpoint step."""
    return Path(run_dir) / "finetune" / (task_name if step is None else f"{task_name}-step{step}")


def _protocol(run, task, protocol, out: Path, say, progress: bool, started: float) -> dict:
    setup = jobs_lib.make_setup(run.config.model, task, protocol, run.specials["pad"],
                       task.accounting["seq_len"])
    settings = _fingerprint(run, task, protocol)
    jobs_dir = out / "jobs"
    if (out / "settings.json").is_file() and files.read_json(out / "settings.json") != settings:
        say(f"{out}: the run, task or protocol changed since its jobs ran; running them again")
        shutil.rmtree(jobs_dir, ignore_errors=True)
        (out / RESULT_FILE).unlink(missing_ok=True)
    jobs_dir.mkdir(parents=True, exist_ok=True)
    files.write_json(out / "settings.json", settings)
    encoders = {"trained": run.params}
    if protocol.control:
        encoders["random_init"] = init_params(run.config.model, run.config.train.seed)
    todo = [(e, lr, s) for e in encoders for lr in protocol.learning_rates
            for s in range(protocol.seeds)]
    pending = [j for j in todo if not (jobs_dir / f"{_job_name(*j)}.json").is_file()]
    if len(pending) < len(todo):
        say(f"{out}: {len(todo) - len(pending)} of {len(todo)} jobs already done; running "
            f"the other {len(pending)}")
    bar = _bar(progress, len(pending) * setup.steps)
    try:
        for encoder, lr, seed in pending:
            name = _job_name(encoder, lr, seed)
            if bar is not None:
                bar[0].update(bar[1], description=name)
            record, params = jobs_lib.run_job(setup, task, encoders[encoder], lr, seed,
                                     None if bar is None else
                                     (lambda n: bar[0].advance(bar[1], n)))
            if encoder == "trained" and params is not None:
                _keep_if_best(jobs_dir, lr, record, params, task.metric)
            files.write_json(jobs_dir / f"{name}.json", record)  # the job's commit
            if "diverged" in record:
                say(f"{name}: diverged at step {record['diverged']['step']} (loss "
                    f"{record['diverged']['loss']}); this rate is not selected")
            elif bar is None:
                say(f"{name}: validation {task.metric} {record['validation'][task.metric]:.4f}"
                    f", test {record['test'][task.metric]:.4f} ({record['seconds']:.1f} s)")
    finally:
        if bar is not None:
            bar[0].stop()
    records = {e: [files.read_json(jobs_dir / f"{_job_name(e, lr, s)}.json")
                   for lr in protocol.learning_rates for s in range(protocol.seeds)]
               for e in encoders}
    results = {e: summarise(rs, task.metric) for e, rs in records.items()}
    chosen = results["trained"]["selected"]["learning_rate"]
    best = jobs_dir / f"best-lr{chosen:g}.safetensors"
    if best.is_file():
        params = finetuned.unflatten(load_file(str(best)))
        meta_job = json.loads((jobs_dir / f"best-lr{chosen:g}.json").read_text())
        finetuned.write(out / "model", params, setup.model_config, {
            "kind": task.kind, "labels": task.labels, "style": setup.style, "pair": task.pair,
            "pooling": protocol.pooling, "task": task.name, "metric": task.metric,
            "source_run": str(Path(run.path).absolute()), "source_step": run.step,
            "seq_len": setup.seq_len, "specials": run.specials,
            "learning_rate": chosen, "seed": meta_job["seed"],
            "validation": meta_job["validation"], "dropout": protocol.dropout,
        }, run.tokenizer_path)
        for kept in jobs_dir.glob("best-lr*.safetensors"):  # model/ holds the one selected
            kept.unlink()
    result = _result(run, task, protocol, setup, results, started)
    files.write_json(out / RESULT_FILE, result)
    return result


def _keep_if_best(jobs_dir: Path, lr: float, record: dict, params, metric: str) -> None:
    """Keep this job's parameters if it is the best-validation seed of its rate so far."""
    meta = jobs_dir / f"best-lr{lr:g}.json"
    if meta.is_file() and json.loads(meta.read_text())["validation"][metric] >= \
            record["validation"][metric]:
        return
    tmp = jobs_dir / f".best-lr{lr:g}.safetensors.tmp"
    save_file(finetuned.flatten(jax.device_get(params)), str(tmp))
    tmp.replace(jobs_dir / f"best-lr{lr:g}.safetensors")
    files.write_json(meta, {"seed": record["seed"], "validation": record["validation"]})


def _result(run, task, protocol, setup, results: dict, started: float) -> dict:
    metric = task.metric
    out = {
        "run": str(run.path), "step": run.step,
        "task": {"name": task.name, "kind": task.kind, "source": task.source,
                 "labels": task.labels, "metric": metric, **task.accounting},
        "protocol": {**asdict(protocol), "steps_per_job": setup.steps, "head": setup.style,
                     "optimizer": f"AdamW {ADAM}, clip 1.0, linear warm-up then decay",
                     "compute_dtype": setup.model_config.compute_dtype},
        "encoders": results,
        "constant_baseline": {"test": constant_baseline(task)},
    }
    trained = results["trained"]["selected"]["test"][metric]["per_seed"]
    if task.kind in ("classification", "pair"):
        out["tfidf"] = tfidf_baseline(task)
        out["trained_minus_tfidf"] = {"metric": metric, **seed_difference(
            trained, out["tfidf"]["test"][metric])}
    if "random_init" in results:
        out["trained_minus_random_init"] = {"metric": metric, **seed_difference(
            trained, results["random_init"]["selected"]["test"][metric]["per_seed"])}
    out["seconds"] = round(time.perf_counter() - started, 2)
    return out


def _bar(progress: bool, total: int):
    if not progress or total == 0:
        return None
    from rich.progress import (
        BarColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    bar = Progress(TextColumn("[bold]finetune[/] {task.description}"), BarColumn(),
                   TextColumn("{task.completed}/{task.total} steps"), TimeElapsedColumn(),
                   TextColumn("eta"), TimeRemainingColumn())
    bar.start()
    return bar, bar.add_task("", total=total)


# --------------------------------------------------------------------------- reading a result


def summary_table(result: dict):
    from rich.table import Table

    t, metric = result["task"], result["task"]["metric"]
    ex = t["examples"]
    table = Table(title=f"finetune {t['name']} ({t['kind']}): train {ex['train']}, validation "
                        f"{ex['validation']}, test {ex['test']}; test {metric}, mean ± std "
                        f"over {result['protocol']['seeds']} seeds at the rate chosen on "
                        "validation")
    for name, justify in (("encoder", "left"), ("lr", "right"), (f"test {metric}", "right"),
                          ("worst seed", "right"), ("s / job", "right")):
        table.add_column(name, justify=justify)
    for name, r in result["encoders"].items():
        s = r["selected"]
        m = s["test"][metric]
        table.add_row(name, f"{s['learning_rate']:g}", f"{m['mean']:.4f} ± {m['std']:.4f}",
                      f"{m['worst']:.4f}", f"{s['seconds_per_job']:.1f}")
        for d in r.get("diverged", []):
            steps = ", ".join(f"seed {k} at step {v['step']}" for k, v in d["seeds"].items())
            table.add_row(name, f"{d['learning_rate']:g}", "diverged", steps, "")
    if "tfidf" in result:
        table.add_row("TF-IDF + logistic regression", f"C={result['tfidf']['C']:g}",
                      f"{result['tfidf']['test'][metric]:.4f}", "", "")
    table.add_row("constant", "", f"{result['constant_baseline']['test'][metric]:.4f}", "", "")
    return table


def result_of(run_dir: Path, name: str) -> dict:
    return files.read_json(Path(run_dir) / "finetune" / name / RESULT_FILE)
