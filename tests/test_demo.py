"""clozax demo: prepare → train → evaluate → probe → finetune → audit → report through the
real CLI."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest

from clozax.app import demo as demo_lib

SECTIONS = ["Headline", "Training", "What the model predicts",
            "Held-out evaluation by corruption kind", "Downstream probe", "Fine-tuning",
            "Retrieval",
            "Failure cases", "Audit", "Provenance"]


def _demo(out, timeout=420):
    return subprocess.run(
        [sys.executable, "-m", "clozax.app.cli", "demo", "--out", str(out), "--preset", "tiny",
         "--steps", "4", "--quick"],
        capture_output=True, text=True, timeout=timeout)


def test_demo_quick_end_to_end_through_the_cli_then_resumes(stdlib_data, tmp_path):
    out = tmp_path / "demo"
    # The session dataset was prepared with the quick settings, so the demo must reuse it.
    shutil.copytree(stdlib_data, out / "data")
    first = _demo(out)
    assert first.returncode == 0, first.stderr[-3000:] + first.stdout[-3000:]
    assert "reusing prepared dataset" in first.stdout
    report = out / "run" / "report.html"
    assert f"report: {report}" in first.stdout.replace("\n", "")
    page = report.read_text(encoding="utf-8")
    for title in SECTIONS:
        assert f"<h2>{title}</h2>" in page
    assert "not run" not in page  # evaluate, probe and audit all ran
    for name in ("eval.json", "failures.jsonl", "probe.json", "audit.json",
                 "finetune/labels/result.json", "finetune/labels/model/model.safetensors",
                 "retrieval.json",
                 "report/loss.png",
                 "report/accuracy.png", "report/probabilities.png"):
        assert (out / "run" / name).is_file(), name
    printed = " ".join(first.stdout.split())  # as printed, whatever the console wrapped
    for line in ("held-out masked-token accuracy: trained", "probe accuracy (95 % CI): trained",
                 "fine-tuned accuracy over seeds: trained", "audit:",
                 "retrieval nDCG@10 (held-out first sentence → rest): BM25",
                 "held-out accuracy ≥ 2× unigram",
                 "probe: trained beats random init outside the 95 % CI",
                 "fine-tuned (built-in task): trained clearly beats TF-IDF",
                 "modern-small beats its random-init control at this budget"):
        assert line in printed, line
    assert json.loads((out / "run" / "audit.json").read_text())["passed"]
    peak = re.search(r"peak RSS (\d+\.\d\d) GB", printed)
    assert peak and 0.1 < float(peak.group(1)) < 2.5  # the demo measures its own peak

    second = _demo(out)  # resumable: training is complete, every stage's output is current
    assert second.returncode == 0, second.stderr[-3000:]
    for name in ("eval.json", "probe.json", "result.json", "retrieval.json", "audit.json"):
        assert f"{name} is up to date" in second.stdout
    assert "already completed 4 steps" in second.stderr + second.stdout


@pytest.mark.parametrize("rule, reused", [("today", True), ("other", False), (None, False)])
def test_a_judged_result_is_reused_only_under_todays_overlap_rule(tmp_path, rule, reused):
    """The demo re-judges a fine-tuning result recorded under another overlap rule (an older
    threshold or shingle length), not only one recorded under none."""
    from clozax.judge import overlap as overlap_lib

    recorded = {"today": overlap_lib.RULE, "other": {**overlap_lib.RULE, "containment": 0.8},
                None: None}[rule]
    path = tmp_path / "finetune.json"
    overlap = {"excluded": 0} if recorded is None else {"excluded": 0, "rule": recorded}
    path.write_text(json.dumps({"step": 7, "task": {"pretraining_overlap": overlap}}))
    ran = []
    result = demo_lib._reuse_or_run(path, 7, lambda _: None, lambda: ran.append(1) or {"new": 1},
                                    judged=True)
    assert (result == {"new": 1}) != reused and bool(ran) != reused


def test_demo_refuses_a_data_directory_prepared_with_other_settings(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    manifest = {"corpus": {"source": "stdlib"}, "seq_len": 128, "heldout_fraction": 0.05,
                "seed": 0, "tokenizer": {"vocab_size": 4096, "model": "bpe", "lowercase": True}}
    (data / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=r"vocab_size 4096 \(want 8192\)"):
        demo_lib.prepare_data(data, demo_lib.DATA_SETTINGS, print)
    (data / "manifest.json").unlink()
    (data / "stray.txt").write_text("x")
    with pytest.raises(ValueError, match="not a prepared dataset"):
        demo_lib.prepare_data(data, demo_lib.DATA_SETTINGS, print)


def test_demo_rejects_nonpositive_steps_with_a_one_line_error(tmp_path, capsys):
    from clozax.app.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--out", str(tmp_path / "d"), "--steps", "0"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().startswith("error: --steps 0 must be >= 1")


@pytest.mark.skipif(sys.platform != "linux", reason="ru_maxrss survives exec on Linux")
def test_the_demo_measures_its_own_peak_memory_not_the_large_process_that_started_it():
    # Linux's ru_maxrss survives exec: a demo started by a 4 GB pytest worker once "measured"
    # 5 GB. The parent here holds 1 GB; the child, a bare interpreter, measures well under it.
    child = ("from clozax.app.demo import peak_rss_gb; import resource; "
             "print(peak_rss_gb(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")
    ballast = bytearray(1_000_000_000)
    ballast[::4096] = b"\x01" * len(ballast[::4096])  # resident, page by page
    own, inherited_kib = map(float, subprocess.run(
        [sys.executable, "-c", child], capture_output=True, text=True, check=True).stdout.split())
    del ballast
    assert inherited_kib * 1024 / 1e9 > 1.0  # the inherited figure: the parent's peak
    assert 0.01 < own < 0.8


def test_a_signal_stops_the_demo_between_stages_keeping_what_is_finished(stdlib_data, tmp_path,
                                                                         monkeypatch):
    import os
    import signal

    from clozax.train.interrupts import Interrupted

    shutil.copytree(stdlib_data, tmp_path / "demo" / "data")  # prepared with quick settings
    real = demo_lib.prepare_data

    def prepare_then_sigterm(*args, **kwargs):
        real(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler's, while the stage finishes

    monkeypatch.setattr(demo_lib, "prepare_data", prepare_then_sigterm)
    with pytest.raises(Interrupted, match="before the train stage; the finished stages are "
                                          "kept") as stopped:
        demo_lib.run_demo(tmp_path / "demo", quick=True)
    assert stopped.value.exit_code == 143
    assert (tmp_path / "demo" / "data" / "manifest.json").is_file()
    assert not (tmp_path / "demo" / "run").exists()
