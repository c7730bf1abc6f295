"""The objective's (sum, count) contract."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from clozax.core import objective

pytestmark = pytest.mark.fast  # make test-fast; tests marked slow stay out


def _fixture(seed=0, batch=8, seq=16, vocab=11):
    rng = np.random.default_rng(seed)
    logits = jnp.asarray(rng.normal(size=(batch, seq, vocab)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, vocab, size=(batch, seq)), jnp.int32)
    # Deliberately unequal counts per sequence (0 .. seq selected).
    selected = jnp.asarray(rng.random((batch, seq)) < np.linspace(0.05, 0.9, batch)[:, None])
    return logits, targets, selected


def test_masked_nll_returns_sum_and_count_not_a_mean():
    logits, targets, selected = _fixture()
    total, count = objective.masked_nll(logits, targets, selected)
    assert int(count) == int(np.asarray(selected).sum())
    logp = jax.nn.log_softmax(logits)
    host = -np.take_along_axis(np.asarray(logp), np.asarray(targets)[..., None], -1)[..., 0]
    np.testing.assert_allclose(float(total), host[np.asarray(selected)].sum(), rtol=1e-6)


def test_microbatch_accumulation_equals_the_full_batch_token_weighted_mean():
    logits, targets, selected = _fixture(seed=3)
    full = float(objective.masked_cross_entropy(logits, targets, selected))
    pairs = [
        objective.masked_nll(logits[i : i + 2], targets[i : i + 2], selected[i : i + 2])
        for i in range(0, 8, 2)
    ]
    counts = [int(c) for _, c in pairs]
    assert len(set(counts)) > 1, "fixture must have unequal counts per microbatch"
    total, count = objective.accumulate(pairs)
    assert float(objective.token_weighted_mean(total, count)) == pytest.approx(full, rel=1e-6)
    mean_of_means = np.mean([float(s) / int(c) for s, c in pairs])
    assert not np.isclose(mean_of_means, full, rtol=1e-4)


def test_check_nonempty_rejects_an_empty_selection():
    with pytest.raises(ValueError, match="batch of 3 sequences has no selected position"):
        objective.check_nonempty(np.zeros((3, 5), bool))
    objective.check_nonempty(np.eye(3, dtype=bool))
