"""`clozax evaluate`: aggregation equals a host recomputation, determinism, baselines, failure
cases, corruption transfer, and one-line errors for bad runs."""

from __future__ import annotations

import json
import shutil

import jax
import numpy as np
import pytest
from tokenizers import Tokenizer

from clozax.core import model as model_lib
from clozax.core.keys import Keys
from clozax.core.masking import KIND_NAMES
from clozax.data import open_dataset
from clozax.judge import evaluate as ev
from clozax.train import heldout
from clozax.train.run_dir import load_run
from commands import one_line_error


@pytest.fixture(scope="module")
def evaluated(tiny_run, tmp_path_factory):
    """A private copy of the tiny run, evaluated once with a second mask seed."""
    run_dir = tmp_path_factory.mktemp("evaluate") / "run"
    shutil.copytree(tiny_run, run_dir)
    result = ev.evaluate_run(run_dir, mask_seed=99, failures=7, batch_size=16)
    return run_dir, result


def _host_slots(params, model_config, split, masks):
    """float64 numpy log-softmax of the gathered logits: (nll, rank) per slot, (R, count)."""

    @jax.jit
    def logits_fn(params, inputs, segments, positions):
        hidden = model_lib.apply(params, model_config, inputs, segments > 0, segments)
        return model_lib.mlm_logits(params, model_config, model_lib.gather(hidden, positions))

    segments = np.asarray(split.segments[masks.rows], np.int32)
    inputs = heldout.corrupted_inputs(np.asarray(split.tokens[masks.rows], np.int32), masks)
    logits = np.asarray(logits_fn(params, inputs, segments, masks.positions), np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))  # (R, count, vocab)
    targets = np.take_along_axis(np.asarray(split.tokens[masks.rows], np.int64),
                                 masks.positions, axis=-1)
    nll = -np.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    target_logit = np.take_along_axis(logits, targets[..., None], axis=-1)
    rank = (logits > target_logit).sum(-1)
    return nll, rank


def _check_against_host(metrics, nll, rank, masks):
    for name, sel in (("all", masks.valid), *(
            (kind, masks.valid & (masks.kinds == int(k)))
            for k, kind in KIND_NAMES.items())):
        m = metrics if name == "all" else metrics["by_kind"][name]
        assert m["count"] == int(sel.sum())
        assert m["nll_sum"] == pytest.approx(nll[sel].sum(), rel=1e-5)
        assert m["loss"] == pytest.approx(nll[sel].sum() / sel.sum(), rel=1e-5)
        assert m["accuracy"] == np.mean(rank[sel] == 0)
        assert m["top5_accuracy"] == np.mean(rank[sel] < 5)


def test_eval_sums_equal_a_host_recomputation_over_all_eval_masks(evaluated):
    run_dir, result = evaluated
    run = load_run(run_dir)
    split = open_dataset(run.info["dataset"]).heldout
    masks, _ = heldout.load_eval_masks(run_dir)
    nll, rank = _host_slots(run.params, run.config.model, split, masks)
    _check_against_host(result["trained"], nll, rank, masks)
    # The function training uses aggregates to the same numbers.
    _check_against_host(heldout.evaluate_masks(run.params, run.config.model, split, masks,
                                          batch_size=16).metrics(), nll, rank, masks)
    # Random init is the run's own init key.
    init = model_lib.init(run.config.model, Keys.from_seed(run.config.train.seed).init)
    nll0, rank0 = _host_slots(init, run.config.model, split, masks)
    _check_against_host(result["random_init"], nll0, rank0, masks)


def test_unigram_baseline_is_add_one_smoothed_train_frequencies(evaluated):
    run_dir, result = evaluated
    ds = open_dataset(load_run(run_dir).info["dataset"])
    specials = sorted(set(ds.specials.values()))
    tokens = np.asarray(ds.train.tokens)[np.asarray(ds.train.segments) > 0].astype(np.int64)
    counts = np.bincount(tokens, minlength=ds.vocab_size)
    counts[specials] = 0
    p = (counts + 1) / (counts.sum() + ds.vocab_size - len(specials))
    masks, _ = heldout.load_eval_masks(run_dir)
    targets = np.take_along_axis(np.asarray(ds.heldout.tokens[masks.rows], np.int64),
                                 masks.positions, axis=-1)[masks.valid]
    u = result["unigram"]
    assert u["count"] == targets.size
    assert u["loss"] == pytest.approx(-np.log(p[targets]).mean(), rel=1e-9)
    assert u["accuracy"] == np.mean(targets == np.argmax(p))
    assert u["top5_accuracy"] == np.mean(np.isin(targets, np.argsort(-p, kind="stable")[:5]))


def test_evaluating_twice_gives_identical_numbers_and_files(evaluated):
    run_dir, result = evaluated
    first_eval = (run_dir / ev.EVAL_FILE).read_text()
    first_failures = (run_dir / ev.FAILURES_FILE).read_text()
    again = ev.evaluate_run(run_dir, mask_seed=99, failures=7, batch_size=16)
    assert again == result
    assert (run_dir / ev.EVAL_FILE).read_text() == first_eval
    assert (run_dir / ev.FAILURES_FILE).read_text() == first_failures
    assert json.loads(first_eval) == result


def test_eval_json_records_step_hash_schedule_and_corruption_transfer(evaluated):
    run_dir, result = evaluated
    masks, meta = heldout.load_eval_masks(run_dir)
    assert result["eval_masks_sha256"] == meta["sha256"] == heldout.eval_masks_sha256(masks)
    assert result["step"] == result["checkpoint_step"] == load_run(run_dir).step
    assert result["schedule"]["selected"] == int(masks.valid.sum())
    transfer = result["transfer"]
    assert "corruption transfer" in transfer["label"] and "not a new-language" in transfer["label"]
    assert transfer["eval_masks_sha256"] != meta["sha256"] and not transfer["same_as_frozen"]
    for key in ("loss", "accuracy", "top5_accuracy"):
        assert transfer["difference"][key] == pytest.approx(
            transfer["trained"][key] - result["trained"][key])


def test_failures_are_the_lowest_probability_positions_with_marked_context(evaluated):
    run_dir, result = evaluated
    lines = (run_dir / ev.FAILURES_FILE).read_text().splitlines()
    cases = [json.loads(line) for line in lines]
    assert len(cases) == 7
    probs = [c["target_probability"] for c in cases]
    assert probs == sorted(probs)
    run = load_run(run_dir)
    split = open_dataset(run.info["dataset"]).heldout
    masks, _ = heldout.load_eval_masks(run_dir)
    nll, _ = _host_slots(run.params, run.config.model, split, masks)
    assert probs[0] == pytest.approx(np.exp(-nll[masks.valid].max()), rel=1e-4)
    assert probs[-1] <= np.sort(np.exp(-nll[masks.valid]))[7] * (1 + 1e-4)
    tokenizer = Tokenizer.from_file(str(run.tokenizer_path))
    for c in cases:
        assert c["kind"] in ("mask", "random", "keep")
        # The target as a vocabulary piece (``▁add`` starts a word), marked in the context.
        assert c["target"] == tokenizer.id_to_token(c["target_id"])
        piece = c["target"].replace("\u2581", "").replace("##", "")
        assert f"⟦{piece}⟧" in c["text"]
        assert len(c["top5"]) == 5
        top = [p for _, p in c["top5"]]
        assert top == sorted(top, reverse=True) and top[0] >= c["target_probability"]
        assert split.tokens[c["row"], c["position"]] == c["target_id"]
        if c["kind"] == "mask":
            assert c["input_token"] == "[MASK]"


def test_evaluate_cli_rejects_a_run_without_checkpoint_or_with_other_data(tiny_run, tmp_path,
                                                                          capsys):
    bare = tmp_path / "bare"
    shutil.copytree(tiny_run, bare)
    shutil.rmtree(bare / "checkpoints")
    other = tmp_path / "other"
    shutil.copytree(tiny_run, other)
    info = json.loads((other / "run.json").read_text())
    info["dataset_fingerprint"] = "0" * 64
    (other / "run.json").write_text(json.dumps(info))
    for run, message in ((bare, "no checkpoint"), (other, "does not match the data")):
        assert message in one_line_error(capsys, "evaluate", run)
        assert not (run / "eval.json").exists()


def test_every_checkpoint_and_step_score_those_checkpoints_and_keep_the_newest_on_top(
        tiny_run_copy, capsys):
    from clozax.app.cli import main
    from clozax.judge import history
    from clozax.judge.fill import fill

    results = ev.evaluate_checkpoints(tiny_run_copy, failures=2, batch_size=16)
    assert [r["step"] for r in results] == [3, 6]
    assert results[0]["trained"]["loss"] != results[1]["trained"]["loss"]
    assert [r["step"] for r in history.recorded(tiny_run_copy, "eval")] == [3, 6]
    top = json.loads((tiny_run_copy / "eval.json").read_text())
    again = ev.evaluate_run(tiny_run_copy, failures=2, batch_size=16, step=3)
    assert again["trained"] == results[0]["trained"]  # the same checkpoint, the same numbers
    # the random-init numbers, scored once for all checkpoints, are those scored afresh
    assert results[0]["random_init"] == results[1]["random_init"] == again["random_init"]
    assert json.loads((tiny_run_copy / "eval.json").read_text()) == top  # step 6 stays on top
    assert fill(tiny_run_copy, "the [MASK] of it", top_k=2, step=3) != \
        fill(tiny_run_copy, "the [MASK] of it", top_k=2, step=6)
    capsys.readouterr()
    main(["fill", str(tiny_run_copy), "the [MASK] of it", "--top-k", "2", "--json",
          "--every-checkpoint"])
    by_step = json.loads(capsys.readouterr().out)
    assert [s["step"] for s in by_step] == [3, 6]
    assert by_step[0]["masks"] == fill(tiny_run_copy, "the [MASK] of it", top_k=2, step=3)
    with pytest.raises(SystemExit) as exit_info:
        main(["evaluate", str(tiny_run_copy), "--step", "4"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1
    assert "has no checkpoint at step 4; it has [3, 6]" in err[0]


def _masker(run, ds):
    from clozax.core.masker import make_masker
    from clozax.core.vocab import Vocabulary

    return make_masker(run.config.masking, Vocabulary(ds.vocab_size, ds.specials), ds.seq_len)


def test_the_frozen_set_is_a_keyed_sample_of_the_whole_heldout_split_stored_as_slots(tiny_run):
    run = load_run(tiny_run)
    ds = open_dataset(run.info["dataset"])
    masks, meta = heldout.load_eval_masks(tiny_run)
    seed, n = run.config.train.eval_seed, ds.heldout.rows
    assert meta["rows"] == masks.rows.size == 32 < meta["heldout_rows"] == n
    assert np.array_equal(masks.rows, heldout.sample_rows(n, 32, seed))
    assert masks.rows.max() >= n // 2, "spread over the split, not its first rows"
    assert np.array_equal(np.sort(masks.rows), masks.rows) and np.unique(masks.rows).size == 32
    assert not np.array_equal(heldout.sample_rows(n, 32, seed + 1), masks.rows)
    assert np.array_equal(heldout.sample_rows(20, 32, seed), np.arange(20))
    assert np.array_equal(heldout.sample_rows(20, None, seed), np.arange(20))
    # The stored slots give back exactly the masker's corrupted rows (chunk 0: fold_in(key, 0)).
    tokens = np.asarray(ds.heldout.tokens[masks.rows], np.int32)
    batch = {"tokens": tokens, "segments": np.asarray(ds.heldout.segments[masks.rows], np.int32),
             "word_starts": np.asarray(ds.heldout.word_starts[masks.rows], bool)}
    masked, _ = _masker(run, ds)(jax.random.fold_in(jax.random.key(seed), 0), batch)
    assert np.array_equal(heldout.corrupted_inputs(tokens, masks), np.asarray(masked.inputs))
    assert "inputs" not in np.load(tiny_run / heldout.EVAL_MASKS_FILE).files


def test_full_scores_every_heldout_row_streamed_and_equals_the_dense_computation(evaluated):
    run_dir, frozen = evaluated
    before = (run_dir / ev.EVAL_FILE).read_text()
    result = ev.evaluate_run(run_dir, full=True, failures=5, batch_size=16)
    run = load_run(run_dir)
    ds = open_dataset(run.info["dataset"])
    dense = heldout.build_eval_masks(ds.heldout, _masker(run, ds), run.config.train.eval_seed,
                                     None)  # every held-out row, in memory
    assert result["set"] == "full" and result["schedule"]["rows"] == ds.heldout.rows
    assert result["eval_masks_sha256"] == heldout.eval_masks_sha256(dense)
    nll, rank = _host_slots(run.params, run.config.model, ds.heldout, dense)
    _check_against_host(result["trained"], nll, rank, dense)
    assert result["trained"]["count"] > frozen["trained"]["count"]
    assert json.loads((run_dir / ev.FULL_FILE).read_text()) == result
    assert (run_dir / ev.EVAL_FILE).read_text() == before, "the frozen sample's result stays"
    cases = [json.loads(line) for line in
             (run_dir / ev.FULL_FAILURES_FILE).read_text().splitlines()]
    assert [c["target_probability"] for c in cases] == pytest.approx(
        np.exp(-np.sort(nll[dense.valid])[::-1][:5]), rel=1e-4)


def test_full_evaluation_memory_stays_bounded_as_the_heldout_split_grows(tiny_run):
    """Host memory (tracemalloc: every NumPy array) of scoring 1,024 and 8,192 held-out rows:
    one chunk's worth, under 4 MiB, and the same for both (a dense set would hold 8x)."""
    import tracemalloc

    from clozax.data.dataset import Split

    run = load_run(tiny_run)
    ds = open_dataset(run.info["dataset"])
    reps = -(-8192 // ds.heldout.rows)
    big = Split(*(np.tile(np.asarray(a), (reps, 1))[:8192] for a in
                  (ds.heldout.tokens, ds.heldout.segments, ds.heldout.word_starts)))
    masker, unigram = _masker(run, ds), np.log(np.full(ds.vocab_size, 1.0 / ds.vocab_size))

    def peak(rows: int) -> int:
        tracemalloc.start()
        try:
            chunks = heldout.iter_chunks(big, masker, 7, np.arange(rows))
            out = ev.score_chunks(chunks, run, run.config.model, big, unigram=unigram,
                                  failures=20, batch_size=64)
            return tracemalloc.get_traced_memory()[1], out
        finally:
            tracemalloc.stop()

    peak(256)  # compiles outside the measurement
    (small, a), (large, b) = peak(1024), peak(8192)
    assert b["rows"] == 8192 and b["selected"] > 7 * a["selected"]
    print(f"traced peak: 1,024 rows {small / 2**20:.2f} MiB, 8,192 rows {large / 2**20:.2f} MiB")
    assert large < 4 * 2**20, f"{large / 2**20:.1f} MiB"
    assert large < 1.3 * small + 2**18, f"{small / 2**20:.2f} -> {large / 2**20:.2f} MiB"


@pytest.mark.fast
def test_set_none_turns_an_optional_setting_off_and_the_default_sample_is_4096_rows():
    from clozax.train import config as config_lib

    assert config_lib.resolve(preset="tiny").train.eval_rows == 4096
    every = config_lib.resolve(preset="tiny", overrides=["train.eval_rows=none"])
    assert every.train.eval_rows is None
    assert config_lib.resolve(preset="tiny", overrides=["train.eval_sample=null"]
                              ).train.eval_sample is None
    with pytest.raises(ValueError, match="train.steps=None is not a whole number"):
        config_lib.resolve(preset="tiny", overrides=["train.steps=none"])


def test_a_run_trained_at_30_percent_is_also_scored_on_a_fixed_15_percent_set(
        stdlib_data, tmp_path, evaluated):
    from clozax.report import sections
    from clozax.train import config as config_lib
    from clozax.train import loop as train_lib

    assert evaluated[1]["fixed_rate"] is None  # a 15 % run's own set is the comparable one
    cfg = config_lib.resolve(preset="tiny", overrides=[
        "masking.rate=0.3", "train.steps=2", "train.batch_size=8", "train.eval_rows=16",
        "train.eval_every=2", "optim.warmup_steps=1"])
    train_lib.train(stdlib_data, tmp_path / "r30", cfg)
    result = ev.evaluate_run(tmp_path / "r30", failures=1, batch_size=16)
    fixed = result["fixed_rate"]
    own, _ = heldout.load_eval_masks(tmp_path / "r30")
    at15, meta = heldout.load_eval_masks(tmp_path / "r30", stem=heldout.FIXED_STEM)
    assert np.array_equal(own.rows, at15.rows) and fixed["eval_masks_sha256"] == meta["sha256"]
    assert fixed["rate"] == 0.15 and result["schedule"]["rate"] == 0.3
    assert fixed["trained"]["count"] == int(at15.valid.sum()) < result["trained"]["count"]
    assert at15.positions.shape[1] * 2 <= own.positions.shape[1] + 1  # half the slots
    # ... and it is the set a 15 % run of the same data, rows and eval seed scores.
    ds = open_dataset(stdlib_data)
    from clozax.core.masker import make_masker
    from clozax.core.vocab import Vocabulary

    plain = config_lib.resolve(preset="tiny")  # masking at 15 %
    masker = make_masker(plain.masking, Vocabulary(ds.vocab_size, ds.specials), ds.seq_len)
    assert heldout.eval_masks_sha256(heldout.build_eval_masks(
        ds.heldout, masker, plain.train.eval_seed, 16)) == meta["sha256"]
    card = sections.headline(result, None, None)["cards"][0]
    assert card["key"].startswith("held-out masked-token accuracy at 15 %")
    assert f"{100 * fixed['trained']['accuracy']:.1f}" in card["value"]
    assert "The run's own 30% masks" in card["note"]
