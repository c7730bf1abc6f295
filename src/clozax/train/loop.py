"""Pretraining: the loop, top to bottom, with exact resume.

``train`` reads the dataset, builds (or restores) the train state, and runs the jitted step
(``clozax.train.step``) over batches that are pure functions of the step number, evaluating on
the frozen held-out set (``clozax.train.heldout``) and checkpointing (``clozax.train.checkpoint``)
on their cadences.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from clozax.core import files
from clozax.core import model as model_lib
from clozax.core.model_config import runnable_here
from clozax.core.pipeline import (
    Keys,
    TrainState,
    init_params,
    make_masker,
    make_optimizer,
    new_state,
)
from clozax.core.vocab import Vocabulary
from clozax.data.dataset import open_dataset
from clozax.data.loader import Prefetcher, batch_rows, host_batch
from clozax.train import checkpoint as ckpt
from clozax.train import config as config_lib
from clozax.train import heldout
from clozax.train.config import RunConfig
from clozax.train.mesh import make_mesh, state_shardings
from clozax.train.observe import TrainLog
from clozax.train.run_dir import CONFIG_FILE, RUN_FILE, TOKENIZER_FILE, load_run, write_run_files
from clozax.train.step import make_train_step


class TrainingDiverged(ValueError):
    """A non-finite loss or gradient norm; the last good checkpoint is kept."""


def check_compatible(run_dir: Path, config: RunConfig, dataset,
                     extend_to: int | None = None) -> tuple[RunConfig, bool]:
    """Refuse to resume into a run whose results-relevant config, tokenizer or data differ.

    Returns the config to continue with and whether it extends the run: with ``extend_to``
    beyond the run's ``train.steps``, a finished run continues to ``extend_to`` steps with its
    schedule re-created for the new length (recorded in ``train.extended_from``).
    """
    saved = config_lib.load_json(run_dir / CONFIG_FILE)
    run = json.loads((run_dir / RUN_FILE).read_text())
    if config.train.minutes is not None and config.train.minutes == saved.train.minutes:
        # The step count was fixed from measured throughput when the run started.
        config = replace(config, train=replace(config.train, steps=saved.train.steps))
    extending = extend_to is not None and extend_to != saved.train.steps
    if extend_to is not None:
        if extend_to < saved.train.steps:
            raise ValueError(f"--extend-to {extend_to} is below the {saved.train.steps} steps run "
                             f"{run_dir} already has; pass a larger number")
        extended = replace(saved.train, steps=extend_to, extended_from=(
            *saved.train.extended_from, saved.train.steps) if extending else
            saved.train.extended_from)
        saved = replace(saved, train=extended)
        config = replace(config, train=replace(config.train, steps=extend_to,
                                               extended_from=extended.extended_from))
    diffs = config_lib.result_differences(saved, config)
    if diffs:
        raise ValueError(
            f"run {run_dir} was trained with a different config ({'; '.join(diffs[:3])}); "
            "resume with the same settings or choose a new --out directory"
        )
    if run["tokenizer_sha256"] != dataset.tokenizer_sha256:
        raise ValueError(
            f"run {run_dir} used tokenizer {run['tokenizer_sha256'][:12]}, the dataset has "
            f"{dataset.tokenizer_sha256[:12]}; resume with the original dataset or a new --out"
        )
    if run["dataset_fingerprint"] != dataset.fingerprint:
        raise ValueError(
            f"run {run_dir} was trained on dataset {run['dataset_fingerprint'][:12]}, not "
            f"{dataset.path} {dataset.fingerprint[:12]} (re-prepared, or other data); resume "
            "with the original dataset or choose a new --out"
        )
    return config, extending


def validate_run(config: RunConfig, dataset, n_devices: int) -> None:
    """Config/data consistency checks that need the dataset, before any compilation."""
    if dataset.seq_len > config.model.max_positions:
        raise ValueError(
            f"dataset seq_len {dataset.seq_len} exceeds model.max_positions="
            f"{config.model.max_positions}; raise model.max_positions or prepare shorter rows"
        )
    if config.model.vocab_size != dataset.vocab_size:
        raise ValueError(
            f"model.vocab_size={config.model.vocab_size} does not match the dataset's tokenizer "
            f"({dataset.vocab_size}); leave model.vocab_size unset so it is taken from the data"
        )
    per_step = n_devices * config.train.microbatches
    if config.train.batch_size % per_step:
        raise ValueError(
            f"train.batch_size={config.train.batch_size} is not divisible by devices "
            f"({n_devices}) x microbatches ({config.train.microbatches}); choose a multiple of "
            f"{per_step}"
        )
    if dataset.train.rows < config.train.batch_size:
        raise ValueError(
            f"the training split has {dataset.train.rows} rows, fewer than one batch of "
            f"{config.train.batch_size}; lower train.batch_size or prepare more data"
        )


# --------------------------------------------------------------------------- the loop


@dataclass
class TrainResult:
    run_dir: Path
    steps: int
    final_loss: float
    eval: dict | None
    state: TrainState


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

    Resume order: read the saved config and check it against this one → rebuild the same
    optimizer and step → restore (params, opt_state, step) from the newest intact checkpoint →
    batches continue at index ``step`` (a pure function of the step) with mask keys
    ``fold_in(mask_key, step)``, so the continued run is bitwise the uninterrupted one.
    ``init_from`` starts a new run from another run's latest parameters (continued
    pretraining, e.g. from ``clozax import-hf``): its model config is adopted and its tokenizer
    must be the dataset's. ``extend_to`` continues a finished run to that many steps (see
    ``check_compatible``). ``stop_after`` ends the loop early (for tests) without changing the
    schedule. The updated parameters are checked to be finite after every step, so no
    checkpoint ever holds a diverged model.
    """

    # --- data and the run's config
    dataset = open_dataset(data_dir)
    config = config.replace(model=replace(config.model, vocab_size=dataset.vocab_size))
    run_dir = Path(run_dir)
    existing = (run_dir / CONFIG_FILE).is_file()
    init_run, extending = None, False
    log = TrainLog(run_dir, console=console)
    if existing:
        config, extending = check_compatible(run_dir, config, dataset, extend_to)
        here = runnable_here(config.model)
        if here != config.model:
            log.info(f"model.attention={config.model.attention!r} cannot run on this machine; "
                     f"using {here.attention!r} (the same maths)")
            config = config.replace(model=here)
    else:
        if run_dir.exists() and any(run_dir.iterdir()):
            raise ValueError(
                f"output directory {run_dir} exists and is not a clozax run; choose a new --out"
            )
        if extend_to is not None:
            raise ValueError(f"--extend-to needs an existing run in {run_dir}; train it first")
        if init_from is not None:
            init_run = load_run(init_from)
            if init_run.info.get("tokenizer_sha256") != dataset.tokenizer_sha256:
                raise ValueError(
                    f"--init-from {init_from} uses a different tokenizer than dataset {data_dir}"
                    f"; prepare the data with `clozax prepare --tokenizer {init_from}/"
                    "tokenizer.json`"
                )
            config = replace(config, model=init_run.config.model)
        if runnable_here(config.model) != config.model:
            raise ValueError(f"model.attention={config.model.attention!r} needs an NVIDIA GPU "
                             f"(this machine runs {jax.default_backend()}); use 'auto'")
    mesh = make_mesh(config.train.devices)
    n_devices = mesh.devices.size
    validate_run(config, dataset, n_devices)
    vocab = Vocabulary(dataset.vocab_size, dataset.specials)
    seq_len = dataset.seq_len
    keys = Keys.from_seed(config.train.seed)
    replicated = NamedSharding(mesh, P())
    data_sharding = NamedSharding(mesh, P("data"))

    # --- init
    params = init_params(config.model, config.train.seed)
    if init_run is not None:
        params = jax.tree.map(jnp.asarray, init_run.params)
    optimizer, schedule = make_optimizer(config.optim, config.train.steps, params)
    state = new_state(params, optimizer)
    shardings = state_shardings(state, mesh, config.train.fsdp)
    state = jax.device_put(state, shardings)

    def compile_step(optimizer, schedule):
        fn = make_train_step(config, vocab, seq_len, optimizer, schedule, mesh)
        return jax.jit(fn, donate_argnums=0, out_shardings=(shardings, replicated))

    step_fn = compile_step(optimizer, schedule)

    special_table = vocab.special_table()

    def device_batch(i: int) -> dict:
        rows = batch_rows(keys.data, i, dataset.train.rows, config.train.batch_size)
        batch = host_batch(dataset.train, rows)
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
        return jax.device_put(batch, data_sharding)

    # --- budget: --minutes fixes the step count once, from throughput measured after compiling
    if config.train.minutes is not None and not existing:
        steps = _steps_for_budget(step_fn, state, device_batch, keys.mask, config.train.minutes)
        config = replace(config, train=replace(config.train, steps=steps))
        optimizer, schedule = make_optimizer(config.optim, steps, params)
        step_fn = compile_step(optimizer, schedule)

    # --- checkpoints: an extension needs a finished run
    checkpointer = ckpt.Checkpointer(run_dir, keep=config.train.keep_checkpoints)
    if extending:
        done, before = checkpointer.latest_step(), config.train.extended_from[-1]
        if done != before:
            checkpointer.close()
            raise ValueError(f"run {run_dir} has not finished (step {done} of {before}); resume "
                             f"it with its own command first, then --extend-to {extend_to}")

    # --- run directory and frozen eval masks
    run_dir.mkdir(parents=True, exist_ok=True)
    if not existing:
        write_run_files(run_dir, config, {
            "dataset": str(Path(data_dir).absolute()),
            "dataset_fingerprint": dataset.fingerprint,
            "tokenizer_sha256": dataset.tokenizer_sha256,
            "seq_len": seq_len,
            "specials": dataset.specials,
            "seed": config.train.seed,
            "eval_seed": config.train.eval_seed,
            "init_from": str(Path(init_from).absolute()) if init_from else None,
        })
        files.write_bytes(run_dir / TOKENIZER_FILE, dataset.tokenizer_path.read_bytes())
    elif extending:
        files.write_json(run_dir / CONFIG_FILE, config.to_dict(), sort_keys=True)
        log.info(f"extending run {run_dir} from {config.train.extended_from[-1]} to "
                 f"{config.train.steps} steps (schedule re-created for {config.train.steps})")
    masker = make_masker(config.masking, vocab, seq_len)
    eval_masks, _ = heldout.ensure_eval_masks(run_dir, dataset, masker, config.train.eval_seed,
                                              config.train.eval_rows, say=log.info)
    eval_fn = heldout.make_eval_fn(config.model)

    def evaluate(params) -> dict:
        try:
            return heldout.evaluate_masks(params, config.model, dataset.heldout, eval_masks,
                                          eval_fn=eval_fn).metrics()
        except heldout.NonFiniteScores as e:
            raise TrainingDiverged(f"{e}; the last good checkpoint is step "
                                   f"{checkpointer.latest_step()}") from None

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
        if start >= config.train.steps:
            checkpointer.close()
            log.info(f"run {run_dir} already completed {start} steps; nothing to do")
            return TrainResult(run_dir, start, math.nan, evaluate(state.params), state)
    n_params = model_lib.param_count(params)
    log.header(
        devices=n_devices, platform=jax.devices()[0].platform, dtype=config.model.compute_dtype,
        params=n_params, batch_tokens=config.train.batch_size * seq_len, steps=config.train.steps,
        start=start, microbatches=config.train.microbatches, fsdp=config.train.fsdp,
    )

    # --- loop
    end = config.train.steps if stop_after is None else min(config.train.steps, stop_after)
    prefetch = Prefetcher(device_batch, start, end, depth=config.train.prefetch)
    tokens_per_step = config.train.batch_size * seq_len
    last_eval = None
    loss = math.nan
    t_last, steps_since = time.perf_counter(), 0
    try:
        log.start(total=config.train.steps, completed=start)
        for i, batch in prefetch:
            state, metrics = step_fn(state, batch, keys.mask)
            loss, grad_norm = float(metrics["loss"]), float(metrics["grad_norm"])
            step = i + 1
            # Impossible by construction (every row has an eligible token); asserted cheaply.
            assert int(metrics["selected"]) > 0, f"empty selection at step {step}"
            if not bool(metrics["finite"]):
                raise TrainingDiverged(
                    f"non-finite loss ({loss}), gradient norm ({grad_norm}) or updated "
                    f"parameters at step {step}; the last good checkpoint (step "
                    f"{checkpointer.latest_step()}) is kept: lower optim.learning_rate or raise "
                    "optim.warmup_steps"
                )
            steps_since += 1
            record = None
            if step % config.train.log_every == 0 or step == end:
                now = time.perf_counter()
                record = {
                    "step": step, "tokens": step * tokens_per_step, "loss": loss,
                    "lr": float(metrics["lr"]), "selected": int(metrics["selected"]),
                    "grad_norm": grad_norm,
                    "tokens_per_s": steps_since * tokens_per_step / max(now - t_last, 1e-9),
                    "data_wait_s": round(prefetch.wait_seconds, 4),
                }
                t_last, steps_since = now, 0
            if step % config.train.eval_every == 0 or step == config.train.steps:
                last_eval = evaluate(state.params)
                record = record or {"step": step, "tokens": step * tokens_per_step, "loss": loss}
                record["eval"] = last_eval
            if record is not None:
                log.metrics(record)
            if step % config.train.save_every == 0 or step == config.train.steps:
                checkpointer.save(step, state, {"step": step, "config": config.to_dict()})
            log.advance(step, loss)
    finally:
        # Best effort: a failing close (a full disk under TensorBoard, say) must never hide
        # the error that ended the loop.
        for close in (prefetch.close, log.stop, checkpointer.close):
            try:
                close()
            except Exception:  # noqa: BLE001
                pass
    return TrainResult(run_dir, int(state.step), loss, last_eval, state)


def _steps_for_budget(step_fn, state, device_batch, mask_key, minutes: float) -> int:
    """Measure seconds per step after compilation on a throwaway copy of the state."""
    probe = jax.tree.map(jnp.copy, state)
    batch = device_batch(0)
    probe, m = step_fn(probe, batch, mask_key)  # compile
    jax.block_until_ready(m)
    t0 = time.perf_counter()
    reps = 3
    for _ in range(reps):
        probe, m = step_fn(probe, device_batch(0), mask_key)
    jax.block_until_ready(m)
    per_step = (time.perf_counter() - t0) / reps
    return max(1, int(minutes * 60 / per_step))
