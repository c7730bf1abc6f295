"""The contrastive stage (``clozax embed``) and the retrieval comparison (``clozax retrieval``):
InfoNCE as its formula, gradient caching equal to the whole batch (one device equal to four:
``test_embed_negatives.py``), a stage run resumed bitwise, pairs from the train split only and
a retrieval set from the held-out split only, and bad pair files refused in one line."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from clozax.data import pairs as pairs_lib
from clozax.data.dataset import open_dataset
from clozax.data.tokenizer import load_tokenizer
from clozax.judge.retrieval.heldout_set import heldout_set
from clozax.train.contrastive.stage import StageSettings, embed, train_in_memory
from clozax.train.contrastive.step import info_nce, make_loss_and_grads
from clozax.train.run_dir import load_run
from commands import clozax, one_line_error
from conftest import simulated_devices

STAGE = dict(steps=4, batch_size=8, seq_len=24)  # a tiny stage: 4 updates of 8 pairs


def _reference_info_nce(q, p, n, t, symmetric):
    """NumPy: each query's cross-entropy over [positives; negatives] at temperature t."""
    def ce(scores):
        scores = scores - scores.max(axis=1, keepdims=True)
        logp = scores - np.log(np.exp(scores).sum(axis=1, keepdims=True))
        return -np.trace(logp[:, :len(scores)])

    cand = p if n is None else np.concatenate([p, n])
    total, count = ce(q @ cand.T / t), len(q)
    if symmetric:
        total, count = total + ce(p @ q.T / t), 2 * len(q)
    return total, count


@pytest.mark.fast
@pytest.mark.parametrize("negatives,symmetric", [(False, False), (True, False), (False, True)])
def test_info_nce_is_the_cross_entropy_over_in_batch_candidates(negatives, symmetric):
    rng = np.random.default_rng(0)
    q, p, n = (rng.normal(size=(5, 3)).astype(np.float32) for _ in range(3))
    n = n if negatives else None
    total, count = info_nce(jnp.asarray(q), jnp.asarray(p), None if n is None else
                            jnp.asarray(n), 0.3, symmetric)
    want_total, want_count = _reference_info_nce(q, p, n, 0.3, symmetric)
    assert int(count) == want_count
    np.testing.assert_allclose(float(total), want_total, rtol=1e-5)


def _params_and_batch(tiny_run):
    run = load_run(tiny_run)
    rng = np.random.default_rng(1)
    pad = run.specials["pad"]
    ids = rng.integers(5, run.config.model.vocab_size, size=(2, 8, 12)).astype(np.int32)
    ids[:, :, 9:] = pad  # padding the pooling must skip
    return run, {"query": jnp.asarray(ids[0]), "positive": jnp.asarray(ids[1])}, pad


def test_gradient_caching_gives_the_whole_batch_loss_and_gradient(tiny_run):
    """Four chunks of two pairs: the same (sum, count) and summed gradient as one pass over
    the eight, to float rounding (no dropout: the chunking then changes no draw)."""
    run, batch, pad = _params_and_batch(tiny_run)
    model = run.config.model
    key = jax.random.key(3)
    whole = make_loss_and_grads(model, "mean", 0.05, True, 1, pad)(run.params, batch, key)
    cached = make_loss_and_grads(model, "mean", 0.05, True, 4, pad)(run.params, batch, key)
    assert int(whole[1]) == int(cached[1]) == 16
    np.testing.assert_allclose(float(cached[0]), float(whole[0]), rtol=1e-5)
    # The whole gradient as one vector (some tensors' gradients are ~1e-9: rounding alone)
    a, b = (np.concatenate([np.asarray(x).ravel() for x in jax.tree.leaves(g)])
            for g in (whole[2], cached[2]))
    assert np.linalg.norm(b - a) <= 1e-5 * np.linalg.norm(a)


def test_attention_dropout_keeps_chunks_speed_only_and_reaches_the_stage_and_its_export(
        capsys, tiny_run, tmp_path):
    """``--attention-dropout`` (sentence-transformers keeps MiniLM's 0.1): the gradient cache's
    chunks change no number with it on (a key per row draws each row's probabilities' mask
    too); the stage's run records it in its settings and model, and an export writes it as
    ``attention_probs_dropout_prob``."""
    from clozax.core.model_config import MODERN
    from clozax.interop.bert import BERT
    from clozax.interop.modernbert import MODERNBERT

    run, batch, pad = _params_and_batch(tiny_run)
    model = dataclasses.replace(run.config.model, dropout=0.1, attention_dropout=0.1)
    key = jax.random.key(3)
    whole, cached = (make_loss_and_grads(model, "mean", 0.05, True, chunks, pad)(
        run.params, batch, key) for chunks in (1, 4))
    np.testing.assert_allclose(float(cached[0]), float(whole[0]), rtol=1e-5)
    a, b = (np.concatenate([np.asarray(x).ravel() for x in jax.tree.leaves(g)])
            for g in (whole[2], cached[2]))
    assert np.linalg.norm(b - a) <= 1e-5 * np.linalg.norm(a)
    without = make_loss_and_grads(dataclasses.replace(model, attention_dropout=0.0), "mean",
                                  0.05, True, 1, pad)(run.params, batch, key)
    assert abs(float(without[0]) - float(whole[0])) > 1e-4  # the probabilities were dropped

    ran = clozax(capsys, "embed", tiny_run, "--out", tmp_path / "emb", "--steps", 2,
                 "--batch-size", 8, "--seq-len", 24, "--attention-dropout", 0.1)
    assert ran.code == 0, ran.err
    stage = load_run(tmp_path / "emb")
    assert stage.info["stage"]["attention_dropout"] == 0.1
    assert stage.config.model.attention_dropout == 0.1
    exported = BERT.hf_config(stage.config.model, stage.specials)
    assert exported["attention_probs_dropout_prob"] == 0.1
    modern = dataclasses.replace(stage.config.model, **MODERN)
    assert MODERNBERT.hf_config(modern, stage.specials)["attention_dropout"] == 0.1
    line = one_line_error(capsys, "embed", tiny_run, "--out", tmp_path / "bad", "--steps", 2,
                          "--attention-dropout", 1.5)
    assert "attention_dropout" in line and not (tmp_path / "bad").exists()


# One device against four (with and without hard negatives): test_embed_negatives.py


def test_a_stopped_stage_resumes_to_the_same_bits_as_one_without_a_stop(tiny_run, tmp_path):
    """Six updates straight, and three + a resume for three more: the same parameters and
    AdamW moments bit for bit (batch i and the dropout key are functions of i); the stage's
    run is a run: load_run reads it, its provenance names its source and its pairs."""
    settings = StageSettings(**{**STAGE, "steps": 6}, pairs="simcse")
    straight = embed(tiny_run, tmp_path / "straight", settings, say=lambda _: None)
    assert straight["trained"] == 6
    first = embed(tiny_run, tmp_path / "stopped", settings, say=lambda _: None, stop_after=3)
    assert first["steps"] == 3
    again = embed(tiny_run, tmp_path / "stopped", settings, say=lambda _: None)
    assert again["trained"] == 3 and again["steps"] == 6
    a, b = load_run(tmp_path / "straight"), load_run(tmp_path / "stopped")
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    stage = a.info["stage"]
    assert stage["source_run"] == str(tiny_run.absolute()) and stage["pair_count"] > 8
    assert "(train split)" in stage["pairs_source"] and not a.info["has_mlm_head"]
    source = load_run(tiny_run).params["embeddings"]["word"]
    assert not np.array_equal(np.asarray(source), np.asarray(a.params["embeddings"]["word"]))
    # the same --out with other settings is refused, nothing trained
    with pytest.raises(ValueError, match="temperature differ"):
        embed(tiny_run, tmp_path / "stopped", StageSettings(**{**STAGE, "steps": 6},
              pairs="simcse", temperature=0.1), say=lambda _: None)


def test_the_stage_in_memory_is_the_stage_run(capsys, tiny_run, tmp_path):
    """What clozax retrieval trains per seed is what clozax embed writes; the stage's run has
    no trained MLM head, so MLM scoring of it is refused in one line."""
    settings = StageSettings(**STAGE)
    embed(tiny_run, tmp_path / "emb", settings, say=lambda _: None)
    params, losses = train_in_memory(load_run(tiny_run), settings)
    written = load_run(tmp_path / "emb").params
    assert len(losses) == 4 and all(np.isfinite(losses))
    for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(written), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert "is a contrastive stage (clozax embed)" in one_line_error(capsys, "evaluate",
                                                                     tmp_path / "emb")


def test_corpus_pairs_come_from_the_train_split_and_the_retrieval_set_from_the_held_out(
        tiny_run, stdlib_data):
    """No query or document of the retrieval set is a train-split document's text, and every
    corpus pair kind reads the train split only; the set is keyed (same key, same digest)."""
    dataset = open_dataset(stdlib_data)
    tok = load_tokenizer(stdlib_data / "tokenizer.json")
    train_texts = {t for _, t in pairs_lib.document_texts(dataset, "train", tok)}
    heldout_ids = {i for i, _ in pairs_lib.document_texts(dataset, "heldout", tok)}
    found, described = heldout_set(load_run(tiny_run), key=0, max_queries=50)
    assert set(found.documents) <= heldout_ids and described["split"] == "heldout"
    assert len(found.queries) == described["queries"] == 50
    assert not any(d in train_texts for d in found.documents.values())
    again, described_again = heldout_set(load_run(tiny_run), key=0, max_queries=50)
    assert described_again["sha256"] == described["sha256"]
    assert heldout_set(load_run(tiny_run), key=1, max_queries=50)[1]["sha256"] != \
        described["sha256"]
    for kind in pairs_lib.KINDS:
        made = pairs_lib.corpus_pairs(pairs_lib.document_texts(dataset, "train", tok), kind,
                                      0, "train", limit=200)
        assert len(made) == 200
        assert all(len(q.split()) >= pairs_lib.MIN_WORDS for q in made.queries)
        if kind == "first-sentence":  # the query is where the document starts
            assert all(not p.startswith(q) for q, p in zip(made.queries, made.positives,
                                                            strict=True))


@pytest.mark.parametrize("lines,expected", [
    ([], "has 0 pair(s)"),
    (['{"query": "a b c", "positive": "d e f"}'], "has 1 pair(s)"),
    (['{"query": "a", "positive": "b", "negative": "c"}', '{"query": "d", "positive": "e"}'],
     "negative on 1 of 2 lines"),
    (['{"query": "a", "positive": ""}', '{"query": "d", "positive": "e"}'],
     "pairs.jsonl:1 has no non-empty string 'positive'"),
    (["not json", '{"query": "d", "positive": "e"}'], "pairs.jsonl:1 is not valid JSON"),
])
def test_a_bad_pair_file_is_one_line_and_nothing_is_written(capsys, tiny_run, tmp_path, lines,
                                                            expected):
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    line = one_line_error(capsys, "embed", tiny_run, "--out", tmp_path / "emb", "--pairs",
                          path, "--steps", "2")
    assert expected in line
    assert not (tmp_path / "emb").exists() or not any((tmp_path / "emb").iterdir())


def test_a_pair_file_trains_with_hard_negatives(capsys, tiny_run, tmp_path):
    path = tmp_path / "pairs.jsonl"
    rows = [{"query": f"what is item {i}", "positive": f"item {i} is a thing number {i}",
             "negative": f"item {i + 1} is another thing"} for i in range(16)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ran = clozax(capsys, "embed", tiny_run, "--out", tmp_path / "emb", "--pairs", path,
                 "--steps", "2", "--batch-size", "8", "--seq-len", "16")
    assert ran.code == 0, ran.err
    assert "trained 2 contrastive steps" in ran.out
    assert load_run(tmp_path / "emb").info["stage"]["pair_count"] == 16


def test_retrieval_prints_bm25_raw_and_both_stages_with_the_interval(capsys, tiny_run,
                                                                     tmp_path):
    out = tmp_path / "retrieval.json"
    ran = clozax(capsys, "retrieval", tiny_run, "--seeds", "2", "--steps", "2",
                 "--batch-size", "8", "--seq-len", "24", "--max-queries", "40", "--out", out)
    assert ran.code == 0, ran.err
    for row in ("BM25: nDCG@10", "raw encoder", "random init stage (seed 1)",
                "trained stage (seed 1)", "trained stage minus random init stage"):
        assert row in ran.out
    result = json.loads(out.read_text())
    assert result["set"]["construction"] == "first-sentence→rest"
    assert len(result["rows"]["trained_stage"]["per_seed"]) == 2
    d = result["differences_ndcg@10"]["trained_stage_minus_random_init_stage"]
    assert d["seeds"] == [2, 2] and (d["interval"] is None or len(d["interval"]) == 2)
    assert 0 <= result["rows"]["bm25"]["ndcg@10"] <= 1


def test_a_stage_withholding_validation_pairs_none_of_its_tenth_which_is_the_validation_set(
        tiny_run, stdlib_data):
    """``withhold_validation``: no pair (nor its mined negative) comes from the train split's
    validation tenth (a tenth of its groups, each whole, as the held-out split is cut), and the
    validation set's queries and documents are that tenth's alone."""
    from clozax.train.contrastive.rows import pair_rows

    dataset = open_dataset(stdlib_data)
    tok = load_tokenizer(stdlib_data / "tokenizer.json")
    train = dict(pairs_lib.document_texts(dataset, "train", tok))
    records = list(dataset.documents("train"))
    tenth = {str(d["id"]) for d in records if pairs_lib.in_validation(d)}
    groups = {d["group"] for d in records}
    withheld_groups = {d["group"] for d in records if str(d["id"]) in tenth}
    assert 0.05 < len(withheld_groups) / len(groups) < 0.15  # a tenth of the modules, whole:
    assert not {d["group"] for d in records if str(d["id"]) not in tenth} & withheld_groups
    assert set(dict(pairs_lib.document_texts(dataset, "train", tok, validation=True))) == \
        tenth & set(train)
    found, described = heldout_set(load_run(tiny_run), max_queries=10**6, split="validation")
    assert described["split"] == "validation" and set(found.documents) <= tenth
    assert {q.removeprefix("q-") for q in found.queries} <= tenth
    run = load_run(tiny_run)
    shape = {**STAGE, "seq_len": 64}  # long enough that no two rests share a row
    rows, source = pair_rows(run, StageSettings(**shape, negatives="bm25",
                                                withhold_validation=True))
    assert "validation tenth withheld" in source
    s = run.specials

    def as_rows(texts):
        return {tuple(r) for r in pairs_lib.tokenize(tok, list(texts), 64, s["cls"], s["sep"],
                                                     s["pad"])}

    def rest(text):
        pair = pairs_lib.first_sentence(text)
        return " ".join(text.split()) if pair is None else pair[1]

    # the tenth's rests (and whole short ones) but a text some other document also has
    withheld = as_rows(found.documents.values()) - as_rows(
        rest(t) for i, t in train.items() if i not in tenth)
    assert rows["positive"].size and not {
        tuple(r) for side in ("positive", "negative") for r in rows[side]} & withheld
    everything, _ = pair_rows(run, StageSettings(**shape, negatives="bm25"))
    assert len(everything["query"]) > len(rows["query"])
    assert {tuple(r) for r in everything["positive"]} & withheld


def test_retrieval_chooses_the_peak_on_validation_and_scores_the_held_out_set_with_it_only(
        capsys, tiny_run, tmp_path):
    """``--learning-rates``: each peak's first-seed stage is scored on the validation tenth,
    the best is the stage's peak, and its first seed on the held-out set is the model a stage
    of that peak trains (kept, not retrained); ``--no-control`` runs no random-init stage."""
    from clozax.judge.retrieval.compare import dense_scores

    out = tmp_path / "retrieval.json"
    ran = clozax(capsys, "retrieval", tiny_run, "--seeds", "2", "--steps", "3",
                 "--batch-size", "8", "--seq-len", "24", "--max-queries", "40", "--out", out,
                 "--learning-rates", "1e-4,5e-3", "--no-control")
    assert ran.code == 0, ran.err
    result = json.loads(out.read_text())
    choice = result["learning_rate_choice"]
    assert set(choice["candidates"]) == {"0.0001", "0.005"}
    assert choice["on"]["split"] == "validation" and result["set"]["split"] == "heldout"
    assert set(choice["raw"]) == {"ndcg@10", "mrr@10", "recall@100"}
    best = max(choice["candidates"], key=lambda r: choice["candidates"][r]["ndcg@10"])
    assert result["stage"]["learning_rate"] == float(best) == choice["learning_rate"]
    assert result["stage"]["withhold_validation"] is True
    assert "random_init_stage" not in result["rows"] and "random init" not in ran.out
    assert set(result["differences_ndcg@10"]) == {"trained_stage_minus_bm25",
                                                  "trained_stage_minus_raw"}
    assert f"peak chosen on validation: {float(best):g}" in ran.out
    run = load_run(tiny_run)
    settings = StageSettings(steps=3, batch_size=8, seq_len=24, learning_rate=float(best),
                             withhold_validation=True)
    found, _ = heldout_set(run, max_queries=40)
    again = dense_scores(train_in_memory(run, settings)[0], run.config.model, run, found, 24,
                         "mean")
    assert result["rows"]["trained_stage"]["per_seed"][0] == again


@pytest.mark.parametrize("extra,words", [
    (["--learning-rates", "1e-4,abc"], "give positive peaks separated by commas"),
    (["--learning-rates", "1e-4,-1"], "give positive peaks separated by commas"),
    (["--learning-rates", "1e-4,1e-4"], "a peak is given twice"),
    (["--learning-rates", "1e-4,1e-3", "--beir", "."], "with --beir give one --learning-rate"),
    (["--learning-rates", "1e-4,1e-3", "--pairs", "PAIRS"], "a pair file gives its own pairs"),
])
def test_a_bad_learning_rate_choice_is_one_line_and_nothing_is_written(capsys, tiny_run,
                                                                        tmp_path, extra, words):
    pair_file = tmp_path / "pairs.jsonl"
    pair_file.write_text("".join(json.dumps({"query": f"q {i}", "positive": f"p {i}"}) + "\n"
                                 for i in range(16)))
    extra = [str(pair_file) if x == "PAIRS" else x for x in extra]
    line = one_line_error(capsys, "retrieval", tiny_run, "--steps", "1", "--batch-size", "8",
                          "--out", tmp_path / "r.json", *extra)
    assert words in line and not (tmp_path / "r.json").exists()


@pytest.mark.slow
def test_sigterm_saves_the_step_a_second_writer_is_refused_and_the_stage_resumes(
        capsys, tiny_run, tmp_path):
    """A stage is a clozax run: while one process writes it, a second ``clozax embed`` on the
    same --out is refused in one line; SIGTERM saves the step it stops at and exits 143; the
    same command resumes from that step."""
    import signal
    import time

    out = tmp_path / "emb"
    argv = ["embed", str(tiny_run), "--out", str(out), "--steps", "100000", "--batch-size",
            "8", "--seq-len", "24"]
    proc = subprocess.Popen([sys.executable, "-c", "import sys; from clozax.app.cli import main; "
                             "main(sys.argv[1:])", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        while not (out / "metrics.jsonl").is_file():  # past its first steps
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        line = one_line_error(capsys, *argv)
        assert f"run {out} is being written by" in line, line
        proc.send_signal(signal.SIGTERM)
        printed, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 143, printed[-2000:]
    saved = int(printed.split("stopped by SIGTERM at step ")[1].split(":")[0])
    assert (out / "checkpoints" / str(saved)).is_dir()
    resumed = embed(tiny_run, out, StageSettings(steps=100000, batch_size=8, seq_len=24),
                    say=lambda _: None, stop_after=saved + 2)
    assert resumed["trained"] == 2 and resumed["steps"] == saved + 2


@pytest.mark.slow
def test_two_processes_of_two_devices_train_the_stage_of_one_process_of_four(tiny_run,
                                                                            tmp_path):
    """``clozax embed`` as a 2-process job (jax.distributed, gloo, 2 simulated devices each)
    trains what one process of 4 devices trains: the contrastive batch is the global batch
    across processes. The 1-process job runs beside it."""
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    argv = ["--steps", "3", "--batch-size", "8", "--seq-len", "24", "--dropout", "0"]
    script = "import sys; from clozax.app.cli import main; main(sys.argv[1:])"
    jobs = [(tmp_path / "1x4", simulated_devices(4))] + [
        (tmp_path / "2x2", {**simulated_devices(2), "CLOZAX_COORDINATOR": f"localhost:{port}",
                            "CLOZAX_NUM_PROCESSES": "2", "CLOZAX_PROCESS_ID": str(i)})
        for i in range(2)]
    procs = [subprocess.Popen([sys.executable, "-c", script, "embed", str(tiny_run), "--out",
                               str(out), *argv], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for out, env in jobs]
    for p in procs:
        printed, _ = p.communicate(timeout=600)
        assert p.returncode == 0, printed[-3000:]
    flat = {name: np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(
        load_run(tmp_path / name).params)]) for name in ("1x4", "2x2")}
    assert np.linalg.norm(flat["2x2"] - flat["1x4"]) <= 1e-5 * np.linalg.norm(flat["1x4"])
    losses = {name: json.loads((tmp_path / name / "metrics.jsonl").read_text().splitlines()[-1])
              for name in ("1x4", "2x2")}
    assert losses["2x2"]["step"] == 3
    assert losses["2x2"]["loss"] == pytest.approx(losses["1x4"]["loss"], rel=1e-5)


def test_a_minutes_stage_sets_its_length_re_estimates_it_and_a_rerun_keeps_it(tiny_run,
                                                                               tmp_path):
    """--minutes: the length is set from the pace of the timed steps and re-estimated at the
    budget's points (as `clozax train --minutes` is, so work that starts beside it later does
    not make it overrun), each choice written to config.json (where a resume reads it) and the
    schedule's total set to it; the budget is kept."""
    import time

    from clozax.train.run_dir import read_config

    settings = StageSettings(**{**STAGE, "steps": 50}, minutes=0.5)
    started = time.perf_counter()
    first = embed(tiny_run, tmp_path / "emb", settings, say=lambda _: None)
    took = time.perf_counter() - started
    config = read_config(tmp_path / "emb")[0]
    # At least one update (lengths.first_length: on a loaded machine loading, compiling and
    # the timed steps can take the whole budget, and the stage then makes one)
    assert config.train.minutes is None and config.train.steps == first["steps"] >= 1
    revisions = config.train.budget_revisions
    assert revisions[0][0] == 0 and revisions[-1][1] == first["steps"]  # set before step 1
    assert [at for at, _ in revisions] == sorted({at for at, _ in revisions})
    assert took < 0.5 * 60 + 15  # the budget, and the final save
    last = json.loads((tmp_path / "emb" / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == first["steps"] and last["lr"] < 0.1 * settings.learning_rate  # decayed
    again = embed(tiny_run, tmp_path / "emb", settings, say=lambda _: None)
    assert again["trained"] == 0 and again["steps"] == first["steps"]


class _Killed(Exception):
    """The process dies here (no save, no clean exit)."""


def _scripted_budget(kill_at: int | None, revised: bool = True):
    """A budget whose choices are fixed (the real one's depend on the clock): the length set
    to 150 from the throwaway timed steps, re-estimated to 140 at step 110 (``revised``), the
    process killed at ``kill_at``."""
    class Scripted:
        def __init__(self, minutes, started):
            self.budget_s = 60 * minutes

        def mark(self, step):
            pass

        def spent_outside(self, seconds):
            pass

        def estimate(self, step, eval_every, save_every):  # an end step, `step` timed ones done
            return step + 150

        def revise(self, step, steps, eval_every, save_every):
            if step == kill_at:
                raise _Killed
            return 140 if step == 110 and revised else None

        def summary(self):
            return ""
    return Scripted


def test_a_minutes_stage_killed_after_a_re_estimate_replays_it_on_resume_to_the_same_bits(
        tiny_run, tmp_path, monkeypatch):
    """A kill between a budget revision (recorded in config.json) and the next checkpoint: the
    resume starts from the checkpoint before the revision, applies the recorded length at the
    step it was made, and ends with the parameters of the stage that was never killed."""
    from clozax.train.contrastive import stage as embed_lib
    from clozax.train.run_dir import read_config

    settings = StageSettings(**{**STAGE, "steps": 50}, minutes=5.0)
    monkeypatch.setattr(embed_lib, "Budget", _scripted_budget(kill_at=None))
    straight = embed(tiny_run, tmp_path / "straight", settings, say=lambda _: None)
    assert straight["steps"] == 140
    monkeypatch.setattr(embed_lib, "Budget", _scripted_budget(kill_at=120))
    with pytest.raises(_Killed):
        embed(tiny_run, tmp_path / "killed", settings, say=lambda _: None)
    assert sorted(p.name for p in (tmp_path / "killed" / "checkpoints").iterdir()
                  if p.name.isdigit()) == ["100"]  # saved before the revision at 110
    recorded = read_config(tmp_path / "killed")[0].train
    assert recorded.budget_revisions == ((0, 150), (110, 140)) and recorded.steps == 140
    resumed = embed(tiny_run, tmp_path / "killed", settings, say=lambda _: None)
    assert resumed["trained"] == 40 and resumed["steps"] == 140
    a, b = load_run(tmp_path / "straight"), load_run(tmp_path / "killed")
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_a_cls_stage_exports_cls_pooled_verified_and_another_pooling_is_refused(
        capsys, tiny_run, tmp_path):
    """``export --sentence-transformers`` of a stage pools as the stage trained (its
    ``run.json``), ``--verify`` compares with the stage's own pooling, and a ``--pooling`` that
    contradicts the stage's is one line naming both, nothing written."""
    pytest.importorskip("sentence_transformers")
    stage = tmp_path / "emb"
    embed(tiny_run, stage, StageSettings(**{**STAGE, "steps": 2}, pooling="cls"),
          say=lambda _: None)
    ran = clozax(capsys, "export", stage, tmp_path / "st", "--sentence-transformers", "--verify")
    assert ran.code == 0, ran.err
    pool = json.loads((tmp_path / "st" / "1_Pooling" / "config.json").read_text())
    assert pool["pooling_mode_cls_token"] and not pool["pooling_mode_mean_tokens"]
    verified = [x for x in ran.out.splitlines() if "SentenceTransformer.encode" in x]
    assert len(verified) == 1 and float(verified[0].rsplit(" ", 1)[1]) < 1e-4
    line = one_line_error(capsys, "export", stage, tmp_path / "st2", "--sentence-transformers",
                          "--pooling", "mean")
    assert "trained with cls pooling, not mean" in line and "--pooling cls" in line
    assert not (tmp_path / "st2").exists()


def test_a_stage_counts_overlap_against_every_dataset_its_source_pretrained_on(
        tiny_run_copy, stdlib_data, tmp_path):
    """A stage of a run in phases: ``judge/overlap.py`` finds, from the stage's ``run.json``,
    the source's datasets, each phase's included (the source's ``phases`` are its steps', so
    the stage names the source as ``init_from`` instead of copying them)."""
    from clozax.judge import overlap

    info_path = tiny_run_copy / "run.json"
    info = json.loads(info_path.read_text())
    second = tmp_path / "second-phase-data"
    second.mkdir()
    info["phases"] = [{"name": "first", "start": 0, "end": 2, "seq_len": 64,
                       "batch_sizes": [[0, 8]], "data": str(stdlib_data)},
                      {"name": "second", "start": 2, "end": 4, "seq_len": 64,
                       "batch_sizes": [[2, 8]], "data": str(second)}]
    info_path.write_text(json.dumps(info))
    source = overlap.pretraining_datasets(info)
    assert source == ([stdlib_data, second], None)
    embed(tiny_run_copy, tmp_path / "emb", StageSettings(**{**STAGE, "steps": 1}),
          say=lambda _: None)
    stage = load_run(tmp_path / "emb")
    assert "phases" not in stage.info and stage.trained_length == 64
    assert overlap.pretraining_datasets(stage.info) == source


def test_a_stage_resumed_with_other_chunks_trains_the_uninterrupted_stage(tiny_run, tmp_path):
    """``--chunks`` is speed only, with dropout on (0.1, a key per row of the batch whatever
    chunk holds it): four updates in one chunk, and two in one chunk + two resumed in four,
    give the same parameters and loss to fp32 rounding (the summation order differs): the
    parameters' change from the source within 1e-5 of its norm, step 4's loss within 1e-6 / τ
    (a score is a cosine / τ: its rounding is ~6e-8 / τ)."""
    settings = StageSettings(**STAGE, pairs="simcse")
    embed(tiny_run, tmp_path / "one", settings, say=lambda _: None)
    embed(tiny_run, tmp_path / "mixed", settings, say=lambda _: None, stop_after=2)
    embed(tiny_run, tmp_path / "mixed", dataclasses.replace(settings, chunks=4),
          say=lambda _: None)

    def flat(run_dir):
        return np.concatenate([np.asarray(x, np.float64).ravel()
                               for x in jax.tree.leaves(load_run(run_dir).params)])

    def final_loss(run_dir):  # step 4's, logged by both
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        return [json.loads(x) for x in lines if '"loss"' in x][-1]

    source, one, mixed = flat(tiny_run), flat(tmp_path / "one"), flat(tmp_path / "mixed")
    assert np.linalg.norm(mixed - one) <= 1e-5 * np.linalg.norm(one - source)
    last = [final_loss(tmp_path / name) for name in ("mixed", "one")]
    assert last[0]["step"] == last[1]["step"] == 4
    assert abs(last[0]["loss"] - last[1]["loss"]) <= 1e-6 / settings.temperature


def test_a_minutes_stage_warms_up_over_a_tenth_of_its_chosen_length_and_retrieval_replays_it(
        tiny_run, tmp_path, monkeypatch):
    """``--minutes`` with ``--steps 40000``: the length the budget chooses (scripted: 150)
    makes the schedule — warm-up a tenth of it — from update 1, so with no re-estimate the
    stage is the ``--steps 150`` stage bit for bit; with one (140 at step 110) ``clozax
    retrieval``'s re-training of the stage run replays the recorded lengths and gives its
    parameters bit for bit."""
    from clozax.judge.retrieval import compare
    from clozax.train.contrastive import stage as embed_lib

    def params(where):
        return [np.asarray(x) for x in jax.tree.leaves(
            where if isinstance(where, dict) else load_run(where).params)]

    settings = StageSettings(**{**STAGE, "steps": 40000}, minutes=5.0)
    monkeypatch.setattr(embed_lib, "Budget", _scripted_budget(kill_at=None, revised=False))
    assert embed(tiny_run, tmp_path / "minutes", settings, say=lambda _: None)["steps"] == 150
    embed(tiny_run, tmp_path / "steps", StageSettings(**{**STAGE, "steps": 150}),
          say=lambda _: None)
    lr = {r["step"]: r["lr"] for r in map(json.loads, (tmp_path / "minutes" / "metrics.jsonl")
                                           .read_text().splitlines()) if "lr" in r}
    assert lr[10] == pytest.approx(settings.learning_rate * 9 / 15, rel=1e-6)  # update 9 of 15
    for x, y in zip(params(tmp_path / "minutes"), params(tmp_path / "steps"), strict=True):
        np.testing.assert_array_equal(x, y)

    monkeypatch.setattr(embed_lib, "Budget", _scripted_budget(kill_at=None))
    embed(tiny_run, tmp_path / "revised", settings, say=lambda _: None)
    stage = load_run(tmp_path / "revised")
    assert stage.info["stage"]["budget_revisions"] == [[0, 150], [110, 140]]
    again = compare._recorded(stage.info["stage"], StageSettings(), stage.config.train.steps)
    retrained, losses = train_in_memory(load_run(tiny_run), again)
    assert len(losses) == 140
    for x, y in zip(params(retrained), params(stage.params), strict=True):
        np.testing.assert_array_equal(x, y)


def _checkpointed_params(out) -> dict:
    """Every checkpoint of run ``out``: ``{step: params}``."""
    from clozax.train import checkpoint as ckpt
    from clozax.train.run_dir import abstract_state, read_config

    checkpointer = ckpt.Checkpointer(out)
    try:
        abstract = abstract_state(read_config(out)[0])
        return {step: checkpointer.restore(step, abstract, params_only=True)[0].params
                for step in checkpointer.all_steps()}
    finally:
        checkpointer.close()


def test_a_stage_checks_every_step_before_it_saves_so_no_checkpoint_holds_a_diverged_model(
        tiny_run, tmp_path):
    """A learning rate that diverges within 3 updates, saves every 3 updates and a log line
    every 10: the steps since the last check are all checked at the save of step 3, so the
    stage stops at the first non-finite step in one line and no checkpoint holds a non-finite
    parameter (the stage used to check only the logged step, and saved step 3 unchecked)."""
    out = tmp_path / "emb"
    settings = StageSettings(**{**STAGE, "steps": 8}, learning_rate=1e30, save_every=3)
    with pytest.raises(ValueError, match="contrastive stage diverged at step") as raised:
        embed(tiny_run, out, settings, say=lambda _: None)
    message = str(raised.value)
    assert "\n" not in message and "lower --learning-rate" in message
    diverged = int(message.split("diverged at step ")[1].split()[0])
    assert diverged <= 3  # before the first save: the old loop saved it
    saved = _checkpointed_params(out)
    assert all(step < diverged for step in saved)
    for step, params in saved.items():
        assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(params)), step


def test_a_stage_saves_every_save_every_minutes_as_pretraining_does(tiny_run, tmp_path):
    """``save_every_minutes`` (here: always overdue) saves after every update, beside the
    ``save_every`` cadence (100, never reached in 4 updates)."""
    out = tmp_path / "emb"
    embed(tiny_run, out, StageSettings(**STAGE, save_every_minutes=1e-9), say=lambda _: None)
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "checkpoint_seconds" in r] == [1, 2, 3, 4]


def test_a_stage_log_line_carries_the_pace_fields_a_pretraining_log_line_carries(tiny_run,
                                                                                 tmp_path):
    """tokens/s, the data wait, the ETA and the elapsed time (and MFU where the peak is known):
    the fields of the pretraining run's own log lines, less the MLM's (tokens seen, positions
    selected, the held-out evaluation); tokens/s counts every side's rows of the batch."""
    def lines(run_dir):
        return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()
                if '"lr"' in x]

    embed(tiny_run, tmp_path / "emb", StageSettings(**STAGE), say=lambda _: None)
    mlm = lines(tiny_run)[-1]
    stage = lines(tmp_path / "emb")[-1]
    assert stage["step"] == 4
    mlm_only = {"tokens", "selected", "eval", "eval_seconds"}  # the stage evaluates nothing
    assert set(mlm) - mlm_only <= set(stage), set(mlm) - set(stage)
    assert stage["tokens_per_s"] > 0 and 0 <= stage["data_wait_share"] <= 1


def test_a_run_replaced_at_the_same_path_gets_its_own_pairs_not_the_cached_ones(
        tiny_run, stdlib_data, tmp_path):
    """The process keeps the last pair rows it made (``clozax retrieval`` asks twice per
    seed), keyed by what makes them — the tokenizer's bytes, the dataset's fingerprint, the
    settings — not by the run's path and step: a run at the same path and step trained on
    other data (another vocabulary) gets its own rows."""
    import shutil

    from clozax.data import prepare
    from clozax.train import config as config_lib
    from clozax.train import loop as train_lib
    from clozax.train.contrastive.stage import pair_rows
    from conftest import TINY_OVERRIDES

    other_data, other_run = tmp_path / "data512", tmp_path / "other"
    prepare(other_data, corpus="stdlib", vocab_size=512, seq_len=64, quiet=True)
    train_lib.train(other_data, other_run, config_lib.resolve(preset="tiny",
                                                              overrides=TINY_OVERRIDES))
    settings = StageSettings(**STAGE)
    here = tmp_path / "run"
    shutil.copytree(tiny_run, here)
    first, _ = pair_rows(load_run(here), settings)
    shutil.rmtree(here)
    shutil.copytree(other_run, here)
    replaced = load_run(here)
    assert replaced.step == load_run(tiny_run).step
    again, source = pair_rows(replaced, settings)
    own, own_source = pair_rows(load_run(other_run), settings)
    assert source == own_source and str(other_data) in source
    assert sorted(again) == sorted(own)
    for side in own:
        np.testing.assert_array_equal(again[side], own[side])
    assert not all(np.array_equal(first[s], own[s]) for s in own if s in first)


def test_encoding_in_length_sorted_narrow_batches_gives_each_texts_full_width_embedding(
        tiny_run):
    """``clozax retrieval`` encodes longest first, each batch cut to the power of two that
    holds its longest text: every text's embedding is the one it has in a row of the full
    length, in the order given, to rounding (the cut columns were padding)."""
    from clozax.judge.retrieval.compare import ENCODE_BATCH, _jitted_encoder, encode, width_for

    run = load_run(tiny_run)
    rng = np.random.default_rng(0)
    words = "socket parse thread gzip date pattern request random lock queue".split()
    texts = [" ".join(rng.choice(words, size=int(n))) for n in rng.integers(1, 60, 150)]
    pad = run.specials["pad"]
    ids = pairs_lib.tokenize(load_tokenizer(run.tokenizer_path), texts, 64, run.specials["cls"],
                             run.specials["sep"], pad)
    assert len({width_for(int(n), 64) for n in (ids != pad).sum(axis=1)}) >= 3
    apply = _jitted_encoder(dataclasses.replace(run.config.model, dropout=0.0), "mean", pad)
    full = np.concatenate([np.asarray(apply(run.params, jnp.asarray(np.pad(
        ids[i:i + ENCODE_BATCH], ((0, max(0, i + ENCODE_BATCH - len(ids))), (0, 0)),
        constant_values=pad))))[:len(ids[i:i + ENCODE_BATCH])]
        for i in range(0, len(ids), ENCODE_BATCH)])
    narrow = encode(run.params, run.config.model, run, texts, 64, "mean")
    np.testing.assert_allclose(narrow, full, atol=1e-5)
    assert encode(run.params, run.config.model, run, [], 64, "mean").shape == (
        0, run.config.model.hidden)


def test_the_mnrl_side_of_the_quality_benchmark_follows_the_stages_schedule():
    """``benchmarks/mnrl_parity.py``'s torch optimizer runs each update at the stage's rate
    (the first at 0, a tenth of the length warming up, linear decay to 0): torch's scheduler
    indexes its updates as optax's count does."""
    from pathlib import Path

    import torch

    from clozax.train.contrastive.step import stage_rate

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import mnrl_parity

    for steps in (1, 2, 10, 37):
        optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=3e-4)
        schedule = mnrl_parity.torch_schedule(optimizer, steps)
        for count in range(steps):
            want = float(stage_rate(3e-4)(count, steps))
            assert abs(optimizer.param_groups[0]["lr"] - want) < 1e-10, (count, steps)
            optimizer.step()
            schedule.step()
