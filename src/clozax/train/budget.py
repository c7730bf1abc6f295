"""``--minutes``: choose the step count so that the whole command — compilation, evaluations
and checkpoints included — takes the budget, and correct it as the run shows its real speed.

The first choice is made before training, from the real compiled step run on a throwaway copy
of the state (its first call is the compilation the run itself then reuses), one timed
evaluation of the in-training held-out sample and one timed checkpoint save — unless start-up
and compiling have spent the budget already: then the run is one step, without the timings.
The speed of the first steps is not the speed of the run (the host heap settles over tens of
steps; on a shared machine other work comes and goes), so from a quarter of the budget on, at
every 15 % of it, the run re-estimates from its speed since the last check and moves its end.
The schedule's length is data in the optimizer state, so a revision recompiles nothing; each is
recorded (``train.budget_revisions``) and a resume applies it at the same step.
"""

from __future__ import annotations

import math
import os
import shutil
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from clozax.train import checkpoint as ckpt
from clozax.train import distributed, heldout

WARMUP_STEPS, TIMED_STEPS = 2, 5  # measured on the throwaway copy after its compiling call
REVISE_AT = (0.25, 0.4, 0.55, 0.7, 0.85)  # fractions of the budget at which to re-estimate
MARGIN = 0.02  # of the budget, kept for closing the run (final metrics, report lines)
MIN_CHANGE = 0.03  # a re-estimate within this fraction of the current length changes nothing


def process_started() -> float:
    """When this process started, on the ``time.perf_counter`` clock (Linux ``/proc``; elsewhere
    now): the budget covers the whole command, imports included."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        age = uptime - ticks / os.sysconf("SC_CLK_TCK")
        return time.perf_counter() - max(age, 0.0)
    except (OSError, ValueError, IndexError):
        return time.perf_counter()


def steps_for_budget(config, started: float, state, step_fn, device_batch, mask_key,
                     evaluate, masks, run_dir: Path, say) -> int:
    """The step count that fits ``config.train.minutes`` from ``started`` (perf_counter).

    ``evaluate(params, masks, sample)`` is the run's own held-out evaluation, timed on the
    run's frozen set ``masks`` (built once: the run keeps it).
    """
    t = config.train
    probe = jax.tree.map(jnp.copy, state)
    t0 = time.perf_counter()
    probe, m = step_fn(probe, device_batch(0), mask_key)  # compiles the run's step
    jax.block_until_ready(m)
    compile_s = time.perf_counter() - t0
    budget_s = 60 * t.minutes
    spent = time.perf_counter() - started
    # Spent already (start-up and compiling took it): timing steps, an evaluation and a save
    # would only overrun it further. Decided by process 0 for all (the probe is collective).
    if distributed.broadcast(int(spent >= budget_s * (1 - MARGIN))):
        say(f"budget {t.minutes:g} min: {spent:.1f} s spent before the first step (compile "
            f"{compile_s:.1f} s) -> 1 step")
        return 1
    for _ in range(WARMUP_STEPS):
        probe, m = step_fn(probe, device_batch(0), mask_key)
    jax.block_until_ready(m)
    t0 = time.perf_counter()
    for _ in range(TIMED_STEPS):
        probe, m = step_fn(probe, device_batch(0), mask_key)
    jax.block_until_ready(m)
    step_s = (time.perf_counter() - t0) / TIMED_STEPS

    sample = heldout.sample_indices(masks.rows.size, t.eval_sample, t.eval_seed)
    evaluate(probe.params, masks, sample)  # compiles evaluation
    t0 = time.perf_counter()
    evaluate(probe.params, masks, sample)
    eval_s = time.perf_counter() - t0

    # A save is collective (every process writes its shards, orbax commits once), so every
    # process times the same save into one scratch directory, which process 0 alone clears.
    scratch = Path(run_dir).parent / f".{Path(run_dir).name}.budget-probe"
    primary = distributed.is_primary()
    if primary:
        shutil.rmtree(scratch, ignore_errors=True)
    distributed.barrier("clozax-budget-probe-start")
    t0 = time.perf_counter()
    checkpointer = ckpt.Checkpointer(scratch, keep=1, primary=primary)
    try:
        checkpointer.save(1, probe, {"probe": True})
        checkpointer.wait()
    finally:
        checkpointer.close()
    save_s = time.perf_counter() - t0
    distributed.barrier("clozax-budget-probe-end")
    if primary:
        shutil.rmtree(scratch, ignore_errors=True)

    per_step = step_s + eval_s / t.eval_every + save_s / t.save_every
    remaining = budget_s * (1 - MARGIN) - (time.perf_counter() - started) - eval_s - save_s
    steps = max(1, math.floor(remaining / per_step))
    say(f"budget {t.minutes:g} min: compile {compile_s:.1f} s, {step_s * 1e3:.0f} ms/step, "
        f"evaluation {eval_s:.1f} s, checkpoint {save_s:.1f} s -> {steps} steps")
    return steps


class Budget:
    """Keeps the run to its budget: measures the loop's own speed and re-estimates the end."""

    def __init__(self, minutes: float, started: float):
        self.budget_s = 60 * minutes
        self.started = started
        self.outside_s = 0.0  # evaluation and checkpoint time inside the loop, all of it
        self.outside_events = 0
        self.window = None  # (step, time, outside_s) where the current speed window began
        self.checks = 0

    def mark(self, step: int) -> None:
        """The first step of the loop has run (compiled): speed is measured from here."""
        self.window = (step, time.perf_counter(), self.outside_s)

    def spent_outside(self, seconds: float) -> None:
        self.outside_s += seconds
        self.outside_events += 1

    def due(self, step: int) -> bool:
        """A re-estimation point of the budget has passed since the last estimate."""
        return not (self.window is None or self.checks >= len(REVISE_AT) or step <= self.window[0]
                    or time.perf_counter() - self.started < REVISE_AT[self.checks] * self.budget_s)

    def revise(self, step: int, steps: int, eval_every: float, save_every: int) -> int | None:
        """A new end step when a re-estimation point has passed and the speed measured since
        the last one moves the end by more than ``MIN_CHANGE``; None otherwise."""
        if not self.due(step):
            return None
        new = self.estimate(step, eval_every, save_every)
        return new if abs(new - steps) > MIN_CHANGE * steps else None

    def estimate(self, step: int, eval_every: float, save_every: int) -> int:
        """The end step that fits the budget at the speed measured since the window began
        (``eval_every`` ``math.inf`` where nothing evaluates); the window restarts here and the
        re-estimation points already passed are spent."""
        now = time.perf_counter()
        elapsed = now - self.started
        while self.checks < len(REVISE_AT) and elapsed >= REVISE_AT[self.checks] * self.budget_s:
            self.checks += 1
        w_step, w_time, w_outside = self.window
        step_s = (now - w_time - (self.outside_s - w_outside)) / (step - w_step)
        self.window = (step, now, self.outside_s)
        outside_each = self.outside_s / max(self.outside_events, 1)
        per_step = step_s + outside_each * (1 / eval_every + 1 / save_every)
        remaining = self.budget_s * (1 - MARGIN) - elapsed - 2 * outside_each
        return max(step + 1, step + math.floor(remaining / per_step))

    def summary(self) -> str:
        used = time.perf_counter() - self.started
        return (f"budget: {used:.0f} s of {self.budget_s:.0f} s used "
                f"({100 * used / self.budget_s:.0f} %)")
