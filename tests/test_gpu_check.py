"""``benchmarks/gpu_check.sh`` with ``QUICK=1`` on this CPU: every stage of the device check
runs and prints its figures, so that a lent GPU's 15 minutes measure instead of debugging the
script. Its numbers here mean nothing; what it proves is the script's logic: the stages, the
commands and options it calls, the parsing of their output, the budget, the exit code."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = ("prepare", "train", "train-modern", "evaluate", "evaluate-modern", "probe",
            "finetune", "embed", "retrieval", "export", "audit")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory) -> tuple[int, str]:
    out = tmp_path_factory.mktemp("gpu-check")
    env = {**os.environ, "QUICK": "1", "PYTHON": sys.executable, "STAGES": "1 2 3 4 5 6 7",
           "BUDGET_S": "1500"}  # stage 7 has a lease of its own on a device
    ran = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), str(out)],
                         # past the check's own budget: a command it cuts is reported, not lost
                         env=env, capture_output=True, text=True, timeout=1500 + 300)
    return ran.returncode, ran.stdout + ran.stderr


def test_every_stage_runs_and_the_check_passes(quick_run):
    code, output = quick_run
    assert code == 0, output[-4000:]
    assert "gpu_check: every stage ran and passed" in output
    assert "FAILED" not in output and "Traceback" not in output
    for stage in range(1, 8):
        assert f"== {stage}. " in output, f"stage {stage} missing"


def test_it_prints_every_figure_the_issue_asks_for(quick_run):
    _, output = quick_run
    assert len(re.findall(r"(cold|warm) cache: compile \+ first step [0-9.]+ s$", output,
                          re.M)) == 2
    for command in COMMANDS:
        assert re.search(rf"^smoke: {command} exit 0 \(\d+ s\)$", output, re.M), command
    rows = re.findall(r"^\s+128 (rows|documents|window)\s+(\w+)\s+[0-9.]+\s+[0-9.]+", output,
                      re.M)
    assert {path for _, path in rows} == {"einsum", "xla", "flash", "blocked"}
    assert len(re.findall(r"ratio clozax/HF\s+[0-9.]+x", output)) == 2  # classic, modern
    assert len(re.findall(r"MFU vs 989 TFLOP/s: clozax [0-9.]+ % \(useful\)", output)) == 2
    assert "packed documents of ~32 tokens" in output
    assert re.search(r"steady [0-9,]+ tokens/s", output)
    assert "'platform': 'cpu'" in output  # run.json's attention record, printed
    # stage 7: the recipe from scratch at the device budget, fine-tuned: its table row
    assert re.search(r"^\| 1 min \| 3 \| [0-9.]+ % .*\| [-+][0-9.]+ pp .*\| [-+][0-9.]+ pp ",
                     output, re.M)
    assert "Crossing with TF-IDF: " in output


def test_a_spent_budget_skips_what_is_left_and_says_so(tmp_path):
    env = {**os.environ, "QUICK": "1", "PYTHON": sys.executable, "BUDGET_S": "1",
           "STAGES": "1 2"}
    ran = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), str(tmp_path)],
                         env=env, capture_output=True, text=True, timeout=300)
    assert ran.returncode == 2, ran.stdout + ran.stderr  # nothing failed, something unrun
    assert "smoke: audit skipped (the check's 1 s budget is spent)" in ran.stdout
    assert "compile + first step not measured" in ran.stdout
