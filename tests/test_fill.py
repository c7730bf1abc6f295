"""`clozax fill`: k sorted probabilities per [MASK]; JSON output; one-line errors."""

from __future__ import annotations

import json

import pytest

from clozax.app import cli
from clozax.judge.fill import fill
from clozax.train.run_dir import load_run
from commands import one_line_error


def test_fill_returns_k_sorted_probabilities_per_mask(tiny_run):
    results = fill(tiny_run, "return the [MASK] of the [MASK] list.", top_k=4)
    assert [r["mask"] for r in results] == [0, 1]
    assert results[0]["position"] < results[1]["position"]
    for r in results:
        probs = [p["probability"] for p in r["predictions"]]
        assert len(probs) == 4
        assert probs == sorted(probs, reverse=True)
        assert all(0.0 < p <= 1.0 for p in probs) and sum(probs) <= 1.0 + 1e-6
        assert len({p["id"] for p in r["predictions"]}) == 4


def test_fill_json_output_is_machine_readable(tiny_run, capsys):
    cli.main(["fill", str(tiny_run), "the [MASK] module", "--top-k", "3", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert len(out) == 1 and len(out[0]["predictions"]) == 3


def test_fill_rejects_bad_top_k(tiny_run):
    with pytest.raises(ValueError, match="top_k"):
        fill(tiny_run, "a [MASK]", top_k=0)


def test_fill_refuses_a_text_past_the_length_the_run_trained_on(tiny_run):
    run = load_run(tiny_run)
    assert run.trained_length == 64 < run.config.model.max_positions == 128
    text = " ".join(["return"] * 70) + " [MASK]"  # under 128 positions, over the 64 trained
    with pytest.raises(ValueError, match="longer than the 64 run .* was trained on"):
        fill(tiny_run, text)
    assert fill(tiny_run, " ".join(["return"] * 50) + " [MASK]")  # within it: answered


def test_fill_cli_rejects_text_without_mask_or_too_long_in_one_line(tiny_run, capsys):
    too_long = " ".join(["word"] * (load_run(tiny_run).config.model.max_positions + 5))
    for text, message in (("no blank here", "has no [MASK]"),
                          (too_long + " [MASK]", "longer than the model's")):
        assert message in one_line_error(capsys, "fill", tiny_run, text)
