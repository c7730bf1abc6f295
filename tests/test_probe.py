"""`clozax probe`: a planted task (label = which of two tokens a document contains) is solved by
the trained tiny encoder; group-level split; user task files; one-line errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from clozax.judge import probe as probe_lib
from commands import one_line_error

FILLER = ("alpha beta gamma delta epsilon theta kappa lambda sigma omega river stone cloud "
          "light green house table water paper music").split()
PLANTED = {"zebra": "striped", "walrus": "tusked"}  # label -> planted word


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


def test_probe_split_is_by_group_and_deterministic(planted):
    root, run, records = planted
    task = probe_lib.Task(ids=[np.zeros(3, np.int32)] * len(records),
                          text=[r["text"] for r in records], label=[r["label"] for r in records],
                          group=[r["group"] for r in records], source="test")
    parts, accounting = probe_lib.select_and_split(task, seed=0, max_per_class=40)
    groups = {p: {task.group[i] for i in ix} for p, ix in parts.items()}
    assert not groups["train"] & groups["test"] and not groups["val"] & groups["test"]
    assert not groups["train"] & groups["val"]
    assert accounting["capped_away"] == len(records) - 80
    assert probe_lib.select_and_split(task, seed=0, max_per_class=40)[0] == parts
    assert probe_lib.select_and_split(task, seed=1, max_per_class=40)[0] != parts


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
    missing.write_text(json.dumps({"text": "a b c", "label": "x"}) + "\n")
    for path, message in ((one, "1 class"), (missing, "lacks field(s) group")):
        assert message in one_line_error(capsys, "probe", run, "--task", path)
