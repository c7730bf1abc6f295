"""``clozax finetune``: judge an encoder the way the field does — fine-tune it on a labelled task
with a grid of learning rates (and layer decays) over several seeds, pick the setting on
validation, report the test metric's mean ± std and its worst seed, beside the same protocol on
the random-init encoder (the control) and, for classification, TF-IDF + logistic regression;
the differences as mean and 95 % interval over seeds (``judge/claims.py``). The task comes
from the one task stack (``judge/task_load.py``): validation and test examples the encoder
read in pretraining are dropped unless ``--keep-pretraining-overlap``.

One job = one (encoder, learning rate, layer decay, seed): AdamW (betas 0.9/0.98, eps 1e-6,
weight decay 0.01 off biases and norms, clipping 1.0) with a linear warm-up over
``warmup_fraction`` of the steps and a linear decay to 0, head dropout, length-bucketed batches
(widths rounded up to ``WIDTH_MULTIPLE``, so a task compiles a few shapes once, shared by every
job; the persistent compilation cache keeps them), data parallel over the devices of this
process; validation and test scored after every epoch, the best-validation epoch kept. A job
is a pure function of (encoder, task, protocol, learning rate, layer decay, seed): seeds
repeat bitwise.

On disk (``RUN/finetune/TASK/``, one writer at a time): ``jobs/KEY/`` per job settings (the
encoder and its step, the task's digest, epochs, batch, warm-up, weight decay, dropout,
pooling, dtype: ``settings.json``), one ``*.json`` per finished job — a rerun with more rates,
decays or seeds runs only the new jobs, a rerun with another ``--metric`` none; then
``model/`` (the selected job's fine-tuned model: what ``export`` and ``--predict`` read) and
``result.json``, which names it (the setting chosen on validation:
``judge/finetune/select.py``). While the jobs run, each setting's best trained seed so far is
kept at its best epoch in ``jobs/KEY/model-lrRATE[-ldDECAY]/`` (written before the job's record
commits); the selected one is moved into ``model/`` and the others deleted. A selection no
candidate holds (jobs recorded by an earlier command, or another ``--metric``) re-runs that
job deterministically, checked to reproduce its recorded validation score.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import asdict, replace
from pathlib import Path

import jax
import numpy as np

from clozax.core import files, locks
from clozax.core.train_state import init_params
from clozax.data.tokenizer import load_tokenizer
from clozax.judge.baselines import constant_baseline, tfidf_baseline
from clozax.judge.claims import accounting_lines, difference_words, seed_difference
from clozax.judge.finetune import jobs as jobs_lib
from clozax.judge.finetune import saved as finetuned
from clozax.judge.finetune import tasks
from clozax.judge.finetune.jobs import ADAM, Protocol
from clozax.judge.finetune.select import decay_of, seed_rank, summarise
from clozax.judge.task_load import TaskSpec, cap_train, load_task
from clozax.train.interrupts import Interrupts
from clozax.train.run_dir import load_run

__all__ = ["Protocol", "TaskSpec", "finetune_run", "load_task", "summarise", "summary_table",
           "task_dir"]
RESULT_FILE = "result.json"
ENCODERS = ("trained", "random_init")
REPRODUCE_TOLERANCE = 1e-6  # the re-run selected job's validation score vs its record
CANDIDATE_PREFIX = "model-lr"  # jobs/KEY/model-lrRATE[-ldDECAY]/: a setting's best seed so far


# --------------------------------------------------------------------------- the protocol


def job_settings(run, task: tasks.Task, protocol: Protocol) -> dict:
    """What one job's result depends on besides its rate and seed (``jobs/KEY/``)."""
    digest = hashlib.sha256()
    for name, sp in sorted(task.splits.items()):
        digest.update(name.encode())
        for ids, y in zip(sp.ids, sp.y, strict=True):
            digest.update(np.asarray(ids, np.int32).tobytes())
            digest.update(json.dumps(np.asarray(y).tolist()).encode())
    keep = {k: v for k, v in asdict(protocol).items()  # the grid's axes are in each job's name
            if k not in ("learning_rates", "layer_decays", "seeds", "control")}
    # The cap the training split was cut to, not the one asked: a cap above the split's size
    # trains the same jobs as none, so it keys the same jobs.
    keep["max_train_examples"] = task.accounting.get("train_capped_to")
    return {"run": str(Path(run.path).absolute()), "step": run.step,
            "task_sha256": digest.hexdigest(), "labels": task.labels, "kind": task.kind,
            "encoder_dropout": run.config.model.dropout, "protocol": keep}


def _jobs_dir(out: Path, run, task: tasks.Task, protocol: Protocol) -> tuple[str, Path]:
    """``OUT/jobs/KEY`` for ``job_settings``' key, made and its settings written."""
    settings = job_settings(run, task, protocol)
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    jobs_dir = out / "jobs" / key
    jobs_dir.mkdir(parents=True, exist_ok=True)
    files.write_json(jobs_dir / "settings.json", settings)
    return key, jobs_dir


def _job_name(encoder: str, lr: float, decay: float, seed: int) -> str:
    return f"{encoder}-lr{lr:g}{_decay_tag(decay)}-seed{seed}"


def _decay_tag(decay: float) -> str:
    return "" if decay == 1 else f"-ld{decay:g}"


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
    if protocol.reinit_top > run.config.model.layers:
        raise ValueError(f"--reinit-top {protocol.reinit_top}: {run_dir} has "
                         f"{run.config.model.layers} blocks; pass 0 to {run.config.model.layers}")
    if protocol.learning_rates is None:
        protocol = replace(protocol,
                           learning_rates=jobs_lib.default_learning_rates(run.config.model))
    tokenizer = load_tokenizer(run.tokenizer_path)
    task = cap_train(load_task(spec, run, tokenizer), protocol.max_train_examples,
                     spec.split_seed)
    out = task_dir(run_dir, task.name, step)
    with locks.hold(out, f"fine-tuning {out}", say=say), Interrupts(1) as stop:
        return _protocol(run, task, protocol, out, say, progress, started, stop)


def task_dir(run_dir: Path, task_name: str, step: int | None = None) -> Path:
    """``RUN/finetune/TASK``, or ``TASK-step{step}`` for a given checkpoint step."""
    return Path(run_dir) / "finetune" / (task_name if step is None else f"{task_name}-step{step}")


def _protocol(run, task, protocol, out: Path, say, progress: bool, started: float,
              stop: Interrupts) -> dict:
    if task.accounting["pretraining_overlap"].get("excluded") is False:
        tell = say

        def say(line):
            tell(f"{line} [pretraining overlap kept]")

    setup = jobs_lib.make_setup(run.config.model, task, protocol, run.specials["pad"],
                                task.accounting["seq_len"])
    key, jobs_dir = _jobs_dir(out, run, task, protocol)
    fresh = (init_params(run.config.model, run.config.train.seed)
             if protocol.control or protocol.reinit_top else None)
    encoders = {"trained": jobs_lib.reinit_top(run.params, fresh, protocol.reinit_top)}
    dirs = {"trained": jobs_dir}  # each encoder's jobs: the control's never re-initialise
    if protocol.control:
        encoders["random_init"] = fresh
        dirs["random_init"] = (jobs_dir if not protocol.reinit_top else
                               _jobs_dir(out, run, task, replace(protocol, reinit_top=0))[1])
    todo = [(e, lr, d, s) for e in encoders for lr in protocol.learning_rates
            for d in protocol.layer_decays for s in range(protocol.seeds)]
    pending = [j for j in todo if not (dirs[j[0]] / f"{_job_name(*j)}.json").is_file()]
    if len(pending) < len(todo):
        say(f"{out}: {len(todo) - len(pending)} of {len(todo)} jobs already done; running "
            f"the other {len(pending)}")
    _run_jobs(setup, task, encoders, pending, dirs, say, progress, stop,
              lambda record, params: _keep_candidate(run, task, protocol, setup, key, jobs_dir,
                                                     record, params))
    stop.raise_if_requested(f"every job ran and is kept in {jobs_dir}; run the same command "
                            "to select and write the model")
    records = {e: [files.read_json(dirs[e] / f"{_job_name(*j)}.json") for j in todo
                   if j[0] == e] for e in encoders}
    results = {e: summarise(rs, task.metric) for e, rs in records.items()}
    (out / RESULT_FILE).unlink(missing_ok=True)  # never beside a model/ it does not name
    model = _selected_model(run, task, protocol, setup, results["trained"]["selected"], key,
                            out, say, encoders["trained"])
    for candidate in jobs_dir.glob(f"{CANDIDATE_PREFIX}*"):  # the rest: model/ is written
        shutil.rmtree(candidate, ignore_errors=True)
    result = _result(run, task, protocol, setup, results, started)
    result["model"] = model
    files.write_json(out / RESULT_FILE, result)
    return result


def _run_jobs(setup, task, encoders: dict, pending: list, dirs: dict, say,
              progress: bool, stop: Interrupts, keep_candidate) -> None:
    """The pending jobs, each committed into its encoder's ``dirs`` as it ends (a trained
    one's model first offered to ``keep_candidate``); a signal stops between two jobs."""
    bar = _bar(progress, len(pending) * setup.steps)
    try:
        for done, (encoder, lr, decay, seed) in enumerate(pending):
            stop.raise_if_requested(
                f"{done} of {len(pending)} pending jobs ran and are kept in "
                f"{dirs['trained'].parent}; run the same command to run the rest")
            name = _job_name(encoder, lr, decay, seed)
            if bar is not None:
                bar[0].update(bar[1], description=name)
            record, best = jobs_lib.run_job(setup, task, encoders[encoder], lr, seed,
                                            None if bar is None else
                                            (lambda n: bar[0].advance(bar[1], n)),
                                            keep_best=encoder == "trained", decay=decay)
            if best is not None:
                keep_candidate(record, best)
            files.write_json(dirs[encoder] / f"{name}.json", record)  # the job's commit
            if "diverged" in record:
                say(f"{name}: diverged at step {record['diverged']['step']} (loss "
                    f"{record['diverged']['loss']}); this setting is not selected")
            elif bar is None:
                e = jobs_lib.best_epoch(record, task.metric)
                kept = record["per_epoch"][e - 1]
                say(f"{name}: validation {task.metric} {kept['validation'][task.metric]:.4f} "
                    f"(epoch {e}, {record['seconds']:.1f} s)")  # test: the chosen setting's
    finally:
        if bar is not None:
            bar[0].stop()


def _job_identity(key: str, learning_rate: float, decay: float, seed: int, epoch: int,
                  validation: dict) -> dict:
    """What ``model/`` names (``finetuned.json``'s and ``result.json``'s ``job``)."""
    return {"jobs": key, "learning_rate": learning_rate, "layer_decay": decay, "seed": seed,
            "epoch": epoch, "validation": validation}


def _write_model(dest: Path, run, task, protocol, setup, job: dict, params) -> None:
    finetuned.write(dest, jax.device_get(params), setup.model_config, {
        "kind": task.kind, "labels": task.labels, "style": setup.style, "pair": task.pair,
        "pooling": protocol.pooling, "task": task.name, "metric": task.metric,
        "source_run": str(Path(run.path).absolute()), "source_step": run.step,
        "seq_len": setup.seq_len, "specials": run.specials, "learning_rate":
        job["learning_rate"], "layer_decay": job["layer_decay"], "seed": job["seed"],
        "validation": job["validation"],
        "dropout": protocol.dropout, "reinit_top": protocol.reinit_top, "job": job},
        run.tokenizer_path)


def _candidate_dir(jobs_dir: Path, learning_rate: float, decay: float) -> Path:
    return jobs_dir / f"{CANDIDATE_PREFIX}{learning_rate:g}{_decay_tag(decay)}"


def _keep_candidate(run, task, protocol, setup, key: str, jobs_dir: Path, record: dict,
                    params) -> None:
    """Keep a finished trained job's best-epoch model as its setting's candidate when it beats
    the one kept (``summarise``'s order within a setting: validation, then the lower seed)."""
    if "diverged" in record:
        return
    epoch = jobs_lib.best_epoch(record, task.metric)
    job = _job_identity(key, record["learning_rate"], decay_of(record), record["seed"], epoch,
                        record["per_epoch"][epoch - 1]["validation"])
    dest = _candidate_dir(jobs_dir, record["learning_rate"], decay_of(record))
    kept = files.read_json(dest / finetuned.META_FILE)
    if kept is not None and seed_rank(kept["job"]["validation"][task.metric],
                                       kept["job"]["seed"]) >= \
            seed_rank(job["validation"][task.metric], job["seed"]):
        return
    _write_model(dest, run, task, protocol, setup, job, params)


def _selected_model(run, task, protocol, setup, selected: dict, key: str, out: Path,
                    say, encoder: dict) -> dict:
    """``model/``: the selected setting's best-validation seed at its best epoch. Kept when
    it is already that job; moved from the setting's candidate when that is the job; otherwise
    the job is re-run (it is deterministic) and must reproduce its recorded validation score."""
    best = selected["best_seed"]
    job = _job_identity(key, selected["learning_rate"], selected["layer_decay"], best["seed"],
                        best["epoch"], best["validation"])
    meta = out / "model" / finetuned.META_FILE
    if meta.is_file() and files.read_json(meta).get("job") == job:
        return job
    setting = _setting_words(job)  # "0.001", or "0.001, decay 0.8"
    say(f"{out}: writing model/ — learning rate {setting}, seed {job['seed']}, epoch "
        f"{job['epoch']}")
    candidate = _candidate_dir(out / "jobs" / key, job["learning_rate"], job["layer_decay"])
    if (files.read_json(candidate / finetuned.META_FILE) or {}).get("job") == job:
        files.publish_dir(candidate, out / "model")
        return job
    record, params = jobs_lib.run_job(setup, task, encoder, job["learning_rate"],
                                      job["seed"], until_epoch=job["epoch"],
                                      decay=job["layer_decay"])
    got = record["per_epoch"][-1]["validation"][task.metric]
    want = best["validation"][task.metric]
    if abs(got - want) > REPRODUCE_TOLERANCE:
        raise ValueError(f"the selected job (lr {setting}, seed {job['seed']}) "
                         f"scored validation {task.metric} {got:.6f} on re-running, not its "
                         f"recorded {want:.6f}; run on the devices it ran on, or delete "
                         f"{out / 'jobs'} to retrain")
    _write_model(out / "model", run, task, protocol, setup, job, params)
    return job


def _result(run, task, protocol, setup, results: dict, started: float) -> dict:
    metric = task.metric
    out = {
        "run": str(run.path), "step": run.step,
        "task": {"name": task.name, "kind": task.kind, "source": task.source,
                 "labels": task.labels, "metric": metric, **task.accounting},
        "protocol": {**asdict(protocol), "steps_per_job": setup.steps, "head": setup.style,
                     "optimizer": f"AdamW {ADAM}, clip 1.0, linear warm-up then decay",
                     "epoch_kept": "best validation",
                     "compute_dtype": setup.model_config.compute_dtype},
        "encoders": results,
        "constant_baseline": {"test": constant_baseline(task)},
    }
    trained = results["trained"]["selected"]["test"][metric]["per_seed"]
    if task.kind in ("classification", "pair"):
        tfidf = tfidf_baseline(task)
        out["tfidf"] = {k: tfidf[k] for k in ("C", "validation", "test")}
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


# What GLUE reports beside a selection metric: MRPC/QQP accuracy beside F1, STS-B Pearson and
# Spearman, MNLI's mismatched dev set beside the matched one.
COMPANIONS = {"f1": ("accuracy",), "pearson_spearman": ("pearson", "spearman"),
              "accuracy": ("mismatched_accuracy",)}


def summary_table(result: dict):
    from rich.table import Table

    t, metric = result["task"], result["task"]["metric"]
    ex = t["examples"]
    kept = (t.get("pretraining_overlap") or {}).get("excluded") is False
    chosen = "rate" if len(result["protocol"].get("layer_decays", (1,))) == 1 else \
        "rate and layer decay"
    table = Table(title=f"finetune {t['name']} ({t['kind']}): train {ex['train']}, validation "
                        f"{ex['validation']}, test {ex['test']}; test {metric}, mean ± std "
                        f"over {result['protocol']['seeds']} seeds at the {chosen} chosen on "
                        "validation" + ("; PRETRAINING OVERLAP KEPT" if kept else ""))
    for name, justify in (("encoder", "left"), ("lr", "right"), (f"test {metric}", "right"),
                          ("worst seed", "right"), ("also", "left"), ("s / job", "right")):
        table.add_column(name, justify=justify)
    for name, r in result["encoders"].items():
        s = r["selected"]
        m = s["test"][metric]
        also = ", ".join(f"{c} {s['test'][c]['mean']:.4f}" for c in COMPANIONS.get(metric, ())
                         if c in s["test"])
        table.add_row(name, _setting_words(s), f"{m['mean']:.4f} ± {m['std']:.4f}",
                      f"{m['worst']:.4f}", also, f"{s['seconds_per_job']:.1f}")
        for d in r.get("diverged", []):
            steps = ", ".join(f"seed {k} at step {v['step']}" for k, v in d["seeds"].items())
            table.add_row(name, _setting_words(d), "diverged", steps, "", "")
    if "tfidf" in result:
        table.add_row("TF-IDF + logistic regression", f"C={result['tfidf']['C']:g}",
                      f"{result['tfidf']['test'][metric]:.4f}", "", "", "")
    table.add_row("constant", "", f"{result['constant_baseline']['test'][metric]:.4f}", "", "",
                  "")
    for key, label in (("trained_minus_random_init", "trained − random init"),
                       ("trained_minus_tfidf", "trained − TF-IDF")):
        if key in result:
            table.add_row(label, "", difference_words(result[key]), "", "", "")
    table.caption = "\n".join(accounting_lines(t))
    return table


def _setting_words(setting: dict) -> str:
    """``1e-3``, or ``1e-3, decay 0.8`` for a setting with layer-wise decay."""
    decay = setting.get("layer_decay", 1.0)
    return f"{setting['learning_rate']:g}" + ("" if decay == 1 else f", decay {decay:g}")


def result_of(run_dir: Path, name: str) -> dict:
    return files.read_json(Path(run_dir) / "finetune" / name / RESULT_FILE)
