"""Decay branches: ``clozax train --decay-from RUN --step S --steps N --out NEW``.

A warmup-stable-decay run can end at any of its stable checkpoints: NEW starts from RUN's
checkpoint of step ``S`` (parameters and optimizer state, so the Adam moments carry on) and
decays over ``N`` more updates, with RUN's decay shape, to its end fraction. NEW's config is
RUN's with ``train.steps = S + N`` and ``optim.decay_start_step = S``; any budget revision or
extension of RUN is dropped (NEW's length is fixed). Batches and masks are pure functions of the
step, so NEW equals a run trained from scratch with NEW's config (tested bitwise).

NEW is written whole or not at all (a staged directory); RUN is only read. The same command
again resumes NEW (its run.json names the branch point).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

from clozax.core import files, locks
from clozax.core.files import staged_dir
from clozax.core.optim import decay_start, piece_decay_start
from clozax.train import checkpoint as ckpt
from clozax.train import config as config_lib
from clozax.train.phases import rate_pieces
from clozax.train.run_dir import CONFIG_FILE, RUN_FILE, TOKENIZER_FILE

# RUN's metrics too: training NEW from S drops their lines after S (TrainLog.forget_after).
COPIED = (TOKENIZER_FILE, "eval_masks.npz", "eval_masks.json", "metrics.jsonl")


def branch_config(source: config_lib.RunConfig, step: int, steps: int,
                  info: dict | None = None) -> config_lib.RunConfig:
    """RUN's config continued from its stable step ``step`` into an ``steps``-update decay
    (``info``: RUN's ``run.json``, which a run in phases needs)."""
    if source.phases:
        return phased_branch(source, step, steps, (info or {}).get("phases") or [])
    optim, train = source.optim, source.train
    if step < optim.warmup_steps:
        raise ValueError(f"--step {step} is inside the warm-up (optim.warmup_steps="
                         f"{optim.warmup_steps}); branch from a later checkpoint")
    start = decay_start(optim, config_lib.schedule_length(train, step))
    if step > start:
        raise ValueError(f"--step {step} is in the run's own decay (from step {start:g}); "
                         "a decay branches off a stable checkpoint: pass an earlier --step")
    train = replace(train, steps=step + steps, minutes=None, budget_revisions=(),
                    extended_from=())
    return replace(source, optim=replace(optim, decay_fraction=1.0, decay_start_step=step),
                   train=train)


def phased_branch(source: config_lib.RunConfig, step: int, steps: int,
                  recorded: list[dict]) -> config_lib.RunConfig:
    """A run in phases branched at ``step``: its phases up to ``step`` (the one holding it cut
    there), then a decay phase of ``steps`` updates with that phase's settings, decaying from
    its peak as the run's ``optim.schedule`` to its end fraction. Refused inside a warm-up, a
    phase's own decay, a batch ramp or a phase's masking ramp (the new phase would restart it)."""
    bounds = [(r["start"], r["end"]) for r in recorded]
    k = next((i for i, (a, b) in enumerate(bounds) if a < step <= b), None)
    if k is None:
        raise ValueError(f"--step {step} is not an update of run's phases {bounds}; pass a "
                         "checkpoint's step")
    piece, phase, (start, _) = rate_pieces(source, bounds)[k], source.phases[k], bounds[k]
    local = step - start
    decay_from = piece_decay_start(piece)
    name = recorded[k]["name"]
    for inside, what in ((0 < local <= piece.warmup, f"phase {name}'s warm-up"),
                         (local > decay_from, f"phase {name}'s own decay"),
                         (local < phase.batch_ramp_steps, f"phase {name}'s batch ramp"),
                         (phase.rate is not None and local < phase.ramp_steps,
                          f"phase {name}'s masking ramp")):
        if inside:
            raise ValueError(f"--step {step} is inside {what}; a decay branches off a stable "
                             "checkpoint: pass another --step")
    cut = replace(phase, steps=local, tokens=None, decay="none", decay_fraction=None)
    rate = phase.rate_end if phase.rate_end is not None else phase.rate
    decay = replace(phase, name=f"{name}-decay", steps=steps, tokens=None, batch_start=None,
                    batch_ramp_steps=0, rate=rate, rate_end=None, ramp_steps=0,
                    learning_rate=piece.peak, warmup_steps=0,
                    decay=phase.decay if phase.decay not in (None, "none")
                    else source.optim.schedule, decay_fraction=1.0,
                    end_lr_fraction=piece.end / piece.peak if piece.peak else 0.0)
    return replace(source, phases=(*source.phases[:k], cut, decay),
                   train=replace(source.train, steps=step + steps))


def branch_records(recorded: list[dict], step: int, steps: int) -> list[dict]:
    """RUN's ``run.json`` phases as the branch's plan gives them (``phased_branch``)."""
    k = next(i for i, r in enumerate(recorded) if r["start"] < step <= r["end"])
    r = recorded[k]
    sizes = [b for b in r["batch_sizes"] if b[0] < step]
    return [*recorded[:k], {**r, "end": step, "batch_sizes": sizes},
            {**r, "name": f"{r['name']}-decay", "start": step, "end": step + steps,
             "batch_sizes": [[step, sizes[-1][1]]]}]


def decay_branch(source_dir: Path, step: int, steps: int,
                 out: Path) -> tuple[config_lib.RunConfig, bool]:
    """Write NEW (``out``) from RUN's checkpoint ``step``, holding NEW's lock while it is
    written; returns the config to train it with, and whether it was written now (False: the
    same command again, resuming it)."""
    source_dir, out = Path(source_dir), Path(out)
    if not (source_dir / CONFIG_FILE).is_file():
        raise ValueError(f"--decay-from {source_dir} is not a clozax run")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"--steps {steps!r}: a decay branch needs its length, --steps N >= 1")
    origin = {"run": str(source_dir.absolute()), "step": step}
    if (out / RUN_FILE).is_file() and \
            json.loads((out / RUN_FILE).read_text()).get("decayed_from") == origin:
        saved = config_lib.load_json(out / CONFIG_FILE)  # the same command again: resume it
        if saved.train.steps != step + steps:
            raise ValueError(f"{out} is the branch of {source_dir} step {step} decaying over "
                             f"{saved.train.steps - step} updates, not {steps}; use a new --out")
        return saved, False
    with locks.hold(out, f"run {out}"):  # a second writer of NEW is refused, as in training
        if out.exists() and any(out.iterdir()):
            raise ValueError(f"output directory {out} exists; a decay branch needs a new --out")
        return _write_branch(source_dir, step, steps, out, origin), True


def _write_branch(source_dir: Path, step: int, steps: int, out: Path,
                  origin: dict) -> config_lib.RunConfig:
    checkpointer = ckpt.Checkpointer(source_dir, read_only=True)
    try:
        available = checkpointer.all_steps()
    finally:
        checkpointer.close()
    if step not in available:
        raise ValueError(f"run {source_dir} has no checkpoint of step {step}; it has "
                         f"{', '.join(map(str, available)) or 'none'}")
    info = json.loads((source_dir / RUN_FILE).read_text())
    config = branch_config(config_lib.load_json(source_dir / CONFIG_FILE), step, steps, info)
    info["decayed_from"] = origin
    if info.get("phases"):
        info["phases"] = branch_records(info["phases"], step, steps)
    with staged_dir(out) as tmp:
        files.write_json(tmp / CONFIG_FILE, config.to_dict(), sort_keys=True)
        files.write_json(tmp / RUN_FILE, info, sort_keys=True)
        for name in COPIED:
            if (source_dir / name).is_file():
                shutil.copyfile(source_dir / name, tmp / name)
        shutil.copytree(source_dir / ckpt.CHECKPOINT_DIR / str(step),
                        tmp / ckpt.CHECKPOINT_DIR / str(step))
        digest = source_dir / ckpt.DIGEST_DIR / f"{step}.json"
        if digest.is_file():
            (tmp / ckpt.DIGEST_DIR).mkdir()
            shutil.copyfile(digest, tmp / ckpt.DIGEST_DIR / digest.name)
    return config
