"""Nothing silently wrong: each fault a user can meet is refused, recovered from, or reported as
an error in one line — never turned into a number (README, "Reliability").

Each test injects one fault into a copy of the session's tiny run or dataset.
"""

from __future__ import annotations

import asyncio
import io
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from orbax.checkpoint._src.path import atomicity
from rich.console import Console

from clozax.app.cli import main
from clozax.core import files
from clozax.core.optim import adam_state
from clozax.data import open_dataset, prepare
from clozax.judge.evaluate import evaluate_run
from clozax.judge.failures import token_piece
from clozax.judge.fill import fill
from clozax.train import checkpoint as ckpt
from clozax.train import config as config_lib
from clozax.train import heldout
from clozax.train import loop as train_lib
from clozax.train.run_dir import abstract_state, load_run
from commands import one_line_error
from conftest import TINY_OVERRIDES


def _cfg(*extra):
    return config_lib.resolve(preset="tiny", overrides=[*TINY_OVERRIDES, *extra])


def _flat(params) -> np.ndarray:
    return np.concatenate([np.asarray(x).ravel() for x in jax.tree.leaves(params)])


# --------------------------------------------------------------------------- data identity


@pytest.fixture(scope="module")
def reprepared(stdlib_data, data32, tmp_path_factory) -> dict:
    """The same corpus prepared again with the run's own tokenizer, once with another split
    seed and once with another row length (the session's ``data32``)."""
    root = tmp_path_factory.mktemp("reprepared")
    prepare(root / "seed1", corpus="stdlib", seq_len=64, seed=1,
            tokenizer=stdlib_data / "tokenizer.json", quiet=True)
    return {"seed 1": root / "seed1", "seq_len 32": data32}


@pytest.mark.parametrize("which", ["seed 1", "seq_len 32"])
def test_a_reprepared_dataset_is_refused_by_train_evaluate_probe_and_audit(
        which, reprepared, tiny_run_copy, stdlib_data, capsys):
    other = reprepared[which]
    assert open_dataset(other).fingerprint != open_dataset(stdlib_data).fingerprint
    overrides = [arg for o in TINY_OVERRIDES for arg in ("--set", o)]
    err = one_line_error(capsys, "train", "--data", other, "--out", tiny_run_copy,
                         "--preset", "tiny", *overrides)
    assert "was trained on dataset" in err and "re-prepared" in err
    # The run now points at the re-prepared directory (as if prepared again in place).
    info = json.loads((tiny_run_copy / "run.json").read_text())
    (tiny_run_copy / "run.json").write_text(json.dumps({**info, "dataset": str(other)}))
    for command in (["evaluate"], ["probe"], ["audit"]):
        err = one_line_error(capsys, *command, str(tiny_run_copy))
        assert "does not match the data" in err and "fingerprint" in err, command
    with pytest.raises(ValueError, match=r"eval-mask set .* was built on dataset .*seq_len"):
        heldout.load_eval_masks(tiny_run_copy, open_dataset(other))


# --------------------------------------------------------------------------- non-finite


def test_a_diverging_update_is_never_saved(stdlib_data, tmp_path):
    # 1e39 is a finite Python float but infinite in float32: the first update makes the
    # parameters infinite while the loss it was computed from is still finite.
    cfg = _cfg("optim.learning_rate=1e39", "optim.warmup_steps=0", "train.save_every=1")
    with pytest.raises(train_lib.TrainingDiverged, match="updated parameters at step 1"):
        train_lib.train(stdlib_data, tmp_path / "run", cfg)
    assert ckpt.Checkpointer(tmp_path / "run").all_steps() == []


def test_evaluating_a_nan_checkpoint_is_an_error_not_a_score(tiny_run_copy, capsys):
    run = load_run(tiny_run_copy)
    checkpointer = ckpt.Checkpointer(tiny_run_copy)
    state, meta = checkpointer.restore(run.step, abstract_state(run.config))
    nan = jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), state.params)
    checkpointer.save(run.step + 1, state._replace(params=nan), meta)
    checkpointer.close()
    err = one_line_error(capsys, "evaluate", str(tiny_run_copy))
    assert "not finite" in err and "positions" in err
    assert not (tiny_run_copy / "eval.json").exists()


@pytest.mark.fast
def test_strict_json_never_holds_nan(tmp_path):
    with pytest.raises(ValueError, match="Out of range float"):
        files.write_json(tmp_path / "x.json", {"loss": float("nan")})
    assert not (tmp_path / "x.json").exists()


# --------------------------------------------------------------------------- checkpoints


def _save_failing_with(error, run, monkeypatch) -> str:
    """Step 7 saved with orbax's write raising ``error``; returns the one-line message. Orbax's
    background directory creation is slowed down (as on a loaded machine), and each write
    asserts its temporary directory already exists: a directory created after the failure
    surfaced would outlive the cleanup (a leftover temporary that CI once found)."""
    created_late = atomicity._create_paths

    async def late(*args, **kwargs):
        await asyncio.sleep(0.5)
        return await created_late(*args, **kwargs)

    uncreated = []

    def failing(self, directory, *args, **kwargs):
        if not Path(directory).is_dir():
            uncreated.append(directory)
        raise error

    monkeypatch.setattr(atomicity, "_create_paths", late)
    monkeypatch.setattr(ocp.handlers.StandardCheckpointHandler, "async_save", failing)
    checkpointer = ckpt.Checkpointer(run)
    state, _ = checkpointer.restore(6, abstract_state(load_run(run).config))
    with pytest.raises(ckpt.CheckpointError) as raised:
        checkpointer.save(7, state, {"step": 7})
    checkpointer.close()
    assert uncreated == [], "a write began before its temporary directory existed"
    return str(raised.value)


def test_disk_full_during_a_save_is_one_line_and_leaves_no_temporary(tiny_run_copy, monkeypatch):
    message = _save_failing_with(
        ValueError("RESOURCE_EXHAUSTED: write failed: No space left on device"),
        tiny_run_copy, monkeypatch)
    assert "RESOURCE_EXHAUSTED" in message and "MiB free" in message and "\n" not in message
    assert str(tiny_run_copy / "checkpoints") in message and "step 6" in message
    assert list((tiny_run_copy / "checkpoints").glob("*orbax-checkpoint-tmp*")) == []
    assert load_run(tiny_run_copy).step == 6


FULL_DISK_MIB = 12


def _small_disk(where: Path) -> dict:
    """A 12 MiB filesystem at ``where``: a real tmpfs where this machine lets the test mount
    one (root with the capability; unmounted by the caller), else a simulation: a process
    whose files may not grow past 12 MiB (``RLIMIT_FSIZE``, writes failing with EFBIG). Returns
    the ``subprocess.run`` keywords that run a command against it."""
    import resource
    import signal
    import subprocess

    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={FULL_DISK_MIB}m", "tmpfs",
                              str(where)], capture_output=True).returncode == 0
    if mounted:
        return {"mounted": True}
    limit = FULL_DISK_MIB * 2**20

    def capped():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a kill
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return {"mounted": False, "preexec_fn": capped}


@pytest.mark.slow
def test_a_full_disk_during_train_is_one_line_and_nothing_else(tmp_path):
    """`clozax train --preset small` on 128-token rows into a 12 MiB filesystem: the first
    save cannot fit. The one-line error is all the command prints besides its own lines:
    orbax's unfinished writes into its closed event loop printed 23-75 "Event loop is closed"
    tracebacks and "Task exception was never retrieved" logs (365 lines), 3 of 3 runs."""
    import subprocess
    import sys

    data = tmp_path / "d128"
    prepare(data, corpus="stdlib", vocab_size=1024, seq_len=128, quiet=True)
    disk = tmp_path / "disk"
    how = _small_disk(disk)
    env = {**__import__("os").environ, "CLOZAX_COMPILATION_CACHE": "off"}
    try:
        ran = subprocess.run(
            [sys.executable, "-m", "clozax.app.cli", "train", "--data", str(data), "--out",
             str(disk / "run"), "--preset", "small", "--steps", "20",
             "--set", "train.save_every=5"], capture_output=True, text=True, env=env,
            timeout=600, preexec_fn=how.get("preexec_fn"))
    finally:
        if how["mounted"]:
            subprocess.run(["umount", str(disk)], capture_output=True)
    assert ran.returncode == 2, ran.stderr[-3000:]
    errors = [line for line in ran.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "could not save the checkpoint at step 5" in errors[0]
    for echo in ("Traceback", "Event loop is closed", "never retrieved", "ERROR:"):
        assert echo not in ran.stdout + ran.stderr, (how["mounted"], ran.stderr[-3000:])
    ours = ("clozax train:", "effective batch", "no MFU", "compiled and ran", "error:")
    stray = [line for line in ran.stderr.splitlines()
             if line.strip() and not line.startswith(ours)]
    assert len(stray) <= 2, stray  # the header's wrapped continuation lines only


def test_only_a_failed_saves_echoes_are_silenced(monkeypatch, caplog):
    """The closed loop's RuntimeError and asyncio's unretrieved orbax write go; another
    unraisable exception and another never-retrieved task still reach their hook and log."""
    import logging
    import sys
    import types

    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(str(u.exc_value)))
    monkeypatch.setattr(ckpt, "_echoes_silenced", False)
    asyncio_log = logging.getLogger("asyncio")
    monkeypatch.setattr(asyncio_log, "filters", [])
    ckpt._silence_failed_save_echoes()

    def unraisable(e):
        return types.SimpleNamespace(exc_type=type(e), exc_value=e, exc_traceback=None,
                                     err_msg=None, object=None)

    sys.unraisablehook(unraisable(RuntimeError("Event loop is closed")))
    sys.unraisablehook(unraisable(ValueError("something else")))
    assert seen == ["something else"]
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        asyncio_log.error("Future exception was never retrieved\nfuture: <Future "
                          "exception=ValueError('.../5.orbax-checkpoint-tmp/...')>")
        asyncio_log.error("Task exception was never retrieved\nfuture: <Task coro=<mine()>>")
    assert [r.getMessage().split("\n")[1] for r in caplog.records] == [
        "future: <Task coro=<mine()>>"]


def test_a_failed_save_names_its_real_cause_not_the_disk(tiny_run_copy, monkeypatch):
    message = _save_failing_with(PermissionError(13, "Permission denied"), tiny_run_copy,
                                 monkeypatch)
    assert "Permission denied (EACCES)" in message and "free disk space" not in message
    assert "fix the cause" in message and "step 6) is intact" in message


def test_a_failing_metric_writer_does_not_hide_the_error_that_stopped_training(
        stdlib_data, tmp_path, monkeypatch):
    from clozax.train.observe import TrainLog

    def broken_close(self):
        raise OSError(28, "No space left on device (tensorboard)")

    monkeypatch.setattr(TrainLog, "stop", broken_close)
    cfg = _cfg("optim.learning_rate=1e39", "optim.warmup_steps=0")
    with pytest.raises(train_lib.TrainingDiverged):
        train_lib.train(stdlib_data, tmp_path / "run", cfg)


def test_a_corrupt_newest_checkpoint_falls_back_and_the_run_still_ends_bitwise_equal(
        stdlib_data, tiny_run, tmp_path):
    out = tmp_path / "run"
    cfg = _cfg("train.save_every=1")
    train_lib.train(stdlib_data, out, cfg, stop_after=4)
    assert ckpt.Checkpointer(out).all_steps() == [2, 3, 4]
    biggest = max((p for p in (out / "checkpoints" / "4").rglob("*") if p.is_file()),
                  key=lambda p: p.stat().st_size)
    data = bytearray(biggest.read_bytes())
    data[len(data) // 2] ^= 0xFF  # orbax itself would restore this as different numbers
    biggest.write_bytes(bytes(data))
    console = _console()
    result = train_lib.train(stdlib_data, out, cfg, console=console)
    said = console.file.getvalue()
    assert "step 4 is damaged" in said and "falling back to step 3" in said
    assert result.steps == 6
    np.testing.assert_array_equal(_flat(load_run(out).params), _flat(load_run(tiny_run).params))


def _console():
    """A console whose output the test can read (``.file.getvalue()``)."""
    return Console(file=io.StringIO(), width=400, highlight=False)


def test_a_missing_or_truncated_eval_mask_file_is_rebuilt_with_the_recorded_hash(
        tiny_run_copy, stdlib_data):
    recorded = json.loads((tiny_run_copy / heldout.EVAL_MASKS_META).read_text())["sha256"]
    npz = tiny_run_copy / heldout.EVAL_MASKS_FILE
    for damage in (lambda: npz.unlink(),  # killed before the file was renamed into place
                   lambda: npz.write_bytes(npz.read_bytes()[:100])):  # a truncated copy
        damage()
        console = _console()
        train_lib.train(stdlib_data, tiny_run_copy, _cfg(), console=console)
        masks, meta = heldout.load_eval_masks(tiny_run_copy)
        assert meta["sha256"] == heldout.eval_masks_sha256(masks) == recorded
        assert "rebuilt it from eval seed" in console.file.getvalue()
    (tiny_run_copy / heldout.EVAL_MASKS_META).unlink()  # the readable copy is rewritten
    train_lib.train(stdlib_data, tiny_run_copy, _cfg())
    assert json.loads((tiny_run_copy / heldout.EVAL_MASKS_META).read_text())["sha256"] == recorded


# --------------------------------------------------------------------------- resume paths


def test_an_init_from_run_resumes_with_the_same_command(tiny_run, stdlib_data, tmp_path, capsys):
    # The command names no preset: the default (small) is not what --init-from adopted (tiny).
    command = ["train", "--data", str(stdlib_data), "--out", str(tmp_path / "continued"),
               "--init-from", str(tiny_run), "--steps", "2", "--set", "train.batch_size=8",
               "--set", "train.eval_rows=16", "--set", "optim.warmup_steps=1"]
    main(command)
    first = capsys.readouterr()
    assert "trained 2 steps" in first.out
    # it says, and records, which MLM head it trains: the source's (a bare import: fresh)
    assert "starting from its encoder and its MLM head" in " ".join((first.out + first.err).split())
    assert json.loads((tmp_path / "continued" / "run.json").read_text())["init_mlm_head"] == \
        "source"
    main(command)  # the same command again: the run's own model section, so it resumes
    assert "already has its 2 steps: nothing trained" in " ".join(capsys.readouterr().out.split())
    assert load_run(tmp_path / "continued").config.model.hidden == 32


def test_extend_to_continues_a_finished_run_with_a_recorded_schedule(
        tiny_run, stdlib_data, tmp_path):
    runs = []
    for name in ("a", "b"):
        out = tmp_path / name
        shutil.copytree(tiny_run, out)
        train_lib.train(stdlib_data, out, _cfg(), extend_to=9)
        runs.append(load_run(out))
    assert runs[0].step == 9 and runs[0].config.train.steps == 9
    assert runs[0].config.train.extended_from == (6,)
    np.testing.assert_array_equal(_flat(runs[0].params), _flat(runs[1].params))
    state, _ = ckpt.Checkpointer(tmp_path / "a").restore(9, abstract_state(runs[0].config))
    assert int(adam_state(state.opt_state).count) == 9  # AdamW's moments carried on, not reset
    assert int(state.opt_state[-1].total_steps) == 9  # the schedule re-created for 9 steps
    result = train_lib.train(stdlib_data, tmp_path / "a", _cfg(), extend_to=9)  # same command
    assert result.steps == 9
    with pytest.raises(ValueError, match="has not finished .step 4 of 6"):
        unfinished = tmp_path / "unfinished"
        train_lib.train(stdlib_data, unfinished, _cfg("train.save_every=2"), stop_after=4)
        train_lib.train(stdlib_data, unfinished, _cfg(), extend_to=9)


def test_a_run_configured_for_cudnn_loads_evaluates_and_fills_on_a_cpu(tiny_run_copy):
    config = json.loads((tiny_run_copy / "config.json").read_text())
    config["model"].update(attention="cudnn", compute_dtype="bfloat16")
    (tiny_run_copy / "config.json").write_text(json.dumps(config))
    assert load_run(tiny_run_copy).config.model.attention == "auto"
    result = evaluate_run(tiny_run_copy, failures=2)
    assert 0 <= result["trained"]["accuracy"] <= 1
    assert len(fill(tiny_run_copy, "return the [MASK] of it", top_k=3)[0]["predictions"]) == 3


# --------------------------------------------------------------------------- config values


@pytest.mark.fast
@pytest.mark.parametrize(("override", "message"), [
    ("train.batch_size=true", "train.batch_size=True is not a whole number"),
    ("optim.learning_rate=inf", "optim.learning_rate=inf is not a finite number"),
    ("optim.warmup_steps=1.5", "optim.warmup_steps=1.5 is not a whole number"),
    ("train.seed=99999999999999999999", r"train.seed=99999999999999999999 must be in \[0, "),
    ("train.seed=4294967296", r"must be in \[0, 4294967295\]"),
    ("masking.rate=nan", "masking.rate=nan is not a finite number"),
    ("optim.b2=1", r"optim.b2=1 is outside \[0, 1\)"),
])
def test_nonsense_config_values_are_one_line_errors(override, message, stdlib_data, tmp_path,
                                                    capsys):
    with pytest.raises(ValueError, match=message):
        config_lib.resolve(overrides=[override])
    err = one_line_error(capsys, "train", "--data", stdlib_data, "--out", tmp_path / "r",
                         "--set", override)
    assert override.split("=")[0] in err


# --------------------------------------------------------------------------- display


def test_different_token_ids_never_display_alike(tiny_run):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tiny_run / "tokenizer.json"))
    shown = [token_piece(tokenizer, i) for i in range(tokenizer.get_vocab_size())]
    assert len(set(shown)) == len(shown)
    decoded = {}
    for i in range(tokenizer.get_vocab_size()):
        decoded.setdefault(tokenizer.decode([i]).strip(), []).append(i)
    alike = next(ids for text, ids in decoded.items() if text and len(ids) > 1)
    assert len({token_piece(tokenizer, i) for i in alike}) == len(alike)  # e.g. ▁a and a
