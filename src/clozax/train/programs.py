"""What the loop runs on the device: each segment's jitted train step (``Programs``, one compile
per segment, made when training reaches it) and the batches it feeds them (``BatchSource``:
batch ``i`` is a pure function of ``i``, each process reading only its own rows of it).
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from clozax.core.optim import make_optimizer
from clozax.core.vocab import Vocabulary
from clozax.data.loader import batch_rows, host_batch, stream_rows
from clozax.train.config import RunConfig
from clozax.train.mesh import global_batch, process_rows
from clozax.train.phase_config import optimizer_apart
from clozax.train.phases import (
    Plan,
    Segment,
    mask_step_offset,
    segment_config,
    segment_trains,
    stream_positions,
)
from clozax.train.step import make_train_step


class Programs:
    """The jitted step of each segment of ``plan``, keyed by its first update."""

    def __init__(self, vocab: Vocabulary, params, rate, mesh, shardings):
        # params: the initial parameters (the optimizer's weight-decay mask follows their tree);
        # rate: a phased run's ``piecewise_rate`` (None otherwise)
        self.vocab, self.params, self.rate, self.mesh = vocab, params, rate, mesh
        self.shardings = shardings
        self.replicated = NamedSharding(mesh, P())
        self.compiled: dict[int, object] = {}

    def step_fn(self, config: RunConfig, segment: Segment):
        """The segment's jitted step, made when training reaches it (one compile each), from the
        run's ``config`` as it stands then."""
        if segment.start not in self.compiled:
            seg_config = segment_config(config, segment)
            seg_optimizer, schedule = make_optimizer(seg_config.optim, config.train.steps,
                                                     self.params, self.rate,
                                                     optimizer_apart(config.phases))
            self.compiled[segment.start] = jax.jit(
                make_train_step(seg_config, self.vocab, segment.seq_len, seg_optimizer,
                                schedule, self.mesh, mask_step_offset(config, segment),
                                segment_trains(config, segment)),
                donate_argnums=0, out_shardings=(self.shardings, self.replicated))
        return self.compiled[segment.start]


class BatchSource:
    """``device_batch(i)``: training batch ``i``, placed on the devices, checked for rows with
    nothing to select."""

    def __init__(self, plan: Plan, datasets: dict, data_dir: Path, vocab: Vocabulary,
                 data_seed: int, data_sharding: NamedSharding):
        self.plan, self.datasets, self.data_dir = plan, datasets, data_dir
        self.data_seed, self.data_sharding = data_seed, data_sharding
        self.special_table = vocab.special_table()  # (vocab,) bool
        self.local_rows = functools.cache(functools.partial(process_rows, data_sharding))

    def device_batch(self, i: int) -> dict:
        # Batch i is a pure function of i; this process reads only its own rows of it.
        segment = self.plan.at(i)
        split = self.datasets[segment.data].train
        if self.plan.phased:
            rows = stream_rows(self.data_seed, *stream_positions(segment, i), split.rows)
        else:
            rows = batch_rows(self.data_seed, i, split.rows, segment.batch_size)
        rows = rows[self.local_rows(segment.batch_size)]
        batch = host_batch(split, rows)
        # Impossible for a dataset of this format (prepare skips documents without a
        # selectable token); checked before the jitted step, which would select nothing.
        eligible = ~self.special_table[batch["tokens"]] & (batch["segments"] > 0)  # (batch, seq)
        empty = ~eligible.any(axis=1)
        if empty.any():
            raise ValueError(
                f"training row {int(rows[np.argmax(empty)])} of {self.data_dir} has no eligible "
                "(non-pad, non-special) token, so nothing can be selected; the dataset is "
                "damaged: re-run `clozax prepare`"
            )
        return global_batch(self.data_sharding, batch, segment.batch_size)
