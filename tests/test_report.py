"""clozax report: a self-contained HTML page from a run directory, degrading to "not run"."""

from __future__ import annotations

import html
import json
import re
import shutil

import numpy as np
import pytest

from browser import assert_drawn, needs_chromium, screenshot
from clozax.judge import claims as claims_lib
from clozax.judge import panel
from clozax.judge.claims import seed_difference
from clozax.report import page as report_lib
from clozax.train.heldout import EvalMasks

SECTIONS = ["Headline", "Training", "What the model predicts",
            "Held-out evaluation by corruption kind", "Downstream probe", "Fine-tuning",
            "Failure cases", "Audit", "Provenance"]


def _finetune_result() -> dict:
    """A result.json of the shape finetune_run writes (its summaries from the real code)."""
    from clozax.judge.finetune.protocol import summarise

    def jobs(base):
        return [{"learning_rate": lr, "seed": s, "seconds": 1.5, "per_epoch": [
                    {"validation": {"accuracy": base + 0.01 * s + lr},
                     "test": {"accuracy": base + 0.02 * s, "macro_f1": base,
                              "matthews": base / 2}}]}
                for lr in (1e-4, 3e-4) for s in range(3)]

    return {"task": {"name": "labels", "kind": "classification", "source": "docstrings",
                     "metric": "accuracy", "examples": {"train": 90, "validation": 20,
                                                        "test": 30},
                     "pretraining_overlap": {"validation": 0, "test": 3, "excluded": True}},
            "protocol": {"seeds": 3, "learning_rates": [1e-4, 3e-4], "epochs": 3,
                         "head": "bert"},
            "encoders": {"trained": summarise(jobs(0.6), "accuracy"),
                         "random_init": summarise(jobs(0.3), "accuracy")},
            "tfidf": {"C": 10.0, "test": {"accuracy": 0.55}},
            "constant_baseline": {"test": {"accuracy": 0.1}},
            "trained_minus_random_init": {"metric": "accuracy", **seed_difference(
                [0.6, 0.62, 0.58], [0.3, 0.31, 0.29])}}


def _ci(acc):
    return [acc - 0.03, acc + 0.03]


PROBE = {  # the shape probe_run writes
    "step": 6,
    "task": {"source": "planted", "seed": 0, "classes": {"a": 40, "b": 40},
             "split": {"train": {"examples": 40, "groups": 8},
                       "test": {"examples": 40, "groups": 8}}},
    "features": "mean of final hidden states", "classifier": "logistic regression",
    "bootstrap": {"resamples": 1000, "seed": 0},
    "majority_class_accuracy": 0.5,
    "results": {
        "trained": {"accuracy": 0.8125, "ci95": _ci(0.8125), "C": 1.0,
                    "val_accuracy": {"0.1": 0.5, "1.0": 0.75}},
        "random_init": {"accuracy": 0.55, "ci95": _ci(0.55), "C": 0.1,
                        "val_accuracy": {"0.1": 0.5, "1.0": 0.5}},
        "tfidf": {"accuracy": 0.6, "ci95": _ci(0.6), "C": 10.0, "val_accuracy": {"10.0": 0.6}},
    },
    "trained_minus_random_init": {"accuracy": 0.2625, "ci95": [0.2, 0.33]},
}

AUDIT = {  # the shape audit_run writes: one pass, one fail, one skip
    "passed": False, "step": 6, "devices": 1, "seconds": 1.0,
    "checks": [
        {"number": 1, "name": "no_leak", "passed": True, "skipped": False,
         "value": {"logit_diffs": 0, "sha": "f" * 64}, "detail": "identical bit for bit"},
        {"number": 3, "name": "initial_loss", "passed": False, "skipped": False,
         "value": {"loss": 9.1}, "detail": "zeroed-head loss differs from log V"},
        {"number": 7, "name": "device_accumulation", "passed": True, "skipped": True,
         "value": "skipped", "detail": "SKIP: 1 device visible"},
    ],
}


@pytest.fixture(scope="module")
def bare_report(tiny_run, tmp_path_factory):
    """A report of a run with nothing but training outputs (no eval/probe/audit files)."""
    run = tmp_path_factory.mktemp("bare") / "run"
    shutil.copytree(tiny_run, run)
    path = report_lib.write_report(run)
    return run, path.read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def full_report(tiny_run, tmp_path_factory):
    """A report after a real `evaluate` plus probe/audit files of the real shape."""
    from clozax.judge.evaluate import evaluate_run

    run = tmp_path_factory.mktemp("full") / "run"
    shutil.copytree(tiny_run, run)
    evaluation = evaluate_run(run, failures=5)
    (run / "probe.json").write_text(json.dumps(PROBE))
    (run / "audit.json").write_text(json.dumps(AUDIT))
    (run / "finetune" / "labels").mkdir(parents=True)
    (run / "finetune" / "labels" / "result.json").write_text(json.dumps(_finetune_result()))
    (run / "retrieval.json").write_text(json.dumps(_retrieval_result()))
    path = report_lib.write_report(run)
    return run, path.read_text(encoding="utf-8"), evaluation


def _retrieval_result() -> dict:
    """The shape ``clozax retrieval`` writes (judge/retrieval/compare.py ``compare``)."""
    def scores(ndcg):
        return {"ndcg@10": ndcg, "mrr@10": ndcg / 2, "recall@100": 0.5}

    trained, control = [0.30, 0.32, 0.31], [0.20, 0.22, 0.21]
    return {
        "set": {"construction": "first-sentence→rest", "queries": 120, "documents": 400},
        "stage": {"pairs": "first-sentence", "steps": 40, "batch_size": 32, "seeds": 3},
        "rows": {"bm25": scores(0.45), "raw": scores(0.05),
                 "random_init_stage": {**scores(0.21), "per_seed": [scores(x) for x in control]},
                 "trained_stage": {**scores(0.31), "per_seed": [scores(x) for x in trained]}},
        "differences_ndcg@10": {
            "trained_stage_minus_random_init_stage": claims_lib.seed_difference(trained, control),
            "trained_stage_minus_bm25": claims_lib.seed_difference(trained, 0.45)},
    }


def _section(page: str, title: str) -> str:
    """The HTML between the <h2> of ``title`` and the next <h2>."""
    start = page.index(f"<h2>{title}</h2>")
    end = page.find("<h2>", start + 1)
    return page[start: end if end > 0 else None]


def test_report_without_evaluations_says_not_run_for_each_missing_file(bare_report):
    _, page = bare_report
    for title in SECTIONS:
        assert f"<h2>{title}</h2>" in page
    for title, command in (("Held-out evaluation by corruption kind", "clozax evaluate RUN"),
                           ("Downstream probe", "clozax probe RUN"),
                           ("Fine-tuning", "clozax finetune RUN"),
                           ("Failure cases", "clozax evaluate RUN"),
                           ("Audit", "clozax audit RUN")):
        body = _section(page, title)
        assert "not run" in body and command in body, title
    assert page.count("not run") >= 4


def test_report_is_self_contained_with_embedded_figures(bare_report):
    run, page = bare_report
    assert not re.search(r'(src|href)\s*=\s*"(https?:)?//', page)
    assert "<script" not in page and "<link" not in page and "@import" not in page
    images = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert len(images) == 3  # loss, accuracy, probability panel
    for name in ("loss.png", "accuracy.png", "probabilities.png"):
        png = (run / report_lib.FIGURE_DIR / name).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def test_probability_panel_shows_target_and_top_predictions(bare_report):
    from clozax.train.run_dir import load_run

    run, page = bare_report
    examples = panel.probability_panel(load_run(run))
    assert len(examples) == panel.PANEL_EXAMPLES
    for x in examples:
        assert len(x["top"]) == panel.PANEL_TOP
        probs = [p for _, p in x["top"]]
        assert probs == sorted(probs, reverse=True) and 0 < probs[0] <= 1
        assert 0 < x["target_probability"] <= 1 and x["target_rank"] >= 0
        if x["target_rank"] < panel.PANEL_TOP:  # the target is among the top predictions
            assert x["target_probability"] == pytest.approx(probs[x["target_rank"]], rel=1e-4)
        assert x["text"].count("⟦") == 1
    assert _section(page, "What the model predicts").count("<mark>") == len(examples)


@pytest.mark.fast
def test_panel_positions_are_fixed_evenly_spaced_and_prefer_mask_slots():
    rows, count = 20, 4
    valid = np.ones((rows, count), bool)
    valid[0] = False  # a row without a selected position is skipped
    kinds = np.full((rows, count), 3, np.int8)  # keep
    kinds[:, 2] = 1  # mask
    masks = EvalMasks(np.arange(rows), np.tile(np.arange(count), (rows, 1)), valid, kinds,
                      np.zeros((rows, count), np.int32))
    chosen = panel.panel_positions(masks, 5)
    assert chosen == panel.panel_positions(masks, 5)
    assert [i for i, _ in chosen] == [5, 10, 14, 19]  # linspace(0, 19, 5) minus the empty row 0
    assert all(j == 2 for _, j in chosen)


def test_report_with_all_inputs_fills_every_table(full_report):
    run, page, evaluation = full_report
    assert "not run" not in page
    tuned = _section(page, "Fine-tuning")
    assert "0.6200 ± 0.0200" in tuned and "random-init encoder" in tuned and "TF-IDF" in tuned
    assert "pretraining overlap excluded: 0 validation / 3 test examples" in tuned
    retrieval = _section(page, "Retrieval")
    assert "0.4500" in retrieval and "0.3100" in retrieval and ">0.3000<" in retrieval  # worst
    assert "120 queries over 400 documents (first-sentence→rest)" in html.unescape(retrieval)
    assert "trained stage minus random init stage +10.0 pp" in retrieval
    table = _section(page, "Held-out evaluation by corruption kind")
    for kind in ("all selected", "mask", "random", "keep"):
        assert f">{kind}</td>" in table
    assert f"{evaluation['trained']['count']:,}" in table
    assert f"{100 * evaluation['unigram']['accuracy']:.1f} %" in table
    probe = _section(page, "Downstream probe")
    assert "81.2 %" in probe and "[78.2, 84.2]" in probe and "+26.2 pp" in probe
    assert "75.0 %" in probe  # validation accuracy at the chosen C
    failures = _section(page, "Failure cases")
    assert failures.count("<mark>") == 5
    audit = _section(page, "Audit")
    assert audit.count('badge PASS">PASS') == 1 and audit.count('badge FAIL">FAIL') == 1
    assert audit.count('badge SKIP">SKIP') == 1
    provenance = _section(page, "Provenance")
    info = json.loads((run / "run.json").read_text())
    masks_sha = json.loads((run / "eval_masks.json").read_text())["sha256"]
    for value in (info["dataset_fingerprint"], info["tokenizer_sha256"], masks_sha,
                  "(file matches)", "(eval.json used this set)", '"rate": 0.15'):
        assert value in html.unescape(provenance)


def test_headline_claims_follow_the_measured_numbers(full_report):
    _, page, evaluation = full_report
    headline = _section(page, "Headline")
    assert "1/3 PASS" in headline  # the skip is not counted as a pass
    results = {c["claim"]: c["holds"] for c in claims_lib.claims(evaluation, PROBE, AUDIT)}
    assert results["probe: trained beats random init outside the 95 % CI"] is True
    assert results["audit passes"] is False


@pytest.mark.fast
def test_claims_thresholds():
    def ev(t, u, r, n=10000):
        return {"trained": {"accuracy": t, "count": n}, "unigram": {"accuracy": u},
                "random_init": {"accuracy": r}}

    def holds(evaluation, probe=None):
        return [c["holds"] for c in claims_lib.claims(evaluation, probe, None)]

    assert holds(ev(0.20, 0.10, 0.001)) == [True, True, None, None]
    assert holds(ev(0.19, 0.10, 0.001)) == [False, True, None, None]
    assert holds(ev(0.02, 0.001, 0.018, n=1000)) == [True, False, None, None]
    overlapping = json.loads(json.dumps(PROBE))
    overlapping["results"]["trained"]["accuracy"] = 0.57  # inside random init's CI
    assert holds(ev(0.2, 0.1, 0.0), overlapping)[2] is False
    assert holds(None) == [None, None, None, None]


def test_stale_evaluation_is_flagged(full_report, tmp_path):
    run, _, _ = full_report
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    evaluation = json.loads((copy / "eval.json").read_text())
    evaluation["step"] = 3
    (copy / "eval.json").write_text(json.dumps(evaluation))
    page = report_lib.write_report(copy).read_text()
    assert "eval.json is from step 3 but the latest checkpoint is step 6" in page


def test_cards_name_their_step_mixed_steps_are_flagged_and_checkpoints_make_a_curve(
        full_report, tmp_path, monkeypatch):
    from clozax.judge.evaluate import evaluate_checkpoints, evaluate_run
    from clozax.report import figures

    run, page, _ = full_report
    assert "held-out masked-token accuracy · step 6" in page and "different checkpoints" \
        not in page
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    (copy / "probe.json").write_text(json.dumps({**PROBE, "step": 3}))
    evaluate_checkpoints(copy, failures=1)  # steps 3 and 6, into history/
    drawn = {}
    real = figures.line_plot

    def spy(path, series, **kw):
        drawn[path.name] = series
        return real(path, series, **kw)

    monkeypatch.setattr(figures, "line_plot", spy)
    page = report_lib.write_report(copy).read_text()
    assert ("These results are of different checkpoints (evaluate at step 6, probe at step 3, "
            "audit at step 6)") in page
    x, y = drawn["accuracy.png"]["held-out, whole set (clozax evaluate)"]
    assert list(x) == [3 * 8 * 64, 6 * 8 * 64] and len(y) == 2  # tokens seen at 3 and 6
    # --step 3: that checkpoint's page, from its own results (its failures, its --full too).
    full = evaluate_run(copy, step=3, full=True, failures=1)
    at3 = report_lib.write_report(copy, step=3)
    assert at3.name == "report-step3.html" and (copy / "report-step3").is_dir()
    old = html.unescape(at3.read_text())
    three = json.loads((copy / "history" / "eval-3.json").read_text())
    assert "held-out masked-token accuracy · step 3" in old and "step 3 of 6" in old
    assert f"{100 * three['trained']['accuracy']:.1f} %" in old
    assert (copy / "history" / "failures-3.jsonl").is_file()
    assert (f"Every held-out row (clozax evaluate --full, step 3): "
            f"{full['schedule']['rows']:,} rows, {full['trained']['count']:,} positions"
            ) in re.sub("<[^>]+>", "", old)
    assert "evaluate --full" not in html.unescape((copy / "report.html").read_text())
    with pytest.raises(ValueError, match="no committed checkpoint at step 4; it has 3, 6"):
        report_lib.write_report(copy, step=4)


def test_report_of_a_directory_that_is_not_a_run_is_a_one_line_error(tmp_path, capsys):
    from clozax.app.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["report", str(tmp_path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "not a clozax run" in err and "\n" not in err


@needs_chromium
def test_report_renders_in_headless_chromium(full_report, tmp_path):
    run = full_report[0]
    image = screenshot((run / report_lib.REPORT_FILE).absolute().as_uri(), tmp_path / "shot.png",
                       1280, 2400)
    assert image.shape == (2400, 1280, 3)
    assert_drawn(image, max_background=0.9)
