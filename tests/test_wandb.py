"""Weights & Biases beside TensorBoard (``train/wandb_log.py``), in offline mode only: nothing
here reaches the network. A run's W&B files are read back from W&B's transaction log
(``RUN/wandb/offline-run-*/run-ID.wandb``: a LevelDB-format log of ``Record`` protos; wandb
0.30 dropped its Python reader of it, ``DataStore``, so the framing is read here and every
record is decoded by wandb's own ``wandb_internal_pb2.Record``)."""

from __future__ import annotations

import json
import struct
import sys
import zlib
from pathlib import Path

import pytest

from clozax.train import config as config_lib
from clozax.train import wandb_log
from conftest import TINY_OVERRIDES

BLOCK, HEADER = 32768, 7  # the LevelDB log's block and record-header sizes
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _offline_env(mp: pytest.MonkeyPatch, home: Path) -> None:
    """W&B offline, silent, and writing nothing outside ``home`` (its settings and caches)."""
    for name, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true",
                        "WANDB_ERROR_REPORTING": "false"}.items():
        mp.setenv(name, value)
    for name in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR",
                 "WANDB_ARTIFACT_DIR"):
        mp.setenv(name, str(home / name.lower()))
    mp.delenv("WANDB_API_KEY", raising=False)


def _records(path: Path) -> list:
    """Every ``Record`` of a ``.wandb`` transaction log, in order (checksums verified)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:HEADER] == struct.pack("<4sHB", b":W&B", 0xBEE1, 0), "not a W&B log"
    seed = {kind: zlib.crc32(bytes([kind])) for kind in (FULL, FIRST, MIDDLE, LAST)}
    out, pending, i = [], b"", HEADER
    while i + HEADER <= len(data):
        if BLOCK - i % BLOCK < HEADER:  # a block's zero trailer
            i += BLOCK - i % BLOCK
            continue
        checksum, length, kind = struct.unpack_from("<IHB", data, i)
        body = data[i + HEADER:i + HEADER + length]
        i += HEADER + length
        assert checksum == zlib.crc32(body, seed[kind]), f"bad checksum in {path}"
        pending += body
        if kind in (FULL, LAST):
            out.append(wandb_internal_pb2.Record.FromString(pending))
            pending = b""
    return out


def _read_run(run_dir: Path) -> list[dict]:
    """Each offline W&B run of ``run_dir`` (one per ``clozax train``), oldest first: its id,
    name, project, config and ``{step: {key: value}}`` history (W&B's own ``_*`` keys left
    out), from its transaction log."""
    import wandb

    wandb.teardown()  # ``finish`` returns before W&B's service has closed the file
    runs = []
    for folder in sorted((run_dir / "wandb").glob("offline-run-*")):
        (log,) = folder.glob("run-*.wandb")
        run = {"history": {}, "config": {}}
        for record in _records(log):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run.update(id=record.run.run_id, name=record.run.display_name,
                           project=record.run.project)
                run["config"].update({c.key: json.loads(c.value_json)
                                      for c in record.run.config.update})
            elif kind == "config":
                run["config"].update({c.key: json.loads(c.value_json)
                                      for c in record.config.update})
            elif kind == "history":
                items = {"/".join(h.nested_key) or h.key: json.loads(h.value_json)
                         for h in record.history.item}
                step = items.pop("_step")
                run["history"][step] = {k: v for k, v in items.items() if not k.startswith("_")}
        runs.append(run)
    return runs


@pytest.fixture(scope="module")
def wandb_run(stdlib_data, tmp_path_factory) -> Path:
    """A tiny run trained with ``train.wandb_project`` in offline mode."""
    pytest.importorskip("wandb")
    from clozax.train import loop as train_lib

    out = tmp_path_factory.mktemp("wandb") / "tiny-wandb"
    cfg = config_lib.resolve(preset="tiny",
                             overrides=[*TINY_OVERRIDES, "train.wandb_project=clozax-test"])
    with pytest.MonkeyPatch.context() as mp:
        _offline_env(mp, out.parent)
        train_lib.train(stdlib_data, out, cfg)
    return out


def test_wandb_offline_run_files_carry_the_logged_scalars_config_and_name(wandb_run):
    """W&B offline files carry the logged scalars: each logged step's ``train/*`` and ``eval/*``
    equal metrics.jsonl's (TensorBoard's tags); the config is the run's config.json, the name
    the run directory's, the id the one recorded in the run directory."""
    records = [json.loads(x) for x in (wandb_run / "metrics.jsonl").read_text().splitlines()]
    (run,) = _read_run(wandb_run)
    assert sorted(run["history"]) == [r["step"] for r in records] == [3, 6]
    for r in records:
        row = run["history"][r["step"]]
        for key in ("loss", "lr", "grad_norm", "tokens_per_s", "data_wait_share"):
            if key in r:
                assert row[f"train/{key}"] == r[key], (r["step"], key)
        for key in ("loss", "accuracy", "top5_accuracy", "perplexity", "count"):
            assert row[f"eval/{key}"] == r["eval"][key], (r["step"], key)
        assert "eval/rows" not in row and "eval/by_kind" not in row  # as TensorBoard's tags
    saved = json.loads((wandb_run / "config.json").read_text())
    assert {k: run["config"][k] for k in saved} == saved
    assert saved["train"]["wandb_project"] == "clozax-test"
    assert run["project"] == "clozax-test" and run["name"] == "tiny-wandb"
    assert run["id"] == (wandb_run / wandb_log.ID_FILE).read_text().strip()


def _log_once(run_dir: Path, config, step: int, enabled: bool = True) -> None:
    """One ``clozax train`` process's worth of TrainLog: start, one metrics line, stop."""
    from clozax.train.observe import TrainLog

    log = TrainLog(run_dir, enabled=enabled, config=config)
    log.start(total=6, completed=step - 3)
    log.metrics({"step": step, "tokens": 512 * step, "loss": 7.0 - step / 10, "lr": 1e-3,
                 "elapsed_s": 1.0})
    log.stop()


def test_a_resumed_run_continues_the_same_wandb_run(monkeypatch, tmp_path):
    """The W&B id is recorded in the run directory the first time and read back by every
    later process of the run (a resume), so each one logs to the same W&B run; a new run
    directory (or the same path later) gets another id."""
    pytest.importorskip("wandb")
    _offline_env(monkeypatch, tmp_path)
    cfg = config_lib.RunConfig(train=config_lib.TrainConfig(wandb_project="clozax-test"))
    run_dir = tmp_path / "run"
    _log_once(run_dir, cfg, 3)
    recorded = (run_dir / wandb_log.ID_FILE).read_text().strip()
    _log_once(run_dir, cfg, 6)  # resumed
    runs = _read_run(run_dir)
    assert [run["id"] for run in runs] == [recorded, recorded]
    assert [sorted(run["history"]) for run in runs] == [[3], [6]]
    assert runs[1]["history"][6] == {"train/loss": 6.4, "train/lr": 1e-3}
    assert runs[0]["config"]["train"] == json.loads(cfg.to_json())["train"]  # no config.json
    assert wandb_log.run_id(run_dir) == recorded
    other = wandb_log.run_id(tmp_path / "other")
    assert wandb_log.run_id(tmp_path / "other") == other != recorded
    assert wandb_log.new_id(run_dir, 1) != wandb_log.new_id(run_dir, 2)
    assert wandb_log.new_id(tmp_path / "a", 1) != wandb_log.new_id(tmp_path / "b", 1)


def test_only_the_reporting_process_needs_or_starts_wandb(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "wandb", None)  # ``import wandb`` raises ImportError
    cfg = config_lib.RunConfig(train=config_lib.TrainConfig(wandb_project="clozax-test"))
    _log_once(tmp_path / "run", cfg, 3, enabled=False)  # process 1 of a job: nothing at all
    assert not (tmp_path / "run").exists()


def test_wandb_project_without_wandb_installed_fails_in_one_line(stdlib_data, tmp_path,
                                                                  monkeypatch, capsys):
    from clozax.app.cli import main
    from clozax.train import loop as train_lib

    monkeypatch.setitem(sys.modules, "wandb", None)  # ``import wandb`` raises ImportError
    out = tmp_path / "run"
    cfg = config_lib.resolve(preset="tiny", overrides=["train.wandb_project=clozax-test"])
    with pytest.raises(ValueError) as refused:
        train_lib.train(stdlib_data, out, cfg)
    assert str(refused.value) == wandb_log.MISSING
    with pytest.raises(SystemExit) as stopped:
        main(["train", "--data", str(stdlib_data), "--out", str(out), "--preset", "tiny",
              "--steps", "2", "--set", "train.wandb_project=clozax-test"])
    assert stopped.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == f"error: {wandb_log.MISSING}"  # its brackets are text, not rich markup
    assert not out.exists()  # refused before anything was written


@pytest.mark.fast
@pytest.mark.parametrize("name", ["", "two words", "team/project", "tab\t", 7])
def test_wandb_project_must_be_a_name(name):
    with pytest.raises(ValueError, match="train.wandb_project=.* is not a name"):
        config_lib.TrainConfig(wandb_project=name)


def test_wandb_mode_is_the_users_else_online_with_an_api_key_else_offline(monkeypatch,
                                                                          tmp_path):
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_BASE_URL", raising=False)
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_log.mode() == "disabled"
    monkeypatch.delenv("WANDB_MODE")
    assert wandb_log.mode() == "offline"  # no netrc file, no key
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password k3y\n")
    assert wandb_log.mode() == "online"
    (tmp_path / "netrc").write_text("machine example.com login user password k3y\n")
    assert wandb_log.mode() == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "k3y")
    assert wandb_log.mode() == "online"
