"""Schedules against their closed forms; AdamW, StableAdamW and LAMB against NumPy references;
weight decay only on dense kernels; a run with WSD and StableAdamW resumes bitwise."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from clozax.core import optim as optim_lib
from clozax.train import config as config_lib
from clozax.train import loop as train_lib
from clozax.train.run_dir import load_run
from commands import one_line_error
from conftest import TINY_OVERRIDES

pytestmark = pytest.mark.fast  # make test-fast; tests marked slow stay out

B1, B2, EPS = 0.9, 0.98, 1e-6


def _optim(**kw) -> config_lib.OptimConfig:
    return config_lib.OptimConfig(**{"b1": B1, "b2": B2, "eps": EPS, **kw})


def _closed_form(optim, count: int, total: int) -> float:
    peak, end = optim.learning_rate, optim.learning_rate * optim.end_lr_fraction
    warmup = min(optim.warmup_steps, max(total - 1, 0))
    if count < warmup:
        return peak * count / warmup
    start = total - optim.decay_fraction * (total - warmup)
    t = min(max((count - start) / max(total - start, 1.0), 0.0), 1.0)
    if optim.schedule == "cosine":
        return end + (peak - end) * 0.5 * (1 + math.cos(math.pi * t))
    if optim.schedule == "1-sqrt":
        return end + (peak - end) * (1 - math.sqrt(t))
    return peak + (end - peak) * t


@pytest.mark.parametrize("schedule", optim_lib.SCHEDULES)
@pytest.mark.parametrize("decay_fraction", [1.0, 0.25])
def test_every_schedule_follows_its_closed_form_at_every_update(schedule, decay_fraction):
    optim = _optim(learning_rate=8e-4, warmup_steps=10, schedule=schedule,
                   decay_fraction=decay_fraction, end_lr_fraction=0.02)
    total = 100
    got = np.asarray(jax.vmap(lambda c: optim_lib.learning_rate(optim, c, total))(
        jnp.arange(total + 1)))
    want = np.array([_closed_form(optim, c, total) for c in range(total + 1)])
    # float32 arithmetic: errors of a few ulps of the peak (the last linear step sits at 3 % of it)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * 8e-4)
    assert got[10] == pytest.approx(8e-4) and got[total] == pytest.approx(8e-4 * 0.02)
    if decay_fraction < 1:  # warmup-stable-decay: the peak held until the last quarter
        np.testing.assert_allclose(got[10:78], 8e-4, rtol=1e-6)
        assert got[79] < 8e-4


def test_wsd_decay_start_moves_with_a_revised_length():
    optim = _optim(warmup_steps=5, schedule="1-sqrt", decay_fraction=0.2)
    lr = lambda c, total: float(optim_lib.learning_rate(optim, c, total))  # noqa: E731
    assert lr(80, 100) == pytest.approx(1e-3) and lr(90, 100) < 1e-3
    assert lr(90, 200) == pytest.approx(1e-3)  # a longer budget keeps it stable for longer


# --------------------------------------------------------------------------- optimizers

PARAMS = {"layer": {"kernel": np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4),
                    "bias": np.full(4, 0.5, np.float32)},
          "norm": {"scale": np.ones(4, np.float32)},
          "embeddings": {"word": np.linspace(0.2, 0.9, 8, dtype=np.float32).reshape(4, 2)}}
DECAYED = {("layer", "kernel")}


def _grads(steps: int) -> list[dict]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(steps):
        scale = 50.0 if i == 3 else 1.0  # a spike: StableAdamW's clipping must act on it
        out.append(jax.tree.map(
            lambda p, s=scale: (s * rng.normal(size=p.shape)).astype(np.float32), PARAMS))
    return out


def _numpy_reference(kind: str, optim, grads: list[dict], total: int):
    """AdamW / StableAdamW / LAMB written out leaf by leaf in float64."""
    params = {k: {n: v.astype(np.float64) for n, v in d.items()} for k, d in PARAMS.items()}
    mu = {k: {n: np.zeros_like(v) for n, v in d.items()} for k, d in params.items()}
    nu = {k: {n: np.zeros_like(v) for n, v in d.items()} for k, d in params.items()}
    clipped = 0
    for t, g in enumerate(grads, start=1):
        lr = _closed_form(optim, t - 1, total)
        for k, d in params.items():
            for n, w in d.items():
                gi = g[k][n].astype(np.float64)
                mu[k][n] = B1 * mu[k][n] + (1 - B1) * gi
                nu[k][n] = B2 * nu[k][n] + (1 - B2) * gi * gi
                m_hat, v_hat = mu[k][n] / (1 - B1 ** t), nu[k][n] / (1 - B2 ** t)
                u = m_hat / (np.sqrt(v_hat) + EPS)
                if (k, n) in DECAYED:
                    u = u + optim.weight_decay * w
                if kind == "stable_adamw":
                    rms = np.sqrt(np.mean(gi * gi / np.maximum(v_hat, EPS * EPS)))
                    clipped += rms > 1
                    u = u / max(1.0, rms)
                elif kind == "lamb":
                    wn, un = np.linalg.norm(w), np.linalg.norm(u)
                    u = u * (wn / un if wn > 0 and un > 0 else 1.0)
                d[n] = w - lr * u
    return params, clipped


@pytest.mark.parametrize("kind", optim_lib.OPTIMIZERS)
def test_each_optimizer_equals_its_numpy_reference(kind):
    optim = _optim(optimizer=kind, learning_rate=1e-2, warmup_steps=2, weight_decay=0.1,
                   clip_norm=0.0, schedule="1-sqrt", decay_fraction=0.5)
    grads, total = _grads(8), 8
    optimizer, rate = optim_lib.make_optimizer(optim, total, PARAMS)
    params, state = jax.tree.map(jnp.asarray, PARAMS), optimizer.init(PARAMS)
    update = jax.jit(optimizer.update)
    for g in grads:
        updates, state = update(g, state, params)
        params = jax.tree.map(lambda p, u: p + u, params, updates)
    want, clipped = _numpy_reference(kind, optim, grads, total)
    for k, d in want.items():
        for n, w in d.items():
            np.testing.assert_allclose(np.asarray(params[k][n]), w, rtol=2e-5, atol=1e-6,
                                       err_msg=f"{kind} {k}.{n}")
    assert int(optim_lib.adam_state(state).count) == total
    assert float(rate(state)) == pytest.approx(_closed_form(optim, total, total))
    if kind == "stable_adamw":
        assert clipped > 0  # the spike was clipped, so the test saw the branch it is about


@pytest.mark.parametrize("kind", optim_lib.OPTIMIZERS)
def test_weight_decay_reaches_dense_kernels_only(kind):
    optim = _optim(optimizer=kind, learning_rate=1e-1, warmup_steps=0, weight_decay=0.5,
                   clip_norm=0.0)
    optimizer, _ = optim_lib.make_optimizer(optim, 10, PARAMS)
    zero = jax.tree.map(np.zeros_like, PARAMS)
    updates, _ = optimizer.update(zero, optimizer.init(PARAMS), PARAMS)
    for k, d in updates.items():
        for n, u in d.items():
            if (k, n) in DECAYED:
                assert np.all(np.sign(np.asarray(u)) == -np.sign(PARAMS[k][n]))
            else:
                np.testing.assert_array_equal(np.asarray(u), 0.0)


@pytest.mark.parametrize(("override", "message"), [
    ("optim.optimizer=sgd", "optim.optimizer='sgd' is not one of 'adamw', 'stable_adamw'"),
    ("optim.schedule=sqrt", "optim.schedule='sqrt' is not one of 'linear', 'cosine', '1-sqrt'"),
    ("optim.decay_fraction=0", "optim.decay_fraction=0 is outside (0, 1]"),
])
def test_bad_optimizer_settings_name_the_key_and_the_choices(override, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("]", r"\]")):
        config_lib.resolve(preset="tiny", overrides=[override])


# --------------------------------------------------------------------------- in a run

RECIPE = ["optim.optimizer=stable_adamw", "optim.schedule=1-sqrt", "optim.decay_fraction=0.5",
          "optim.clip_norm=0", "optim.end_lr_fraction=0.02",
          "masking.rate=0.4", "masking.rate_end=0.15", "masking.ramp_steps=4"]


@pytest.mark.slow
def test_a_wsd_stable_adamw_mask_ramp_run_resumes_mid_ramp_bitwise(stdlib_data, tmp_path,
                                                                     capsys):
    cfg = config_lib.resolve(preset="tiny", overrides=[*TINY_OVERRIDES, *RECIPE])
    assert dataclasses.asdict(cfg.optim)["optimizer"] == "stable_adamw"
    whole = tmp_path / "whole"
    train_lib.train(stdlib_data, whole, cfg)
    logged = {r["step"]: r["selected"] for r in map(json.loads, (whole / "metrics.jsonl")
                                                    .read_text().splitlines()) if "selected" in r}
    # updates 2 and 5 (0-based) of 8 rows x 64 tokens: rates 0.275 and 0.15, at most 18 and 10
    # selected per row (fewer only in a row with fewer real tokens)
    assert 8 * 10 < logged[3] <= 8 * 18 and logged[6] <= 8 * 10
    resumed = tmp_path / "resumed"
    shutil.copytree(whole, resumed)
    shutil.rmtree(resumed / "checkpoints" / "6")  # as if killed after the step-3 save
    capsys.readouterr()
    train_lib.train(stdlib_data, resumed, cfg)
    assert "steps 3->6" in capsys.readouterr().err  # resumed mid-decay, not trained again
    a, b = load_run(whole), load_run(resumed)
    assert a.step == b.step == 6
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(a.params))


# --------------------------------------------------------------------------- decay branches

WSD = ["optim.schedule=1-sqrt", "optim.decay_fraction=0.5"]  # 6 steps, warm-up 2: decay from 4


@pytest.mark.slow
def test_a_decay_branch_equals_a_run_trained_with_that_decay_from_scratch(
        stdlib_data, tiny_run, tmp_path, capsys):
    from clozax.app.cli import main

    source = tmp_path / "wsd"
    train_lib.train(stdlib_data, source,
                    config_lib.resolve(preset="tiny", overrides=[*TINY_OVERRIDES, *WSD]))
    branch = ["train", "--data", str(stdlib_data), "--out", str(tmp_path / "branch"),
              "--decay-from", str(source), "--step", "3", "--steps", "4"]
    main(branch)
    said = capsys.readouterr()
    assert "branched" in said.out and "steps 3->7" in said.err  # from RUN's step 3, not from 0
    branched = load_run(tmp_path / "branch")
    assert branched.step == 7 and branched.info["decayed_from"]["step"] == 3
    assert branched.config.optim.decay_start_step == 3
    # the same decay trained from step 0 in one run
    fresh = tmp_path / "fresh"
    train_lib.train(stdlib_data, fresh, branched.config)
    for x, y in zip(jax.tree.leaves(branched.params), jax.tree.leaves(load_run(fresh).params),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    lrs = [json.loads(line)["lr"] for line in (fresh / "metrics.jsonl").read_text().splitlines()
           if "lr" in json.loads(line)]
    assert lrs[0] == pytest.approx(1e-3) and lrs[-1] < 1e-3  # stable at 3, decayed by 6
    main(branch)  # the same command again: the branch is resumed (here: already complete)
    again = " ".join(capsys.readouterr().out.split())
    assert "already has its 7 steps: nothing trained" in again
    assert "branched" not in again  # it was printed again on every resume
    # refused, one line each: past the stable stretch, a step without a checkpoint, a run
    # with no stable stretch (linear decay from the warm-up's end)
    for src, step, words in ((source, "6", "in the run's own decay (from step 4)"),
                             (source, "5", "has no checkpoint of step 5; it has 3, 6"),
                             (tiny_run, "3", "in the run's own decay (from step 2)")):
        err = one_line_error(capsys, "train", "--data", stdlib_data, "--out",
                             tmp_path / f"bad{step}", "--decay-from", src, "--step", step,
                             "--steps", "2")
        assert words in err, err
        assert not (tmp_path / f"bad{step}").exists()
