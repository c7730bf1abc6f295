"""`clozax probe`: a planted task (label = which of two tokens a document contains) is solved by
the trained tiny encoder; group-level split; user task files; one-line errors."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from clozax.judge import probe as probe_lib
from clozax.judge.finetune import protocol as ft
from commands import one_line_error

FILLER = ("alpha beta gamma delta epsilon theta kappa lambda sigma omega river stone cloud "
          "light green house table water paper music").split()
PLANTED = {"zebra": "striped", "walrus": "tusked"}  # label -> planted word
ONE_JOB = ft.Protocol(learning_rates=(3e-3,), seeds=1, epochs=1, batch_size=16, control=False)


def _corpus(path, groups_per_label=12, docs_per_group=6):
    rng = np.random.default_rng(0)
    lines = []
    for label, word in PLANTED.items():
        for g in range(groups_per_label):
            for d in range(docs_per_group):
                words = list(rng.choice(FILLER, size=int(rng.integers(12, 30))))
                for _ in range(3):
                    words.insert(int(rng.integers(0, len(words) + 1)), word)
                lines.append({"text": " ".join(words), "label": label,
                              "group": f"{label}-{g}", "id": f"{label}-{g}-{d}"})
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return lines


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """A prepared planted-task dataset and a tiny run trained on it for a few dozen steps."""
    from clozax.data import prepare
    from clozax.train import config as config_lib
    from clozax.train import loop as train_lib

    root = tmp_path_factory.mktemp("probe")
    records = _corpus(root / "corpus.jsonl")
    data = root / "data"
    prepare(data, corpus=str(root / "corpus.jsonl"), group_field="group", label_field="label",
            vocab_size=128, seq_len=48, heldout_fraction=0.2, quiet=True)
    run = root / "run"
    cfg = config_lib.resolve(preset="tiny", overrides=[
        "train.steps=40", "train.batch_size=16", "train.eval_every=40", "train.save_every=40",
        "train.log_every=40", "optim.warmup_steps=5", "optim.learning_rate=0.003"])
    train_lib.train(data, run, cfg)
    return root, run, records


def test_planted_task_is_solved_by_the_trained_encoder(planted):
    _, run, _ = planted
    result = probe_lib.probe_run(run)
    assert result["results"]["trained"]["accuracy"] >= 0.9
    for name in ("trained", "random_init", "tfidf"):
        r = result["results"][name]
        assert r["ci95"][0] <= r["accuracy"] <= r["ci95"][1]
        assert r["C"] in probe_lib.C_GRID
    assert set(result["task"]["classes"]) == set(PLANTED)
    assert json.loads((run / probe_lib.PROBE_FILE).read_text()) == result


def test_the_dataset_task_trains_on_train_documents_and_tests_on_held_out_ones_only(planted):
    from clozax.data.dataset import open_dataset
    from clozax.data.tokenizer import load_tokenizer
    from clozax.judge import task_load
    from clozax.train.run_dir import load_run

    root, run, records = planted
    dataset = open_dataset(root / "data")
    ids = {s: {d["id"] for d in dataset.documents(s)} for s in ("train", "heldout")}
    tok = load_tokenizer(load_run(run).tokenizer_path)
    raws, selection = task_load.dataset_raws(dataset, tok, seed=0, max_per_class=40)
    assert {d for (d,) in raws["train"].digests} <= ids["train"]
    for split in ("validation", "test"):
        assert raws[split].digests and {d for (d,) in raws[split].digests} <= ids["heldout"]
    # stratified by label: a held-out label with two documents or more is on both sides
    held = Counter(raws["validation"].targets + raws["test"].targets)
    for label in (lab for lab, n in held.items() if n > 1):
        assert label in raws["validation"].targets and label in raws["test"].targets
    assert selection["capped_away"] == sum(selection["classes"].values()) - 80
    assert task_load.dataset_raws(dataset, tok, 0, 40)[0]["test"].where == raws["test"].where
    assert task_load.dataset_raws(dataset, tok, 1, 40)[0]["test"].where != raws["test"].where
    # what probe and finetune record: no evaluated example was pretrained on
    task = task_load.load_task(task_load.TaskSpec(), load_run(run), tok)
    overlap = task.accounting["pretraining_overlap"]
    assert (overlap["validation"], overlap["test"]) == (0, 0) and overlap["excluded"]


def test_test_rows_that_repeat_pretraining_documents_are_counted_and_excluded(planted,
                                                                             tmp_path):
    from clozax.data.dataset import open_dataset

    root, run, records = planted
    pretrained = {d["id"] for d in open_dataset(root / "data").documents("train")}
    from clozax.data.corpus import normalise, text_digest

    seen = [r for r in records if text_digest(normalise(r["text"])).hex() in pretrained]
    rng = np.random.default_rng(1)
    fresh = []  # texts the encoder never read: the planted word among new filler
    for k in range(90):
        label = list(PLANTED)[k % 2]
        words = [*rng.choice(FILLER, size=15), PLANTED[label], PLANTED[label]]
        fresh.append({"text": " ".join(words) + f" fresh{k}", "label": label, "group": f"f{k}"})
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in seen[:80] + fresh[:30]))
    validation = tmp_path / "validation.jsonl"
    validation.write_text("".join(json.dumps(r) + "\n" for r in fresh[30:60]))
    test = tmp_path / "test.jsonl"
    test_rows = seen[80:100] + fresh[60:]  # 20 pretrained documents (with their own spacing)
    test.write_text("".join(json.dumps({**r, "text": "  " + r["text"].replace(" ", "   ")})
                            + "\n" for r in test_rows))
    result = ft.finetune_run(run, ft.TaskSpec(train=train, validation=validation, test=test,
                                                  name="overlap"),
                             ONE_JOB, say=lambda _: None, progress=False)
    overlap = result["task"]["pretraining_overlap"]
    assert overlap["test"] == 20 and overlap["excluded"]
    assert result["task"]["examples"]["test"] == 30
    kept = ft.finetune_run(run, ft.TaskSpec(train=train, validation=validation, test=test,
                                            name="overlap-kept",
                                            keep_pretraining_overlap=True),
                           ONE_JOB, say=lambda _: None, progress=False)
    assert kept["task"]["examples"]["test"] == 50
    assert kept["task"]["pretraining_overlap"] == {**overlap, "excluded": False}
    table = _rendered(ft.summary_table(kept))
    assert "PRETRAINING OVERLAP KEPT: 0 validation / 20 test" in table
    # a test file of pretraining documents only: said in one line, nothing scored
    from clozax.data.tokenizer import load_tokenizer
    from clozax.train.run_dir import load_run

    only_seen = tmp_path / "seen.jsonl"
    only_seen.write_text("".join(json.dumps(r) + "\n" for r in seen[80:100]))
    loaded = load_run(run)
    with pytest.raises(ValueError, match="all 20 test examples occur in the encoder's "
                                         "pretraining data; give others, or pass "
                                         "--keep-pretraining-overlap"):
        ft.load_task(ft.TaskSpec(train=train, validation=validation, test=only_seen), loaded,
                     load_tokenizer(loaded.tokenizer_path))


@pytest.mark.fast
def test_an_imported_encoders_overlap_is_unknown():
    from clozax.judge import overlap
    from clozax.judge.finetune import tasks

    raws = {s: tasks.Raw(texts=[("a b",)], targets=["x"]) for s in ("train", "validation",
                                                                    "test")}
    kept, record = overlap.account(raws, {"dataset": None}, keep=False)
    assert kept is raws and record["test"] == "unknown" and "imported" in record["why"]
    _, missing = overlap.account(raws, {"dataset": "/nowhere/data"}, keep=False)
    assert missing["test"] == "unknown" and "/nowhere/data" in missing["why"]


def _rendered(table) -> str:
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(table)
    return console.export_text()


def test_a_user_task_file_with_text_label_group_is_probed(planted, tmp_path):
    _, run, records = planted
    task = tmp_path / "task.jsonl"
    task.write_text("".join(json.dumps({k: r[k] for k in ("text", "label", "group")}) + "\n"
                            for r in records))
    result = probe_lib.probe_run(run, task=task)
    assert result["task"]["source"] == str(task)
    assert result["results"]["trained"]["accuracy"] >= 0.9


def test_probe_cli_rejects_one_class_or_missing_fields_in_one_line(planted, tmp_path, capsys):
    _, run, records = planted
    one = tmp_path / "one.jsonl"
    one.write_text("".join(json.dumps({"text": r["text"], "label": "x", "group": r["group"]})
                           + "\n" for r in records))
    missing = tmp_path / "missing.jsonl"
    missing.write_text(json.dumps({"text": "a b c", "group": "g"}) + "\n")
    for path, message in ((one, "1 class"), (missing, "has no field 'label'")):
        assert message in one_line_error(capsys, "probe", run, "--task", path)
