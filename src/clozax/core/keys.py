"""Named random keys of a run, split once from ``train.seed``: the init key, the data seed (the
row permutation) and the mask key. Per-step keys come from ``fold_in``.

Training, evaluation, the audit and the probe all draw from the same ones, so that what is judged
is exactly what was trained (the same init key, the same masks).
"""

from __future__ import annotations

from typing import NamedTuple

import jax


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
