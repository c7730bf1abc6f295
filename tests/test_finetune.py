"""clozax finetune: every task kind learns, seeds repeat bitwise, a protocol resumes after a
job's commit, exports are transformers' classes with its logits, bad input is one line."""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

from clozax.app.cli import main
from clozax.core import locks
from clozax.core import model_config as model_config_lib
from clozax.core.train_state import init_params
from clozax.data.tokenizer import load_tokenizer
from clozax.judge.finetune import glue, heads, tasks
from clozax.judge.finetune import jobs as jobs_lib
from clozax.judge.finetune import protocol as ft
from clozax.judge.finetune import saved as finetuned
from clozax.judge.finetune.predict import logits_of, predict_file
from clozax.train.run_dir import load_run
from commands import clozax

# Keywords and filler that are one piece each in the tiny run's 1,024-entry vocabulary.
KEYWORDS = {"socket": "net", "thread": "task", "error": "fault"}
FILLER = ["the", "returns", "a", "of", "values", "for", "each", "and", "is", "set", "to",
          "when", "with", "an", "in", "on", "by", "file", "path", "name", "data", "list"]
FAST = ft.Protocol(learning_rates=(5e-3,), seeds=1, epochs=12, batch_size=16, control=False)


def _sentence(rng: random.Random, keyword: str | None, n: int = 8) -> list[str]:
    words = [rng.choice(FILLER) for _ in range(n)]
    if keyword is not None:
        words[rng.randrange(n)] = keyword
    return words


def _write_jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _classification(path: Path, n: int = 360, seed: int = 0) -> Path:
    rng = random.Random(seed)
    records = []
    for i in range(n):
        word = list(KEYWORDS)[i % 3]
        records.append({"text": " ".join(_sentence(rng, word)), "label": KEYWORDS[word]})
    return _write_jsonl(path, records)


def _pair(path: Path, n: int = 360) -> Path:
    rng = random.Random(1)
    records = []
    for i in range(n):
        word = list(KEYWORDS)[i % 3]
        records.append({"text": " ".join(_sentence(rng, None)),
                        "text_pair": " ".join(_sentence(rng, word)), "label": KEYWORDS[word]})
    return _write_jsonl(path, records)


def _regression(path: Path, n: int = 360) -> Path:
    rng = random.Random(2)
    records = []
    for _ in range(n):
        count = rng.randrange(4)
        words = _sentence(rng, None)
        for k in range(count):
            words[k * 2] = "socket"
        records.append({"text": " ".join(words), "label": float(count)})
    return _write_jsonl(path, records)


def _tokens(path: Path, n: int = 300) -> Path:
    rng = random.Random(3)
    records = []
    for _ in range(n):
        words = _sentence(rng, rng.choice([None, *KEYWORDS]))
        words[rng.randrange(len(words))] = rng.choice(list(KEYWORDS))
        tags = [f"B-{KEYWORDS[w].upper()}" if w in KEYWORDS else "O" for w in words]
        records.append({"tokens": words, "tags": tags})
    return _write_jsonl(path, records)


@pytest.fixture(scope="module")
def task_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("tasks")
    return {"classification": _classification(d / "cls.jsonl"), "pair": _pair(d / "pair.jsonl"),
            "regression": _regression(d / "reg.jsonl"), "tokens": _tokens(d / "tok.jsonl")}


@pytest.fixture(scope="module")
def finetuned_runs(tiny_run, task_files, tmp_path_factory):
    """Each kind fine-tuned once on a copy of the tiny run (the result of every kind)."""
    import shutil

    run = tmp_path_factory.mktemp("ft") / "run"
    shutil.copytree(tiny_run, run)
    results = {}
    for kind, path in task_files.items():
        results[kind] = ft.finetune_run(run, ft.TaskSpec(train=path, kind=kind), FAST,
                                        say=lambda _: None, progress=False)
    return run, results


# --------------------------------------------------------------------------- learning


@pytest.mark.parametrize("kind", tasks.KINDS)
def test_each_task_kind_learns_beyond_a_constant_predictor(finetuned_runs, kind):
    run, results = finetuned_runs
    result = results[kind]
    metric = result["task"]["metric"]
    got = result["encoders"]["trained"]["selected"]["test"][metric]["mean"]
    constant = result["constant_baseline"]["test"][metric]
    margin = {"classification": 0.3, "pair": 0.3, "regression": 0.5, "tokens": 0.5}[kind]
    assert got > constant + margin, (kind, got, constant)
    assert (run / "finetune" / result["task"]["name"] / "model" / "finetuned.json").is_file()
    if kind in ("classification", "pair"):
        assert "tfidf" in result and result["tfidf"]["test"]["accuracy"] > constant


def test_seeds_repeat_bitwise_and_differ_between_seeds(tiny_run, task_files):
    run = load_run(tiny_run)
    tok = load_tokenizer(run.tokenizer_path)
    task = ft.load_task(ft.TaskSpec(train=task_files["classification"]), run, tok)
    protocol = ft.Protocol(learning_rates=(1e-3,), seeds=1, epochs=1, batch_size=16)
    setup = jobs_lib.make_setup(run.config.model, task, protocol, run.specials["pad"], 64)
    runs = [jobs_lib.run_job(setup, task, run.params, 1e-3, seed)[1] for seed in (0, 0, 1)]
    flat = [np.concatenate([np.ravel(x) for x in jax.tree.leaves(p)]) for p in runs]
    assert np.array_equal(flat[0], flat[1])
    assert not np.array_equal(flat[0], flat[2])


def test_max_len_cuts_each_text_to_fit_counts_the_cuts_and_keys_the_jobs_apart(
        tiny_run, task_files):
    run = load_run(tiny_run)
    tok = load_tokenizer(run.tokenizer_path)
    full = ft.load_task(ft.TaskSpec(train=task_files["classification"]), run, tok)
    cut = ft.load_task(ft.TaskSpec(train=task_files["classification"], max_len=8), run, tok)
    assert full.accounting["seq_len"] == run.trained_length and cut.accounting["seq_len"] == 8
    for name, split in cut.splits.items():
        longer = sum(len(x) > 8 for x in full.splits[name].ids)
        assert longer > 0 and cut.accounting["truncated_to_seq_len"][name] == longer
        for short, whole in zip(split.ids, full.splits[name].ids, strict=True):
            assert len(short) == min(len(whole), 8)  # [CLS], the text's first tokens, [SEP]
            assert list(short[:-1]) == list(whole[: len(short) - 1]) and short[-1] == whole[-1]
    assert ft.job_settings(run, cut, FAST) != ft.job_settings(run, full, FAST)


def test_a_cap_above_the_training_split_keys_the_same_jobs_as_none_and_a_binding_cap_does_not(
        tiny_run, task_files):
    run = load_run(tiny_run)
    task = ft.load_task(ft.TaskSpec(train=task_files["classification"]), run,
                        load_tokenizer(run.tokenizer_path))
    n = len(task.splits["train"])
    settings = {cap: ft.job_settings(run, ft.cap_train(task, cap, 0),
                                     dataclasses.replace(FAST, max_train_examples=cap))
                for cap in (None, n, n + 100, n - 1)}
    assert settings[None] == settings[n] == settings[n + 100]
    assert settings[n - 1] != settings[None]
    assert settings[n - 1]["protocol"]["max_train_examples"] == n - 1
    assert "train_capped_to" not in task.accounting  # the task capped is a copy


def test_layer_decay_scales_each_layers_step_by_its_depth_and_1_is_the_plain_step(
        tiny_run, task_files):
    run = load_run(tiny_run)
    task = ft.load_task(ft.TaskSpec(train=task_files["classification"]), run,
                        load_tokenizer(run.tokenizer_path))
    b = jobs_lib.arrays(task.splits["train"], np.arange(16), 16, task.kind, run.specials["pad"],
                        64)

    setup = jobs_lib.make_setup(run.config.model, task, ft.Protocol(
        learning_rates=(1e-3,), seeds=1, epochs=1, batch_size=16), run.specials["pad"], 64)
    start = jobs_lib.initial_params(setup, run.params, 0)

    def one_step(decay):  # the step's parameter change from the same start, batch and key
        after = setup.step_fn(jax.tree.map(np.array, start), setup.optimizer.init(start), b,
                              jax.random.key(1), np.float32(1e-3), np.float32(decay))[0]
        return jax.tree.map(lambda a, s: np.asarray(a) - np.asarray(s), after, start)

    plain, half = one_step(1.0), one_step(0.5)
    L = run.config.model.layers  # 2: layers 0 and 1 at 0.5^2 and 0.5^1, embeddings at 0.5^3
    for i in range(L):
        for d, p in zip(jax.tree.leaves(half["encoder"]["layers"]),
                        jax.tree.leaves(plain["encoder"]["layers"]), strict=True):
            np.testing.assert_allclose(d[i], p[i] * 0.5 ** (L - i), rtol=1e-3, atol=1e-6)
    for d, p in zip(jax.tree.leaves(half["encoder"]["embeddings"]),
                    jax.tree.leaves(plain["encoder"]["embeddings"]), strict=True):
        np.testing.assert_allclose(d, p * 0.5 ** (L + 1), rtol=1e-3, atol=1e-6)
    for d, p in zip(jax.tree.leaves(half["head"]), jax.tree.leaves(plain["head"]), strict=True):
        np.testing.assert_allclose(d, p, rtol=1e-3, atol=1e-6)  # the task head: the full rate
    assert any(np.abs(x).max() > 0 for x in jax.tree.leaves(plain["encoder"]["layers"]))
    # decay 1: every factor exactly 1, so lr x 1 x update is the undecayed step, bitwise
    assert all(np.all(np.asarray(r) == 1) for r in jax.tree.leaves(
        jobs_lib.layer_rates(start, L, np.float32(1.0))))


def test_a_protocol_killed_after_a_job_commit_resumes_to_the_same_result(
        tiny_run_copy, task_files, monkeypatch):
    spec = ft.TaskSpec(train=task_files["classification"], name="resume")
    protocol = ft.Protocol(learning_rates=(1e-3, 3e-3), seeds=2, epochs=1, batch_size=16)
    real, calls = jobs_lib.run_job, []

    def dies_on_the_third(*args, **kwargs):
        calls.append(args[3:5])
        if len(calls) == 3:
            raise KeyboardInterrupt  # as a kill between two jobs leaves the directory
        return real(*args, **kwargs)

    monkeypatch.setattr(jobs_lib, "run_job", dies_on_the_third)
    with pytest.raises(KeyboardInterrupt):
        ft.finetune_run(tiny_run_copy, spec, protocol, say=lambda _: None, progress=False)
    monkeypatch.setattr(jobs_lib, "run_job", real)
    said = []
    resumed = ft.finetune_run(tiny_run_copy, spec, protocol, say=said.append, progress=False)
    assert any("2 of 8 jobs already done" in s for s in said), said
    fresh = ft.finetune_run(tiny_run_copy, ft.TaskSpec(train=task_files["classification"],
                                                       name="fresh"), protocol,
                            say=lambda _: None, progress=False)

    assert _without_seconds(resumed) == _without_seconds(fresh)
    # One writer: a second protocol on the same task while one holds it is refused.
    out = tiny_run_copy / "finetune" / "resume"
    with locks.hold(out, "test"), pytest.raises(locks.Locked, match="is being written"):
        ft.finetune_run(tiny_run_copy, spec, protocol, say=lambda _: None, progress=False)


def test_a_signal_stops_finetune_between_jobs_keeping_the_finished_ones(
        tiny_run_copy, task_files, monkeypatch, capsys):
    import os
    import signal

    real = jobs_lib.run_job

    def sigterm_during_the_first_job(*args, **kwargs):
        if not hasattr(sigterm_during_the_first_job, "sent"):
            sigterm_during_the_first_job.sent = os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)

    monkeypatch.setattr(jobs_lib, "run_job", sigterm_during_the_first_job)
    argv = ["finetune", str(tiny_run_copy), "--task", str(task_files["classification"]),
            "--lr", "3e-3", "--seeds", "2", "--epochs", "1", "--no-control"]
    ran = clozax(capsys, *argv)
    assert ran.code == 143, ran.err
    assert "stopped by SIGTERM: 1 of 2 pending jobs ran and are kept" in " ".join(
        ran.err.split())
    jobs = tiny_run_copy / "finetune" / "cls" / "jobs"
    assert len(list(jobs.glob("*/trained-*.json"))) == 1
    assert not (tiny_run_copy / "finetune" / "cls" / "result.json").exists()
    monkeypatch.setattr(jobs_lib, "run_job", real)
    again = clozax(capsys, *argv)
    assert again.code == 0 and "1 of 2 jobs already done" in again.out + again.err


def _without_seconds(result: dict) -> str:
    def strip(x):
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if "seconds" not in k}
        if isinstance(x, list):
            return [strip(v) for v in x]
        return x

    return json.dumps(strip(result["encoders"]), sort_keys=True)


# --------------------------------------------------------------------------- metrics, tasks


@pytest.mark.fast
def test_a_diverging_rate_is_a_result_and_the_grid_goes_on(tiny_run_copy, task_files,
                                                           monkeypatch):
    # The step reports a non-finite loss at the rate 0.5 only (as a too-high rate does).
    made = jobs_lib.make_setup

    def make_setup(*args, **kwargs):
        setup = made(*args, **kwargs)

        def step_fn(params, opt_state, batch, key, rate, decay):
            params, opt_state, s, n = setup.step_fn(params, opt_state, batch, key, rate, decay)
            return params, opt_state, s * np.nan if float(rate) == 0.5 else s, n

        return dataclasses.replace(setup, step_fn=step_fn)

    monkeypatch.setattr(jobs_lib, "make_setup", make_setup)
    grid = ft.Protocol(learning_rates=(5e-3, 0.5), seeds=2, epochs=2, batch_size=16,
                       control=False)
    said = []
    result = ft.finetune_run(tiny_run_copy, ft.TaskSpec(train=task_files["classification"]),
                             grid, say=said.append, progress=False)
    trained = result["encoders"]["trained"]
    assert [d["learning_rate"] for d in trained["diverged"]] == [0.5]
    seeds = trained["diverged"][0]["seeds"]  # each seed stopped at its first epoch's end
    assert set(seeds) == {"0", "1"} and all(v["epoch"] == 1 and v["step"] > 0
                                            for v in seeds.values())
    assert trained["selected"]["learning_rate"] == 5e-3
    assert [s["learning_rate"] for s in trained["settings"]] == [5e-3]
    assert sum("diverged at step" in line for line in said) == 2
    with pytest.raises(ValueError, match=r"diverged at every learning rate \(0.5\); pass lower"):
        ft.finetune_run(tiny_run_copy, ft.TaskSpec(train=task_files["classification"]),
                        dataclasses.replace(grid, learning_rates=(0.5,)), say=said.append,
                        progress=False)


def test_a_rerun_of_the_same_protocol_rewrites_no_job_file(tiny_run_copy, task_files):
    """Anything that watches the job directory sees a change only where there is one: the
    same command again leaves every file of ``jobs/`` as it was (inode and modification time);
    ``settings.json`` was rewritten on every rerun."""
    spec = ft.TaskSpec(train=task_files["classification"], name="watched")
    protocol = ft.Protocol(learning_rates=(1e-3,), seeds=1, epochs=1, batch_size=16,
                           control=False)
    ft.finetune_run(tiny_run_copy, spec, protocol, say=lambda _: None, progress=False)
    jobs = tiny_run_copy / "finetune" / "watched" / "jobs"

    def stats():
        return {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in jobs.rglob("*")
                if p.is_file()}

    before = stats()
    assert any(p.name == "settings.json" for p in before)
    ft.finetune_run(tiny_run_copy, spec, protocol, say=lambda _: None, progress=False)
    assert stats() == before


def test_a_rerun_trains_only_new_jobs_and_model_is_always_the_job_result_names(
        tiny_run_copy, task_files, monkeypatch):
    real, trained = jobs_lib.run_job, []

    def counted(*args, **kwargs):
        trained.append((args[3], kwargs.get("decay", 1.0), args[4], kwargs.get("until_epoch")))
        return real(*args, **kwargs)

    monkeypatch.setattr(jobs_lib, "run_job", counted)
    spec = ft.TaskSpec(train=task_files["classification"], name="grid")
    one = ft.Protocol(learning_rates=(1e-3,), seeds=2, epochs=2, batch_size=16, control=False)
    ft.finetune_run(tiny_run_copy, spec, one, say=lambda _: None, progress=False)
    assert [t for t in trained if t[3] is None] == [(1e-3, 1.0, 0, None), (1e-3, 1.0, 1, None)]

    def names_its_model(result):
        meta = json.loads((tiny_run_copy / "finetune" / "grid" / "model" /
                           "finetuned.json").read_text())
        sel = result["encoders"]["trained"]["selected"]
        assert meta["job"] == result["model"]
        assert (meta["learning_rate"], meta["layer_decay"], meta["seed"]) == (
            sel["learning_rate"], sel["layer_decay"], sel["best_seed"]["seed"])
        assert meta["metric"] == result["task"]["metric"]
        settings = result["encoders"]["trained"]["settings"]  # the best mean validation
        assert sel == max(settings, key=lambda x: x["validation"]["mean"])
        # result.json holds the chosen setting's test figures alone: none to choose on
        written = json.loads((tiny_run_copy / "finetune" / "grid" / "result.json").read_text())
        assert [("test" in x, x == sel) for x in written["encoders"]["trained"]["settings"]] \
            == [(x == sel,) * 2 for x in settings]

    trained.clear()
    two = dataclasses.replace(one, learning_rates=(1e-3, 3e-3))
    result = ft.finetune_run(tiny_run_copy, spec, two, say=lambda _: None, progress=False)
    assert [t for t in trained if t[3] is None] == [(3e-3, 1.0, 0, None), (3e-3, 1.0, 1, None)]
    names_its_model(result)
    # a layer-decay grid beside the rates: only the new (rate, decay) jobs train, and the
    # setting chosen on validation is one of the four
    trained.clear()
    four = dataclasses.replace(two, layer_decays=(1.0, 0.5))
    result = ft.finetune_run(tiny_run_copy, spec, four, say=lambda _: None, progress=False)
    assert [t for t in trained if t[3] is None] == [(lr, 0.5, seed, None) for lr in (1e-3, 3e-3)
                                                     for seed in (0, 1)]
    assert sorted((x["learning_rate"], x["layer_decay"]) for x in
                  result["encoders"]["trained"]["settings"]) == [
        (1e-3, 0.5), (1e-3, 1.0), (3e-3, 0.5), (3e-3, 1.0)]
    assert (tiny_run_copy / "finetune" / "grid" / "jobs" / result["model"]["jobs"] /
            "trained-lr0.003-ld0.5-seed1.json").is_file()
    names_its_model(result)
    # another metric re-selects from the recorded jobs: nothing trains but (at most) the
    # selected job, re-run to its kept epoch for model/
    trained.clear()
    other = ft.finetune_run(tiny_run_copy, dataclasses.replace(spec, metric="matthews"), two,
                            say=lambda _: None, progress=False)
    assert all(t[3] is not None for t in trained) and len(trained) <= 1
    names_its_model(other)


def test_the_selected_model_is_its_job_kept_not_trained_again_even_across_a_crash(
        tiny_run_copy, task_files, monkeypatch):
    real, trained = jobs_lib.run_job, []

    def crashing_third(*args, **kwargs):
        trained.append((args[3], args[4], kwargs.get("until_epoch")))
        if len(trained) == 3:
            raise RuntimeError("killed")
        return real(*args, **kwargs)

    monkeypatch.setattr(jobs_lib, "run_job", crashing_third)
    spec = ft.TaskSpec(train=task_files["classification"], name="kept")
    grid = ft.Protocol(learning_rates=(1e-3, 3e-3), seeds=2, epochs=2, batch_size=16,
                       control=False)
    with pytest.raises(RuntimeError, match="killed"):  # after two jobs committed
        ft.finetune_run(tiny_run_copy, spec, grid, say=lambda _: None, progress=False)
    out = tiny_run_copy / "finetune" / "kept"
    monkeypatch.setattr(jobs_lib, "run_job", lambda *a, **k: trained.append(
        (a[3], a[4], k.get("until_epoch"))) or real(*a, **k))
    trained.clear()
    ft.finetune_run(tiny_run_copy, spec, grid, say=lambda _: None, progress=False)
    # the two jobs left ran, and model/ came from the kept candidate: no job re-run for it
    assert trained == [(3e-3, 0, None), (3e-3, 1, None)]
    jobs_dir = next((out / "jobs").iterdir())
    assert not list(jobs_dir.glob("model-lr*"))  # the rate not selected: deleted
    kept = (out / "model" / finetuned.WEIGHTS_FILE).read_bytes()
    meta = json.loads((out / "model" / finetuned.META_FILE).read_text())
    # the same model as re-running the selected job to its kept epoch writes, bit for bit
    shutil.rmtree(out / "model")
    trained.clear()
    result = ft.finetune_run(tiny_run_copy, spec, grid, say=lambda _: None, progress=False)
    assert trained == [(meta["learning_rate"], meta["seed"], meta["job"]["epoch"])]
    assert (out / "model" / finetuned.WEIGHTS_FILE).read_bytes() == kept
    assert json.loads((out / "model" / finetuned.META_FILE).read_text()) == meta
    assert result["model"] == meta["job"]


def test_entity_f1_follows_seqeval():
    # seqeval's documented example: F1 0.50 (one of two entities exactly right).
    gold = [["O", "O", "O", "B-MISC", "I-MISC", "I-MISC", "O"], ["B-PER", "I-PER", "O"]]
    pred = [["O", "O", "B-MISC", "I-MISC", "I-MISC", "I-MISC", "O"], ["B-PER", "I-PER", "O"]]
    assert heads.entity_f1(gold, pred)["entity_f1"] == pytest.approx(0.5)
    # conlleval reading: an I- after O starts a chunk; a change of type ends one.
    assert heads.entities(["O", "I-PER", "I-PER", "I-LOC"]) == {("PER", 1, 2), ("LOC", 3, 3)}


def test_token_labels_go_to_the_first_piece_and_round_trip(tiny_run):
    run = load_run(tiny_run)
    tok = load_tokenizer(run.tokenizer_path)
    words = ["unbelievably", "long", "identifiers"]
    raw = tasks.Raw(words=[words], targets=[["B-X", "O", "B-Y"]], groups=[""], where=["t"])
    split, _ = tasks.encode(tok, raw, "tokens", ["B-X", "B-Y", "O"], run.specials, 64, "train")
    enc = tok.encode(words, is_pretokenized=True, add_special_tokens=False)
    assert len(enc.ids) > len(words)  # some word has several pieces
    y = split.y[0]
    first = [i + 1 for i, w in enumerate(enc.word_ids) if i == 0 or enc.word_ids[i - 1] != w]
    assert [int(y[i]) for i in first] == [0, 2, 1]
    assert sum(int(v) >= 0 for v in y) == 3 and y[0] == y[-1] == tasks.IGNORE


@pytest.mark.fast
def test_every_metric_a_kind_names_is_one_it_scores():
    labels = ["B-X", "O"]
    for kind, names in tasks.METRICS.items():
        y = [np.asarray([0, 1])] * 2 if kind == "tokens" else [0.0, 1.0, 0.0]
        assert set(heads.metrics(kind, y, y, labels)) == set(names), kind
        assert tasks.default_metric(kind, labels) == names[0]
    # F1 of the positive class (GLUE's MRPC/QQP), only where there are two classes
    f1 = heads.metrics("pair", [1, 1, 0, 0, 1], [1, 0, 0, 1, 1], ["0", "1"])["f1"]
    assert f1 == pytest.approx(2 / 3)
    assert "f1" not in heads.metrics("classification", [0, 1, 2], [0, 1, 2], ["a", "b", "c"])


@pytest.mark.fast
def test_a_token_task_without_bio_tags_is_scored_by_accuracy():
    # part of speech: entity F1 reads no chunk in these tags and would pick rates on a 0
    pos = ["ADJ", "DET", "NOUN", "VERB"]
    assert heads.entity_f1([pos], [pos])["entity_f1"] == 0.0
    assert tasks.default_metric("tokens", pos) == "accuracy"
    assert tasks.default_metric("tokens", ["B-PER", "I-PER", "O"]) == "entity_f1"


@pytest.mark.fast
def test_the_learning_rate_grid_follows_the_encoders_width():
    base = model_config_lib.preset("tiny", hidden=768)
    assert jobs_lib.default_learning_rates(base) == (2e-5, 5e-5, 1e-4)  # BERT/ModernBERT's
    assert jobs_lib.default_learning_rates(model_config_lib.preset("tiny")) == \
        jobs_lib.SMALL_LEARNING_RATES


@pytest.mark.fast
def test_each_seed_keeps_its_best_validation_epoch_and_the_best_seed_is_the_model():
    def job(lr, seed, val, test):
        return {"learning_rate": lr, "seed": seed, "seconds": 1.0, "per_epoch": [
            {"validation": {"accuracy": v}, "test": {"accuracy": t}}
            for v, t in zip(val, test, strict=True)]}

    records = [job(1e-3, 0, [0.5, 0.8, 0.7], [0.4, 0.75, 0.6]),
               job(1e-3, 1, [0.9, 0.6, 0.6], [0.85, 0.5, 0.5]),
               job(3e-3, 0, [0.6, 0.6, 0.6], [0.9, 0.9, 0.9]),
               job(3e-3, 1, [0.7, 0.6, 0.6], [0.9, 0.9, 0.9])]
    chosen = ft.summarise(records, "accuracy")["selected"]
    assert chosen["learning_rate"] == 1e-3 and chosen["epochs"] == [2, 1]
    assert chosen["test"]["accuracy"]["per_seed"] == [0.75, 0.85]  # not the last epoch's
    assert chosen["best_seed"] == {"seed": 1, "epoch": 1, "validation": {"accuracy": 0.9}}


@pytest.mark.fast
def test_only_the_setting_chosen_on_validation_carries_test_figures():
    """A setting not chosen keeps its validation figures and no test ones, so ``result.json``
    (``summarise``'s output) offers nothing to choose a setting on test with."""
    def job(lr, decay, seed, val, test):
        return {"learning_rate": lr, "layer_decay": decay, "seed": seed, "seconds": 1.0,
                "per_epoch": [{"validation": {"accuracy": val}, "test": {"accuracy": test}}]}

    records = [job(lr, d, seed, val + 0.01 * seed, 0.95 - val)
               for (lr, d, val) in ((1e-3, 1.0, 0.8), (1e-3, 0.8, 0.6), (3e-3, 1.0, 0.7))
               for seed in (0, 1)]
    summary = ft.summarise(records, "accuracy")
    chosen = summary["selected"]
    assert (chosen["learning_rate"], chosen["layer_decay"]) == (1e-3, 1.0)
    assert chosen["test"]["accuracy"]["per_seed"] == pytest.approx([0.15, 0.15])
    assert [("test" in s, "validation" in s) for s in summary["settings"]] == [
        (True, True), (False, True), (False, True)]  # (1e-3, 1), (1e-3, 0.8), (3e-3, 1)
    assert summary["settings"][0] is chosen
    assert "test" not in json.dumps(summary["settings"][1:])


@pytest.mark.fast
def test_a_difference_over_seeds_is_welchs_interval_and_one_seed_has_none():
    from scipy import stats

    from clozax.judge.claims import difference_words, seed_difference

    a, b = [0.60, 0.62, 0.58, 0.61], [0.30, 0.35, 0.29]
    d = seed_difference(a, b)
    welch = stats.ttest_ind(a, b, equal_var=False).confidence_interval(0.95)
    assert d["interval"] == pytest.approx([welch.low, welch.high]) and d["clear"]
    # against a fixed baseline (TF-IDF): the one-sample interval, shifted
    one = stats.ttest_1samp(a, 0.59).confidence_interval(0.95)
    near = seed_difference(a, 0.59)
    assert near["interval"] == pytest.approx([one.low - 0.59, one.high - 0.59])
    assert not near["clear"] and "not clear" in difference_words(near)
    # once, mean ± 1 std called any one-seed difference "outside the seed spread"
    single = seed_difference([0.9], [0.1])
    assert single["interval"] is None and not single["clear"]
    assert "one seed: no interval" in difference_words(single)
    # a result.json written before intervals (mean ± 1 std) still reads, saying what it lacks
    older = {"metric": "accuracy", "mean": 0.3, "outside_the_seed_spread": True}
    assert difference_words(older) == "+30.0 pp (no interval recorded: rerun clozax finetune " \
                                      "for one)"


@pytest.mark.fast
@pytest.mark.parametrize("a, b, words", [
    ([0.7, 0.7, 0.7], [0.7, 0.7, 0.7], "+0.0 pp (identical on every seed: no spread over seeds, "
                                       "no interval)"),
    ([0.7, 0.7, 0.7], [0.6, 0.6, 0.6], "+10.0 pp (the same on every seed: no spread over seeds, "
                                       "no interval)"),
    ([0.7, 0.7, 0.7], 0.6, "+10.0 pp (the same on every seed: no spread over seeds, no "
                           "interval)")])
def test_seeds_that_all_score_the_same_are_no_interval_and_never_clear(a, b, words):
    """Every seed scoring the same on each side is no spread over seeds, not an exact zero-width
    interval: the difference is said with no interval and is not clear, zero or not — and a
    result written with such a zero-width interval called clear holds no downstream claim."""
    from clozax.judge.claims import difference_words, downstream_claims, seed_difference

    d = seed_difference(a, b)
    assert d["interval"] is None and d["clear"] is False and d["same_on_every_seed"]
    assert difference_words(d) == words
    assert downstream_claims({"trained_minus_random_init": d})[0]["holds"] is False
    older = {"metric": "accuracy", "mean": 0.1, "seeds": [3, 3], "level": 0.95,
             "interval": [0.1, 0.1], "clear": True}
    assert "clear" not in difference_words(older)
    assert downstream_claims({"trained_minus_random_init": older})[0]["holds"] is False


@pytest.mark.fast
def test_the_downstream_claims_hold_only_on_a_clear_positive_difference():
    from clozax.judge.claims import downstream_claims, seed_difference

    result = {"trained_minus_random_init": seed_difference([0.70, 0.69, 0.71], [0.3, 0.2, 0.4]),
              "trained_minus_tfidf": seed_difference([0.70, 0.69, 0.71], 0.72)}
    got = {c["claim"]: c for c in downstream_claims(result)}
    assert got["fine-tuned (built-in task): trained clearly beats its random-init control"][
        "holds"] is True
    below = got["fine-tuned (built-in task): trained clearly beats TF-IDF"]
    assert below["holds"] is False and below["detail"].startswith("-2.0 pp")
    # clearly *below* TF-IDF is clear, but not a win
    worse = downstream_claims({"trained_minus_tfidf": seed_difference([0.5, 0.51, 0.49], 0.72)})
    assert worse[1]["holds"] is False
    # what the demo does not run says so, with the command that measures it
    rest = downstream_claims(None)
    assert [c["holds"] for c in rest] == [None] * 5
    assert all("not run" in c["detail"] for c in rest)


@pytest.mark.fast
def test_a_regression_file_with_the_default_pair_field_keeps_its_second_text(tmp_path):
    records = [{"text": f"a man plays {i}", "text_pair": f"a cat sits {i}", "label": i / 2}
               for i in range(4)]
    raw = tasks.read_file(_write_jsonl(tmp_path / "sts.jsonl", records), "regression",
                          tasks.Fields())
    assert raw.texts[1] == ("a man plays 1", "a cat sits 1")
    single = tasks.read_file(_write_jsonl(tmp_path / "one.jsonl", [
        {"text": "one text", "label": 1.0}]), "regression", tasks.Fields())
    assert single.texts == [("one text",)]


def test_a_word_that_tokenizes_to_nothing_shifts_no_tag(finetuned_runs, tmp_path):
    # A zero-width space, a soft hyphen and a BOM have no piece to read: each gets no tag,
    # and every other word the tag it has without them (once: its neighbour's, and the last
    # word dropped).
    run, results = finetuned_runs
    model_dir = run / "finetune" / results["tokens"]["task"]["name"] / "model"
    words = ["the", "socket", "\u200b", "opens", "\u00ad", "a", "thread", "\ufeff", "now"]
    plain = [w for w in words if w not in ("\u200b", "\u00ad", "\ufeff")]
    tok = load_tokenizer(model_dir / "tokenizer.json")
    assert all(tok.encode([w], is_pretokenized=True, add_special_tokens=False).ids == []
               for w in words if w not in plain)  # the case this test is about
    got, = predict_file(model_dir, _write_jsonl(tmp_path / "in.jsonl", [{"tokens": words}]))
    want, = predict_file(model_dir, _write_jsonl(tmp_path / "plain.jsonl", [{"tokens": plain}]))
    assert [t["word"] for t in got["tokens"]] == words
    assert [t for t in got["tokens"] if t["word"] in plain] == want["tokens"]
    assert all(t["tag"] is None and t["score"] is None
               for t in got["tokens"] if t["word"] not in plain)


def test_predict_at_a_step_reads_that_steps_model(finetuned_runs, task_files, tmp_path, capsys):
    import shutil

    run, results = finetuned_runs
    name = results["classification"]["task"]["name"]
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    # only a fine-tuning of step 3 exists (as `finetune RUN --step 3` makes)
    (copy / "finetune" / name).rename(copy / "finetune" / f"{name}-step3")
    ran = clozax(capsys, "finetune", str(copy), "--task", str(task_files["classification"]),
                 "--step", "3", "--predict", str(task_files["classification"]))
    out = ran.out.splitlines()
    assert ran.code == 0 and len(out) == 360 and "label" in json.loads(out[0]), ran.err


GLUE_LINES = {
    "cola": ("CoLA", None, ["gj04\t1\t\tThe sailors rode the breeze clear of the rocks.",
                            "gj04\t0\t*\tThe more we study verbs, the crazier they get get."]),
    "sst2": ("SST-2", "sentence\tlabel", ["a gorgeous film \t1", "dull and flat \t0"]),
    "mrpc": ("MRPC", "Quality\t#1 ID\t#2 ID\t#1 String\t#2 String",
             ["1\t1\t2\tHe said so .\tHe said that .", "0\t3\t4\tIt rained .\tSun shone ."]),
    "qqp": ("QQP", "id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate",
            ["1\t1\t2\tHow do I cook?\tHow to cook?\t1", "2\t3\t4\tWhy?\tWhere?\t0"]),
    "stsb": ("STS-B", "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\t"
                      "sentence2\tscore",
             ["0\tmain\tf\t2012\t1\tnone\tnone\tA plane takes off.\tAn air plane is taking "
              "off.\t5.000", "1\tmain\tf\t2012\t4\tnone\tnone\tA man plays.\tA cat sits.\t0.5"]),
    "mnli": ("MNLI", "index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\t"
                     "sentence2_binary_parse\tsentence1_parse\tsentence2_parse\tsentence1\t"
                     "sentence2\tlabel1\tgold_label",
             ['0\t1\t1e\tgov\t( a )\t( b )\t(ROOT a)\t(ROOT b)\tConceptually "cream" skimming.'
              '\tProduct and geography.\tneutral\tneutral',
              "1\t2\t2e\tgov\t( c )\t( d )\t(ROOT c)\t(ROOT d)\tYou know.\tYou do.\t"
              "entailment\tentailment"]),
    "qnli": ("QNLI", "index\tquestion\tsentence\tlabel",
             ["0\tWhen?\tIn May.\tentailment", "1\tWho?\tA cat.\tnot_entailment"]),
    "rte": ("RTE", "index\tsentence1\tsentence2\tlabel",
            ["0\tNo weapons.\tWeapons found.\tnot_entailment", "1\tA b.\tA.\tentailment"]),
}


@pytest.mark.fast
def test_glue_layouts_parse(tmp_path):
    for name, (folder, header, lines) in GLUE_LINES.items():
        d = tmp_path / folder
        d.mkdir()
        text = "".join(line + "\n" for line in ([header] if header else []) + lines)
        dev_files = glue.GLUE[name][4]
        for file in ("train.tsv", *((dev_files,) if isinstance(dev_files, str) else dev_files)):
            (d / file).write_text(text)
        train, tests, kind, metric = glue.read_glue(tmp_path, name)
        assert len(train.targets) == len(tests["test"].targets) == 2, name
        # as GLUE scores them: MRPC/QQP by the positive class's F1, MNLI on both dev sets
        assert metric == {"cola": "matthews", "stsb": "pearson_spearman", "mrpc": "f1",
                          "qqp": "f1"}.get(name, "accuracy"), name
        assert set(tests) == ({"test", "test_mismatched"} if name == "mnli" else {"test"})
        assert kind == glue.GLUE[name][0]
        assert all(len(t) == (1 if glue.GLUE[name][2] is None else 2) for t in train.texts)
        assert all(s.strip() for t in train.texts for s in t)
    assert train.texts[0] == ("No weapons.", "Weapons found.")
    assert glue.read_glue(tmp_path, "mnli")[0].texts[0][0] == 'Conceptually "cream" skimming.'
    assert glue.read_glue(tmp_path, "stsb")[0].targets == ["5.000", "0.5"]
    assert glue.read_glue(tmp_path, "cola")[0].targets == ["1", "0"]


@pytest.mark.parametrize("case, message", [
    ("no label field", "has no field 'label'"),
    ("one class", "the training split has 1 class"),
    ("unseen test label", "test label 'gamma' never appears in training"),
    ("empty text", "field 'text' is empty"),
    ("pair without its second text", "has no field 'text_pair'"),
    # before any job trains (it once trained two jobs, then ended in a KeyError traceback)
    ("unknown metric", "--metric 'bleu' is not scored for a classification task of 2 classes; "
                       "choose one of accuracy, macro_f1, matthews, f1 (two classes)"),
])
def test_bad_task_input_is_one_line(tiny_run, tmp_path, case, message):
    run = load_run(tiny_run)
    tok = load_tokenizer(run.tokenizer_path)
    good = [{"text": f"some text {i}", "label": "ab"[i % 2]} for i in range(40)]
    kind, test, metric = "classification", None, None
    if case == "no label field":
        records = [{"text": "x", "category": "a"}]
    elif case == "one class":
        records = [{**r, "label": "a"} for r in good]
    elif case == "unseen test label":
        records = good
        test = _write_jsonl(tmp_path / "test.jsonl", [{"text": "t", "label": "gamma"}])
    elif case == "empty text":
        records = [*good, {"text": "  ", "label": "a"}]
    elif case == "unknown metric":
        records, metric = good, "bleu"
    else:
        records, kind = good, "pair"
    train = _write_jsonl(tmp_path / "train.jsonl", records)
    with pytest.raises(ValueError) as error:
        ft.load_task(ft.TaskSpec(train=train, test=test, kind=kind, metric=metric), run, tok)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_labels_of_one_value_are_one_class_and_two_forms_of_it_are_one_line(tiny_run, tmp_path):
    """JSON's ``1`` and ``1.0`` (and the string ``"1"``) are one class, named ``1``; two forms
    that read as one number or truth value (``1`` and ``true``, ``"1"`` and ``"1.0"`` in a CSV,
    ``1`` in training and ``true`` in the test file) are refused in one line naming each form
    and where it is, never made two classes."""
    run = load_run(tiny_run)
    tok = load_tokenizer(run.tokenizer_path)
    forms = [1, 1.0, "1", 0, 0.0, "0"]
    train = _write_jsonl(tmp_path / "numbers.jsonl",
                         [{"text": f"some text {i}", "label": forms[i % 6]} for i in range(60)])
    task = ft.load_task(ft.TaskSpec(train=train), run, tok)
    assert task.labels == ["0", "1"]
    assert sum(len(s) for s in task.splits.values()) == 60
    assert tasks.label_name(True) == "true" and tasks.label_name(0.5) == "0.5"

    def refused(spec: ft.TaskSpec) -> str:
        with pytest.raises(ValueError) as error:
            ft.load_task(spec, run, tok)
        assert "\n" not in str(error.value)
        return str(error.value)

    mixed = _write_jsonl(tmp_path / "mixed.jsonl", [
        {"text": f"some text {i}", "label": [0, 1, True][i % 3]} for i in range(30)])
    said = refused(ft.TaskSpec(train=mixed))
    assert said.startswith(f"labels 1 ({mixed}:2) and true ({mixed}:3) are one value written "
                           "two ways") and "write each class one way in every file" in said
    table = tmp_path / "labels.csv"
    table.write_text("text,label\n" + "".join(f"some text {i},{['0', '1', '1.0'][i % 3]}\n"
                                              for i in range(30)))
    assert refused(ft.TaskSpec(train=table)).startswith(
        f'labels "1" ({table}:3) and "1.0" ({table}:4) are one value written two ways')
    numbers = _write_jsonl(tmp_path / "train.jsonl", [
        {"text": f"some text {i}", "label": i % 2} for i in range(30)])
    truths = _write_jsonl(tmp_path / "test.jsonl", [{"text": "t", "label": True}])
    assert refused(ft.TaskSpec(train=numbers, test=truths)).startswith(
        f"labels 1 ({numbers}:2) and true ({truths}:1) are one value written two ways")


def test_the_cli_says_a_bad_task_in_one_line(tiny_run, tmp_path, capsys):
    train = _write_jsonl(tmp_path / "t.jsonl", [{"text": "x", "category": "a"}])
    with pytest.raises(SystemExit) as exit_:
        main(["finetune", str(tiny_run), "--task", str(train)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "--label-field" in err[0]
    for option, value, says in (("--layer-decay", "0", "--layer-decay 0.8"),
                                ("--layer-decay", "1,1.5", "--layer-decay 0.8"),
                                ("--layer-decay", "1,0.8,1", "lists a value twice"),
                                ("--lr", "1e-3,1e-3", "lists a value twice")):
        with pytest.raises(SystemExit) as exit_:  # refused before any job trains
            main(["finetune", str(tiny_run), "--task", str(train), option, value])
        assert exit_.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0] and option in err[0], err
    trained = load_run(tiny_run).trained_length
    for length, says in (("4", "pass at least 8"), (str(trained + 1), f"at most {trained}")):
        with pytest.raises(SystemExit) as exit_:  # no room for a text; positions never trained
            main(["finetune", str(tiny_run), "--task", str(train), "--max-len", length])
        assert exit_.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--max-len" in err[0] and says in err[0], err
    assert not (tiny_run / "finetune" / "t").exists()
    assert not (tiny_run / "finetune" / "t").exists()


# --------------------------------------------------------------------------- export


def _fake_finetuned(tmp_path, tokenizer_path, family: str, kind: str, pooling="cls"):
    """A fine-tuned model directory with random (non-trivial) encoder and head parameters."""
    overrides = {"vocab_size": 1024}
    if family == "roberta":
        overrides["layer_norm"] = "pre"
    preset = "modern-tiny" if family == "modern" else "tiny"
    config = model_config_lib.preset(preset, **overrides)
    if family == "modern":
        import dataclasses

        config = dataclasses.replace(config, attention_within_segments=False)
    encoder = init_params(config, 0)
    noise = jax.random.key(5)
    encoder = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(noise, x.shape), encoder)
    style = heads.style_for(config)
    labels = None if kind == "regression" else ["B-A", "I-A", "O"] if kind == "tokens" \
        else ["neg", "neu", "pos"]
    head = heads.init_head(style, config, kind, 1 if labels is None else len(labels),
                           jax.random.key(1), mlm_head=encoder["head"])
    head = jax.tree.map(lambda x: x + 0.1 * jax.random.normal(jax.random.key(2), x.shape), head)
    body = {k: v for k, v in encoder.items() if k != "head"}
    out = tmp_path / f"{family}-{kind}-{pooling}"
    from clozax.core.vocab import SPECIAL_NAMES

    specials = {name: i for i, name in enumerate(SPECIAL_NAMES)}
    finetuned.write(out, {"encoder": body, "head": head}, config, {
        "kind": kind, "labels": labels, "style": style, "pooling": pooling, "pair": False,
        "seq_len": 64, "specials": specials, "task": "t", "dropout": 0.1}, tokenizer_path)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("family", ["bert", "roberta", "modern"])
def test_exported_classifiers_give_transformers_logits(tiny_run, tmp_path, family):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from clozax.interop import export_run

    texts = ["the module returns a list", "a short one", "values for each file path name"]
    tokenizer_path = load_run(tiny_run).tokenizer_path
    cases = [("classification", "cls"), ("regression", "cls"), ("tokens", "cls")]
    if family == "modern":
        cases.append(("classification", "mean"))
    for kind, pooling in cases:
        model_dir = _fake_finetuned(tmp_path, tokenizer_path, family, kind, pooling)
        hf_dir = export_run(model_dir, tmp_path / f"hf-{model_dir.name}")
        auto = (transformers.AutoModelForTokenClassification if kind == "tokens"
                else transformers.AutoModelForSequenceClassification)
        hf = auto.from_pretrained(str(hf_dir)).eval()
        tok = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
        batch = tok(texts, padding=True, return_tensors="pt")
        with torch.no_grad():
            theirs = hf(input_ids=batch["input_ids"],
                        attention_mask=batch["attention_mask"]).logits.numpy()
        model = finetuned.load(model_dir)
        ids = [np.asarray(r, np.int32)[np.asarray(m, bool)]
               for r, m in zip(batch["input_ids"].numpy(), batch["attention_mask"].numpy(),
                               strict=True)]
        split = tasks.Split(ids, [np.zeros(len(x), np.int32) if kind == "tokens" else 0
                                  for x in ids], texts)
        ours = logits_of(model, split)
        for i, lg in enumerate(ours):
            n = len(split.ids[i])
            ref = theirs[i, :n] if kind == "tokens" else theirs[i]
            assert np.abs(lg - ref).max() <= 1e-4, (family, kind, pooling,
                                                    np.abs(lg - ref).max())
        assert hf.config.id2label[0] == ("LABEL_0" if kind == "regression" else
                                         model.meta["labels"][0])


@pytest.mark.slow
def test_pipelines_agree_with_predict(finetuned_runs, task_files, tmp_path):
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from clozax.interop import export_run

    run, results = finetuned_runs
    for kind, pipe in (("classification", "text-classification"),
                       ("tokens", "token-classification")):
        model_dir = run / "finetune" / results[kind]["task"]["name"] / "model"
        hf_dir = export_run(model_dir, tmp_path / kind)
        ours = predict_file(model_dir, task_files[kind])[:12]
        records = [json.loads(line) for line in task_files[kind].read_text().splitlines()][:12]
        p = transformers.pipeline(pipe, model=str(hf_dir), device="cpu")
        if kind == "classification":
            theirs = p([r["text"] for r in records])
            assert [t["label"] for t in theirs] == [o["label"] for o in ours]
            assert np.allclose([t["score"] for t in theirs], [o["score"] for o in ours],
                               atol=1e-4)
        else:
            tok = load_tokenizer(model_dir / "tokenizer.json")
            for record, mine in zip(records, ours, strict=True):
                words = record["tokens"]
                word_ids = tok.encode(words, is_pretokenized=True,
                                      add_special_tokens=False).word_ids
                first = [i + 1 for i, w in enumerate(word_ids)
                         if i == 0 or word_ids[i - 1] != w]  # after [CLS]
                theirs = p(" ".join(words))  # per token, "O" left out
                at_first = {t["index"]: t["entity"] for t in theirs if t["index"] in first}
                tags = {pos: w["tag"] for pos, w in zip(first, mine["tokens"], strict=True)
                        if w["tag"] != "O"}
                assert at_first == tags, (words, at_first, tags)


def test_reinit_top_takes_the_top_blocks_from_the_random_init_and_keeps_the_rest(tiny_run):
    run = load_run(tiny_run)
    fresh = init_params(run.config.model, run.config.train.seed)
    layers = run.config.model.layers
    assert jobs_lib.reinit_top(run.params, fresh, 0) is run.params
    mixed = jobs_lib.reinit_top(run.params, fresh, 1)
    for pre, new, got in zip(jax.tree.leaves(run.params["layers"]),
                             jax.tree.leaves(fresh["layers"]),
                             jax.tree.leaves(mixed["layers"]), strict=True):
        np.testing.assert_array_equal(got[:layers - 1], pre[:layers - 1])
        np.testing.assert_array_equal(got[layers - 1:], new[layers - 1:])
        assert not np.array_equal(got[layers - 1:], pre[layers - 1:])
    for part in ("embeddings", "head"):
        assert mixed[part] is run.params[part]
    with pytest.raises(ValueError, match="--reinit-top 3: the encoder has 2 blocks"):
        jobs_lib.reinit_top(run.params, fresh, layers + 1)
    with pytest.raises(ValueError, match="reinit_top"):
        ft.Protocol(reinit_top=-1)


def test_a_reinitialised_selected_job_rerun_for_its_model_reproduces_its_record(
        tiny_run_copy, task_files):
    spec = ft.TaskSpec(train=task_files["classification"], name="reinit")
    plain = ft.finetune_run(tiny_run_copy, spec, dataclasses.replace(FAST, epochs=2),
                            say=lambda _: None, progress=False)
    out = tiny_run_copy / "finetune" / "reinit"
    plain_weights = (out / "model" / finetuned.WEIGHTS_FILE).read_bytes()
    protocol = dataclasses.replace(FAST, epochs=2, reinit_top=1)
    first = ft.finetune_run(tiny_run_copy, spec, protocol, say=lambda _: None, progress=False)
    # Its own jobs, and a different model (the scores alone may tie on a task this small, and a
    # job's seconds are rounded to 0.01 s: equal summaries are no evidence of shared jobs).
    assert first["model"]["jobs"] != plain["model"]["jobs"]
    kept = (out / "model" / finetuned.WEIGHTS_FILE).read_bytes()
    assert kept != plain_weights
    shutil.rmtree(out / "model")  # the jobs are kept: the selected one re-runs for model/
    again = ft.finetune_run(tiny_run_copy, spec, protocol, say=lambda _: None, progress=False)
    assert again["model"] == first["model"]
    assert (out / "model" / finetuned.WEIGHTS_FILE).read_bytes() == kept
    assert json.loads((out / "model" / finetuned.META_FILE).read_text())["reinit_top"] == 1


def test_reinit_top_past_the_encoders_blocks_is_one_line_and_nothing_written(tiny_run_copy,
                                                                              capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["finetune", str(tiny_run_copy), "--reinit-top", "9"])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and "--reinit-top 9" in err and "pass 0 to 2" in err
    assert "Traceback" not in err and err.count("\n") == 0
    assert not (tiny_run_copy / "finetune").exists()


def test_the_control_jobs_are_shared_by_every_reinit_top(tiny_run_copy, task_files):
    """--reinit-top changes the trained encoder only: its random-init control's jobs are the
    same jobs for every N, so a second N runs the trained jobs alone and reads the control's."""
    spec = ft.TaskSpec(train=task_files["classification"], name="shared")
    protocol = dataclasses.replace(FAST, epochs=2, control=True)
    plain = ft.finetune_run(tiny_run_copy, spec, protocol, say=lambda _: None, progress=False)
    said = []
    again = ft.finetune_run(tiny_run_copy, spec, dataclasses.replace(protocol, reinit_top=1),
                            say=said.append, progress=False)
    assert any("1 of 2 jobs already done; running the other 1" in line for line in said)
    assert again["encoders"]["random_init"] == plain["encoders"]["random_init"]
    assert again["model"]["jobs"] != plain["model"]["jobs"]  # the trained jobs ran again
    keys = [d.name for d in (tiny_run_copy / "finetune" / "shared" / "jobs").iterdir()]
    assert len(keys) == 2  # the re-initialised trained jobs under a key of their own
