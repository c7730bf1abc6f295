"""The parameters a run starts from and the state it trains: random-init parameters (drawn with
the init key of ``train.seed``), the ``TrainState`` with its optimizer state (``core/optim.py``),
and the schedule's total length set on it.

Evaluation, the audit and the probe draw the same random-init parameters, the baseline every
judge compares against.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from clozax.core import model as model_lib
from clozax.core import optim
from clozax.core.keys import Keys


def init_params(model_config, seed: int) -> model_lib.Params:
    """The architecture at initialisation, drawn with the init key of ``train.seed`` = ``seed``:
    what a run starts from, and the random-init baseline every judge compares against.

    Jitted: one program (which the persistent compilation cache keeps) instead of one compiled
    eager op per tensor (33 compilations, ~3 s on 2 CPU cores). XLA fuses the N(0, std)
    scaling, so a draw can differ from eager ``model.init`` in its last bit (tested).
    """
    return _jitted_init(model_config, Keys.from_seed(seed).init)


_jitted_init = jax.jit(model_lib.init, static_argnums=0)


class TrainState(NamedTuple):
    step: jax.Array  # () int32: completed updates
    params: dict
    opt_state: optax.OptState


def with_total_steps(state: TrainState, steps: int) -> TrainState:
    """``state`` with the schedule's total length set to ``steps`` (``--minutes``,
    ``--extend-to``); the optimizer's moments and counts are kept."""
    return state._replace(opt_state=optim.with_total_steps(state.opt_state, steps))


def new_state(params, optimizer) -> TrainState:
    """Step 0 of training from ``params`` (the optimizer state built in one jitted program)."""
    return TrainState(jnp.zeros((), jnp.int32), params, jax.jit(optimizer.init)(params))
