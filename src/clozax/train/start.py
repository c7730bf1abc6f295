"""Starting a run, the stages before its loop (``train/loop.py``), in the order they run:
``set_up`` (data, config, devices: what every stage shares, as a ``Run``), ``init_state`` (the
state at step 0 and its programs), ``fix_budget`` (``--minutes``), ``open_checkpoints``,
``write_run`` (run files and the frozen held-out set) and ``restore`` (the newest intact
checkpoint).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from clozax.core import files, pattern
from clozax.core.keys import Keys
from clozax.core.optim import make_optimizer, piecewise_rate
from clozax.core.train_state import TrainState, init_params, new_state, with_total_steps
from clozax.core.vocab import Vocabulary
from clozax.data.dataset import Dataset, open_dataset
from clozax.train import checkpoint as ckpt
from clozax.train import distributed
from clozax.train.budget import Budget, steps_for_budget
from clozax.train.checks import validate_for_data
from clozax.train.config import RunConfig, schedule_length
from clozax.train.evaluation import Evaluator
from clozax.train.interrupts import Interrupts
from clozax.train.mesh import make_mesh, place, state_shardings
from clozax.train.observe import TrainLog
from clozax.train.phase_config import optimizer_apart
from clozax.train.phases import Plan, make_plan, run_records, segment_config
from clozax.train.programs import BatchSource, Programs
from clozax.train.run_dir import (
    CONFIG_FILE,
    RUN_FILE,
    TOKENIZER_FILE,
    LoadedRun,
    init_mlm_head,
    resolve_run,
    write_run_files,
)


@dataclass(frozen=True)
class Run:
    """What every stage shares, fixed once the run is set up."""

    data_dir: Path  # as given (--data)
    run_dir: Path
    plan: Plan
    datasets: dict  # absolute directory -> Dataset, for every dataset of the plan
    dataset: Dataset  # the run's own (--data)
    existing: bool  # the run directory holds a run (resume or extension)
    extending: bool
    init_run: LoadedRun | None  # --init-from
    phase_records: list | None  # the plan as run.json records it
    mesh: Mesh
    data_sharding: NamedSharding  # a batch's rows split over the devices
    vocab: Vocabulary
    keys: Keys
    started: float  # process start: a --minutes budget counts from it
    primary: bool
    log: TrainLog
    interrupts: Interrupts


def set_up(data_dir, run_dir: Path, config: RunConfig, init_from, extend_to, started: float,
           primary: bool, log: TrainLog, interrupts: Interrupts) -> tuple[Run, RunConfig]:
    """Data and the run's config (a run in phases has a plan of segments, train/phases.py),
    checked against an existing run and the devices."""
    plan, datasets = make_plan(config, data_dir, open_dataset)
    dataset = datasets[Path(data_dir).absolute()]
    config = config.replace(model=replace(config.model, vocab_size=dataset.vocab_size))
    if plan.phased:  # the phases give the run's length
        config = config.replace(train=replace(config.train, steps=plan.total))
    # Every process of a job reads the run directory before the first one writes to it.
    config, existing, extending, init_run, info = resolve_run(run_dir, config, dataset,
                                                               init_from, extend_to, log.info)
    distributed.barrier("clozax-train-start")
    mesh = make_mesh(config.train.devices)
    n_devices = mesh.devices.size
    validate_for_data(config, dataset, n_devices)
    for segment in plan.segments if plan.phased else ():
        validate_for_data(segment_config(config, segment), datasets[segment.data], n_devices)
    phase_records = run_records(plan, datasets, run_dir, (info or {}).get("phases")
                                if existing else None)
    if existing and primary and phase_records and info.get("phases") != phase_records:
        files.write_json(run_dir / RUN_FILE, {**info, "phases": phase_records})  # moved data
        saved = json.loads((run_dir / CONFIG_FILE).read_text())
        for recorded, phase in zip(saved["phases"], config.phases, strict=True):
            recorded["data"] = phase.data
        files.write_json(run_dir / CONFIG_FILE, saved, sort_keys=True)
        log.info(f"run {run_dir}: its phases' datasets moved; run.json and config.json now "
                 "name them where they are (the same fingerprints)")
    vocab = Vocabulary(dataset.vocab_size, dataset.specials)
    keys = Keys.from_seed(config.train.seed)
    return Run(data_dir, run_dir, plan, datasets, dataset, existing, extending, init_run,
               phase_records, mesh, NamedSharding(mesh, P("data")), vocab, keys, started,
               primary, log, interrupts), config


def init_state(run: Run, config: RunConfig) -> tuple[TrainState, Programs, BatchSource]:
    """The train state at step 0, placed on the devices, and the programs that train it: one
    compiled step per segment (the schedule's length is data in the optimizer state, so
    --minutes, a budget revision and --extend-to never recompile)."""
    params = init_params(config.model, config.train.seed)
    if run.init_run is not None:
        params = jax.tree.map(jnp.asarray, run.init_run.params)
    rate = piecewise_rate(run.plan.pieces) if run.plan.phased else None
    optimizer, _ = make_optimizer(config.optim, config.train.steps, params, rate,
                                  optimizer_apart(config.phases))
    state = new_state(params, optimizer)
    shardings = state_shardings(state, run.mesh, config.train.fsdp)
    state = place(state, shardings)
    programs = Programs(run.vocab, params, rate, run.mesh, shardings)
    programs.step_fn(config, run.plan.segments[0])  # the first segment's, from this config
    batches = BatchSource(run.plan, run.datasets, run.data_dir, run.vocab, run.keys.data,
                          run.data_sharding)
    return state, programs, batches


def fix_budget(run: Run, config: RunConfig, state: TrainState, programs: Programs,
               batches: BatchSource, evaluator: Evaluator):
    """--minutes fixes the step count of a new run from measured costs (compile included).
    Returns ``(config, state, budget, built_masks)``, the last two None without a budget."""
    if config.train.minutes is None or run.existing:
        return config, state, None, None
    built_masks = evaluator.build_masks()
    steps = distributed.broadcast(steps_for_budget(
        config, run.started, state, programs.step_fn(config, run.plan.segments[0]),
        batches.device_batch, run.keys.mask, evaluator.evaluate, built_masks, run.run_dir,
        run.log.info))
    config = replace(config, train=replace(config.train, steps=steps,
                                           budget_revisions=((0, steps),)))
    state = with_total_steps(state, steps)
    return config, state, Budget(config.train.minutes, run.started), built_masks


def open_checkpoints(run: Run, config: RunConfig, extend_to) -> ckpt.Checkpointer:
    """The run's checkpoints; an extension needs a finished run."""
    checkpointer = ckpt.Checkpointer(run.run_dir, keep=config.train.keep_checkpoints,
                                     primary=run.primary)
    if run.extending:
        done, before = checkpointer.latest_step(), config.train.extended_from[-1]
        if done != before:
            checkpointer.close()
            raise ValueError(f"run {run.run_dir} has not finished (step {done} of {before}); "
                             f"resume it with its own command first, then --extend-to "
                             f"{extend_to}")
    return checkpointer


def write_run(run: Run, config: RunConfig, init_from, evaluator: Evaluator, built_masks):
    """The run directory (a new run's files; an extension's config) and its frozen held-out
    set. Returns ``(eval_masks, sample)``."""
    run_dir, dataset, init_run = run.run_dir, run.dataset, run.init_run
    seq_len = dataset.seq_len
    run_dir.mkdir(parents=True, exist_ok=True)
    if not run.existing and run.primary:
        write_run_files(run_dir, config, {
            "dataset": str(Path(run.data_dir).absolute()),
            "dataset_fingerprint": dataset.fingerprint,
            "tokenizer_sha256": dataset.tokenizer_sha256,
            "seq_len": seq_len,
            # the longest row trained on, the source's included (LoadedRun.trained_length)
            "trained_length": max(seq_len, init_run.trained_length if init_run else 0),
            "specials": dataset.specials,
            "special_strings": dataset.special_strings,
            "seed": config.train.seed,
            "eval_seed": config.train.eval_seed,
            "init_from": str(Path(init_from).absolute()) if init_from else None,
            "attention": attention_record(config, run.plan),
            # The head's optimizer state kept apart (a head-only phase): what a resume checks
            **({"optimizer_apart": optimizer_apart(config.phases)}
               if optimizer_apart(config.phases) else {}),
            **({"init_mlm_head": init_mlm_head(init_run)} if init_run else {}),
            **({"phases": run.phase_records,
                "source_trained_length": init_run.trained_length if init_run else 0}
               if run.plan.phased else {}),
        })
        files.write_bytes(run_dir / TOKENIZER_FILE, dataset.tokenizer_path.read_bytes())
    elif run.extending and run.primary:
        files.write_json(run_dir / CONFIG_FILE, config.to_dict(), sort_keys=True)
        run.log.info(f"extending run {run_dir} from {config.train.extended_from[-1]} to "
                     f"{config.train.steps} steps (schedule re-created for "
                     f"{config.train.steps})")
    return evaluator.run_eval_set(built_masks)


def attention_record(config: RunConfig, plan: Plan) -> dict:
    """``run.json``'s ``attention``: the setting, the platform and the path each layer kind runs
    at each row length the run trains on (``pattern.attention_plan``)."""
    paths = {}
    for segment in plan.segments:
        model = segment_config(config, segment).model
        paths.setdefault(segment.seq_len,
                         pattern.attention_plan(model, segment.seq_len).record())
    return {"setting": config.model.attention, "platform": pattern.device()[0],
            "paths": [{"seq_len": n, **paths[n]} for n in sorted(paths)]}


def restore(run: Run, config: RunConfig, state: TrainState,
            checkpointer: ckpt.Checkpointer) -> tuple[TrainState, int, bool]:
    """The newest intact checkpoint, if any: ``(state, start, restored)``, the schedule's
    length set to the one in effect from ``start``."""
    try:
        restored = checkpointer.restore_latest(ckpt.abstract_like(state), say=run.log.info,
                                               set_aside=True)
    except BaseException:
        checkpointer.close()
        raise
    start = 0  # a run directory whose first checkpoint never landed starts again
    if restored is not None:
        state, _, start = restored
    run.log.forget_after(start)  # lines of steps after the checkpoint: they are computed again
    # The schedule's length in effect from here (a --minutes estimate, revision or extension)
    state = with_total_steps(state, schedule_length(config.train, start))
    return state, start, restored is not None
