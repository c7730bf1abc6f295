"""Checks that the loss is token-weighted wherever the batch is split: k microbatches and N
devices give the full batch's loss and gradient when selected counts differ between the parts.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from clozax.core.train_state import TrainState
from clozax.judge.audit.pipeline import CheckResult, Pipeline
from clozax.train.config import RunConfig

ACCUMULATION_RTOL = 1e-5


def _capture_gradients() -> optax.GradientTransformation:
    """An 'optimizer' that leaves parameters alone and stores the gradient as its state."""

    def init(params):
        return jax.tree.map(jnp.zeros_like, params)

    def update(updates, state, params=None):
        return jax.tree.map(jnp.zeros_like, updates), updates

    return optax.GradientTransformation(init, update)


def uneven_batch(batch: dict, rows, keep: int = 4) -> dict:
    """``rows`` cut to ``keep`` real tokens, so that selected counts differ between the parts a
    batch is split into (a per-part mean then differs from the token-weighted mean)."""
    out = {name: np.array(x) for name, x in batch.items()}
    out["tokens"][rows, keep:] = 0
    out["segments"][rows, keep:] = 0
    out["word_starts"][rows, keep:] = False
    return out


CAPTURE = _capture_gradients()


def _no_schedule(opt_state):
    return jnp.zeros((), jnp.float32)


@functools.lru_cache(maxsize=16)
def _jitted_step(make_step, config: RunConfig, mesh):
    step = make_step(config, CAPTURE, _no_schedule, mesh)
    if mesh is None:
        return jax.jit(step)
    replicated = NamedSharding(mesh, P())
    return jax.jit(step, out_shardings=(replicated, replicated))


def _one_step(pipe: Pipeline, config: RunConfig, batch, mask_key, mesh=None):
    """Loss and gradient of one step of ``pipe.make_step`` (the gradient captured exactly)."""
    zeros = jax.tree.map(np.zeros_like, pipe.params)  # host zeros: no per-leaf compiles
    state = TrainState(np.zeros((), np.int32), pipe.params, zeros)
    if mesh is not None:
        state = jax.device_put(state, NamedSharding(mesh, P()))
        batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
    state, metrics = _jitted_step(pipe.make_step, config, mesh)(state, batch, mask_key)
    return float(metrics["loss"]), jax.tree.map(np.asarray, state.opt_state)


def _compare(name, a, b, what: str) -> CheckResult:
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    loss_rel = abs(loss_a - loss_b) / max(abs(loss_a), 1e-30)
    diff = math.sqrt(sum(float(np.sum((x - y) ** 2)) for x, y in
                         zip(jax.tree.leaves(grads_a), jax.tree.leaves(grads_b), strict=True)))
    norm = math.sqrt(sum(float(np.sum(x ** 2)) for x in jax.tree.leaves(grads_a)))
    grad_rel = diff / max(norm, 1e-30)
    passed = loss_rel <= ACCUMULATION_RTOL and grad_rel <= ACCUMULATION_RTOL
    return CheckResult(name, passed,
                       {"loss": [loss_a, loss_b], "loss_rel": loss_rel, "grad_rel": grad_rel},
                       f"{what}: loss {loss_a:.6f} vs {loss_b:.6f} (rel {loss_rel:.1e}), "
                       f"gradient rel {grad_rel:.1e}, tolerance {ACCUMULATION_RTOL:g}")


def check_microbatch_accumulation(pipe: Pipeline, batch, mask_key) -> CheckResult:
    size = batch["tokens"].shape[0]
    k = next((k for k in (4, 3, 2) if size % k == 0), None)
    if k is None:
        return CheckResult("microbatch_accumulation", True, "skipped",
                           f"SKIP: batch of {size} cannot be split into microbatches",
                           skipped=True)
    batch = uneven_batch(batch, np.arange(0, size, k))  # microbatch 0 takes rows 0, k, 2k, ...
    train = pipe.config.train

    def with_k(m):
        return dataclasses.replace(pipe.config,
                                   train=dataclasses.replace(train, microbatches=m, devices=None))

    full = _one_step(pipe, with_k(1), batch, mask_key)
    split = _one_step(pipe, with_k(k), batch, mask_key)
    return _compare("microbatch_accumulation", full, split,
                    f"1 vs {k} microbatches (uneven selected counts)")


def check_device_accumulation(pipe: Pipeline, batch, mask_key, devices=None) -> CheckResult:
    devices = list(jax.devices() if devices is None else devices)
    size = batch["tokens"].shape[0]
    n = max((d for d in range(2, len(devices) + 1) if size % d == 0), default=1)
    if n < 2:
        return CheckResult("device_accumulation", True, "skipped",
                           f"SKIP: {len(devices)} device visible" if len(devices) < 2 else
                           f"SKIP: batch of {size} does not divide over {len(devices)} devices",
                           skipped=True)
    batch = uneven_batch(batch, np.arange(size // n))  # device 0 holds the first rows
    config = dataclasses.replace(
        pipe.config, train=dataclasses.replace(pipe.config.train, microbatches=1, devices=None))
    one = _one_step(pipe, config, batch, mask_key, Mesh(np.array(devices[:1]), ("data",)))
    many = _one_step(pipe, config, batch, mask_key, Mesh(np.array(devices[:n]), ("data",)))
    return _compare("device_accumulation", one, many, f"1 vs {n} devices (uneven counts)")
