"""Training: token-weighted accumulation, devices, exact resume, frozen eval masks, bad input."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from clozax.core import model_config
from clozax.core import optim as optim_lib
from clozax.core.keys import Keys
from clozax.core.masker import make_masker
from clozax.core.train_state import TrainState
from clozax.core.vocab import Vocabulary
from clozax.data import open_dataset
from clozax.data.loader import batch_rows, host_batch
from clozax.train import checkpoint as ckpt
from clozax.train import config as config_lib
from clozax.train import heldout as eval_lib
from clozax.train import loop as train_lib
from clozax.train import step as step_lib
from clozax.train.run_dir import abstract_state, load_run
from commands import one_line_error
from conftest import TINY_OVERRIDES, simulated_devices

ROOT = Path(__file__).resolve().parents[1]


def _cfg(*extra, preset="tiny"):
    return config_lib.resolve(preset=preset, overrides=[*TINY_OVERRIDES, *extra])


def _vocab(ds):
    return Vocabulary(ds.vocab_size, ds.specials)


def _flat(tree):
    return np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(tree)])


def test_microbatches_4_give_the_same_loss_and_gradients_as_1_for_unequal_counts(stdlib_data):
    ds = open_dataset(stdlib_data)
    batch = host_batch(ds.train, np.arange(16))
    # Pad out most of some rows so the selected counts differ between microbatches.
    for r, keep in ((1, 6), (2, 9), (5, 4), (6, 12)):
        batch["tokens"][r, keep:] = ds.specials["pad"]
        batch["segments"][r, keep:] = 0
    results = {}
    for k in (1, 4):
        cfg = _cfg("train.batch_size=16", f"train.microbatches={k}")
        cfg = cfg.replace(model=model_config.ModelConfig(**{**cfg.model.__dict__,
                                                          "vocab_size": ds.vocab_size}))
        fn = jax.jit(step_lib.make_loss_and_grads(cfg, _vocab(ds), ds.seq_len))
        from clozax.core import model as model_lib

        params = model_lib.init(cfg.model, jax.random.key(0))
        total, count, grads = fn(params, batch, jax.random.key(5))
        results[k] = (float(total), int(count), _flat(grads) / int(count))
    (t1, c1, g1), (t4, c4, g4) = results[1], results[4]
    assert c1 == c4
    # Per-microbatch counts really are unequal, so a mean of means would differ.
    assert t4 / c4 == pytest.approx(t1 / c1, rel=1e-5)
    np.testing.assert_allclose(g4, g1, rtol=1e-5, atol=1e-5 * np.abs(g1).max())


@pytest.mark.fast
def test_a_mean_of_microbatch_means_would_differ_on_this_batch(stdlib_data):
    """Guards the test above: its fixture must make the per-microbatch weighting matter."""
    ds = open_dataset(stdlib_data)
    batch = host_batch(ds.train, np.arange(16))
    for r, keep in ((1, 6), (2, 9), (5, 4), (6, 12)):
        batch["segments"][r, keep:] = 0
    eligible = batch["segments"] > 0
    per_row = np.minimum(eligible.sum(1), 10)
    per_micro = [per_row[j::4].sum() for j in range(4)]
    assert len(set(per_micro)) > 1


# Three steps of the tiny preset, the same on every layout the device test compares.
DEVICE_RUN = ["train.batch_size=8", "train.steps=3", "train.eval_every=3", "train.save_every=3",
              "train.eval_rows=16", "train.eval_sample=8", "optim.warmup_steps=1"]

DEVICE_SCRIPT = r"""
import json, sys
import jax, numpy as np
from clozax.core.optim import adam_state
from clozax.train import config as C, loop as T
from clozax.train.run_dir import load_run
data, out, base = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
res = {}
for name, n, fsdp in (("1", 1, "false"), ("4", 4, "false"), ("4fsdp", 4, "true")):
    cfg = C.resolve(preset="tiny", overrides=[*base, f"train.devices={n}", f"train.fsdp={fsdp}"])
    r = T.train(data, f"{out}/d{name}", cfg)
    p = load_run(f"{out}/d{name}").params
    word = r.state.params["embeddings"]["word"]
    mu = adam_state(r.state.opt_state).mu["embeddings"]["word"]
    res[name] = {"loss": r.final_loss, "params": [np.asarray(x).ravel().tolist()
                 for x in jax.tree.leaves(p)][:6], "eval": r.eval["loss"],
                 "word_shape": list(word.shape),
                 "word_shards": [list(s.data.shape) for s in word.addressable_shards],
                 "mu_shards": [list(s.data.shape) for s in mu.addressable_shards]}
# Stopped after step 2 (checkpoints every step); the test resumes it on one device.
cfg = C.resolve(preset="tiny", overrides=[*base, "train.save_every=1", "train.devices=4",
                                          "train.fsdp=true"])
T.train(data, f"{out}/d4fsdp-stopped", cfg, stop_after=2)
from clozax.judge.evaluate import evaluate_run
res["full"] = evaluate_run(f"{out}/d4", full=True, failures=3, batch_size=16)["trained"]
print(json.dumps({"devices": jax.device_count(), **res}))
"""


def _assert_params_close(reference, other):
    """Each parameter tensor within 1e-5 of the reference, norm-wise: summation order differs
    across devices, and Adam's normalisation amplifies it for elements whose gradient is ~0."""
    for a, b in zip(reference, other, strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert np.linalg.norm(b - a) <= 1e-5 * np.linalg.norm(a)


def test_one_and_four_devices_give_the_same_loss_and_parameters(stdlib_data, tmp_path):
    """Replicated or, with ``train.fsdp``, sharded parameters and AdamW moments: the same
    run as on one device. The sharded run's checkpoint also loads in this 1-device process."""
    env = simulated_devices(4)
    proc = subprocess.run([sys.executable, "-c", DEVICE_SCRIPT, str(stdlib_data),
                           str(tmp_path), json.dumps(DEVICE_RUN)],
                          capture_output=True, text=True, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["devices"] == 4
    one = out["1"]
    for name in ("4", "4fsdp"):
        assert out[name]["loss"] == pytest.approx(one["loss"], rel=1e-5)
        assert out[name]["eval"] == pytest.approx(one["eval"], rel=1e-5)
        _assert_params_close(one["params"], out[name]["params"])
    vocab, hidden = out["4"]["word_shape"]
    assert out["4"]["word_shards"] == [[vocab, hidden]] * 4  # replicated
    assert out["4fsdp"]["word_shards"] == [[vocab // 4, hidden]] * 4  # a quarter each
    assert out["4fsdp"]["mu_shards"] == [[vocab // 4, hidden]] * 4
    here = load_run(tmp_path / "d4fsdp").params
    np.testing.assert_allclose(
        np.asarray(jax.tree.leaves(here)[0]).ravel(), out["4fsdp"]["params"][0], rtol=0, atol=0
    )
    assert jax.tree.leaves(here)[0].sharding.num_devices == 1
    # The frozen held-out sample: the same keyed rows and masks on 1 and 4 devices, and here.
    shas = {json.loads((tmp_path / f"d{name}" / "eval_masks.json").read_text())["sha256"]
            for name in ("1", "4", "4fsdp")}
    ds = open_dataset(stdlib_data)
    masker = make_masker(config_lib.resolve(preset="tiny").masking,
                         Vocabulary(ds.vocab_size, ds.specials), ds.seq_len)
    here_set = eval_lib.build_eval_masks(ds.heldout, masker, 1234, 16)
    assert shas == {eval_lib.eval_masks_sha256(here_set)}
    assert here_set.rows.size == 16 and here_set.rows[-1] > 16  # a sample, not the first rows
    # evaluate --full with its batches split over 4 devices: the sums of one device.
    from clozax.judge.evaluate import evaluate_run

    one_device = evaluate_run(tmp_path / "d4", full=True, failures=3, batch_size=16)["trained"]
    assert out["full"]["count"] == one_device["count"] > 0
    # (a target's rank may flip at a float tie between layouts: at most one position)
    assert abs(out["full"]["accuracy"] - one_device["accuracy"]) <= 1 / one_device["count"]
    assert out["full"]["loss"] == pytest.approx(one_device["loss"], rel=1e-6)
    # A sharded 4-device run stopped at step 2, resumed here on one device, replicated: the
    # uninterrupted 1-device run.
    cfg = config_lib.resolve(preset="tiny", overrides=[*DEVICE_RUN, "train.devices=1"])
    resumed = train_lib.train(stdlib_data, tmp_path / "d4fsdp-stopped", cfg)
    assert resumed.final_loss == pytest.approx(one["loss"], rel=1e-5)
    _assert_params_close(one["params"], [np.asarray(x).ravel()
                                         for x in jax.tree.leaves(resumed.state.params)][:6])


@pytest.mark.fast
def test_batches_are_a_pure_function_of_the_index_and_cover_each_epoch():
    rows, bs = 103, 10
    first = np.concatenate([batch_rows(7, i, rows, bs) for i in range(10)])
    assert len(set(first.tolist())) == 100  # one epoch: no row twice
    assert np.array_equal(batch_rows(7, 13, rows, bs), batch_rows(7, 13, rows, bs))
    assert not np.array_equal(batch_rows(7, 0, rows, bs), batch_rows(8, 0, rows, bs))
    assert not np.array_equal(batch_rows(7, 0, rows, bs), batch_rows(7, 10, rows, bs))


def test_eval_masks_are_frozen_hashed_and_reproducible_from_the_eval_key(tiny_run, stdlib_data):
    masks, meta = eval_lib.load_eval_masks(tiny_run)
    assert meta["sha256"] == eval_lib.eval_masks_sha256(masks)
    cfg = config_lib.load_json(tiny_run / "config.json")
    ds = open_dataset(stdlib_data)
    masker = make_masker(cfg.masking, _vocab(ds), ds.seq_len)
    again = eval_lib.build_eval_masks(ds.heldout, masker, cfg.train.eval_seed,
                                      cfg.train.eval_rows)
    assert eval_lib.eval_masks_sha256(again) == meta["sha256"]
    other = eval_lib.build_eval_masks(ds.heldout, masker, cfg.train.seed, cfg.train.eval_rows)
    assert eval_lib.eval_masks_sha256(other) != meta["sha256"], "eval key must not be the train key"


def test_training_writes_metrics_with_eval_and_a_falling_loss(tiny_run):
    records = [json.loads(x) for x in (tiny_run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [3, 6]
    for r in records:
        assert {"loss", "lr", "selected", "grad_norm", "tokens_per_s", "eval"} <= set(r)
        assert r["eval"]["count"] == sum(k["count"] for k in r["eval"]["by_kind"].values())
    assert records[-1]["eval"]["loss"] < records[0]["eval"]["loss"]
    resolved = json.loads((tiny_run / "config.json").read_text())
    assert resolved["model"]["vocab_size"] == 1024


def _tensorboard_scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    """``{tag: {step: value}}`` read back from a run's TensorBoard event files (TFRecords:
    u64 length, u32 crc, an ``Event`` proto, u32 crc)."""
    from tensorboardX.proto import event_pb2

    scalars: dict[str, dict[int, float]] = {}
    for path in sorted((run_dir / "tensorboard").glob("events.out.tfevents.*")):
        data, i = path.read_bytes(), 0
        while i < len(data):
            (length,) = struct.unpack_from("<Q", data, i)
            event = event_pb2.Event.FromString(data[i + 12:i + 12 + length])
            i += 12 + length + 4
            for value in event.summary.value:
                scalars.setdefault(value.tag, {})[event.step] = value.simple_value
    return scalars


def test_tensorboard_events_carry_the_logged_train_and_eval_scalars(tiny_run):
    """With the ``tensorboard`` extra installed (the dev extra has it), the run directory's
    event files hold the same loss, learning rate and held-out metrics as metrics.jsonl."""
    records = [json.loads(x) for x in (tiny_run / "metrics.jsonl").read_text().splitlines()]
    scalars = _tensorboard_scalars(tiny_run)
    for r in records:
        step = r["step"]
        assert scalars["train/loss"][step] == pytest.approx(r["loss"], rel=1e-6)
        assert scalars["train/lr"][step] == pytest.approx(r["lr"], rel=1e-6)
        assert scalars["eval/loss"][step] == pytest.approx(r["eval"]["loss"], rel=1e-6)
        assert scalars["eval/accuracy"][step] == pytest.approx(r["eval"]["accuracy"], rel=1e-6)


def test_resume_refuses_a_different_config(tiny_run_copy, stdlib_data):
    with pytest.raises(ValueError, match="different config.*masking.rate"):
        train_lib.train(stdlib_data, tiny_run_copy, _cfg("masking.rate=0.3"))


def test_resume_refuses_different_data_or_tokenizer(tiny_run_copy, stdlib_data):
    info = json.loads((tiny_run_copy / "run.json").read_text())
    (tiny_run_copy / "run.json").write_text(json.dumps({**info, "dataset_fingerprint": "0" * 64}))
    with pytest.raises(ValueError, match="trained on dataset"):
        train_lib.train(stdlib_data, tiny_run_copy, _cfg())
    (tiny_run_copy / "run.json").write_text(json.dumps({**info, "tokenizer_sha256": "f" * 64}))
    with pytest.raises(ValueError, match="tokenizer"):
        train_lib.train(stdlib_data, tiny_run_copy, _cfg())


def test_a_failed_save_keeps_the_previous_checkpoint_loadable(tiny_run_copy, monkeypatch):
    before = load_run(tiny_run_copy)
    checkpointer = ckpt.Checkpointer(tiny_run_copy)

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    state, _ = checkpointer.restore(6, abstract_state(before.config))
    monkeypatch.setattr(checkpointer.manager, "save", full_disk)
    with pytest.raises(ckpt.CheckpointError, match="No space left.*step 6.*intact"):
        checkpointer.save(9, state, {})
    checkpointer.close()
    after = load_run(tiny_run_copy)
    assert after.step == before.step == 6


def test_non_finite_loss_stops_the_run_and_keeps_the_last_good_checkpoint(stdlib_data, tmp_path,
                                                                          monkeypatch):
    out = tmp_path / "nan"
    cfg = _cfg("train.steps=4", "train.save_every=2", "train.eval_every=4")
    train_lib.train(stdlib_data, out, cfg, stop_after=2)
    real = step_lib.make_loss

    def poisoned(model_config, *rest):
        loss_fn = real(model_config, *rest)

        def fn(params, *args):
            total, (t, c) = loss_fn(params, *args)
            return total * jnp.nan, (t * jnp.nan, c)

        return fn

    monkeypatch.setattr(step_lib, "make_loss", poisoned)
    with pytest.raises(train_lib.TrainingDiverged, match="step 3.*last good checkpoint .step 2"):
        train_lib.train(stdlib_data, out, cfg)
    assert load_run(out).step == 2


@pytest.mark.fast
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.heads=3"], "does not divide"),
        (["masking.rate=0.6"], "rate 0.6 is outside"),
        (["masking.mask=0.5"], "sum to"),
        (["train.batch_size=10", "train.microbatches=4"], "not divisible"),
        (["model.nonsense=1"], "valid model keys are"),
        (["trian.steps=1"], "unknown config section"),
        (["masking.unit=sentence"], "masking.unit"),
        (["train.fsdp=1"], "train.fsdp=1 is not a bool"),
    ],
)
def test_impossible_configs_are_rejected_with_the_value(overrides, message):
    with pytest.raises(ValueError, match=message):
        config_lib.resolve(preset="tiny", overrides=overrides)


@pytest.mark.fast
def test_config_file_and_overrides_resolve_in_order(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[model]\npreset = "tiny"\nlayers = 3\n[train]\nsteps = 7\n')
    cfg = config_lib.resolve(path, overrides=["train.steps=9", "optim.schedule=cosine"])
    assert (cfg.model.hidden, cfg.model.layers, cfg.train.steps) == (32, 3, 9)
    assert cfg.optim.schedule == "cosine"
    assert config_lib.from_dict(json.loads(cfg.to_json())) == cfg


CLI_BAD = [
    (["--data", "/nonexistent/x"], "dataset"),
    (["--preset", "huge"], "unknown preset"),
    (["--set", "train.batch_size=5", "--set", "train.microbatches=2"], "not divisible"),
    (["--set", "model.max_positions=32"], "exceeds model.max_positions"),
    (["--preset", "modern-tiny", "--set", "model.local_window=80"],
     "model.local_window=80 is larger than the dataset's 64-token rows"),
    (["--set", 'model.attention="flash"'],
     "model.attention='flash' (clozax's Pallas (Triton) kernel) needs an NVIDIA GPU and this "
     "machine runs cpu; choose one of 'auto', 'einsum', 'xla'"),
    (["--set", 'model.attention="pallas"'], "model.attention='pallas' is not one of"),
]


@pytest.mark.fast
@pytest.mark.parametrize(("args", "message"), CLI_BAD)
def test_train_cli_bad_input_is_one_line_exit_2(args, message, stdlib_data, tmp_path, capsys):
    base = {"--data": str(stdlib_data), "--out": str(tmp_path / "r")}
    argv = ["train"]
    for k, v in base.items():
        if k not in args:
            argv += [k, v]
    argv += args
    assert message in one_line_error(capsys, *argv)
    assert not (tmp_path / "r").exists()  # refused before anything was written


def test_minutes_fixes_the_step_count_once_and_records_it(stdlib_data, tmp_path):
    out = tmp_path / "budget"
    cfg = _cfg("train.minutes=0.02", "train.eval_every=1000", "train.save_every=1000")
    result = train_lib.train(stdlib_data, out, cfg)
    saved = json.loads((out / "config.json").read_text())
    assert saved["train"]["minutes"] == 0.02
    assert saved["train"]["steps"] == result.steps >= 1


@pytest.mark.fast
def test_the_budget_re_estimates_at_its_points_from_the_pace_since_its_last_estimate(
        monkeypatch):
    """A 120 s budget on a fake clock: the end step from the speed since the last estimate,
    saves counted apart at their own cadence, 2 % of the budget kept for closing; points
    already passed are spent, a change under 3 % changes nothing, after 85 % no more."""
    import math
    from types import SimpleNamespace

    from clozax.train import budget as budget_lib

    now = [10.0]
    monkeypatch.setattr(budget_lib, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    budget = budget_lib.Budget(2.0, started=0.0)
    assert not budget.due(5)  # not marked: nothing measured
    budget.mark(1)
    now[0] = 20.0  # 10 steps in 10 s; 117.6 s usable - 20 s spent = 97 steps more
    assert budget.estimate(11, math.inf, 10) == 11 + 97
    now[0] = 29.0
    assert not budget.due(15)  # before 25 %
    budget.spent_outside(3.0)  # a save
    now[0] = 53.0  # 15 steps at 2 s and the save: 25 % and 40 % have passed
    assert budget.due(26)
    # 2 s a step + a 3 s save every 10 steps; 117.6 - 53 - 2 x 3 = 58.6 s: 25 steps more
    assert budget.revise(26, 108, math.inf, 10) == 26 + 25
    now[0] = 61.0
    assert not budget.due(30)  # both points were spent at once: the next is 55 % (66 s)
    now[0] = 67.0  # the same pace: 52, within 3 % of 51
    assert budget.revise(33, 51, math.inf, 10) is None
    now[0] = 110.0  # past 70 % and 85 %: one last estimate, then none
    assert budget.revise(45, 51, math.inf, 10) is not None
    now[0] = 115.0
    assert not budget.due(47)


@pytest.mark.parametrize("spent_before", [0.0, 100.0])
def test_minutes_times_steps_unless_start_up_has_spent_the_budget(spent_before, tmp_path):
    """The probe times steps, an evaluation and a save within the budget; when start-up and
    compiling have spent it already, the run is one step and nothing more is timed."""
    import time
    from types import SimpleNamespace

    from clozax.train.budget import TIMED_STEPS, WARMUP_STEPS, steps_for_budget

    calls, said = [], []

    def step_fn(state, batch, key):
        calls.append("step")
        return state, jnp.float32(1.0)

    def evaluate(params, masks, sample):
        calls.append("evaluate")

    state = TrainState(step=jnp.int32(0), params={"w": jnp.ones(4)},
                       opt_state={"m": jnp.zeros(4)})
    config = SimpleNamespace(train=SimpleNamespace(minutes=1.0, eval_sample=8, eval_seed=0,
                                                   eval_every=100, save_every=100))
    masks = SimpleNamespace(rows=np.arange(16))
    steps = steps_for_budget(config, time.perf_counter() - spent_before, state, step_fn,
                             lambda i: None, None, evaluate, masks, tmp_path / "run",
                             said.append)
    if spent_before:
        assert steps == 1 and calls == ["step"]  # the compiling call only
        assert "spent before the first step" in said[0]
    else:
        assert calls == ["step"] * (1 + WARMUP_STEPS + TIMED_STEPS) + ["evaluate"] * 2
        # near-free fake steps: the probe save's cost, spread over save_every=100 steps,
        # bounds the count (1,000 needs a save under ~5 s; 100 one under ~28 s)
        assert steps > 100 and "ms/step" in said[0]


def test_whole_word_masking_and_bf16_compute_train_finitely(stdlib_data, tmp_path):
    cfg = _cfg("masking.unit=word", "model.compute_dtype=bfloat16", "train.steps=2",
               "train.eval_every=2")
    result = train_lib.train(stdlib_data, tmp_path / "ww", cfg)
    assert np.isfinite(result.final_loss) and np.isfinite(result.eval["loss"])


def test_continued_pretraining_starts_from_the_other_runs_parameters(tiny_run, stdlib_data,
                                                                      tmp_path):
    out = tmp_path / "continued"
    # A different seed: a fresh init of this run would be far from the source's weights.
    cfg = _cfg("train.steps=1", "train.eval_every=1", "train.save_every=1", "train.seed=1")
    train_lib.train(stdlib_data, out, cfg, init_from=tiny_run)
    assert json.loads((out / "run.json").read_text())["init_from"] == str(tiny_run.absolute())
    source, continued = _flat(load_run(tiny_run).params), _flat(load_run(out).params)
    from clozax.core import model as model_lib

    fresh = _flat(model_lib.init(load_run(out).config.model, Keys.from_seed(1).init))
    # One AdamW step moves each weight by at most lr * (1 + weight_decay * |w|) (Adam's first
    # update m/sqrt(v) has magnitude <= 1); a fresh init is far away.
    optim = load_run(out).config.optim
    bound = optim.learning_rate * (1 + optim.weight_decay * np.abs(source).max())
    assert np.abs(continued - source).max() <= bound * (1 + 1e-5)
    assert np.abs(continued - fresh).max() > 1e-2


def _trajectory(ds, cfg, steps=10):
    """Losses of ``steps`` train steps from the same init on the same batches."""
    from clozax.core import model as model_lib

    params = model_lib.init(cfg.model, jax.random.key(0))
    optimizer, schedule = optim_lib.make_optimizer(cfg.optim, steps, params)
    step = jax.jit(step_lib.make_train_step(cfg, _vocab(ds), ds.seq_len, optimizer, schedule))
    state = TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params))
    losses = []
    for i in range(steps):
        batch = host_batch(ds.train, batch_rows(3, i, ds.train.rows, 8))
        state, metrics = step(state, batch, jax.random.key(9))
        losses.append(float(metrics["loss"]))
    return np.array(losses)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_optimised_step_keeps_the_plain_steps_loss_trajectory(stdlib_data, monkeypatch, dtype):
    """The speed changes keep the numbers: the unrolled layer scan, the CPU-layout kernels
    (``clozax.core.kernels``: dense, attention and decoder gradients) and the last block computed
    only at the selected positions, against a rolled scan, ``jax.nn.dot_product_attention``,
    autodiff of the plain matmuls and a full last block.

    Measured max relative loss difference over 10 steps on the tiny preset: 0 in fp32 (the
    same products; bound 1e-5 for summation-order changes); in bf16 the kernels round each
    incoming gradient to bf16 before its matmul (as torch autocast does) where autodiff
    multiplies it in float32: measured 6.6e-6, bound 5e-5.
    """
    from clozax.core import kernels
    from clozax.core import model as model_lib

    ds = open_dataset(stdlib_data)
    cfg = _cfg(f"model.compute_dtype={dtype}")
    cfg = cfg.replace(model=model_config.ModelConfig(**{**cfg.model.__dict__,
                                                      "vocab_size": ds.vocab_size}))
    optimised = _trajectory(ds, cfg)
    apply, gather = model_lib.apply, model_lib.gather

    def plain_apply(*args, positions=None, unroll=1, **kwargs):
        hidden = apply(*args, unroll=1, **kwargs)
        return hidden if positions is None else gather(hidden, positions)

    cfg = cfg.replace(model=model_config.ModelConfig(**{**cfg.model.__dict__, "attention": "xla"}))
    monkeypatch.setattr(kernels, "matmul", kernels.plain_matmul)
    monkeypatch.setattr(kernels, "decode", kernels.plain_decode)
    monkeypatch.setattr(model_lib, "apply", plain_apply)
    plain = _trajectory(ds, cfg)
    assert optimised[-1] < optimised[0]
    np.testing.assert_allclose(optimised, plain, rtol=1e-5 if dtype == "float32" else 5e-5)


def test_the_loop_reads_the_device_only_at_sync_points(stdlib_data, tmp_path, monkeypatch):
    """No per-step host read: the step runs under a transfer guard that forbids implicit
    device→host copies, and metrics are fetched once per log/eval/save point."""
    from clozax.train import drive

    fetched = []
    real = drive._fetch

    def counting(pending):
        fetched.append(len(pending))
        return real(pending)

    monkeypatch.setattr(drive, "_fetch", counting)
    cfg = _cfg("train.steps=8", "train.log_every=4", "train.eval_every=8", "train.save_every=8")
    result = train_lib.train(stdlib_data, tmp_path / "run", cfg)
    assert result.steps == 8 and fetched == [4, 4]  # two reads for eight steps


def test_params_only_restore_equals_the_full_restore(tiny_run):
    run = load_run(tiny_run)
    checkpointer = ckpt.Checkpointer(tiny_run)
    full, meta = checkpointer.restore(run.step, abstract_state(run.config))
    only, _ = checkpointer.restore(run.step, abstract_state(run.config), params_only=True)
    checkpointer.close()
    assert only.opt_state is None and full.opt_state is not None and meta["step"] == 6
    for x, y, z in zip(jax.tree.leaves(full.params), jax.tree.leaves(only.params),
                       jax.tree.leaves(run.params), strict=True):
        assert np.array_equal(np.asarray(x), np.asarray(y))
        assert np.array_equal(np.asarray(x), np.asarray(z))


@pytest.mark.fast
def test_the_in_training_eval_sample_is_a_pure_function_of_its_key():
    a = eval_lib.sample_indices(1000, 64, eval_seed=3)
    assert np.array_equal(a, eval_lib.sample_indices(1000, 64, eval_seed=3))
    assert not np.array_equal(a, eval_lib.sample_indices(1000, 64, eval_seed=4))
    assert a.size == np.unique(a).size == 64 and np.all(np.diff(a) > 0) and a.max() < 1000
    assert np.array_equal(eval_lib.sample_indices(50, 64, eval_seed=3), np.arange(50))
    assert np.array_equal(eval_lib.sample_indices(50, None, eval_seed=3), np.arange(50))


def test_a_recorded_budget_revision_is_replayed_on_resume(stdlib_data, tiny_run, tmp_path):
    """A --minutes run's schedule length is data (no recompilation) and each choice is
    recorded: first 20 steps planned, then 8 from step 4 on. Resumed from step 2, the run
    replays the revision at step 4 and ends bitwise equal to the uninterrupted one."""
    revised = ("train.steps=8", "train.budget_revisions=[[0, 20], [4, 8]]", "train.save_every=2")
    whole = train_lib.train(stdlib_data, tmp_path / "whole", _cfg(*revised))
    train_lib.train(stdlib_data, tmp_path / "resumed", _cfg(*revised), stop_after=2)
    train_lib.train(stdlib_data, tmp_path / "resumed", _cfg(*revised))
    a, b = load_run(tmp_path / "whole"), load_run(tmp_path / "resumed")
    assert a.step == b.step == whole.steps == 8
    assert np.array_equal(_flat(a.params), _flat(b.params))
    # The 20-step plan before step 4 is not the 8-step schedule: the parameters differ.
    plain = train_lib.train(stdlib_data, tmp_path / "plain", _cfg("train.steps=8"))
    assert plain.steps == 8 and not np.array_equal(_flat(a.params),
                                                     _flat(load_run(tmp_path / "plain").params))
    assert config_lib.schedule_length(a.config.train, 3) == 20
    assert config_lib.schedule_length(a.config.train, 4) == 8


def test_train_on_a_finished_run_says_it_trained_nothing(tiny_run_copy, stdlib_data, capsys):
    # It once printed "trained N steps" having trained none.
    from commands import clozax
    from conftest import TINY_OVERRIDES

    ran = clozax(capsys, "train", "--data", stdlib_data, "--out", tiny_run_copy, "--preset",
                 "tiny", *sum((["--set", o] for o in TINY_OVERRIDES), []))
    assert ran.code == 0, ran.err
    steps = json.loads((tiny_run_copy / "config.json").read_text())["train"]["steps"]
    assert f"already has its {steps} steps: nothing trained" in " ".join(ran.out.split())
    assert "trained " not in ran.out.replace("nothing trained", "")
