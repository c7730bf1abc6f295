"""Pretraining: the loop, top to bottom, with exact resume.

``train`` reads the dataset, builds (or restores) the train state, and runs the jitted step
(``clozax.train.step``) over batches that are pure functions of the step number, evaluating on
the frozen held-out set (``clozax.train.heldout``) and checkpointing (``clozax.train.checkpoint``)
on their cadences. A run in phases (``train/phases.py``) trains its plan's segments in order,
each with its own compiled step, batches and held-out set.

Longer than 400 lines because the loop's stages (set-up, restore, loop, sync point, save,
finish) still share one function's locals; splitting them into functions a reader can find is
the house work of the documentation issue (29), not done in the change that added phases.
"""

from __future__ import annotations

import functools
import math
import time
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from clozax.core import files, flops
from clozax.core import model as model_lib
from clozax.core.optim import make_optimizer, piecewise_rate
from clozax.core.pipeline import (
    Keys,
    TrainState,
    init_params,
    make_masker,
    new_state,
    with_total_steps,
)
from clozax.core.vocab import Vocabulary
from clozax.data.dataset import open_dataset
from clozax.data.loader import Prefetcher, batch_rows, host_batch, stream_rows
from clozax.train import checkpoint as ckpt
from clozax.train import distributed, heldout, hostmem
from clozax.train.budget import Budget, process_started, steps_for_budget
from clozax.train.checks import validate_for_data
from clozax.train.config import RunConfig, schedule_length
from clozax.train.interrupts import Interrupted, Interrupts
from clozax.train.mesh import (
    from_host,
    global_batch,
    make_mesh,
    place,
    process_rows,
    state_shardings,
)
from clozax.train.observe import Pace, TrainLog
from clozax.train.phases import (
    make_plan,
    mask_step_offset,
    run_records,
    segment_config,
    step_fields,
    stream_positions,
)
from clozax.train.run_dir import (
    CONFIG_FILE,
    RUN_FILE,
    TOKENIZER_FILE,
    lock_run,
    resolve_run,
    write_run_files,
)
from clozax.train.step import make_train_step


class TrainingDiverged(ValueError):
    """A non-finite loss or gradient norm; the last good checkpoint is kept."""


# --------------------------------------------------------------------------- the loop


@dataclass
class TrainResult:
    run_dir: Path
    steps: int
    final_loss: float
    eval: dict | None
    state: TrainState


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
        interrupts = held.enter_context(Interrupts(jax.process_count(), say=log.info))
        return _train(data_dir, run_dir, config, init_from, extend_to, stop_after, started,
                      primary, log, interrupts)


def _train(data_dir, run_dir: Path, config: RunConfig, init_from, extend_to, stop_after,
           started: float, primary: bool, log: TrainLog,
           interrupts: Interrupts) -> TrainResult:
    # --- data and the run's config; a run in phases has a plan of segments (train/phases.py)
    plan, datasets = make_plan(config, data_dir, open_dataset)
    dataset = datasets[Path(data_dir).absolute()]
    config = config.replace(model=replace(config.model, vocab_size=dataset.vocab_size))
    if plan.phased:  # the phases give the run's length
        config = config.replace(train=replace(config.train, steps=plan.total))
    # Every process of a job reads the run directory before the first one writes to it.
    config, existing, extending, init_run = resolve_run(run_dir, config, dataset, init_from,
                                                         extend_to, log.info)
    distributed.barrier("clozax-train-start")
    mesh = make_mesh(config.train.devices)
    n_devices = mesh.devices.size
    validate_for_data(config, dataset, n_devices)
    for segment in plan.segments if plan.phased else ():
        validate_for_data(segment_config(config, segment), datasets[segment.data], n_devices)
    phase_records = run_records(plan, datasets, run_dir, (files.read_json(
        run_dir / RUN_FILE) or {}).get("phases") if existing else None)
    vocab = Vocabulary(dataset.vocab_size, dataset.specials)
    seq_len = dataset.seq_len
    keys = Keys.from_seed(config.train.seed)
    replicated = NamedSharding(mesh, P())
    data_sharding = NamedSharding(mesh, P("data"))

    # --- init: one compiled step for the whole run (the schedule's length is data in the
    # optimizer state, so --minutes, a budget revision and --extend-to never recompile)
    params = init_params(config.model, config.train.seed)
    if init_run is not None:
        params = jax.tree.map(jnp.asarray, init_run.params)
    rate = piecewise_rate(plan.pieces) if plan.phased else None
    optimizer, _ = make_optimizer(config.optim, config.train.steps, params, rate)
    state = new_state(params, optimizer)
    shardings = state_shardings(state, mesh, config.train.fsdp)
    state = place(state, shardings)
    programs: dict[int, object] = {}

    def step_fn_of(segment):
        """The segment's jitted step, made when training reaches it (one compile each)."""
        if segment.start not in programs:
            seg_config = segment_config(config, segment)
            seg_optimizer, schedule = make_optimizer(seg_config.optim, config.train.steps,
                                                     params, rate)
            programs[segment.start] = jax.jit(
                make_train_step(seg_config, vocab, segment.seq_len, seg_optimizer, schedule,
                                mesh, mask_step_offset(config, segment)),
                donate_argnums=0, out_shardings=(shardings, replicated))
        return programs[segment.start]

    step_fn = step_fn_of(plan.segments[0])
    special_table = vocab.special_table()

    local_rows = functools.cache(functools.partial(process_rows, data_sharding))

    def device_batch(i: int) -> dict:
        # Batch i is a pure function of i; this process reads only its own rows of it.
        segment = plan.at(i)
        split = datasets[segment.data].train
        if plan.phased:
            rows = stream_rows(keys.data, *stream_positions(segment, i), split.rows)
        else:
            rows = batch_rows(keys.data, i, split.rows, segment.batch_size)
        rows = rows[local_rows(segment.batch_size)]
        batch = host_batch(split, rows)
        # Impossible for a dataset of this format (prepare skips documents without a
        # selectable token); checked before the jitted step, which would select nothing.
        eligible = ~special_table[batch["tokens"]] & (batch["segments"] > 0)
        empty = ~eligible.any(axis=1)
        if empty.any():
            raise ValueError(
                f"training row {int(rows[np.argmax(empty)])} of {data_dir} has no eligible "
                "(non-pad, non-special) token, so nothing can be selected; the dataset is "
                "damaged: re-run `clozax prepare`"
            )
        return global_batch(data_sharding, batch, segment.batch_size)

    # --- held-out evaluation: the frozen set, a keyed sample of it during training, sharded
    masker = make_masker(config.masking, vocab, seq_len)
    eval_fns: dict = {}
    eval_batch = math.lcm(64, n_devices)

    checkpointer = None

    def evaluate(params, eval_masks, sample, segment=None) -> dict:
        """The frozen set's sample (the run's; a phase on another dataset: that phase's)."""
        model_config, split = config.model, dataset.heldout
        if segment is not None and plan.phased:
            model_config = segment_config(config, segment).model
            split = datasets[segment.data].heldout
            eval_masks, sample = phase_eval_set(segment, eval_masks, sample)
        if model_config not in eval_fns:
            eval_fns[model_config] = heldout.make_eval_fn(model_config)
        rows = eval_masks.rows.size if sample is None else len(sample)
        try:
            return {**heldout.evaluate_masks(
                params, model_config, split, eval_masks, eval_batch, eval_fns[model_config],
                sample, functools.partial(from_host, data_sharding)).metrics(), "rows": rows}
        except heldout.NonFiniteScores as e:
            kept = checkpointer.latest_step() if checkpointer is not None else None
            raise TrainingDiverged(f"{e}; the last good checkpoint is step {kept}") from None

    # --- budget: --minutes fixes the step count from measured costs (compile included)
    budget, built_masks = None, None
    if config.train.minutes is not None and not existing:
        built_masks = heldout.build_eval_masks(dataset.heldout, masker, config.train.eval_seed,
                                               config.train.eval_rows)
        steps = distributed.broadcast(steps_for_budget(
            config, started, state, step_fn, device_batch, keys.mask, evaluate, built_masks,
            run_dir, log.info))
        config = replace(config, train=replace(config.train, steps=steps,
                                               budget_revisions=((0, steps),)))
        state = with_total_steps(state, steps)
        budget = Budget(config.train.minutes, started)

    # --- checkpoints: an extension needs a finished run
    checkpointer = ckpt.Checkpointer(run_dir, keep=config.train.keep_checkpoints,
                                     primary=primary)
    if extending:
        done, before = checkpointer.latest_step(), config.train.extended_from[-1]
        if done != before:
            checkpointer.close()
            raise ValueError(f"run {run_dir} has not finished (step {done} of {before}); resume "
                             f"it with its own command first, then --extend-to {extend_to}")

    # --- run directory and frozen eval masks
    run_dir.mkdir(parents=True, exist_ok=True)
    if not existing and primary:
        write_run_files(run_dir, config, {
            "dataset": str(Path(data_dir).absolute()),
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
            **({"phases": phase_records,
                "source_trained_length": init_run.trained_length if init_run else 0}
               if plan.phased else {}),
        })
        files.write_bytes(run_dir / TOKENIZER_FILE, dataset.tokenizer_path.read_bytes())
    elif extending and primary:
        files.write_json(run_dir / CONFIG_FILE, config.to_dict(), sort_keys=True)
        log.info(f"extending run {run_dir} from {config.train.extended_from[-1]} to "
                 f"{config.train.steps} steps (schedule re-created for {config.train.steps})")
    eval_masks, _ = heldout.ensure_eval_masks(run_dir, dataset, masker, config.train.eval_seed,
                                              config.train.eval_rows, say=log.info,
                                              write=primary, built=built_masks)
    distributed.same_everywhere(heldout.eval_masks_sha256(eval_masks), "frozen held-out set")
    sample = heldout.sample_indices(eval_masks.rows.size, config.train.eval_sample,
                                    config.train.eval_seed)
    phase_sets: dict = {}

    def phase_eval_set(segment, run_masks, run_sample):
        """A phase on another dataset is scored on a frozen set of its own held-out rows
        (``eval_masks_NAME``, the run's masking at that phase's ``seq_len``), built once."""
        if segment.data == Path(data_dir).absolute():
            return run_masks, run_sample
        if segment.data not in phase_sets:
            other = datasets[segment.data]
            masks, _ = heldout.ensure_eval_masks(
                run_dir, other, make_masker(config.masking, vocab, other.seq_len),
                config.train.eval_seed, config.train.eval_rows, say=log.info, write=primary,
                stem=f"{heldout.STEM}_{segment.name}")
            distributed.same_everywhere(heldout.eval_masks_sha256(masks),
                                        f"phase {segment.name}'s held-out set")
            phase_sets[segment.data] = (masks, heldout.sample_indices(
                masks.rows.size, config.train.eval_sample, config.train.eval_seed))
        return phase_sets[segment.data]

    # --- restore
    try:
        restored = checkpointer.restore_latest(ckpt.abstract_like(state), say=log.info,
                                               set_aside=True)
    except BaseException:
        checkpointer.close()
        raise
    start = 0  # a run directory whose first checkpoint never landed starts again
    if restored is not None:
        state, _, start = restored
    log.forget_after(start)  # lines of steps after the checkpoint: they are computed again
    # The schedule's length in effect from here (a --minutes estimate, revision or extension)
    state = with_total_steps(state, schedule_length(config.train, start))
    if restored is not None:
        if start >= config.train.steps:
            checkpointer.close()
            log.info(f"run {run_dir} already completed {start} steps; nothing to do")
            return TrainResult(run_dir, start, math.nan, evaluate(
                state.params, eval_masks, sample, plan.at(start - 1)), state)
    n_params = model_lib.param_count(params)
    peak, peak_source = flops.peak_flops(jax.devices()[0].device_kind,
                                         config.model.compute_dtype, n_devices,
                                         config.train.peak_tflops)
    log.header(
        devices=n_devices, platform=jax.devices()[0].platform, dtype=config.model.compute_dtype,
        params=n_params, batch_tokens=config.train.batch_size * seq_len, steps=config.train.steps,
        start=start, microbatches=config.train.microbatches, fsdp=config.train.fsdp,
        processes=jax.process_count(), peak=peak_source,
    )

    # --- loop
    t = config.train
    end = t.steps if stop_after is None else min(t.steps, stop_after)
    revisions = dict(t.budget_revisions)
    prefetch = Prefetcher(device_batch, start, end, depth=t.prefetch)
    pace = Pace(t.batch_size * seq_len, flops.model_flops_per_token(config.model, seq_len),
                peak, started, end)
    last_eval, loss, pending, last_save = None, math.nan, [], time.perf_counter()
    try:
        log.start(total=t.steps, completed=start)
        for i, batch in prefetch:
            segment = plan.at(i)
            with jax.transfer_guard_device_to_host("disallow"):  # no per-step host read
                state, metrics = step_fn_of(segment)(state, batch, keys.mask)
            step = i + 1
            if pending:  # one step queued behind the running one, no further (a wait, no read):
                jax.block_until_ready(pending[-1][1])  # unbounded run-ahead fragmented the heap
            pending.append((step, metrics))
            if step == start + 1:  # the first step of this process: say what compiling cost
                jax.block_until_ready(metrics)
                log.info(f"compiled and ran the first step in "
                         f"{time.perf_counter() - started:.1f} s since start")
                pace.begin(step, time.perf_counter(), prefetch.wait_seconds)
                if budget is not None:
                    budget.mark(step)
            elif plan.phased and i == segment.start:  # a new segment: its own compile
                jax.block_until_ready(metrics)
                log.info(f"phase {segment.name} at step {i}: batch {segment.batch_size} x "
                         f"{segment.seq_len} tokens (compiled and ran its first step)")
            if plan.phased and i == segment.start:  # its tokens per step, from after its compile
                pace.tokens_per_step = segment.batch_size * segment.seq_len
                pace.flops_per_token = flops.model_flops_per_token(
                    segment_config(config, segment).model, segment.seq_len)
                pace.begin(step, time.perf_counter(), prefetch.wait_seconds)
            if step in revisions:  # a recorded budget revision: the same step, the same length
                state = with_total_steps(state, revisions[step])
            boundary = plan.phased and step == segment.phase_end  # a phase's last update
            due_eval = step % t.eval_every == 0 or step == t.steps or boundary
            overdue = (t.save_every_minutes is not None
                       and time.perf_counter() - last_save >= 60 * t.save_every_minutes)
            stop = interrupts.reached(step)  # SIGTERM, SIGINT or a job's preemption notice
            due_save = step % t.save_every == 0 or step == t.steps or overdue or stop or boundary
            due_log = step % t.log_every == 0 or step == end or stop
            if not (due_log or due_eval or due_save):
                log.advance(step)
                continue

            # A sync point: read the metrics since the last one, check them, act on them.
            fetched = _fetch([m for _, m in pending])
            now = time.perf_counter()
            _check_finite(pending, fetched, checkpointer)
            loss = float(fetched[-1]["loss"])
            pending = []
            record = None
            if due_log:
                m = fetched[-1]
                record = {
                    **step_fields(plan, segment, step), "loss": loss,
                    "lr": float(m["lr"]), "selected": int(m["selected"]),
                    "grad_norm": float(m["grad_norm"]),
                    "data_wait_s": round(prefetch.wait_seconds, 4),
                    **pace.fields(step, now, prefetch.wait_seconds),
                }
            if due_eval:
                t_eval = time.perf_counter()
                last_eval = evaluate(state.params, eval_masks, sample, segment)
                record = record or {**step_fields(plan, segment, step), "loss": loss}
                record["eval"] = last_eval  # on a sample of the frozen set (its rows)
                spent = time.perf_counter() - t_eval  # one reading for the record and pace
                record["eval_seconds"] = round(spent, 3)
                if budget is not None:
                    budget.spent_outside(spent)
                pace.exclude(spent)  # tokens/s: training time only
            if due_save:  # started now, written in the background while training goes on
                t_save = time.perf_counter()
                checkpointer.save(step, state, {"config": config.to_dict()})
                if hostmem.applied():  # CPU host: the same cores would write it, and the save's
                    checkpointer.wait()  # buffers between steps fragment the one kept arena
                last_save = time.perf_counter()
                if budget is not None:
                    budget.spent_outside(last_save - t_save)
                pace.exclude(last_save - t_save)
                record = record or {**step_fields(plan, segment, step), "loss": loss}
                record["checkpoint_seconds"] = round(last_save - t_save, 3)
            if record is not None:
                log.metrics(record)
            if budget is not None and due_log:
                revised = budget.revise(step, t.steps, t.eval_every, t.save_every)
                revised = distributed.broadcast(-1 if revised is None else revised)
                if revised >= 0:
                    t = replace(t, steps=revised, budget_revisions=(
                        *t.budget_revisions, (step, revised)))
                    config = replace(config, train=t)
                    state = with_total_steps(state, revised)
                    if primary:
                        files.write_json(run_dir / CONFIG_FILE, config.to_dict(), sort_keys=True)
                    end = revised if stop_after is None else min(revised, stop_after)
                    prefetch.stop_at(end)
                    pace.end = end
                    log.retotal(revised)
                    log.info(f"budget: re-estimated at step {step}; the run now ends at step "
                             f"{revised} (recorded in config.json)")
            log.advance(step, loss)
            if stop and step < t.steps:
                checkpointer.wait()  # committed and digested before the process goes
                raise Interrupted(interrupts.signal_name, step, run_dir)
        if pending:  # stopped early (stop_after) between sync points: still check the steps
            _check_finite(pending, _fetch([m for _, m in pending]), checkpointer)
        checkpointer.wait()  # a failing background write is this run's error
        if budget is not None:
            log.info(budget.summary())
    finally:
        # Best effort: a failing close (a full disk under TensorBoard, say) must never hide
        # the error that ended the loop.
        for close in (prefetch.close, log.stop, checkpointer.close):
            try:
                close()
            except Exception:  # noqa: BLE001
                pass
    return TrainResult(run_dir, int(jax.device_get(state.step)), loss, last_eval, state)


def _check_finite(pending: list, fetched: list, checkpointer) -> None:
    """Stop at the first step since the last read whose loss, gradient norm or updated
    parameters were not finite (before anything from it is logged or saved)."""
    for (step, _), m in zip(pending, fetched, strict=True):
        # Impossible by construction (every row has an eligible token); checked cheaply.
        assert int(m["selected"]) > 0, f"empty selection at step {step}"
        if not bool(m["finite"]):
            raise TrainingDiverged(
                f"non-finite loss ({float(m['loss'])}), gradient norm "
                f"({float(m['grad_norm'])}) or updated parameters at step {step}; the last good "
                f"checkpoint (step {checkpointer.latest_step()}) is kept: lower "
                "optim.learning_rate or raise optim.warmup_steps"
            )
