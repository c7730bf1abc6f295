"""A run in phases: the config's [[phases]], the plan, the piecewise learning rate, the row
stream, and one two-phase run (32 -> 64 tokens, StableAdamW, WSD, a mask ramp and a batch
ramp, RoPE theta raised) resumed before, at and after its boundary."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import jax
import numpy as np
import pytest

from clozax.core import optim as optim_lib
from clozax.data.dataset import open_dataset
from clozax.data.loader import epoch_permutation, stream_rows
from clozax.train import config as config_lib
from clozax.train import loop as train_lib
from clozax.train.phase_config import PhaseConfig
from clozax.train.phases import batch_stages, make_plan, tokens_at
from clozax.train.recipes import apply_recipe
from clozax.train.run_dir import load_run

pytestmark = pytest.mark.fast  # make test-fast; tests marked slow stay out

# --------------------------------------------------------------------------- config


def _toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


def test_phases_load_from_toml_tables_with_data_paths_relative_to_the_file(tmp_path):
    (tmp_path / "sub").mkdir()
    cfg = config_lib.resolve(_toml(tmp_path / "sub", """
[[phases]]
steps = 10
[[phases]]
name = "long"
data = "../d512"
tokens = 4096
"""))
    assert [p.steps for p in cfg.phases] == [10, None] and cfg.phases[1].tokens == 4096
    assert cfg.phases[1].data == str((tmp_path / "sub" / ".." / "d512").absolute())
    assert config_lib.from_dict(json.loads(cfg.to_json())) == cfg  # config.json round trip


@pytest.mark.parametrize("text, words", [
    ("[[phases]]\nsteps = 3\ntokens = 9\n", "exactly one of steps and tokens"),
    ("[[phases]]\n", "exactly one of steps and tokens"),
    ("[[phases]]\nsteps = 3\nlr = 1.0\n", "unknown phases key(s) ['lr']; valid phases keys"),
    ("[[phases]]\nsteps = 3\nbatch_start = 4\n", "batch_start and phases.batch_ramp_steps"),
    ("[[phases]]\nsteps = 3\nbatch_start = 8\nbatch_ramp_steps = 2\nbatch_size = 8\n",
     "not below phases.batch_size=8"),
    ("[[phases]]\nsteps = 3\nrate_end = 0.15\n", "without phases.rate"),
    ("[[phases]]\nsteps = 3\nrate = 0.9\n", "outside (0, 0.5]"),
    ("[[phases]]\nsteps = 3\ndecay = \"exp\"\n", "phases.decay='exp' is not one of"),
    ("[[phases]]\nsteps = 3\ntrains = \"encoder\"\n", "phases.trains='encoder' is not one of"),
    ("[[phases]]\nsteps = 3\nwarmup_steps = 3\n", "not shorter than the phase"),
    ("[[phases]]\nsteps = 3\nrope_theta_global = 1e6\n", "needs model.positions='rope'"),
    ("[train]\nminutes = 2.0\n[[phases]]\nsteps = 3\n", "train.minutes cannot be combined"),
    ("[[phases]]\nname = \"a\"\nsteps = 3\n[[phases]]\nname = \"a\"\nsteps = 3\n",
     "used twice"),
    # its held-out set was eval_masks_15.npz, the fixed-15 % set's file
    ("[[phases]]\nname = \"15\"\nsteps = 3\n", "phase name '15' would name its held-out set"),
    # the phases' 3 once replaced it without a word
    ("[train]\nsteps = 5\n[[phases]]\nsteps = 3\n", "sets [train] steps = 5 beside [[phases]], "
     "whose steps total 3: a run in phases has the length its phases give; drop [train] steps"),
    ("[train]\nsteps = 5\n[[phases]]\ntokens = 4096\n", "sets [train] steps = 5 beside"),
])
def test_a_bad_phase_table_is_one_line_naming_the_key(tmp_path, text, words):
    with pytest.raises(ValueError) as e:
        config_lib.resolve(_toml(tmp_path, text))
    assert words in str(e.value) and "\n" not in str(e.value)


def test_train_steps_equal_to_the_phases_total_is_their_length_and_accepted(tmp_path):
    cfg = config_lib.resolve(_toml(tmp_path, "[train]\nsteps = 7\n[[phases]]\nsteps = 3\n"
                                             "[[phases]]\nsteps = 4\n"))
    assert cfg.train.steps == 7 and [p.steps for p in cfg.phases] == [3, 4]


def test_steps_beside_phases_is_refused_in_one_line_before_anything_trains(
        stdlib_data, tmp_path, capsys):
    # It was dropped without a word: `--steps 5` trained the phases' 50.
    from commands import one_line_error

    toml = _toml(tmp_path, "[[phases]]\nsteps = 50\n")
    line = one_line_error(capsys, "train", "--data", stdlib_data, "--out", tmp_path / "run",
                          "--config", toml, "--preset", "tiny", "--steps", "5")
    assert "--steps 5 cannot be combined with [[phases]]" in line
    assert not (tmp_path / "run").exists()
    line = one_line_error(capsys, "train", "--data", stdlib_data, "--out", tmp_path / "run",
                          "--config", toml, "--preset", "tiny", "--set", "train.steps=5")
    assert "--set train.steps=5 cannot be combined with [[phases]]" in line
    assert not (tmp_path / "run").exists()


# --------------------------------------------------------------------------- the plan


def _fake(seq_len: int, rows: int = 1000, tokenizer: str = "t", fingerprint: str = "f"):
    return SimpleNamespace(seq_len=seq_len, tokenizer_sha256=tokenizer,
                           train=SimpleNamespace(rows=rows), fingerprint=fingerprint)


def test_a_batch_ramp_is_growing_stages_rounded_to_a_common_unit():
    ramp = PhaseConfig(steps=20, batch_start=768, batch_ramp_steps=8, batch_size=4608)
    # ModernBERT's 768 -> 4,608 in 4 stages of 2 updates, multiples of gcd = 768
    assert batch_stages(ramp, 4608) == [(2, 768), (2, 1536), (2, 2304), (2, 3072)]
    small = PhaseConfig(steps=20, batch_start=4, batch_ramp_steps=6, batch_ramp_stages=3)
    assert batch_stages(small, 8) == [(6, 4)]  # 4, 5 -> 4, 6 -> 4: one stage, one compile


def test_the_plan_gives_each_segment_its_rows_and_a_tokens_length_its_steps(tmp_path):
    data = {tmp_path / "a": _fake(32), tmp_path / "b": _fake(64)}
    for path in data:
        path.mkdir()
    cfg = config_lib.RunConfig(train=config_lib.TrainConfig(batch_size=8), phases=(
        PhaseConfig(steps=10, batch_start=4, batch_ramp_steps=4, batch_ramp_stages=2),
        PhaseConfig(data=str(tmp_path / "b"), tokens=64 * 8 * 3 + 1),  # 3 steps and a token
        PhaseConfig(steps=2)))
    plan, opened = make_plan(cfg, tmp_path / "a", lambda p: data[Path(p)])
    got = [(s.phase, s.start, s.end, s.batch_size, s.seq_len, s.row_start) for s in plan.segments]
    assert got == [(0, 0, 4, 4, 32, 0), (0, 4, 10, 8, 32, 16),
                   (1, 10, 14, 8, 64, 0),  # its own dataset's stream starts at 0
                   (2, 14, 16, 8, 32, 64)]  # the first dataset's stream goes on after 16 + 48
    assert plan.total == 16 and plan.at(13).phase == 1 and plan.at(14).phase == 2
    assert plan.tokens_through(5) == 4 * 4 * 32 + 8 * 32
    assert [p["batch_sizes"] for p in plan.phases()] == [[[0, 4], [4, 8]], [[10, 8]], [[14, 8]]]
    other = {**data, tmp_path / "b": _fake(64, tokenizer="other")}
    with pytest.raises(ValueError, match="another tokenizer than"):
        make_plan(cfg, tmp_path / "a", lambda p: other[Path(p)])


def test_a_run_in_phases_may_move_its_datasets_but_not_change_them(tmp_path):
    # Datasets are compared by fingerprint and row length: a moved one (a new path) resumes;
    # it was refused, as an unphased run's is not.
    from clozax.train.phases import run_records

    def records(root: Path, fingerprint: str = "f"):
        data = {root / "a": _fake(32), root / "b": _fake(64, fingerprint=fingerprint)}
        for path in data:
            path.mkdir(parents=True, exist_ok=True)
        cfg = config_lib.RunConfig(phases=(PhaseConfig(steps=4),
                                           PhaseConfig(data=str(root / "b"), steps=2)))
        plan, opened = make_plan(cfg, root / "a", lambda p: data[Path(p)])
        return plan, opened

    plan, opened = records(tmp_path / "here")
    recorded = run_records(plan, opened, tmp_path / "run", None)
    moved, moved_data = records(tmp_path / "there")
    now = run_records(moved, moved_data, tmp_path / "run", recorded)
    assert [r["data"] for r in now] != [r["data"] for r in recorded]  # where they are now
    changed, changed_data = records(tmp_path / "there", fingerprint="other bytes")
    with pytest.raises(ValueError, match="planned on other data or lengths"):
        run_records(changed, changed_data, tmp_path / "run", recorded)


def test_a_run_in_phases_resumes_after_its_datasets_and_config_moved(stdlib_data, data32,
                                                                    tmp_path):
    """Killed after its first checkpoint, then the datasets and the TOML (whose second phase
    names its data relative to the file) moved to another folder: the same command resumes
    and finishes, and config.json and run.json name the datasets where they are now. It was
    refused: `phases[1]: data` differed."""
    import shutil

    def place(root: Path):
        root.mkdir()
        shutil.copytree(data32, root / "d32")
        shutil.copytree(stdlib_data, root / "d64")
        (root / "conf").mkdir()
        return _toml(root / "conf", """
[model]
preset = "tiny"
[train]
batch_size = 8
save_every = 2
eval_every = 4
[[phases]]
steps = 2
[[phases]]
data = "../d64"
steps = 2
""")

    run = tmp_path / "run"
    cfg = config_lib.resolve(place(tmp_path / "here"))
    train_lib.train(tmp_path / "here" / "d32", run, cfg, stop_after=2)
    shutil.rmtree(tmp_path / "here")
    moved = config_lib.resolve(place(tmp_path / "there"))
    result = train_lib.train(tmp_path / "there" / "d32", run, moved)
    assert result.steps == 4
    there = (tmp_path / "there" / "d64").resolve()
    saved = json.loads((run / "config.json").read_text())
    assert Path(saved["phases"][1]["data"]).resolve() == there
    info = json.loads((run / "run.json").read_text())
    assert Path(info["phases"][1]["data"]).resolve() == there


def test_the_row_stream_reads_every_row_once_per_epoch_whatever_the_batch_sizes():
    rows, seed = 37, 5
    sizes = [4, 4, 8, 8, 8, 16, 16, 16, 16]  # 96 rows: 2 epochs and 22 more
    got, at = [], 0
    for b in sizes:
        got.append(stream_rows(seed, at, b, rows))
        at += b
    stream = np.concatenate(got)
    for e in range(2):
        np.testing.assert_array_equal(stream[e * rows:(e + 1) * rows],
                                      epoch_permutation(seed, e, rows))
    np.testing.assert_array_equal(stream_rows(seed, 30, 20, rows), stream[30:50])  # pure


# --------------------------------------------------------------------------- learning rate


def test_a_one_piece_schedule_is_the_classic_learning_rate():
    optim = config_lib.OptimConfig(warmup_steps=3, schedule="1-sqrt", decay_fraction=0.4,
                                   end_lr_fraction=0.02)
    piece = optim_lib.RatePiece(0, 20, 1e-3, 3, "1-sqrt", 0.4, 2e-5)
    counts = np.arange(20)
    np.testing.assert_allclose(optim_lib.piecewise_rate((piece,))(counts),
                               optim_lib.learning_rate(optim, counts, 20), rtol=0, atol=1e-9)


def test_each_phase_has_its_closed_form_piece_and_warms_up_from_where_the_last_ended():
    cfg = config_lib.RunConfig(optim=config_lib.OptimConfig(warmup_steps=2, schedule="cosine",
                                                            end_lr_fraction=0.1), phases=(
        PhaseConfig(steps=6, decay="linear", decay_fraction=0.5, end_lr_fraction=0.5),
        PhaseConfig(steps=4, learning_rate=2e-3, warmup_steps=2),
        PhaseConfig(steps=5)))
    data = {Path("/d").absolute(): _fake(32)}
    plan, _ = make_plan(cfg, Path("/d"), lambda p: data[Path(p)])
    lr = np.asarray(optim_lib.piecewise_rate(plan.pieces)(np.arange(15)))
    peak = 1e-3
    # phase 1: warm-up 0, 1/2; stable 1e-3 until 4 = 6 - 0.5 * (6 - 2); linear to 5e-4 at 6
    expected = [0, peak / 2, peak, peak, peak, peak - (peak / 2) * 0.5]
    # phase 2 warms up from the rate phase 1 ended at (5e-4) to 2e-3, no decay (not last)
    expected += [5e-4, 5e-4 + (2e-3 - 5e-4) / 2, 2e-3, 2e-3]
    # phase 3 (last): optim's cosine over its steps from 1e-3 to 1e-4, no warm-up
    frac = np.arange(5) / 5
    expected += list(1e-4 + (peak - 1e-4) * 0.5 * (1 + np.cos(np.pi * frac)))
    np.testing.assert_allclose(lr, expected, rtol=2e-6, atol=1e-10)


def test_the_modernbert_recipe_scales_its_phases_to_the_run():
    cfg = apply_recipe("modernbert", config_lib.resolve(
        preset="tiny", overrides=["train.steps=100", "train.batch_size=32"]))
    assert cfg.optim.optimizer == "stable_adamw" and cfg.optim.learning_rate == 8e-4
    assert (cfg.optim.b1, cfg.optim.b2, cfg.optim.eps, cfg.optim.weight_decay) == (
        0.9, 0.98, 1e-6, 1e-5)
    assert cfg.masking.rate == 0.3
    stable, decay = cfg.phases
    assert (stable.steps, stable.batch_start, stable.batch_ramp_steps) == (90, 8, 10)
    assert (decay.steps, decay.decay) == (10, "1-sqrt") and cfg.optim.end_lr_fraction == 0.02
    with pytest.raises(ValueError, match="unknown recipe 'bert'"):
        apply_recipe("bert", cfg)
    with pytest.raises(ValueError, match="--recipe and \\[\\[phases\\]\\] both given"):
        apply_recipe("modernbert", cfg)


def test_the_budget_recipe_masks_40_percent_in_two_microbatches_and_keeps_the_rest(tmp_path):
    from clozax.train.command import Options, resolve_command

    base = config_lib.resolve(preset="tiny", overrides=[
        "train.steps=100", "train.batch_size=32", "optim.learning_rate=5e-4"])
    cfg = apply_recipe("budget", base)
    assert cfg.masking.rate == 0.4 and cfg.masking.rate_end is None
    assert cfg.train.microbatches == 2 and cfg.train.steps == 100
    assert cfg.optim == base.optim and cfg.model == base.model and not cfg.phases
    # as `clozax train --recipe budget` resolves it, --set and --minutes kept
    resolved = resolve_command(tmp_path / "run", Options(
        minutes=8.0, preset="tiny", set_=("optim.learning_rate=5e-4",), recipe="budget"))
    assert resolved.masking.rate == 0.4 and resolved.optim.learning_rate == 5e-4
    assert resolved.train.minutes == 8.0 and resolved.train.microbatches == 2
    with pytest.raises(ValueError, match="microbatches"):
        apply_recipe("budget", config_lib.resolve(preset="tiny",
                                                  overrides=["train.batch_size=7"]))


@pytest.mark.parametrize("recipe, given, words", [
    ("budget", ["--set", "masking.rate=0.3"],
     "--recipe budget sets masking.rate to 0.4, and --set masking.rate=0.3 sets it to 0.3; drop "
     "one of them"),
    ("budget", ["--set", "train.microbatches=4"], "sets train.microbatches to 2, and --set "
     "train.microbatches=4 sets it to 4"),
    ("modernbert", ["--steps", "100", "--set", "optim.learning_rate=5e-4"],
     "--recipe modernbert sets optim.learning_rate to 0.0008, and --set optim.learning_rate=5e-4 "
     "sets it to 0.0005"),
    ("budget", ["--config", "CONFIG"], "sets masking.rate to 0.4, and config file CONFIG "
     "([masking] rate) sets it to 0.15"),
])
def test_a_recipe_and_a_setting_of_the_same_key_are_refused_in_one_line_naming_both(
        tmp_path, capsys, recipe, given, words):
    # The recipe's value once replaced the user's without a word (the run masked 40 %, not 30).
    from commands import one_line_error

    config = _toml(tmp_path, "[masking]\nrate = 0.15\n")
    given = [str(config) if g == "CONFIG" else g for g in given]
    line = one_line_error(capsys, "train", "--data", tmp_path / "data", "--out",
                          tmp_path / "run", "--preset", "tiny", "--recipe", recipe, *given)
    assert words.replace("CONFIG", str(config)) in line
    assert not (tmp_path / "run").exists()


def test_a_setting_the_recipe_agrees_with_is_no_conflict(tmp_path):
    from clozax.train.command import Options, resolve_command

    cfg = resolve_command(tmp_path / "run", Options(preset="tiny", recipe="budget", set_=(
        "masking.rate=0.4", "train.microbatches=2", "optim.learning_rate=5e-4")))
    assert (cfg.masking.rate, cfg.train.microbatches, cfg.optim.learning_rate) == (0.4, 2, 5e-4)


def test_every_budget_sweep_candidate_resolves_to_a_valid_config(tmp_path, monkeypatch):
    """benchmarks/budget.py's candidates as `clozax train` resolves them: a typo in one fails
    here, not after another candidate's 8 minutes of pretraining."""
    from clozax.train.command import Options, resolve_command

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    budget = pytest.importorskip("budget")
    for name, c in budget.CANDIDATES.items():
        cfg = resolve_command(tmp_path / name, Options(minutes=8.0, preset=c.preset,
                                                       set_=c.sets, recipe=c.recipe))
        assert cfg.train.minutes == 8.0, name
        assert cfg.masking.rate == (0.4 if c.recipe == "budget" else
                                    config_lib.resolve(preset=c.preset).masking.rate), name
    assert resolve_command(tmp_path / "init", Options(
        preset="modern-small", set_=budget.CANDIDATES["modern-init"].sets)).model.init == \
        "modernbert"


# --------------------------------------------------------------------------- a run


PHASED = """
[optim]
optimizer = "stable_adamw"
schedule = "1-sqrt"
end_lr_fraction = 0.02
warmup_steps = 2
[train]
batch_size = 8
eval_every = 100
save_every = 100
eval_rows = 32
log_every = 1
[[phases]]
name = "short"
steps = 6
batch_start = 4
batch_ramp_steps = 4
batch_ramp_stages = 2
rate = 0.4
rate_end = 0.15
ramp_steps = 4
[[phases]]
name = "long"
data = "DATA64"
steps = 4
rope_theta_global = 320000.0
warmup_steps = 1
learning_rate = 5e-4
"""


def _subtrees(run: Path, step: int | None = None) -> dict:
    """Each top-level part of ``run``'s parameters (at ``step``) as a list of arrays."""
    params = load_run(run, step=step).params
    return {k: [np.asarray(x) for x in jax.tree.leaves(v)] for k, v in params.items()}


def _same(a: list, b: list) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def _params_equal(a: Path, b: Path) -> bool:
    x, y = _subtrees(a), _subtrees(b)
    return x.keys() == y.keys() and all(_same(x[k], y[k]) for k in x)


@pytest.mark.slow
def test_a_two_phase_run_resumes_bitwise_before_at_and_after_its_boundary_and_exports(
        stdlib_data, data32, tmp_path, capsys):
    from clozax import interop
    from clozax.app.cli import main

    toml = _toml(tmp_path, PHASED.replace("DATA64", str(stdlib_data)))
    cfg = config_lib.resolve(toml, preset="modern-tiny")
    whole = tmp_path / "whole"
    train_lib.train(data32, whole, cfg)
    lines = [json.loads(line) for line in (whole / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["phase"], r["phase_step"]) for r in lines] == [
        *((s, "short", s) for s in range(1, 7)), *((s, "long", s - 6) for s in range(7, 11))]
    # the mask ramp 0.4 -> 0.15 over the first phase's 4 updates, at 32 tokens (13, 11, 9, 7,
    # then 5 a row), on batches of 4 (updates 1-4) then 8; the second phase at the run's 30 %
    # of 64 tokens (19 a row)
    assert [r["selected"] for r in lines] == [4 * 13, 4 * 11, 4 * 9, 4 * 7, 8 * 5, 8 * 5,
                                              *[8 * 19] * 4]
    assert lines[-1]["tokens"] == 4 * 4 * 32 + 2 * 8 * 32 + 4 * 8 * 64
    info = json.loads((whole / "run.json").read_text())
    assert [tokens_at(info, r["step"]) for r in lines] == [r["tokens"] for r in lines]
    pieces = make_plan(cfg, data32, open_dataset)[0].pieces
    np.testing.assert_allclose([r["lr"] for r in lines],
                               optim_lib.piecewise_rate(pieces)(np.arange(10)), rtol=1e-6)
    assert (whole / "checkpoints" / "6").is_dir()  # the boundary is saved
    assert (whole / "eval_masks_long.npz").is_file() and "eval" in lines[5] and "eval" in lines[9]
    # killed before (after 5), at (after 6) and after (after 7) the boundary, each time resumed
    chain = tmp_path / "chain"
    every = cfg.replace(train=dataclasses.replace(cfg.train, save_every=1))  # speed-only
    for stop in (5, 6, 7, None):
        capsys.readouterr()
        train_lib.train(data32, chain, every, stop_after=stop)
        if stop is not None:
            assert load_run(chain).step == stop
    # resumed at 7, inside "long": its header and pace are of 8 x 64-token rows (they once
    # read the --data rows, 8 x 32, for the whole run)
    said = " ".join("".join(capsys.readouterr()).split())
    assert "effective batch 512 tokens" in said and "steps 7->10" in said
    assert _params_equal(whole, chain)
    # a checkpoint's model and trained length are its phase's
    first, last = load_run(whole, step=6), load_run(whole)
    assert (first.trained_length, first.config.model.rope_theta_global) == (32, 160_000.0)
    assert (last.trained_length, last.config.model.rope_theta_global) == (64, 320_000.0)
    # the report counts each phase's tokens and the checkpoint's rows (it read --data's)
    from clozax.report import page as report_lib

    html = report_lib.write_report(whole).read_text(encoding="utf-8")
    assert f"{lines[-1]['tokens']:,} tokens seen, rows of 64 tokens" in html
    out = interop.export_run(whole, tmp_path / "hf")
    hf = json.loads((out / "config.json").read_text())
    assert hf["global_rope_theta"] == 320_000.0
    assert json.loads((out / "tokenizer_config.json").read_text())["model_max_length"] == 64
    # resuming with another phase plan is refused in one line, nothing trained
    capsys.readouterr()
    toml.write_text(PHASED.replace("DATA64", str(stdlib_data)).replace("steps = 4\n",
                                                                       "steps = 5\n"))
    with pytest.raises(SystemExit) as e:
        main(["train", "--data", str(data32), "--out", str(whole), "--config", str(toml),
              "--preset", "modern-tiny"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err.startswith("error:") and "\n" not in err
    assert "phases[1]: steps" in err


HEAD_FIRST = """
[train]
batch_size = 8
eval_every = 100
save_every = 1
keep_checkpoints = 10
eval_rows = 32
log_every = 1
[[phases]]
name = "head"
steps = 3
trains = "head"
learning_rate = 1e-2
[[phases]]
name = "all"
steps = 2
warmup_steps = 1
"""


@pytest.mark.slow
def test_a_head_only_phase_moves_the_mlm_head_and_holds_the_encoder_bitwise(data32, tmp_path):
    """A head warm-up before adapting an encoder: through a ``trains = "head"`` phase every
    parameter outside the MLM head (the tied word embeddings included) is bitwise the source's,
    weight decay notwithstanding; the head moves; the next phase moves the encoder."""
    source = tmp_path / "source"
    cfg = config_lib.resolve(preset="tiny", overrides=["train.steps=2", "train.eval_rows=32",
                                                         "optim.weight_decay=0.1"])
    train_lib.train(data32, source, cfg)
    held = tmp_path / "held"
    train_lib.train(data32, held, config_lib.resolve(_toml(tmp_path, HEAD_FIRST), preset="tiny",
                                                     overrides=["optim.weight_decay=0.1"]),
                    init_from=source)
    before, warmed, after = _subtrees(source), _subtrees(held, step=3), _subtrees(held)
    assert {"embeddings", "layers"} <= set(before) - {"head"}
    for name in set(before) - {"head"}:
        assert _same(before[name], warmed[name]), name
        assert not _same(warmed[name], after[name]), name
    assert not _same(before["head"], warmed["head"])
    lines = [json.loads(line) for line in (held / "metrics.jsonl").read_text().splitlines()]
    assert [r["phase"] for r in lines] == ["head"] * 3 + ["all"] * 2
    assert all(r["grad_norm"] > 0 for r in lines)


def _head_first_steps(data32: Path, tmp_path: Path, head_steps: int):
    """The HEAD_FIRST run's config, a batch, and its two steps (head alone, everything) built
    as the run builds them: the optimizer with the state ``optimizer_apart`` keeps apart."""
    from clozax.core import model as model_lib
    from clozax.core.train_state import TrainState
    from clozax.core.vocab import Vocabulary
    from clozax.data.loader import host_batch
    from clozax.train import step as step_lib
    from clozax.train.phase_config import optimizer_apart

    cfg = config_lib.resolve(_toml(tmp_path, HEAD_FIRST.replace("steps = 3\n", f"steps = "
                                                                  f"{head_steps}\n")),
                             preset="tiny", overrides=["optim.b2=0.98"])
    ds = open_dataset(data32)
    vocab = Vocabulary(ds.vocab_size, ds.specials)
    params = model_lib.init(cfg.model, jax.random.key(0))
    optimizer, rate = optim_lib.make_optimizer(cfg.optim, cfg.train.steps, params,
                                               apart=optimizer_apart(cfg.phases))
    steps = {trains: jax.jit(step_lib.make_train_step(cfg, vocab, ds.seq_len, optimizer, rate,
                                                      trains=trains))
             for trains in ("head", "all")}
    state = TrainState(jax.numpy.zeros((), jax.numpy.int32), params, optimizer.init(params))
    return state, optimizer, steps, host_batch(ds.train, np.arange(8))


@pytest.mark.parametrize("head_steps", [1, 10])
def test_after_a_head_only_phase_the_encoders_first_update_is_a_fresh_adams(data32, tmp_path,
                                                                           head_steps):
    """The head warm-up leaves the encoder's Adam where it was: its moments and count stand
    still through the head-only steps (the head's own state counts them), so the encoder's
    first update afterwards is bitwise the one a fresh Adam makes from the same parameters at
    the same step. With one shared count it was 0.73x (1 head step) and 0.42x (10) of it
    (b2 = 0.98: the bias correction divided moments that never saw those steps)."""
    state, optimizer, steps, batch = _head_first_steps(data32, tmp_path, head_steps)
    key = jax.random.key(3)
    before = state.opt_state
    for _ in range(head_steps):
        state, _ = steps["head"](state, batch, key)
    held = [s for s in jax.tree.leaves(state.opt_state[-2].rest)]
    assert all(np.array_equal(a, b) for a, b in zip(held, jax.tree.leaves(before[-2].rest),
                                                    strict=True))
    fresh_opt = optimizer.init(state.params)  # a fresh Adam at the same place in the schedule
    fresh_opt = (*fresh_opt[:-1], state.opt_state[-1])
    fresh = state._replace(opt_state=fresh_opt)
    after, _ = steps["all"](state, batch, key)
    reference, _ = steps["all"](fresh, batch, key)

    def encoder_moves(s):
        return [np.asarray(b) - np.asarray(a) for k in state.params if k != "head"
                for a, b in zip(jax.tree.leaves(state.params[k]), jax.tree.leaves(s.params[k]),
                                strict=True)]

    moved, expected = encoder_moves(after), encoder_moves(reference)
    assert sum(float(np.abs(e).sum()) for e in expected) > 0
    for m, e in zip(moved, expected, strict=True):
        np.testing.assert_array_equal(m, e)


def test_a_head_phased_run_saved_with_one_shared_adam_state_is_refused_in_one_line(tmp_path):
    """A run with a head-only phase whose run.json predates the state kept apart (its
    checkpoints hold one Adam state for both) cannot resume: one line saying why and what to
    do, before any checkpoint is read (or set aside as damaged)."""
    from clozax.train.run_dir import check_compatible, write_run_files

    cfg = config_lib.resolve(_toml(tmp_path, HEAD_FIRST), preset="tiny")
    run = tmp_path / "old"
    run.mkdir()
    write_run_files(run, cfg, {"tokenizer_sha256": "x", "dataset_fingerprint": "y"})
    with pytest.raises(ValueError) as e:
        check_compatible(run, cfg, SimpleNamespace(tokenizer_sha256="x", fingerprint="y"))
    assert "\n" not in str(e.value)
    assert "head's Adam state apart" in str(e.value) and "new --out" in str(e.value)
    info = json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(json.dumps({**info, "optimizer_apart": "head"}))
    check_compatible(run, cfg, SimpleNamespace(tokenizer_sha256="x", fingerprint="y"))


RAMP = """
[train]
batch_size = 8
eval_every = 100
save_every = 100
eval_rows = 32
log_every = 1
[[phases]]
steps = 4
batch_start = 4
batch_ramp_steps = 2
batch_ramp_stages = 2
"""


@pytest.mark.slow
def test_microbatches_change_no_number_under_a_batch_ramp(data32, tmp_path):
    """``train.microbatches`` is speed-only in every stage of a batch ramp (4 then 8 rows): the
    same selected counts, token-weighted losses and parameters as one microbatch."""
    cfg = config_lib.resolve(_toml(tmp_path, RAMP), preset="tiny")
    runs = {}
    for k in (1, 2):
        out = tmp_path / f"mb{k}"
        train_lib.train(data32, out, cfg.replace(
            train=dataclasses.replace(cfg.train, microbatches=k)))
        runs[k] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    one, two = runs[1], runs[2]
    assert [r["selected"] for r in one] == [r["selected"] for r in two]
    assert [r["tokens"] for r in one] == [4 * 32, 2 * 4 * 32, 2 * 4 * 32 + 8 * 32,
                                          2 * 4 * 32 + 2 * 8 * 32]  # the ramp: 4, 4, 8, 8 rows
    np.testing.assert_allclose([r["loss"] for r in two], [r["loss"] for r in one], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(load_run(tmp_path / "mb1").params),
                    jax.tree.leaves(load_run(tmp_path / "mb2").params), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-6)


TWO = """
[optim]
schedule = "1-sqrt"
[train]
batch_size = 8
eval_every = 100
save_every = 2
keep_checkpoints = 10
log_every = 1
eval_rows = 32
[[phases]]
steps = 6
rate = 0.3
rate_end = 0.15
ramp_steps = 2
[[phases]]
steps = 4
"""


@pytest.mark.slow
def test_a_decay_branch_of_a_run_in_phases_equals_its_phases_trained_from_scratch(
        stdlib_data, tmp_path, capsys):
    from clozax.app.cli import main

    source = tmp_path / "run"
    train_lib.train(stdlib_data, source, config_lib.resolve(
        _toml(tmp_path, TWO), preset="tiny", overrides=["optim.warmup_steps=2"]))
    main(["train", "--data", str(stdlib_data), "--out", str(tmp_path / "branch"),
          "--decay-from", str(source), "--step", "4", "--steps", "3"])
    assert "steps 4->7" in capsys.readouterr().err  # from RUN's step 4, not from 0
    branched = load_run(tmp_path / "branch")
    first, decay = branched.config.phases
    assert (first.steps, decay.steps, decay.decay, decay.rate) == (4, 3, "1-sqrt", 0.15)
    fresh = tmp_path / "fresh"
    train_lib.train(stdlib_data, fresh, branched.config)
    assert _params_equal(tmp_path / "branch", fresh)
    lrs = [json.loads(line)["lr"] for line in (fresh / "metrics.jsonl").read_text().splitlines()
           if "lr" in json.loads(line)]
    assert lrs[3] == pytest.approx(1e-3) and lrs[-1] < 1e-3  # stable at 4, decaying by 7
    capsys.readouterr()
    for step, words in (("2", "inside phase phase1's warm-up"),
                        ("8", "inside phase phase2's own decay"),
                        ("5", "no checkpoint of step 5")):
        with pytest.raises(SystemExit):
            main(["train", "--data", str(stdlib_data), "--out", str(tmp_path / f"bad{step}"),
                  "--decay-from", str(source), "--step", step, "--steps", "2"])
        err = capsys.readouterr().err.strip()
        assert words in err and "\n" not in err, err
