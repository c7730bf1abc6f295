"""``benchmarks/budget_curve.py``: the budget curve's crossing with TF-IDF (measured, extrapolated
with its interval, or not in sight), each budget's length from one pace, its figure, and bad
input refused in one line. The runs themselves are measurements (docs/tutorials/finetune.md),
not tests."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from clozax.judge.claims import seed_difference

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import budget_curve  # noqa: E402

pytestmark = pytest.mark.fast


def _points(means: dict[float, float], spread: float = 0.01, seeds: int = 3):
    """Budget → per-seed trained − TF-IDF differences around ``means``."""
    out = []
    for minutes, mean in means.items():
        values = [mean + spread * (i - (seeds - 1) / 2) for i in range(seeds)]
        out.append((minutes, values, seed_difference(values, 0.0)))
    return out


def test_a_budget_clearly_above_tfidf_is_the_measured_crossing():
    found = budget_curve.crossing(_points({8: -0.05, 16: -0.01, 32: 0.04, 64: 0.08}))
    assert found["kind"] == "measured" and found["minutes"] == 32


def test_a_rising_curve_below_tfidf_is_extrapolated_to_where_its_line_reaches_zero():
    # -4 pp per doubling up to -2 pp at 64 minutes: the line reaches 0 at 2^6.5 = 90.5 minutes
    found = budget_curve.crossing(_points({8: -0.14, 16: -0.10, 32: -0.06, 64: -0.02}))
    assert found["kind"] == "extrapolated"
    assert found["minutes"] == pytest.approx(2 ** 6.5, rel=1e-6)
    low, high = found["interval"]
    assert low <= found["minutes"] <= high and high < 200
    assert "extrapolated to 91 minutes" in found["words"]


def test_a_curve_that_does_not_rise_has_no_crossing_and_an_interval_open_above():
    found = budget_curve.crossing(_points({8: -0.05, 16: -0.06, 32: -0.07}, spread=0.002))
    assert found["kind"] == "none" and found["minutes"] is None
    assert np.isinf(found["interval"][1]) and "no crossing in sight" in found["words"]


def test_one_budget_has_no_line_to_extrapolate_a_crossing_from():
    """The device budget is one point: clear above TF-IDF is its crossing; otherwise it says
    so (a line through one budget's seeds has no slope)."""
    assert budget_curve.crossing(_points({5: 0.04}))["kind"] == "measured"
    found = budget_curve.crossing(_points({5: -0.02}))
    assert found["kind"] == "none" and found["interval"] is None
    assert "a crossing is extrapolated from two or more" in found["words"]


def test_a_point_whose_seeds_agree_is_drawn_and_tabled_without_an_interval(tmp_path):
    same = [0.6, 0.6]
    curve = {"candidate": "budget", "metric": "accuracy", "points": [{
        "minutes": 5, "steps": 90, "run": "r", "tfidf": 0.7,
        "trained": budget_curve.mean_interval(same),
        "minus_tfidf": seed_difference(same, 0.7), "minus_random_init": None}],
        "references": {}, "crossing": budget_curve.crossing([(5, [-0.1, -0.1],
                                                               seed_difference(same, 0.7))])}
    budget_curve.figure(curve, tmp_path / "f.png")
    assert (tmp_path / "f.png").is_file()
    assert budget_curve.table(curve)[2].startswith("| 5 min | 90 | 60.0 % (no interval) | "
                                                   "-10.0 pp (no interval) |")


def test_every_budget_runs_the_first_budgets_pace_times_its_minutes():
    assert budget_curve.steps_for([8, 16, 32.5], 75.0) == {8: 600, 16: 1200, 32.5: 2438}


def test_the_figure_and_table_are_drawn_from_a_curve(tmp_path):
    point = {"minutes": 8, "steps": 600, "run": "r", "tfidf": 0.7,
             "trained": {"mean": 0.6, "interval": [0.58, 0.62], "per_seed": [0.58, 0.6, 0.62]},
             "minus_tfidf": seed_difference([0.58, 0.6, 0.62], 0.7),
             "minus_random_init": seed_difference([0.58, 0.6, 0.62], [0.3, 0.31, 0.29])}
    curve = {"candidate": "budget", "metric": "accuracy", "points": [
        point, {**point, "minutes": 16, "steps": 1200}],
        "references": {"TF-IDF (70.0 %)": {"mean": 0.7},
                       "random init, fine-tuned": budget_curve.mean_interval([0.3, 0.31, 0.29])},
        "crossing": {"words": "no crossing in sight"}}
    budget_curve.figure(curve, tmp_path / "f.png")
    assert (tmp_path / "f.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = budget_curve.table(curve)
    assert lines[2].startswith("| 8 min | 600 | 60.0 % [58.0, 62.0] | -10.0 pp [-15.0, -5.0], "
                               "clear | +30.0 pp [")
    assert any(line.startswith("| random init, fine-tuned | | 30.0 %") for line in lines)


@pytest.mark.parametrize("argv,words", [
    (["--minutes", "0.5,8"], "--minutes 0.5: a budget under 1 minute"),
    (["--minutes", "8,x"], "give budgets in minutes separated by commas"),
    (["--minutes", "16,8"], "give each budget once, in increasing order"),
    (["--candidate", "nope"], "--candidate 'nope' is unknown; choose one of budget"),
    (["--steps-per-minute", "0"], "give a positive pace"),
    (["--adapted", "/nonexistent"], "not a run directory"),
])
def test_bad_input_is_one_line_and_exit_2_before_anything_trains(tmp_path, argv, words):
    ran = subprocess.run([sys.executable, str(BENCHMARKS / "budget_curve.py"), "--out",
                          str(tmp_path / "out"), *argv], capture_output=True, text=True,
                         timeout=120)
    lines = [line for line in ran.stderr.splitlines() if line.strip()]
    assert ran.returncode == 2 and len(lines) == 1, ran.stderr
    assert lines[0].startswith("error: ") and words in lines[0]
    assert "Traceback" not in ran.stderr and not (tmp_path / "out").exists()


def test_curve_json_is_plain_json():
    """What the docs regenerate from: ``crossing`` gives JSON-ready values (inf aside)."""
    found = budget_curve.crossing(_points({8: -0.14, 16: -0.10}))
    json.dumps(found)


@pytest.mark.parametrize("option", [["--tasks", "wordnet"], ["--retrieval-steps", "5"]])
def test_an_option_the_curve_would_ignore_is_refused(option, capsys):
    with pytest.raises(SystemExit) as stopped:
        budget_curve.main(option)
    assert stopped.value.code == 2 and "unrecognized arguments" in capsys.readouterr().err


# ----------------------------------------------------------------------------- a growing curve


@pytest.fixture
def faked(tmp_path, monkeypatch):
    """``budget_curve.main`` with pretraining and fine-tuning faked: each budget's run is a
    directory with one committed checkpoint; ``measured`` lists every fine-tuning asked."""
    from clozax.train import compile_cache, layout

    measured = []

    def pretrain(name, candidate, out, length):
        run = out / name / "run"
        digests = run / layout.DIGEST_DIR
        if not digests.is_dir():
            digests.mkdir(parents=True)
            (digests / f"{int(length[1])}.json").write_text(json.dumps({"state": name}))
        return run, {"steps": int(length[1]), "seconds": 0.0}

    def measure(runs, tasks, protocol, out, per_class):
        measured.append((runs[0].parent.name, protocol.control))
        steps = int(next((runs[0] / layout.DIGEST_DIR).glob("*.json")).stem)
        seeds = [0.5 + steps / 1e4 + 0.01 * i for i in range(3)]
        rows = [{"encoder": "trained", "per_seed": seeds, "metric": "accuracy", "tfidf": 0.6,
                 "lr": 3e-4, "mean": float(np.mean(seeds))}]
        if protocol.control:
            rows.append({"encoder": "random_init", "per_seed": [0.3, 0.31, 0.32]})
        return rows

    monkeypatch.setattr(budget_curve.budget, "pretrain", pretrain)
    monkeypatch.setattr(budget_curve.downstream, "measure", measure)
    monkeypatch.setattr(compile_cache, "enable", lambda: None)

    def main(*argv):
        assert budget_curve.main(["--out", str(tmp_path), "--steps-per-minute", "10",
                                  *argv]) == 0
        return json.loads((tmp_path / "curve.json").read_text())

    return main, measured, tmp_path


def test_a_budget_measured_before_on_the_same_checkpoint_is_not_fine_tuned_again(faked):
    main, measured, _ = faked
    first = main("--minutes", "8,16")
    assert measured == [("m8", True), ("m16", False)]  # the control once, beside 8 minutes
    assert all(p["measured"]["date"] and p["checkpoint"] for p in first["points"])
    again = main("--minutes", "8,16,32")
    assert measured[2:] == [("m32", False)]  # 8 and 16 reused, and the control with them
    assert again["points"][:2] == first["points"]
    assert again["references"]["random init, fine-tuned"] == \
        first["references"]["random init, fine-tuned"]
    assert again["points"][2]["minus_random_init"]["mean"] < 0.5  # against the kept control


def test_a_re_trained_checkpoint_a_new_protocol_or_fresh_is_fine_tuned_again(faked):
    from clozax.train import layout

    main, measured, out = faked
    main("--minutes", "8,16")
    (out / "m8" / "run" / layout.DIGEST_DIR / "80.json").write_text('{"state": "again"}')
    main("--minutes", "8,16")
    assert measured[2:] == [("m8", False)]  # only the changed checkpoint; the control kept
    main("--minutes", "8,16", "--epochs", "2")
    assert measured[3:] == [("m8", True), ("m16", False)]  # another protocol: all of it
    main("--minutes", "8,16", "--epochs", "2", "--fresh")
    assert measured[5:] == [("m8", True), ("m16", False)]


def test_budgets_measured_before_stay_on_the_curve_while_their_runs_are_kept(faked):
    import shutil

    main, measured, out = faked
    main("--minutes", "8,64")
    grown = main("--minutes", "16")
    assert [p["minutes"] for p in grown["points"]] == [8, 16, 64]
    assert measured[2:] == [("m16", False)]
    shutil.rmtree(out / "m8")  # a point whose run is gone leaves the curve
    assert [p["minutes"] for p in main("--minutes", "16")["points"]] == [16, 64]
