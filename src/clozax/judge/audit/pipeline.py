"""What the audit exercises: the pipeline's pieces (clozax's own by default, or yours), the
result every check returns, and the training batches the checks read."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from clozax.core import model as model_lib
from clozax.core import objective
from clozax.core.keys import Keys
from clozax.core.masker import make_masker
from clozax.core.masking import MaskedBatch, Selection
from clozax.core.vocab import Vocabulary
from clozax.data.dataset import Dataset
from clozax.data.loader import batch_rows, host_batch
from clozax.train.config import RunConfig
from clozax.train.step import make_train_step


@dataclass(frozen=True)
class CheckResult:
    name: str
    passed: bool
    value: Any  # JSON-able measurement
    detail: str
    skipped: bool = False  # passed without running (e.g. one device visible); said in detail


@functools.lru_cache(maxsize=8)
def default_logits_fn(model_config):
    """``(params, batch, masked, selection) -> (batch, count, vocab)``: encoder on the corrupted
    inputs only, MLM head at the selected slots (as in training)."""

    def logits_fn(params, batch, masked: MaskedBatch, selection: Selection):
        return model_lib.logits_at(params, model_config, masked.inputs, batch["segments"],
                                   selection.positions)

    return logits_fn


def default_zero_head(params):
    """Parameters whose MLM logits are exactly 0 everywhere: the head's LayerNorm scale and bias
    and the output bias are zeroed, so the normalised features are 0 and ``0 @ E.T + 0 = 0``.
    (Zeroing the transform alone is not enough: LayerNorm's bias would still reach the
    tied decoder.)"""
    head = dict(params["head"])
    head["layer_norm"] = jax.tree.map(jnp.zeros_like, head["layer_norm"])
    head["bias"] = jnp.zeros_like(head["bias"])
    return {**params, "head": head}


def default_boundary(tokens, selected) -> None:
    """The host-side check that guards the objective: raises ValueError on an empty selection."""
    objective.check_nonempty(selected)


def default_make_step(vocab: Vocabulary, seq_len: int):
    """``(config, optimizer, schedule, mesh) -> step``: clozax's own ``make_train_step``."""
    return _default_make_step(vocab.size, specials_key(vocab), seq_len)


def default_masker(config: RunConfig, vocab: Vocabulary, seq_len: int):
    """The run's own masker, ``make_masker`` (cached, so repeated audits compile it once)."""
    return _default_masker(config.masking, vocab.size, specials_key(vocab), seq_len)


def specials_key(vocab: Vocabulary) -> tuple:
    return tuple(sorted(vocab.specials.items()))


# Default pieces are cached by value so that audits of the same shapes reuse compilations
# (jit caches by function identity).
@functools.lru_cache(maxsize=8)
def _default_masker(masking_config, size, specials, seq_len):
    return make_masker(masking_config, Vocabulary(size, dict(specials)), seq_len)


@functools.lru_cache(maxsize=8)
def _default_make_step(size, specials, seq_len):
    vocab = Vocabulary(size, dict(specials))

    @functools.lru_cache(maxsize=16)  # the same step object for the same arguments
    def make_step(config, optimizer, schedule, mesh):
        return make_train_step(config, vocab, seq_len, optimizer, schedule, mesh)

    return make_step


@dataclass(frozen=True)
class Pipeline:
    """What the audit exercises. Signatures (axis names as in ``masking``):

    masker(key, batch) -> (MaskedBatch, Selection), jittable; batch holds (batch, seq)
        ``tokens``/``segments``/``word_starts``.
    logits_fn(params, batch, masked, selection) -> (batch, count, vocab) float32.
    loss_fn(logits, targets, selected) -> (sum, count); the audit divides once.
    make_step(config, optimizer, schedule, mesh) -> step(state, batch, mask_key) -> (state,
        metrics with "loss"), pure; the gradient reaches ``optimizer.update``.
    boundary(tokens, selected) -> None; raises ValueError when the selection is unusable.
    zero_head(params) -> params whose logits are constant.
    """

    config: RunConfig
    vocab: Vocabulary
    seq_len: int
    params: dict
    masker: Callable
    logits_fn: Callable
    loss_fn: Callable
    make_step: Callable
    boundary: Callable
    zero_head: Callable


def take_rows(tree, n: int):
    # On the host: slicing device arrays eagerly would compile one small program per leaf.
    return jax.tree.map(lambda x: np.asarray(x)[:n], tree)


def train_batches(dataset: Dataset, config: RunConfig, keys: Keys, n: int):
    """Batches ``0..n-1`` of the training order with their step keys, exactly as train sees them."""
    for i in range(n):
        rows = batch_rows(keys.data, i, dataset.train.rows, config.train.batch_size)
        yield jax.random.fold_in(keys.mask, i), host_batch(dataset.train, rows)
