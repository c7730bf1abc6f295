"""A ``--minutes`` contrastive stage's length: fixed before its first update from a few steps
timed on a throwaway copy of the state (``first_length``), re-estimated at the budget's points by
the loop ``clozax train --minutes`` runs in (``train/drive.py``, ``train/budget.py``), each
choice recorded in ``config.json`` and ``run.json``'s ``stage`` (``record_length``: what a
resume and ``clozax retrieval`` replay), the schedule's warm-up a tenth of the length chosen."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from clozax.core import files
from clozax.core.train_state import with_total_steps
from clozax.train import distributed
from clozax.train.budget import Budget
from clozax.train.layout import CONFIG_FILE, RUN_FILE

TIMING_STEPS = 3  # a --minutes stage times this many throwaway steps (after the compiling one)

def first_length(out, step_once, config, state, budget: Budget, start: int, log):
    """A ``--minutes`` stage's length, fixed before its first update: the step compiled and
    then ``TIMING_STEPS`` steps timed on a throwaway copy of the state (``train/budget.py``'s
    estimate from that pace), so the schedule — its warm-up a tenth of the length — is the
    stage's from update 1. Process 0 decides for all; recorded as ``(start, length)``.
    Returns ``(config, state)``."""
    probe = jax.tree.map(jnp.copy, state)
    probe, metrics = step_once(probe)  # compiles
    jax.block_until_ready(metrics)
    budget.mark(1)
    for _ in range(TIMING_STEPS):
        probe, metrics = step_once(probe)
    jax.block_until_ready(metrics)
    timed = 1 + TIMING_STEPS
    length = budget.estimate(timed, math.inf, config.train.save_every) - timed
    del probe
    steps = start + distributed.broadcast(max(1, length))
    budget.mark(start)  # the loop's pace is measured from its own steps
    config = record_length(out, config, start, steps)
    log.retotal(steps)
    log.info(f"budget: at step {start} the stage ends at step {steps} (recorded in config.json)")
    return config, with_total_steps(state, steps)


def record_length(out, config, step: int, steps: int):
    """``config`` with the stage's length set to ``steps`` after ``step`` updates, recorded in
    ``config.json`` and ``run.json``'s ``stage`` (what ``clozax retrieval`` replays)."""
    train = config.train
    revisions = (*train.budget_revisions, (step, steps))
    config = config.replace(
        train=dataclasses.replace(train, steps=steps, minutes=None,
                                  budget_revisions=revisions),
        optim=dataclasses.replace(config.optim, warmup_steps=max(1, math.ceil(steps / 10))))
    if distributed.is_primary():
        files.write_json(out / CONFIG_FILE, config.to_dict(), sort_keys=True)
        info = files.read_json(out / RUN_FILE)
        info["stage"]["budget_revisions"] = [list(r) for r in revisions]
        files.write_json(out / RUN_FILE, info, sort_keys=True)
    return config
