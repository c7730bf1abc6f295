"""Pretraining: on-device corruption, sparse prediction, token-weighted accumulation, exact resume.

The step (``make_train_step``) is pure and jitted: ``(state, batch) -> (state, metrics)``.
Inside it the batch is corrupted with ``fold_in(mask_key, step)``, the vocabulary head runs only
at the static number of selected slots, and the loss numerator and selected count are summed over
microbatches (and, through the global-array semantics of ``jit`` over a device mesh, over
devices) before one division. ``train`` is the loop, top to bottom.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from clozax import __version__, masking
from clozax import checkpoint as ckpt
from clozax import config as config_lib
from clozax import evaluate as eval_lib
from clozax import model as model_lib
from clozax.config import MaskingConfig, OptimConfig, RunConfig
from clozax.data import open_dataset
from clozax.data.loader import Prefetcher, batch_rows, host_batch
from clozax.objective import masked_nll
from clozax.observe import TrainLog

CONFIG_FILE = "config.json"
RUN_FILE = "run.json"


class TrainState(NamedTuple):
    step: jax.Array  # () int32: completed updates
    params: dict
    opt_state: optax.OptState


class Keys(NamedTuple):
    """Named keys, split once from ``train.seed``; per-step keys come from ``fold_in``."""

    init: jax.Array
    data: int  # numpy seed for the row permutation
    mask: jax.Array

    @staticmethod
    def from_seed(seed: int) -> Keys:
        init_key, data_key, mask_key = jax.random.split(jax.random.key(seed), 3)
        data_seed = int(jax.random.randint(data_key, (), 0, 2**31 - 1))
        return Keys(init_key, data_seed, mask_key)


class TrainingDiverged(ValueError):
    """A non-finite loss or gradient norm; the last good checkpoint is kept."""


# --------------------------------------------------------------------------- pieces


def make_optimizer(optim: OptimConfig, steps: int, params) -> tuple:
    """AdamW (no decay on biases, LayerNorm, embeddings), warm-up then decay, clipping."""
    warmup = min(optim.warmup_steps, max(steps - 1, 0))
    end = optim.learning_rate * optim.end_lr_fraction
    decay_steps = max(steps - warmup, 1)
    if optim.schedule == "cosine":
        decay = optax.cosine_decay_schedule(optim.learning_rate, decay_steps,
                                            alpha=optim.end_lr_fraction)
    else:
        decay = optax.linear_schedule(optim.learning_rate, end, decay_steps)
    if warmup > 0:
        warm = optax.linear_schedule(0.0, optim.learning_rate, warmup)
        schedule = optax.join_schedules([warm, decay], [warmup])
    else:
        schedule = decay
    parts = [optax.clip_by_global_norm(optim.clip_norm)] if optim.clip_norm > 0 else []
    parts.append(
        optax.adamw(schedule, b1=optim.b1, b2=optim.b2, eps=optim.eps,
                    weight_decay=optim.weight_decay, mask=model_lib.decay_mask(params))
    )
    return optax.chain(*parts), schedule


@dataclass(frozen=True)
class Vocabulary:
    """What masking needs from the frozen tokenizer."""

    size: int
    specials: dict  # name -> id

    @property
    def special_ids(self) -> tuple[int, ...]:
        return tuple(sorted(set(int(v) for v in self.specials.values())))

    def special_table(self) -> np.ndarray:
        """(vocab,) bool, True at special ids: ``~table[tokens]`` marks non-special tokens."""
        table = np.zeros(self.size, bool)
        table[list(self.special_ids)] = True
        return table


def make_masker(masking_config: MaskingConfig, vocab: Vocabulary, seq_len: int):
    """``(key, batch) -> (MaskedBatch, Selection)``, jittable, static selected count.

    Eligible positions: real tokens (segment > 0) that are not special ids.
    """
    count = masking.selection_count(masking_config.rate, seq_len)
    special_table = jnp.asarray(vocab.special_table())
    random_ids = jnp.asarray(masking.allowed_random_ids(vocab.size, vocab.special_ids))
    policy = masking_config.policy
    mask_id = int(vocab.specials["mask"])

    def masker(key, batch):
        tokens, segments = batch["tokens"], batch["segments"]
        eligible = ~special_table[tokens] & (segments > 0)  # (batch, seq)
        select_key, corrupt_key = jax.random.split(key)
        if masking_config.unit == "word":
            selection = masking.select_words(select_key, eligible, batch["word_starts"], count)
        else:
            selection = masking.select_fixed(select_key, eligible, count)
        selected = masking.selection_mask(selection, tokens.shape[1])
        masked = masking.corrupt(corrupt_key, tokens, selected, policy, mask_id, random_ids)
        return masked, selection

    return masker


def make_loss(model_config):
    """``(params, *micro) -> (sum, (sum, count))`` on one microbatch; the head runs sparsely.

    The gradient taken is that of the *sum*; the caller divides summed gradients by the summed
    count once.
    """

    def loss_fn(params, inputs, segments, positions, targets, valid):
        hidden_sel = model_lib.apply(params, model_config, inputs, segments > 0, segments,
                                     positions=positions)  # (batch, count, hidden)
        logits = model_lib.mlm_logits(params, model_config, hidden_sel)
        total, count = masked_nll(logits, targets, valid)  # logits: (batch, count, vocab)
        return total, (total, count)  # differentiate the numerator; carry the count

    return loss_fn


def make_loss_and_grads(config: RunConfig, vocab: Vocabulary, seq_len: int,
                        mesh: Mesh | None = None):
    """``(params, batch, step_key) -> (sum, count, grad_sum)`` over the whole global batch.

    The batch is corrupted once with ``step_key``; the microbatches (``train.microbatches``)
    only split the forward/backward work, so they cannot change the masks. Numerators,
    counts and gradient numerators are summed; nothing is divided here.
    """
    masker = make_masker(config.masking, vocab, seq_len)
    loss_fn = make_loss(config.model)
    grad_fn = jax.grad(loss_fn, has_aux=True)
    k = config.train.microbatches
    micro_sharding = NamedSharding(mesh, P(None, "data")) if mesh is not None else None

    def split_micro(x):
        # Microbatch j takes rows j, j+k, j+2k, ...: every microbatch spans every device.
        x = x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1)
        if micro_sharding is not None:
            x = jax.lax.with_sharding_constraint(x, micro_sharding)
        return x

    def loss_and_grads(params, batch: dict, step_key):
        masked, selection = masker(step_key, batch)
        targets = jnp.take_along_axis(batch["tokens"], selection.positions, axis=-1)
        micro = (masked.inputs, batch["segments"], selection.positions, targets, selection.valid)
        if k == 1:
            grad_sum, (total, count) = grad_fn(params, *micro)
            return total, count, grad_sum

        def body(carry, mb):
            g_acc, s_acc, c_acc = carry
            g, (s, c) = grad_fn(params, *mb)
            return (jax.tree.map(jnp.add, g_acc, g), s_acc + s, c_acc + c), None

        zeros = jax.tree.map(jnp.zeros_like, params)
        init = (zeros, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32))
        (grad_sum, total, count), _ = jax.lax.scan(body, init, tuple(map(split_micro, micro)))
        return total, count, grad_sum

    return loss_and_grads


def make_train_step(config: RunConfig, vocab: Vocabulary, seq_len: int, optimizer, schedule,
                    mesh: Mesh | None = None):
    """The pure train step ``(state, batch, mask_key) -> (state, metrics)`` (not yet jitted)."""
    loss_and_grads = make_loss_and_grads(config, vocab, seq_len, mesh)

    def step(state: TrainState, batch: dict, mask_key):
        total, count, grad_sum = loss_and_grads(
            state.params, batch, jax.random.fold_in(mask_key, state.step)
        )
        # One division, after every microbatch and device has contributed. Every row has an
        # eligible token (checked on the host), so count >= batch; the guard only avoids a NaN.
        denom = jnp.maximum(count, 1).astype(jnp.float32)
        grads = jax.tree.map(lambda g: g / denom, grad_sum)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {
            "loss": total / denom,
            "loss_sum": total,
            "selected": count,
            "grad_norm": optax.tree.norm(grads),
            "lr": schedule(state.step),
        }
        return TrainState(state.step + 1, params, opt_state), metrics

    return step


# --------------------------------------------------------------------------- run directory


def _write_json(path: Path, data) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)


def check_compatible(run_dir: Path, config: RunConfig, dataset) -> RunConfig:
    """Refuse to resume into a run whose results-relevant config, tokenizer or data differ."""
    saved = config_lib.load_json(run_dir / CONFIG_FILE)
    run = json.loads((run_dir / RUN_FILE).read_text())
    if config.train.minutes is not None and config.train.minutes == saved.train.minutes:
        # The step count was fixed from measured throughput when the run started.
        config = replace(config, train=replace(config.train, steps=saved.train.steps))
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
            f"{dataset.fingerprint[:12]}; resume with the original dataset or a new --out"
        )
    return config


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


def make_mesh(devices: int | None) -> Mesh:
    available = jax.local_devices()
    n = len(available) if devices is None else devices
    if n > len(available):
        raise ValueError(
            f"train.devices={n} but only {len(available)} device(s) are visible; lower it "
            "(on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N simulates N)"
        )
    return Mesh(np.array(available[:n]), ("data",))


def state_shardings(state, mesh: Mesh, fsdp: bool):
    """Per-leaf ``NamedSharding`` of the train state over ``mesh``'s ``data`` axis.

    Replicated by default. With ``fsdp`` every array is split over the devices along its
    largest axis that the device count divides (the first such on ties); scalars and arrays
    with no such axis stay replicated. ``jit`` then gathers parameters where the step needs
    them whole and reduce-scatters the gradients, so each device keeps 1/n of the parameters
    and of AdamW's moments.
    """
    n = mesh.devices.size

    def sharding(x):
        divisible = [a for a in range(x.ndim) if x.shape[a] % n == 0]
        if not fsdp or n == 1 or not divisible:
            return NamedSharding(mesh, P())
        axis = max(divisible, key=lambda a: (x.shape[a], -a))
        return NamedSharding(mesh, P(*([None] * axis), "data"))

    return jax.tree.map(sharding, state)


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
    console=None,
    stop_after: int | None = None,
) -> TrainResult:
    """Train ``config`` on the dataset at ``data_dir`` into ``run_dir``.

    Resume order: read the saved config and check it against this one → rebuild the same
    optimizer and step → restore (params, opt_state, step) from the latest checkpoint → batches
    continue at index ``step`` (a pure function of the step) with mask keys ``fold_in(mask_key,
    step)``, so the continued run is bitwise the uninterrupted one.
    ``init_from`` starts a new run from another run's latest parameters (continued
    pretraining, e.g. from ``clozax import-hf``): its model config is adopted and its tokenizer
    must be the dataset's. ``stop_after`` ends the loop early (for tests) without changing the
    schedule.
    """

    # --- data
    dataset = open_dataset(data_dir)
    config = config_lib.from_dict(
        {**config.to_dict(), "model": {**config.to_dict()["model"],
                                        "vocab_size": dataset.vocab_size}}
    )
    run_dir = Path(run_dir)
    existing = (run_dir / CONFIG_FILE).is_file()
    init_run = None
    if init_from is not None and not existing:
        from clozax.run import load_run

        init_run = load_run(init_from)
        if init_run.info.get("tokenizer_sha256") != dataset.tokenizer_sha256:
            raise ValueError(
                f"--init-from {init_from} uses a different tokenizer than dataset {data_dir}; "
                f"prepare the data with `clozax prepare --tokenizer {init_from}/tokenizer.json`"
            )
        config = replace(config, model=init_run.config.model)
    if existing:
        config = check_compatible(run_dir, config, dataset)
    elif run_dir.exists() and any(run_dir.iterdir()):
        raise ValueError(
            f"output directory {run_dir} exists and is not a clozax run; choose a new --out"
        )
    mesh = make_mesh(config.train.devices)
    n_devices = mesh.devices.size
    validate_run(config, dataset, n_devices)
    vocab = Vocabulary(dataset.vocab_size, dataset.specials)
    seq_len = dataset.seq_len
    keys = Keys.from_seed(config.train.seed)
    replicated = NamedSharding(mesh, P())
    data_sharding = NamedSharding(mesh, P("data"))
    log = TrainLog(run_dir, console=console)

    # --- init
    params = model_lib.init(config.model, keys.init)
    if init_run is not None:
        params = jax.tree.map(jnp.asarray, init_run.params)
    optimizer, schedule = make_optimizer(config.optim, config.train.steps, params)
    state = TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params))
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
        # Validate before the jitted step: a row with no eligible token would select nothing.
        eligible = ~special_table[batch["tokens"]] & (batch["segments"] > 0)
        empty = ~eligible.any(axis=1)
        if empty.any():
            raise ValueError(
                f"training row {int(rows[np.argmax(empty)])} of {data_dir} has no eligible "
                "(non-pad, non-special) token, so nothing can be selected; re-run prepare"
            )
        return jax.device_put(batch, data_sharding)

    # --- budget: --minutes fixes the step count once, from throughput measured after compiling
    if config.train.minutes is not None and not existing:
        steps = _steps_for_budget(step_fn, state, device_batch, keys.mask, config.train.minutes)
        config = replace(config, train=replace(config.train, steps=steps))
        optimizer, schedule = make_optimizer(config.optim, steps, params)
        step_fn = compile_step(optimizer, schedule)

    # --- run directory and frozen eval masks
    run_dir.mkdir(parents=True, exist_ok=True)
    if not existing:
        _write_json(run_dir / CONFIG_FILE, config.to_dict())
        _write_json(run_dir / RUN_FILE, {
            "clozax_version": __version__,
            "jax_version": jax.__version__,
            "dataset": str(Path(data_dir).absolute()),
            "dataset_fingerprint": dataset.fingerprint,
            "tokenizer_sha256": dataset.tokenizer_sha256,
            "seq_len": seq_len,
            "specials": dataset.specials,
            "seed": config.train.seed,
            "eval_seed": config.train.eval_seed,
            "init_from": str(Path(init_from).absolute()) if init_from else None,
        })
        shutil.copyfile(dataset.tokenizer_path, run_dir / "tokenizer.json")
    masker = make_masker(config.masking, vocab, seq_len)
    masks_exist = (run_dir / eval_lib.EVAL_MASKS_FILE).is_file()
    if masks_exist:
        eval_masks, _ = eval_lib.load_eval_masks(run_dir)
    else:
        eval_masks = eval_lib.build_eval_masks(
            dataset.heldout, masker, config.train.eval_seed, config.train.eval_rows
        )
        eval_lib.save_eval_masks(run_dir, eval_masks, config.train.eval_seed)
    eval_fn = eval_lib.make_eval_fn(config.model)

    # --- restore
    checkpointer = ckpt.Checkpointer(run_dir, keep=config.train.keep_checkpoints)
    start = checkpointer.latest_step()
    if start is not None:
        state, _ = checkpointer.restore(start, ckpt.abstract_like(state))
        if start >= config.train.steps:
            checkpointer.close()
            log.info(f"run {run_dir} already completed {start} steps; nothing to do")
            last = eval_lib.evaluate_masks(
                state.params, config.model, dataset.heldout, eval_masks, eval_fn=eval_fn
            ).metrics()
            return TrainResult(run_dir, start, math.nan, last, state)
    # A run directory whose first checkpoint never landed starts again from step 0.
    start = start or 0
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
            if not (math.isfinite(loss) and math.isfinite(grad_norm)):
                raise TrainingDiverged(
                    f"non-finite loss ({loss}) or gradient norm ({grad_norm}) at step {step}; the "
                    f"last good checkpoint (step {checkpointer.latest_step()}) is kept: lower "
                    "optim.learning_rate or raise optim.warmup_steps"
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
                last_eval = eval_lib.evaluate_masks(
                    state.params, config.model, dataset.heldout, eval_masks, eval_fn=eval_fn
                ).metrics()
                record = record or {"step": step, "tokens": step * tokens_per_step, "loss": loss}
                record["eval"] = last_eval
            if record is not None:
                log.metrics(record)
            if step % config.train.save_every == 0 or step == config.train.steps:
                checkpointer.save(step, state, {"step": step, "config": config.to_dict()})
            log.advance(step, loss)
    finally:
        prefetch.close()
        log.stop()
        checkpointer.close()
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
