"""The clozax side of ``compare_hf.py``: ``ClozaxSide``, the real train step.

``clozax.train.make_train_step`` + ``make_optimizer`` (on-device corruption, sparse head at the
static selected slots, clipping, AdamW), ``jax.jit`` with ``donate_argnums=0``; the batch is read
from the rows and ``device_put`` inside the timed loop. bf16: ``model.compute_dtype=bfloat16``
(fp32 parameters and statistics). ``profile_step.py`` traces this same side.
"""

from __future__ import annotations

import time

import numpy as np
from shapes import B1, B2, CLIP, DTYPES, EPS, LR, WD, Rows


class ClozaxSide:
    """The real clozax train step, jitted with donated state."""

    def __init__(self, shape: dict, dtype_name: str, rows: Rows, overrides: tuple = ()):
        import jax
        import jax.numpy as jnp

        from clozax.core import model as M
        from clozax.core import optim as optim_lib
        from clozax.core.keys import Keys
        from clozax.core.masker import make_masker
        from clozax.core.train_state import TrainState
        from clozax.core.vocab import Vocabulary
        from clozax.train import config as C
        from clozax.train import step as step_lib

        self.jax, self.rows, self.batch = jax, rows, shape["batch"]
        self.cfg = C.resolve(preset=shape["preset"], overrides=[
            f"model.vocab_size={shape['vocab']}",
            f"model.compute_dtype=\"{DTYPES[dtype_name]}\"",
            f"train.batch_size={shape['batch']}",
            f"optim.learning_rate={LR}", f"optim.b1={B1}", f"optim.b2={B2}",
            f"optim.eps={EPS}", f"optim.weight_decay={WD}", f"optim.clip_norm={CLIP}",
            *overrides,
        ])
        vocab = Vocabulary(shape["vocab"], rows.specials)
        seq = shape["seq"]
        keys = Keys.from_seed(0)
        params = M.init(self.cfg.model, keys.init)
        optimizer, schedule = optim_lib.make_optimizer(self.cfg.optim, 10_000, params)
        self.state = TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params))
        self.mask_key = keys.mask
        self.step_fn = jax.jit(
            step_lib.make_train_step(self.cfg, vocab, seq, optimizer, schedule), donate_argnums=0
        )
        masker = make_masker(self.cfg.masking, vocab, seq)
        loss_fn = step_lib.make_loss(self.cfg.model)

        def forward(params, batch, key):
            masked, sel = masker(key, batch)
            targets = jnp.take_along_axis(batch["tokens"], sel.positions, axis=-1)
            return loss_fn(params, masked.inputs, batch["segments"], sel.positions, targets,
                           sel.valid)[0]

        self.forward_fn = jax.jit(forward)
        from clozax.core.masking import selection_count

        self.count = selection_count(self.cfg.masking.rate, seq)
        self.data_seconds = 0.0
        self.metrics = None

    def host_batch(self, index: int):
        t0 = time.perf_counter()
        r = np.sort(self.rows.batch_rows(index, self.batch))
        batch = {"tokens": self.rows.tokens[r], "segments": self.rows.segments[r],
                 "word_starts": self.rows.word_starts[r]}
        batch = self.jax.device_put(batch)
        self.data_seconds += time.perf_counter() - t0
        return batch

    def step(self, index: int) -> None:
        self.state, self.metrics = self.step_fn(self.state, self.host_batch(index), self.mask_key)

    def sync(self) -> float:
        return float(self.jax.block_until_ready(self.metrics)["loss"])

    def forward_only(self, index: int) -> None:
        self.metrics = {"loss": self.forward_fn(self.state.params, self.host_batch(index),
                                                self.mask_key)}
