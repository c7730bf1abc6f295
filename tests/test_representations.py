"""``benchmarks/representations.py``: the measures the `modern-small` diagnosis rests on (the
effective rank, the mean cosine, how far a fine-tuning moved a layer) and the features read at
a depth, which at the top are the encoder's own output. The diagnosis itself is a measurement
(docs/tutorials/finetune.md), not a test."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import representations  # noqa: E402

pytestmark = pytest.mark.fast


def test_the_effective_rank_is_one_for_one_direction_and_near_full_for_isotropic_noise():
    rng = np.random.default_rng(0)
    line = rng.normal(size=(200, 1)) * rng.normal(size=(1, 16)) + 5.0  # one direction, shifted
    assert representations.effective_rank(line) == pytest.approx(1.0, abs=1e-6)
    noise = rng.normal(size=(2000, 16))
    assert 15.0 < representations.effective_rank(noise) <= 16.0


def test_the_mean_cosine_is_one_for_copies_and_zero_for_orthogonal_rows():
    same = np.tile(np.array([[1.0, 2.0, 3.0]]), (5, 1))
    assert representations.mean_cosine(same) == pytest.approx(1.0)
    assert representations.mean_cosine(np.eye(4)) == pytest.approx(0.0)
    pair = np.array([[1.0, 0.0], [1.0, 1.0]])
    assert representations.mean_cosine(pair) == pytest.approx(2 ** -0.5)


def test_the_norms_are_of_the_embeddings_and_of_each_block():
    params = {"embeddings": {"word": np.full((2, 2), 1.0)},
              "layers": {"a": np.stack([np.full(3, 2.0), np.zeros(3)]),
                         "b": np.stack([np.zeros(1), np.full(1, 4.0)])}}
    got = representations.norms(params, 2)
    assert got["embeddings"] == pytest.approx(2.0)
    assert got["blocks"] == pytest.approx([np.sqrt(12.0), 4.0])


def test_the_relative_change_is_the_norm_of_the_difference_over_the_norm_before():
    before = {"a": np.ones((2, 2)), "b": {"c": np.zeros(3)}}
    assert representations.relative_change(before, before) == 0.0
    after = {"a": 3 * np.ones((2, 2)), "b": {"c": np.zeros(3)}}
    assert representations.relative_change(before, after) == pytest.approx(2.0)


@pytest.mark.parametrize("preset", ["modern-tiny", "tiny"])
def test_the_features_at_the_top_are_the_encoders_own_output(preset):
    from clozax.core import model as model_lib
    from clozax.core.model_config import preset as model_preset

    config = model_preset(preset, vocab_size=64)
    params = model_lib.init(config, jax.random.key(0))
    ids = [np.array([1, 5, 9, 12, 2]), np.array([1, 7, 2]), np.array([1, 30, 31, 32, 33, 34, 2])]
    split = SimpleNamespace(ids=ids)
    got = representations.depth_features(params, config, config.layers, {"x": split}, 0,
                                         16)["x"]
    for r, row in enumerate(ids):
        inputs = jnp.asarray(row[None])
        mask = jnp.ones_like(inputs, bool)
        hidden = model_lib.apply(params, config, inputs, mask, mask.astype(jnp.int32))[0]
        np.testing.assert_allclose(got["cls"][r], hidden[0], atol=2e-5)
        np.testing.assert_allclose(got["mean"][r], hidden.mean(0), atol=2e-5)
    assert "cls_head" in got and got["cls_head"].shape == got["cls"].shape
    assert np.all(got["ratio"] > 0)
    shallower = representations.depth_features(params, config, 1, {"x": split}, 0, 16)["x"]
    assert "cls_head" not in shallower
    assert not np.allclose(shallower["cls"], got["cls"])


def test_a_directory_that_is_not_a_run_is_one_line_and_exit_2(tmp_path):
    done = subprocess.run([sys.executable, str(BENCHMARKS / "representations.py"),
                           str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "not a run directory" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_run_it_cannot_read_is_one_line_and_exit_2(tmp_path):
    (tmp_path / "run.json").write_text("{}")  # a run directory with nothing else in it
    done = subprocess.run([sys.executable, str(BENCHMARKS / "representations.py"),
                           str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.startswith("error: ")
    assert done.stderr.strip().count("\n") == 0 and "Traceback" not in done.stderr
