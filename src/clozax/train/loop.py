"""Pretraining: the loop, top to bottom, with exact resume.

``train`` reads the dataset, builds (or restores) the train state, and runs the jitted step
(``train/programs.py``) over batches that are pure functions of the step number, evaluating on
the frozen held-out set (``train/evaluation.py``) and checkpointing (``train/checkpoint.py``)
on their cadences. A run in phases (``train/phases.py``) trains its plan's segments in order,
each with its own compiled step, batches and held-out set.

``_train`` runs the stages in order: those that start a run (``train/start.py``: set-up, init,
budget, checkpoints, run files, restore), then ``_header`` and the loop. The loop is the one
every training command shares (``train/drive.py``: steps, sync points where metrics are read
and checked, saves, budget re-estimates, signals, finish); pretraining hands it a
``_Pretraining`` job: each segment's compiled step and batches, the held-out evaluation, the
phases' boundaries, the record's fields and the divergence check (``train/evaluation.py``).
"""

from __future__ import annotations

import math
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path

import jax

from clozax.core import files, flops, pattern
from clozax.core import model as model_lib
from clozax.core.train_state import TrainState
from clozax.train import distributed, evaluation
from clozax.train.budget import process_started
from clozax.train.config import RunConfig
from clozax.train.drive import Job, Progress, drive
from clozax.train.evaluation import Evaluator
from clozax.train.evaluation import TrainingDiverged as TrainingDiverged  # re-exported
from clozax.train.interrupts import Interrupts
from clozax.train.observe import TrainLog
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
    job = _Pretraining(run_dir, log, interrupts, checkpointer, started, peak, budget,
                       stop_after, run, programs, batches, evaluator, eval_set)
    progress = Progress(config, state)
    del state  # the loop's from here: no reference here keeps a donated step's state alive
    final = drive(job, progress, start)
    return TrainResult(run_dir, final, progress.loss, progress.last_eval, progress.state,
                       trained=final - start)


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
class _Pretraining(Job):
    """Pretraining as the loop (``train/drive.py``) runs it: each segment's compiled step and
    batches, the held-out evaluation on the frozen set, and a run in phases' boundaries."""

    run: Run
    programs: Programs
    batches: BatchSource
    evaluator: Evaluator
    eval_set: tuple  # (eval masks, sample)

    evaluates = True

    def step(self, config: RunConfig, i: int, state: TrainState, batch):
        return self.programs.step_fn(config, self.run.plan.at(i))(state, batch,
                                                                  self.run.keys.mask)

    def batch(self, i: int):
        return self.batches.device_batch(i)

    def pace_shape(self, config: RunConfig, i: int) -> tuple[int, float]:
        segment = self.run.plan.at(i)  # a resume inside a phase: that phase's rows
        return segment.batch_size * segment.seq_len, flops.model_flops_per_token(
            segment_config(config, segment).model, segment.seq_len)

    def fields(self, step: int) -> dict:
        return step_fields(self.run.plan, self.run.plan.at(step - 1), step)

    def metric_fields(self, metrics: dict) -> dict:
        return {"lr": float(metrics["lr"]), "selected": int(metrics["selected"]),
                "grad_norm": float(metrics["grad_norm"])}

    def check(self, pending: list, fetched: list) -> None:
        evaluation.check_finite(pending, fetched, self.checkpointer)

    def checkpoint_meta(self, config: RunConfig) -> dict:
        return {"config": config.to_dict()}

    def record_length(self, config: RunConfig, step: int, steps: int) -> RunConfig:
        """The revision in ``train.budget_revisions``, written to config.json."""
        t = config.train
        config = replace(config, train=replace(
            t, steps=steps, budget_revisions=(*t.budget_revisions, (step, steps))))
        if self.run.primary:
            files.write_json(self.run.run_dir / CONFIG_FILE, config.to_dict(), sort_keys=True)
        return config

    def evaluate(self, params, step: int) -> dict:
        """The in-training held-out number, on a sample of the frozen set (its rows)."""
        return self.evaluator.evaluate(params, *self.eval_set, self.run.plan.at(step - 1))

    def new_program(self, i: int) -> str | None:
        segment = self.run.plan.at(i)
        if not (self.run.plan.phased and i == segment.start):
            return None
        return (f"phase {segment.name} at step {i}: batch {segment.batch_size} x "
                f"{segment.seq_len} tokens (compiled and ran its first step)")

    def boundary(self, step: int) -> bool:
        return self.run.plan.phased and step == self.run.plan.at(step - 1).phase_end
