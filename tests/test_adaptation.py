"""``benchmarks/adaptation.py``: the adaptation's peak chosen on validation alone, a domain
corpus that holds no validation or test text, the table drawn from a study, and bad input
refused in one line. The study itself is a measurement (docs/tutorials/finetune.md), not a
test."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from clozax.judge.claims import seed_difference

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import adaptation  # noqa: E402

pytestmark = pytest.mark.fast


def test_the_peak_kept_is_the_best_mean_on_validation():
    assert adaptation.choose({1e-4: {"mean": 0.80, "worst": 0.79},
                              3e-4: {"mean": 0.84, "worst": 0.80},
                              1e-3: {"mean": 0.83, "worst": 0.83}}) == 3e-4


def test_a_tie_on_validation_goes_to_the_better_worst_seed_then_the_lower_peak():
    assert adaptation.choose({1e-4: {"mean": 0.84, "worst": 0.80},
                              1e-3: {"mean": 0.84, "worst": 0.82}}) == 1e-3
    assert adaptation.choose({1e-3: {"mean": 0.84, "worst": 0.82},
                              3e-4: {"mean": 0.84, "worst": 0.82}}) == 3e-4


def test_a_domain_corpus_holds_no_text_of_the_tasks_validation_or_test():
    records = [{"text": t, "group": str(i)} for i, t in enumerate("a b c d e".split())]
    kept, cut = adaptation.without_texts(records, {"b", "d", "z"})
    assert [r["text"] for r in kept] == ["a", "c", "e"] and cut == 2


def test_the_table_reports_each_adaptation_against_the_encoder_not_adapted():
    def scores(per_seed):
        mean = sum(per_seed) / len(per_seed)
        return {"test": {"mean": mean, "std": 0.01, "per_seed": per_seed}}

    adapted, base = scores([0.85, 0.86, 0.84]), scores([0.82, 0.83, 0.81])
    study = {"choice": {"chosen": 1e-3}, "results": [
        {"variant": "domain", "task": "builtin", "chosen_here": True, "adapted": adapted,
         "not_adapted": base, "minus_not_adapted": seed_difference(
             adapted["test"]["per_seed"], base["test"]["per_seed"])},
        {"variant": "task", "task": "wordnet", "chosen_here": False, "adapted": base,
         "not_adapted": base, "minus_not_adapted": seed_difference(
             base["test"]["per_seed"], base["test"]["per_seed"])}]}
    lines = adaptation.table(study)
    assert lines[2].startswith("| domain-adaptive, peak chosen on its validation | builtin | "
                               "0.001 | 85.0 % ± 1.0 | 82.0 % ± 1.0 | +3.0 pp [")
    assert lines[3].startswith("| task-adaptive, at the kept peak | wordnet | 0.001 |")


@pytest.mark.parametrize("argv,words", [
    (["--peaks", "1e-4,0"], "--peaks: 0 is not a positive learning rate"),
    (["--peaks", "1e-4,x"], "give learning rates separated by commas"),
    (["--peaks", "1e-4,1e-4"], "give each peak once"),
    (["--choose-on", "glue"], "--choose-on 'glue': not a task here; choose from builtin"),
    (["--choose-on", "builtin,wordnet"], "give the one task the peak is chosen on"),
    (["--then", "nope"], "--then 'nope': not a task here"),
    (["--config", "/nonexistent.toml"], "--config /nonexistent.toml: no such file"),
    (["--base", "/nonexistent"], "--base /nonexistent: not a run directory"),
])
def test_bad_input_is_one_line_and_exit_2_before_anything_runs(tmp_path, argv, words):
    recipe = tmp_path / "recipe.toml"
    recipe.write_text("[optim]\nlearning_rate = 1e-4\n")
    ran = subprocess.run([sys.executable, str(BENCHMARKS / "adaptation.py"), "--out",
                          str(tmp_path / "out"), "--config", str(recipe), *argv],
                         capture_output=True, text=True, timeout=120)
    lines = [line for line in ran.stderr.splitlines() if line.strip()]
    assert ran.returncode == 2 and len(lines) == 1, ran.stderr
    assert lines[0].startswith("error: ") and words in lines[0]
    assert "Traceback" not in ran.stderr and not (tmp_path / "out").exists()


def test_the_default_recipe_is_the_continue_pretraining_tutorials_head_first_toml():
    import re

    page = (BENCHMARKS.parent / "docs" / "tutorials" / "continue-pretraining.md").read_text()
    block = re.search(r'```toml title="head-first.toml"\n(.*?)```', page, re.S)
    assert block is not None
    assert (BENCHMARKS / "head-first.toml").read_text() == block.group(1)


def test_each_peak_names_its_own_run():
    tags = [adaptation.peak_tag(p) for p in (1e-4, 2.5e-4, 3e-4, 1e-3, 0.01)]
    assert tags == ["1e-4", "2.5e-4", "3e-4", "1e-3", "1e-2"]


@pytest.mark.parametrize("option", [["--tasks", "wordnet"], ["--retrieval-steps", "5"],
                                    ["--no-control"]])
def test_an_option_the_study_would_ignore_is_refused(option, capsys):
    with pytest.raises(SystemExit) as stopped:
        adaptation.main(option)
    assert stopped.value.code == 2 and "unrecognized arguments" in capsys.readouterr().err
