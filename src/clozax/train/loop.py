"""Pretraining: the loop, top to bottom, with exact resume.

``train`` reads the dataset, builds (or restores) the train state, and runs the jitted step
(``train/programs.py``) over batches that are pure functions of the step number, evaluating on
the frozen held-out set (``train/evaluation.py``) and checkpointing (``train/checkpoint.py``)
on their cadences. A run in phases (``train/phases.py``) trains its plan's segments in order,
each with its own compiled step, batches and held-out set.

``_train`` runs the stages in order: those that start a run (``train/start.py``: set-up, init,
budget, checkpoints, run files, restore), then ``_header``, ``_loop`` with its ``_sync_point``
(where metrics are read and checked) and ``_save``, and ``_finish``.
"""

from __future__ import annotations

import math
import time
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path

import jax

from clozax.core import files, flops, pattern
from clozax.core import model as model_lib
from clozax.core.train_state import TrainState, with_total_steps
from clozax.data.loader import Prefetcher
from clozax.train import distributed, evaluation, hostmem
from clozax.train.budget import process_started
from clozax.train.config import RunConfig
from clozax.train.evaluation import Evaluator
from clozax.train.evaluation import TrainingDiverged as TrainingDiverged  # re-exported
from clozax.train.interrupts import Interrupted, Interrupts
from clozax.train.observe import Pace, TrainLog
from clozax.train.phases import segment_config, step_fields
from clozax.train.programs import BatchSource, Programs
from clozax.train.run_dir import CONFIG_FILE, lock_run
from clozax.train.start import (
    Run,
    fix_budget,
    init_state,
    open_checkpoints,
    restore,
    set_up,
    write_run,
)


@dataclass
class TrainResult:
    run_dir: Path
    steps: int  # the run's step counter at the end
    final_loss: float  # NaN when this invocation trained nothing
    eval: dict | None
    state: TrainState
    trained: int = 0  # updates this invocation made (0: the run had its steps already)


def _fetch(pending: list):
    """Read the metrics of the steps since the last read, in one device→host transfer: the only
    place the loop waits for the device (every ``log_every`` steps, evaluation and save)."""
    return jax.device_get(pending)


def train(
    data_dir: Path,
    run_dir: Path,
    config: RunConfig,
    *,
    resume: bool = False,
    init_from: Path | None = None,
    extend_to: int | None = None,
    console=None,
    stop_after: int | None = None,
) -> TrainResult:
    """Train ``config`` on the dataset at ``data_dir`` into ``run_dir``.

    Stages: take the run's lock (one writer) and its signals → data and config → init →
    budget → checkpoints, run files and eval masks → restore → loop (sync points, evaluation,
    saves; a signal saves the step it stopped at and raises ``Interrupted``) → finish.

    Resume order: read the saved config and check it against this one → rebuild the same
    optimizer and step → restore (params, opt_state, step) from the newest intact checkpoint →
    batches continue at index ``step`` (a pure function of the step) with mask keys
    ``fold_in(mask_key, step)``, so the continued run is bitwise the uninterrupted one.
    ``init_from`` starts a new run from another run's latest parameters (continued
    pretraining, e.g. from ``clozax import-hf``): its model config is adopted and its tokenizer
    must be the dataset's. ``extend_to`` continues a finished run to that many steps (see
    ``check_compatible``). ``stop_after`` ends the loop early (for tests) without changing the
    schedule.

    The device never waits for the host: metrics stay on the device and are read every
    ``log_every`` steps (and before each evaluation and save), where their finiteness — loss,
    gradient norm and updated parameters of every step since the last read — is checked, so no
    checkpoint ever holds a diverged model; saves are written in the background.
    """
    started = process_started()  # a --minutes budget covers the whole command
    run_dir = Path(run_dir)
    primary = distributed.is_primary()  # the process that writes files and reports
    log = TrainLog(run_dir, console=console, enabled=primary, config=config)
    with ExitStack() as held:  # the run's lock and signal handlers, for the whole run
        lock_run(held, run_dir, primary, log.info)
        interrupts = held.enter_context(Interrupts(jax.process_count(), say=log.info,
                                                   early_exit=True))
        return _train(data_dir, run_dir, config, init_from, extend_to, stop_after, started,
                      primary, log, interrupts)


def _train(data_dir, run_dir: Path, config: RunConfig, init_from, extend_to, stop_after,
           started: float, primary: bool, log: TrainLog,
           interrupts: Interrupts) -> TrainResult:
    run, config = set_up(data_dir, run_dir, config, init_from, extend_to, started, primary,
                         log, interrupts)
    state, programs, batches = init_state(run, config)
    evaluator = Evaluator(config, run.plan, run.datasets, data_dir, run_dir, run.vocab,
                          run.mesh.devices.size, run.data_sharding, primary, log.info)
    config, state, budget, built_masks = fix_budget(run, config, state, programs, batches,
                                                    evaluator)
    checkpointer = evaluator.checkpointer = open_checkpoints(run, config, extend_to)
    eval_set = write_run(run, config, init_from, evaluator, built_masks)  # (masks, sample)
    state, start, restored = restore(run, config, state, checkpointer)
    if restored and start >= config.train.steps:
        checkpointer.close()
        log.info(f"run {run_dir} already completed {start} steps; nothing to do")
        return TrainResult(run_dir, start, math.nan, evaluator.evaluate(
            state.params, *eval_set, run.plan.at(start - 1)), state)
    peak = _header(run, config, programs.params, start)
    progress = _Progress(config, state)
    del state  # the loop's from here: no reference here keeps a donated step's state alive
    return _loop(run, progress, start, stop_after, programs, batches, evaluator, eval_set,
                 checkpointer, budget, peak)


def _header(run: Run, config: RunConfig, params, start: int):
    """Say what trains where; returns the devices' peak FLOP/s (for MFU)."""
    n_devices = run.mesh.devices.size
    peak, peak_source = flops.peak_flops(jax.devices()[0].device_kind,
                                         config.model.compute_dtype, n_devices,
                                         config.train.peak_tflops)
    t = config.train
    first = run.plan.at(start)  # the segment this invocation starts in
    run.log.header(
        devices=n_devices, platform=jax.devices()[0].platform, dtype=config.model.compute_dtype,
        params=model_lib.param_count(params), batch_tokens=first.batch_size * first.seq_len,
        steps=t.steps, start=start, microbatches=t.microbatches, fsdp=t.fsdp,
        processes=jax.process_count(), peak=peak_source,
        attention=pattern.attention_plan(config.model, first.seq_len).describe(),
    )
    return peak


@dataclass
class _Progress:
    """What the loop changes as it goes."""

    config: RunConfig  # a budget revision changes its train.steps
    state: TrainState
    loss: float = math.nan  # at the last sync point
    last_eval: dict | None = None
    pending: list = field(default_factory=list)  # (step, metrics on the device) since a read
    last_save: float = field(default_factory=time.perf_counter)


def _loop(run: Run, p: _Progress, start: int, stop_after, programs: Programs,
          batches: BatchSource, evaluator: Evaluator, eval_set, checkpointer, budget,
          peak) -> TrainResult:
    """Steps ``start`` on: a step per batch, the device never waiting for the host between
    sync points."""
    t, log = p.config.train, run.log
    end = t.steps if stop_after is None else min(t.steps, stop_after)
    revisions = dict(t.budget_revisions)
    prefetch = Prefetcher(batches.device_batch, start, end, depth=t.prefetch)
    first = run.plan.at(start)  # a resume inside a phase: that phase's rows
    pace = Pace(first.batch_size * first.seq_len, flops.model_flops_per_token(
        segment_config(p.config, first).model, first.seq_len), peak, run.started, end)
    p.last_save = time.perf_counter()
    lp = _Loop(run, stop_after, prefetch, pace, evaluator, eval_set, checkpointer, budget)
    try:
        log.start(total=t.steps, completed=start)
        for i, batch in prefetch:
            segment = run.plan.at(i)
            with jax.transfer_guard_device_to_host("disallow"):  # no per-step host read
                p.state, metrics = programs.step_fn(p.config, segment)(p.state, batch,
                                                                       run.keys.mask)
            step = i + 1
            if p.pending:  # one step queued behind the running one, no further (a wait, no read):
                jax.block_until_ready(p.pending[-1][1])  # unbounded run-ahead fragmented the heap
            p.pending.append((step, metrics))
            if step == start + 1:  # the first step of this process: say what compiling cost
                jax.block_until_ready(metrics)
                run.interrupts.arm()  # a signal now saves the step it stops at
                log.info(f"compiled and ran the first step in "
                         f"{time.perf_counter() - run.started:.1f} s since start")
                pace.begin(step, time.perf_counter(), prefetch.wait_seconds)
                if budget is not None:
                    budget.mark(step)
            elif run.plan.phased and i == segment.start:  # a new segment: its own compile
                jax.block_until_ready(metrics)
                log.info(f"phase {segment.name} at step {i}: batch {segment.batch_size} x "
                         f"{segment.seq_len} tokens (compiled and ran its first step)")
            if run.plan.phased and i == segment.start:  # its tokens per step, after its compile
                pace.tokens_per_step = segment.batch_size * segment.seq_len
                pace.flops_per_token = flops.model_flops_per_token(
                    segment_config(p.config, segment).model, segment.seq_len)
                pace.begin(step, time.perf_counter(), prefetch.wait_seconds)
            if step in revisions:  # a recorded budget revision: the same step, the same length
                p.state = with_total_steps(p.state, revisions[step])
            end = _sync_point(lp, p, segment, step, end)
        _finish(p, checkpointer, budget, log)
        if run.interrupts.signal_name is not None:  # after the last sync point: saved, go
            step = int(jax.device_get(p.state.step))
            raise Interrupted(run.interrupts.signal_name, message=(
                f"the run trained to step {step} and its checkpoint is saved in "
                f"{run.run_dir}" + ("" if step >= p.config.train.steps else
                                    "; run the same command to resume")))
    finally:
        # Best effort: a failing close (a full disk under TensorBoard, say) must never hide
        # the error that ended the loop.
        for close in (prefetch.close, log.stop, checkpointer.close):
            try:
                close()
            except Exception:  # noqa: BLE001
                pass
    final = int(jax.device_get(p.state.step))
    return TrainResult(run.run_dir, final, p.loss, p.last_eval, p.state, trained=final - start)


@dataclass(frozen=True)
class _Loop:
    """What every sync point of one ``_loop`` reads (the objects, not their state)."""

    run: Run
    stop_after: int | None
    prefetch: Prefetcher
    pace: Pace
    evaluator: Evaluator
    eval_set: tuple
    checkpointer: object
    budget: object | None


@dataclass(frozen=True)
class _Due:
    """What a sync point after a step has to do."""

    log: bool
    eval: bool
    save: bool
    stop: bool  # SIGTERM, SIGINT or a job's preemption notice


def _sync_point(lp: _Loop, p: _Progress, segment, step: int, end: int) -> int:
    """After step ``step``: when a log, evaluation or save is due (or a signal arrived), read
    the metrics since the last one, check them, act on them. Returns the last step to train."""
    due = _due(lp.run, p, segment, step, end)
    if not (due.log or due.eval or due.save):
        lp.run.log.advance(step)
        return end
    last, now = _read_metrics(p, lp.checkpointer)
    record = _log_record(lp, p, segment, step, last, now) if due.log else None
    if due.eval:
        record = _evaluate(lp, p, segment, step, record)
    if due.save:
        record = _save(lp.run, p, segment, step, record, lp.pace, lp.checkpointer, lp.budget)
    if record is not None:
        lp.run.log.metrics(record)
    if lp.budget is not None and due.log:
        end = _revise_budget(lp, p, step, end)
    lp.run.log.advance(step, p.loss)
    if due.stop and step < p.config.train.steps:
        lp.checkpointer.wait()  # committed and digested before the process goes
        raise Interrupted(lp.run.interrupts.signal_name, step, lp.run.run_dir)
    return end


def _due(run: Run, p: _Progress, segment, step: int, end: int) -> _Due:
    t, plan = p.config.train, run.plan
    boundary = plan.phased and step == segment.phase_end  # a phase's last update
    overdue = (t.save_every_minutes is not None
               and time.perf_counter() - p.last_save >= 60 * t.save_every_minutes)
    stop = run.interrupts.reached(step)
    return _Due(log=step % t.log_every == 0 or step == end or stop,
                eval=step % t.eval_every == 0 or step == t.steps or boundary,
                save=step % t.save_every == 0 or step == t.steps or overdue or stop or boundary,
                stop=stop)


def _read_metrics(p: _Progress, checkpointer) -> tuple[dict, float]:
    """The metrics of every step since the last read, checked finite; the last step's, and
    when they were read."""
    fetched = _fetch([m for _, m in p.pending])
    now = time.perf_counter()
    evaluation.check_finite(p.pending, fetched, checkpointer)
    p.loss = float(fetched[-1]["loss"])
    p.pending = []
    return fetched[-1], now


def _log_record(lp: _Loop, p: _Progress, segment, step: int, m: dict, now: float) -> dict:
    wait = lp.prefetch.wait_seconds
    return {**step_fields(lp.run.plan, segment, step), "loss": p.loss, "lr": float(m["lr"]),
            "selected": int(m["selected"]), "grad_norm": float(m["grad_norm"]),
            "data_wait_s": round(wait, 4), **lp.pace.fields(step, now, wait)}


def _evaluate(lp: _Loop, p: _Progress, segment, step: int, record: dict | None) -> dict:
    """The in-training held-out number, on a sample of the frozen set; its time is not
    training time (tokens/s) and not the budget's."""
    started = time.perf_counter()
    p.last_eval = lp.evaluator.evaluate(p.state.params, *lp.eval_set, segment)
    record = record or {**step_fields(lp.run.plan, segment, step), "loss": p.loss}
    record["eval"] = p.last_eval  # on a sample of the frozen set (its rows)
    spent = time.perf_counter() - started  # one reading for the record and pace
    record["eval_seconds"] = round(spent, 3)
    if lp.budget is not None:
        lp.budget.spent_outside(spent)
    lp.pace.exclude(spent)  # tokens/s: training time only
    return record


def _revise_budget(lp: _Loop, p: _Progress, step: int, end: int) -> int:
    """A time budget's re-estimate of the run's length, the same on every process, recorded
    in config.json. Returns the last step to train."""
    t, run = p.config.train, lp.run
    revised = lp.budget.revise(step, t.steps, t.eval_every, t.save_every)
    revised = distributed.broadcast(-1 if revised is None else revised)
    if revised < 0:
        return end
    t = replace(t, steps=revised, budget_revisions=(*t.budget_revisions, (step, revised)))
    p.config = replace(p.config, train=t)
    p.state = with_total_steps(p.state, revised)
    if run.primary:
        files.write_json(run.run_dir / CONFIG_FILE, p.config.to_dict(), sort_keys=True)
    end = revised if lp.stop_after is None else min(revised, lp.stop_after)
    lp.prefetch.stop_at(end)
    lp.pace.end = end
    run.log.retotal(revised)
    run.log.info(f"budget: re-estimated at step {step}; the run now ends at step {revised} "
                 "(recorded in config.json)")
    return end


def _save(run: Run, p: _Progress, segment, step: int, record: dict | None, pace: Pace,
          checkpointer, budget) -> dict:
    """Save step ``step``: started now, written in the background while training goes on.
    Returns the step's record with the save's time."""
    t_save = time.perf_counter()
    checkpointer.save(step, p.state, {"config": p.config.to_dict()})
    if hostmem.applied():  # CPU host: the same cores would write it, and the save's
        checkpointer.wait()  # buffers between steps fragment the one kept arena
    p.last_save = time.perf_counter()
    if budget is not None:
        budget.spent_outside(p.last_save - t_save)
    pace.exclude(p.last_save - t_save)
    record = record or {**step_fields(run.plan, segment, step), "loss": p.loss}
    record["checkpoint_seconds"] = round(p.last_save - t_save, 3)
    return record


def _finish(p: _Progress, checkpointer, budget, log: TrainLog) -> None:
    """After the last step: check the steps since the last sync point, wait for the last save."""
    if p.pending:  # stopped early (stop_after) between sync points: still check the steps
        evaluation.check_finite(p.pending, _fetch([m for _, m in p.pending]), checkpointer)
    checkpointer.wait()  # a failing background write is this run's error
    if budget is not None:
        log.info(budget.summary())
