"""The training loop, one for every command that trains: ``clozax train`` (``train/loop.py``)
and ``clozax embed`` (``train/contrastive/stage.py``) each hand ``drive`` a ``Job``, what
differs between them, and the loop does the rest the same way for both.

``drive`` runs a step per batch (batches made ahead on a background thread, ``Prefetcher``)
under a transfer guard, so the device never waits for the host between sync points. A sync
point (``_sync_point``) comes when a log line, an evaluation or a save is due or a signal
arrived: the metrics of every step since the last one are read in one transfer and checked
(``Job.check``) before anything of them is logged or saved, so no checkpoint holds a diverged
model; then the log line (with the pace: tokens/s, MFU, data wait, ETA), the evaluation, the
save (every ``save_every`` steps or ``save_every_minutes``), a ``--minutes`` budget's
re-estimate, and a signal's stop after its checkpoint is committed. ``_finish`` checks the
steps after the last sync point and waits for the last save.

A ``Job`` supplies the step program of each step index and its batch, the record's fields,
the checkpoint's metadata, the divergence check, how a budget's new length is recorded, and,
optionally, a held-out evaluation and a run's phases (a new program, a phase's end).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import jax

from clozax.core.train_state import TrainState, with_total_steps
from clozax.data.loader import Prefetcher
from clozax.train import distributed, hostmem
from clozax.train.config import RunConfig
from clozax.train.interrupts import Interrupted, Interrupts
from clozax.train.observe import Pace, TrainLog


def _fetch(pending: list):
    """Read the metrics of the steps since the last read, in one device→host transfer: the only
    place the loop waits for the device (every ``log_every`` steps, evaluation and save)."""
    return jax.device_get(pending)


@dataclass
class Job:
    """What one run of the loop trains, beside the loop itself. The defaults are a run of one
    program without a held-out evaluation (the contrastive stage); a run that has them
    (pretraining) overrides ``evaluates``, ``evaluate``, ``new_program`` and ``boundary``."""

    run_dir: Path
    log: TrainLog
    interrupts: Interrupts
    checkpointer: object
    started: float  # when the command started: the records' elapsed_s count from it
    peak: float | None  # the devices' peak FLOP/s (MFU); None: unknown
    budget: object | None  # a --minutes budget (train/budget.py)
    stop_after: int | None  # end the loop early (tests) without changing the schedule

    evaluates = False  # a held-out evaluation every eval_every steps
    saves_at_stop_after = False  # a stop_after end is saved (as a signal's stop is)

    def step(self, config: RunConfig, i: int, state: TrainState, batch):
        """Update ``i`` (0-based) of ``state`` on ``batch``: ``(state, metrics)``."""
        raise NotImplementedError

    def batch(self, i: int):
        """Batch ``i``, on the devices (a pure function of ``i``)."""
        raise NotImplementedError

    def pace_shape(self, config: RunConfig, i: int) -> tuple[int, float]:
        """Update ``i``'s tokens and model FLOPs per token (the pace's tokens/s and MFU)."""
        raise NotImplementedError

    def fields(self, step: int) -> dict:
        """Where a record of ``step`` is (its step, and what else places it)."""
        return {"step": step}

    def metric_fields(self, metrics: dict) -> dict:
        """A log line's fields from a step's metrics, read on the host (the loss aside)."""
        return {"lr": float(metrics["lr"]), "grad_norm": float(metrics["grad_norm"])}

    def check(self, pending: list, fetched: list) -> None:
        """Raise at the first step of ``pending`` ``(step, _)`` whose ``fetched`` metrics are
        not finite, before anything of it is logged or saved."""
        raise NotImplementedError

    def checkpoint_meta(self, config: RunConfig) -> dict:
        """What a checkpoint records beside the state."""
        raise NotImplementedError

    def record_length(self, config: RunConfig, step: int, steps: int) -> RunConfig:
        """``config`` with a budget's new length ``steps`` chosen after ``step``, recorded where
        a resume reads it."""
        raise NotImplementedError

    def evaluate(self, params, step: int) -> dict:
        """The held-out numbers after ``step`` (``evaluates`` jobs only)."""
        raise NotImplementedError

    def new_program(self, i: int) -> str | None:
        """What to say when update ``i`` runs a newly compiled program (a phase's first)."""
        return None

    def boundary(self, step: int) -> bool:
        """``step`` ends a phase: evaluate and save there."""
        return False


@dataclass
class Progress:
    """What the loop changes as it goes."""

    config: RunConfig  # a budget revision changes its train.steps
    state: TrainState
    loss: float = math.nan  # at the last sync point
    last_eval: dict | None = None
    pending: list = field(default_factory=list)  # (step, metrics on the device) since a read
    last_save: float = field(default_factory=time.perf_counter)


@dataclass(frozen=True)
class _Loop:
    """What every sync point of one ``drive`` reads (the objects, not their state)."""

    job: Job
    prefetch: Prefetcher
    pace: Pace


@dataclass(frozen=True)
class _Due:
    """What a sync point after a step has to do."""

    log: bool
    eval: bool
    save: bool
    stop: bool  # SIGTERM, SIGINT or a job's preemption notice


def drive(job: Job, p: Progress, start: int) -> int:
    """Steps ``start`` on: a step per batch, the device never waiting for the host between sync
    points; then ``_finish``. Returns the step reached. A signal saves the step it stopped at
    and raises ``Interrupted``; so does one that came during the last sync point, after it."""
    t, log = p.config.train, job.log
    end = t.steps if job.stop_after is None else min(t.steps, job.stop_after)
    revisions = dict(t.budget_revisions)
    prefetch = Prefetcher(job.batch, start, end, depth=t.prefetch)
    pace = Pace(*job.pace_shape(p.config, start), job.peak, job.started, end)
    p.last_save = time.perf_counter()
    lp = _Loop(job, prefetch, pace)
    try:
        log.start(total=t.steps, completed=start)
        for i, batch in prefetch:
            with jax.transfer_guard_device_to_host("disallow"):  # no per-step host read
                p.state, metrics = job.step(p.config, i, p.state, batch)
            step = i + 1
            if p.pending:  # one step queued behind the running one, no further (a wait, no read):
                jax.block_until_ready(p.pending[-1][1])  # unbounded run-ahead fragmented the heap
            p.pending.append((step, metrics))
            note = job.new_program(i)
            if step == start + 1:  # the first step of this process: say what compiling cost
                jax.block_until_ready(metrics)
                job.interrupts.arm()  # a signal now saves the step it stops at
                log.info(f"compiled and ran the first step in "
                         f"{time.perf_counter() - job.started:.1f} s since start")
                pace.begin(step, time.perf_counter(), prefetch.wait_seconds)
                if job.budget is not None:
                    job.budget.mark(step)
            elif note is not None:  # a new program: its own compile
                jax.block_until_ready(metrics)
                log.info(note)
            if note is not None:  # its tokens per step, after its compile
                pace.tokens_per_step, pace.flops_per_token = job.pace_shape(p.config, i)
                pace.begin(step, time.perf_counter(), prefetch.wait_seconds)
            if step in revisions:  # a recorded budget revision: the same step, the same length
                p.state = with_total_steps(p.state, revisions[step])
            end = _sync_point(lp, p, step, end)
        _finish(job, p)
        if job.interrupts.signal_name is not None:  # after the last sync point: saved, go
            step = int(jax.device_get(p.state.step))
            raise Interrupted(job.interrupts.signal_name, message=(
                f"the run trained to step {step} and its checkpoint is saved in "
                f"{job.run_dir}" + ("" if step >= p.config.train.steps else
                                    "; run the same command to resume")))
    finally:
        # Best effort: a failing close (a full disk under TensorBoard, say) must never hide
        # the error that ended the loop.
        for close in (prefetch.close, log.stop, job.checkpointer.close):
            try:
                close()
            except Exception:  # noqa: BLE001
                pass
    return int(jax.device_get(p.state.step))


def _sync_point(lp: _Loop, p: Progress, step: int, end: int) -> int:
    """After step ``step``: when a log, evaluation or save is due (or a signal arrived), read
    the metrics since the last one, check them, act on them. Returns the last step to train."""
    job = lp.job
    due = _due(job, p, step, end)
    if not (due.log or due.eval or due.save):
        job.log.advance(step)
        return end
    last, now = _read_metrics(job, p)
    record = _log_record(lp, p, step, last, now) if due.log else None
    if due.eval:
        record = _evaluate(lp, p, step, record)
    if due.save:
        record = _save(lp, p, step, record)
    if record is not None:
        job.log.metrics(record)
    if job.budget is not None and due.log:
        end = _revise_budget(lp, p, step, end)
    job.log.advance(step, p.loss)
    if due.stop and step < p.config.train.steps:
        job.checkpointer.wait()  # committed and digested before the process goes
        raise Interrupted(job.interrupts.signal_name, step, job.run_dir)
    return end


def _due(job: Job, p: Progress, step: int, end: int) -> _Due:
    t = p.config.train
    boundary = job.boundary(step)
    overdue = (t.save_every_minutes is not None
               and time.perf_counter() - p.last_save >= 60 * t.save_every_minutes)
    stop = job.interrupts.reached(step)
    return _Due(log=step % t.log_every == 0 or step == end or stop,
                eval=job.evaluates and (step % t.eval_every == 0 or step == t.steps
                                        or boundary),
                save=(step % t.save_every == 0 or step == t.steps or overdue or stop or boundary
                      or (job.saves_at_stop_after and step == end)),
                stop=stop)


def _read_metrics(job: Job, p: Progress) -> tuple[dict, float]:
    """The metrics of every step since the last read, checked finite; the last step's, and
    when they were read."""
    fetched = _fetch([m for _, m in p.pending])
    now = time.perf_counter()
    job.check(p.pending, fetched)
    p.loss = float(fetched[-1]["loss"])
    p.pending = []
    return fetched[-1], now


def _log_record(lp: _Loop, p: Progress, step: int, m: dict, now: float) -> dict:
    wait = lp.prefetch.wait_seconds
    return {**lp.job.fields(step), "loss": p.loss, **lp.job.metric_fields(m),
            "data_wait_s": round(wait, 4), **lp.pace.fields(step, now, wait)}


def _evaluate(lp: _Loop, p: Progress, step: int, record: dict | None) -> dict:
    """The held-out numbers; their time is not training time (tokens/s) and not the
    budget's."""
    started = time.perf_counter()
    p.last_eval = lp.job.evaluate(p.state.params, step)
    record = record or {**lp.job.fields(step), "loss": p.loss}
    record["eval"] = p.last_eval
    spent = time.perf_counter() - started  # one reading for the record and pace
    record["eval_seconds"] = round(spent, 3)
    if lp.job.budget is not None:
        lp.job.budget.spent_outside(spent)
    lp.pace.exclude(spent)  # tokens/s: training time only
    return record


def _revise_budget(lp: _Loop, p: Progress, step: int, end: int) -> int:
    """A time budget's re-estimate of the run's length, the same on every process, recorded
    (``Job.record_length``). Returns the last step to train."""
    t, job = p.config.train, lp.job
    revised = job.budget.revise(step, t.steps, t.eval_every if job.evaluates else math.inf,
                                t.save_every)
    revised = distributed.broadcast(-1 if revised is None else revised)
    if revised < 0:
        return end
    p.config = job.record_length(p.config, step, revised)
    p.state = with_total_steps(p.state, revised)
    end = revised if job.stop_after is None else min(revised, job.stop_after)
    lp.prefetch.stop_at(end)
    lp.pace.end = end
    job.log.retotal(revised)
    job.log.info(f"budget: re-estimated at step {step}; the run now ends at step {revised} "
                 "(recorded in config.json)")
    return end


def _save(lp: _Loop, p: Progress, step: int, record: dict | None) -> dict:
    """Save step ``step``: started now, written in the background while training goes on.
    Returns the step's record with the save's time."""
    job = lp.job
    t_save = time.perf_counter()
    job.checkpointer.save(step, p.state, job.checkpoint_meta(p.config))
    if hostmem.applied():  # CPU host: the same cores would write it, and the save's
        job.checkpointer.wait()  # buffers between steps fragment the one kept arena
    p.last_save = time.perf_counter()
    if job.budget is not None:
        job.budget.spent_outside(p.last_save - t_save)
    lp.pace.exclude(p.last_save - t_save)
    record = record or {**job.fields(step), "loss": p.loss}
    record["checkpoint_seconds"] = round(p.last_save - t_save, 3)
    return record


def _finish(job: Job, p: Progress) -> None:
    """After the last step: check the steps since the last sync point, wait for the last save."""
    if p.pending:  # stopped early (stop_after) between sync points: still check the steps
        job.check(p.pending, _fetch([m for _, m in p.pending]))
    job.checkpointer.wait()  # a failing background write is this run's error
    if job.budget is not None:
        job.log.info(job.budget.summary())
