"""What a run's log lines say: throughput from the end of the compiling step, training time
only, MFU against a stated peak, the data-wait share, elapsed and ETA."""

from __future__ import annotations

import json

import pytest

from clozax.core import flops
from clozax.core.model_config import PRESETS, ModelConfig
from clozax.train.observe import Pace, clock, step_line

pytestmark = pytest.mark.fast  # make test-fast; tests marked slow stay out


def test_throughput_is_measured_from_the_first_step_and_excludes_evaluation_and_saves():
    pace = Pace(tokens_per_step=1000, flops_per_token=6e6, peak=1e12, started=0.0, end=21)
    assert "tokens_per_s" not in pace.fields(1, 9.0, 0.0)  # the compiling step: no rate
    pace.begin(1, 10.0, waited=0.2)  # step 1 compiled and ran, 10 s after the command began
    first = pace.fields(3, 12.0, waited=0.7)
    assert first["tokens_per_s"] == pytest.approx(2 * 1000 / 2.0)  # steps 2-3 over 2 s
    assert first["data_wait_share"] == pytest.approx(0.25)  # 0.5 s of the 2 s
    assert first["mfu"] == pytest.approx(1000 * 6e6 / 1e12)
    assert first["elapsed_s"] == 12.0 and first["eta_s"] == pytest.approx(1.0 * 18)
    pace.exclude(0.5)  # an evaluation
    second = pace.fields(5, 14.0, waited=0.7)
    assert second["tokens_per_s"] == pytest.approx(2 * 1000 / 1.5)
    assert second["eta_s"] == pytest.approx(4.0 / 4 * 16)  # wall per step, evaluation included
    assert "mfu" not in Pace(1000, 6e6, None, 0.0, 21).fields(1, 1.0, 0.0)


def test_a_log_line_off_a_terminal_says_rate_mfu_wait_elapsed_and_eta():
    record = {"step": 40, "loss": 5.1234, "lr": 1e-3, "tokens_per_s": 6100.4, "mfu": 0.123,
              "data_wait_share": 0.01, "elapsed_s": 83.2, "eta_s": 3725.0}
    assert step_line(record, 600) == ("step 40/600: loss 5.1234 lr 1.00e-03 | 6,100 tok/s mfu "
                                      "12.3% data wait 1% | elapsed 1:23 eta 1:02:05")
    assert clock(59.6) == "1:00" and clock(-3) == "0:00"


def test_mfu_peaks_come_from_the_data_sheet_or_the_config_and_flops_follow_the_formula():
    peak, source = flops.peak_flops("NVIDIA H100 80GB HBM3", "bfloat16", 8)
    assert peak == 8 * 989e12 and "H100 bfloat16 989" in source
    assert flops.peak_flops("cpu", "float32", 2)[0] is None
    assert flops.peak_flops("cpu", "float32", 2, stated_tflops=1.5)[0] == 3e12
    small = ModelConfig(**PRESETS["small"])
    h, i, v, L, s = small.hidden, small.intermediate, small.vocab_size, small.layers, 128
    per_layer = 2 * (4 * h * h + 2 * h * i) + 4 * s * h
    assert flops.model_flops_per_token(small, s) == 3 * (L * per_layer + 2 * (h * h + h * v))


@pytest.mark.slow
def test_training_logs_carry_pace_fields_and_a_consistent_rate(tiny_run):
    records = [json.loads(x) for x in (tiny_run / "metrics.jsonl").read_text().splitlines()]
    first, second = records[0], records[1]  # steps 3 and 6 (evaluated and saved at 3)
    for r in records:
        assert {"elapsed_s", "eta_s", "tokens_per_s", "data_wait_share"} <= set(r)
        assert r["eval"]["rows"] > 0  # the in-training sample's size, said with its numbers
    train_seconds = (second["elapsed_s"] - first["elapsed_s"] - first["eval_seconds"]
                     - first.get("checkpoint_seconds", 0.0))
    tokens_per_step = second["tokens"] // second["step"]
    # The rate's interval is the record's, up to its three fields' rounding to 1 ms (at most
    # 1.5 ms: a tiny run's 3 steps take a few ms, so a relative bound would be rounding noise).
    assert 3 * tokens_per_step / second["tokens_per_s"] == pytest.approx(train_seconds,
                                                                         abs=1.6e-3)
    # The first line's rate is over steps 2-3, measured from the end of the compiling step: its
    # interval is a real one, not the 1e-9 s floor of a line with no measured time (a ratio to
    # the second line's rate would be timing noise: an async save of step 3 overlaps 4-6).
    first_seconds = 2 * tokens_per_step / first["tokens_per_s"]
    assert 1e-4 < first_seconds < first["elapsed_s"]
