"""The contrastive stage's hard negatives, packed texts and dropout: negatives mined by BM25
from the corpus pairs and recorded, a pair file's bad negatives counted, texts longer than a
row counted, across devices each anchor's positive its own (sentence-transformers shipped the
opposite, PR #3442, fixed in #3453); packed rows equal to padded ones; a key per row drawn in
one batched encoder."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from clozax.train.contrastive.stage import NEGATIVES_FILE, StageSettings
from clozax.train.run_dir import load_run
from commands import clozax, one_line_error
from conftest import simulated_devices

WORDS = ("socket parse thread gzip date pattern request random lock queue stream header "
         "cookie seed zone match bytes worker string timeout").split()

DEVICE_SCRIPT = r"""
import json, sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from clozax.train.contrastive.stage import StageSettings, train_in_memory
from clozax.train.contrastive.step import info_nce
from clozax.train.mesh import make_mesh
from clozax.train.run_dir import load_run
run = load_run(sys.argv[1])
res = {"devices": len(jax.devices())}
for pairs, symmetric in (("first-sentence", False), (sys.argv[2], True)):  # corpus; negatives
    for n, chunks in ((1, 1), (4, 1), (4, 2)):
        s = StageSettings(pairs=pairs, steps=3, batch_size=8, seq_len=24, dropout=0.0,
                          chunks=chunks, symmetric=symmetric)
        params, losses = train_in_memory(run, s, make_mesh(n))
        res[f"{symmetric} {n}x{chunks}"] = {"losses": losses, "params": [
            np.asarray(x).ravel()[:64].tolist() for x in jax.tree.leaves(params)]}
# the loss alone on unit vectors sharded over the 4 devices, against NumPy's global formula
rng = np.random.default_rng(1)
q, p, n = (rng.normal(size=(8, 5)).astype(np.float32) for _ in range(3))
q, p, n = (x / np.linalg.norm(x, axis=1, keepdims=True) for x in (q, p, n))
put = lambda x: jax.device_put(x, NamedSharding(make_mesh(4), P("data")))
total, count = jax.jit(lambda a, b, c: info_nce(a, b, c, 0.05, True))(put(q), put(p), put(n))
def ce(s):
    s = s - s.max(axis=1, keepdims=True)
    return -(s - np.log(np.exp(s).sum(axis=1, keepdims=True)))[np.arange(8), np.arange(8)].sum()
want = ce(q @ np.concatenate([p, n]).T / 0.05) + ce((q @ p.T / 0.05).T)
res["formula"] = [float(total), int(count), float(want)]
print(json.dumps(res))
"""


def _pair_file(path, n=24):
    rng = np.random.default_rng(0)
    with path.open("w") as f:
        for i in range(n):
            q, p, neg = (" ".join(rng.choice(WORDS, size=6)) for _ in range(3))
            f.write(json.dumps({"query": f"{q} {i}", "positive": f"{p} {i}",
                                "negative": f"{neg} {i}"}) + "\n")
    return path


@pytest.fixture(scope="module")
def four_devices(tiny_run, tmp_path_factory) -> dict:
    """One process of 4 simulated devices runs ``DEVICE_SCRIPT`` (the stages and the loss)."""
    pairs = _pair_file(tmp_path_factory.mktemp("pairs") / "pairs.jsonl")
    ran = subprocess.run([sys.executable, "-c", DEVICE_SCRIPT, str(tiny_run), str(pairs)],
                         env=simulated_devices(4), capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0, ran.stderr[-3000:]
    res = json.loads(ran.stdout.strip().splitlines()[-1])
    assert res["devices"] == 4
    return res


def _assert_same_stage(res: dict, prefix: str) -> None:
    one = res[f"{prefix} 1x1"]
    assert all(np.isfinite(one["losses"])) and one["losses"][0] > 0
    for name in ("4x1", "4x2"):
        np.testing.assert_allclose(res[f"{prefix} {name}"]["losses"], one["losses"], rtol=1e-4)
        # as one vector: a tensor the loss never reaches (the MLM head) moves by rounding only
        a, b = (np.concatenate([np.asarray(x) for x in r["params"]])
                for r in (one, res[f"{prefix} {name}"]))
        assert np.linalg.norm(b - a) <= 1e-5 * np.linalg.norm(a)


@pytest.mark.slow
def test_one_device_four_devices_and_cached_chunks_train_the_same_stage(four_devices):
    """The contrastive batch is the global batch: on 4 simulated devices (the in-batch
    negatives gathered across them), and with the gradient cache on top, three updates of
    corpus pairs give the one-device losses and parameters (to rounding: the summation order
    differs)."""
    _assert_same_stage(four_devices, "False")


@pytest.mark.slow
def test_hard_negatives_on_four_devices_train_the_one_device_stage(four_devices):
    """A stage with a hard-negative column, symmetric, on 4 simulated devices (and with the
    gradient cache on top): the one-device losses and parameters, to rounding. The score
    matrix is the global batch's [B, 2B] and query i's answer is positive i of the *global*
    batch; had a device labelled its queries by local index among gathered columns (the
    sentence-transformers bug), the losses would differ from the first step."""
    _assert_same_stage(four_devices, "True")


@pytest.mark.slow
def test_the_loss_on_a_sharded_batch_with_negatives_is_the_global_formula(four_devices):
    """InfoNCE on unit vectors sharded over 4 devices (the stage's layout) equals NumPy's
    global formula: query i's cross-entropy over all B positives and B negatives with answer
    i, and (symmetric) positive i's over the B queries."""
    total, count, want = four_devices["formula"]
    assert count == 16
    np.testing.assert_allclose(total, want, rtol=1e-5)


def test_a_bm25_stage_trains_on_mined_negatives_and_records_them(capsys, tiny_run, tmp_path):
    """``--negatives bm25``: every corpus pair that BM25 finds a negative for trains with one
    (another pair's positive, never its own), the triples are written beside the run, the
    header and run.json say how many were mined and dropped, and a resume keeps the setting."""
    out = tmp_path / "stage"
    args = ["embed", tiny_run, "--out", out, "--steps", 2, "--batch-size", 8, "--seq-len", 24,
            "--negatives", "bm25", "--negatives-skip", 1]
    ran = clozax(capsys, *args)
    assert ran.code == 0, ran
    assert "BM25 hard negatives for" in ran.out + ran.err
    stage = json.loads((out / "run.json").read_text())["stage"]
    assert stage["negatives"] == "bm25" and stage["negatives_skip"] == 1
    assert "BM25 hard negatives for" in stage["pairs_source"]
    triples = [json.loads(line) for line in (out / NEGATIVES_FILE).read_text().splitlines()]
    assert len(triples) == stage["pair_count"] >= 8
    positives = {t["positive"] for t in triples}
    assert all(t["negative"] != t["positive"] and t["bm25_rank"] >= 2 for t in triples)
    assert sum(t["negative"] in positives for t in triples) >= len(triples) // 2
    again = clozax(capsys, *args[:-4])  # the same stage without the setting: refused
    assert again.code == 2 and "negatives" in again.err
    same = clozax(capsys, *args)
    assert same.code == 0 and "nothing trained" in same.out


def test_a_pair_file_with_negatives_and_bm25_mining_is_one_line(capsys, tiny_run, tmp_path):
    pairs = _pair_file(tmp_path / "pairs.jsonl")
    line = one_line_error(capsys, "embed", tiny_run, "--out", tmp_path / "s", "--pairs", pairs,
                          "--negatives", "bm25", "--steps", 1, "--batch-size", 8)
    assert "gives its own negatives" in line and "drop one" in line
    assert not (tmp_path / "s" / "checkpoints").exists()


def test_negatives_equal_to_positives_and_texts_longer_than_a_row_are_counted(tiny_run,
                                                                             tmp_path):
    from clozax.train.contrastive.rows import pair_rows

    path = _pair_file(tmp_path / "pairs.jsonl")
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    lines[0]["negative"] = lines[0]["positive"].upper()
    lines[1]["query"] = " ".join(["socket"] * 200)  # longer than any row here
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    rows, source = pair_rows(load_run(tiny_run), StageSettings(pairs=str(path), batch_size=8,
                                                               seq_len=16))
    assert len(rows["query"]) == len(lines) - 1 and set(rows) == {"query", "positive",
                                                                   "negative"}
    assert "1 pair(s) whose negative equals its positive or query dropped" in source
    assert "text(s) longer than --seq-len 16 cut to it" in source


def _padded_and_packed(run, length=24):
    """Three sides of 8 texts of 3 to 20 tokens: padded rows, and the same packed."""
    import jax.numpy as jnp

    from clozax.data.pairs import pack_texts

    pad = run.specials["pad"]
    rng = np.random.default_rng(2)
    padded, packed = {}, {}
    for side in ("query", "positive", "negative"):
        rows = np.full((8, length), pad, np.int32)
        for i in range(8):
            n = int(rng.integers(3, 21))
            rows[i, :n] = [run.specials["cls"], *rng.integers(5, 200, n - 2), run.specials["sep"]]
        padded[side] = jnp.asarray(rows)
        ids, segments, where = pack_texts(rows, pad, at_least=6)
        assert ids.shape[0] < 8 or side != "query"  # short texts: fewer rows than texts
        packed |= {side: jnp.asarray(ids), f"{side}_segments": jnp.asarray(segments),
                   f"{side}_where": jnp.asarray(where)}
    return padded, packed


def test_the_packed_step_is_the_padded_step_in_loss_and_gradients(tiny_run):
    """Texts of 3 to 20 tokens packed several to a row (each attending to itself alone, its
    positions from 0, mean-pooled per segment) give the padded rows' loss and gradient to
    1e-5, hard negatives and the symmetric loss included; in fewer rows than texts."""
    import jax

    from clozax.train.contrastive.step import make_loss_and_grads

    run = load_run(tiny_run)
    pad, pooling = run.specials["pad"], "mean"
    padded, packed = _padded_and_packed(run)
    model = run.config.model
    key = jax.random.key(0)
    a = make_loss_and_grads(model, pooling, 0.05, True, 1, pad)(run.params, padded, key)
    b = make_loss_and_grads(model, pooling, 0.05, True, 1, pad, packed=True)(run.params, packed,
                                                                             key)
    assert int(a[1]) == int(b[1]) == 16
    np.testing.assert_allclose(float(b[0]), float(a[0]), rtol=1e-5)
    ga, gb = (np.concatenate([np.asarray(x).ravel() for x in jax.tree.leaves(g)])
              for g in (a[2], b[2]))
    assert np.linalg.norm(gb - ga) <= 1e-5 * np.linalg.norm(ga)


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_a_packed_text_embeds_as_it_does_alone_in_its_row(tiny_run, pooling):
    """Each text's embedding from the packed rows is its padded row's, to 1e-5 (its first
    token's state with ``cls``; the classic encoder's learned positions restart at each
    text). The cls gradient is too small here (norm ~0.04) for its rounding to sit under 1e-5:
    the gradient cache itself moves it by ~1e-3."""
    import jax

    from clozax.train.contrastive.step import make_embedder, make_packed_embedder

    run = load_run(tiny_run)
    padded, packed = _padded_and_packed(run)
    model, pad = run.config.model, run.specials["pad"]
    for side in padded:
        ids = padded[side]
        alone = jax.jit(make_embedder(model, pooling))(run.params, ids, ids != pad, None)
        together = jax.jit(make_packed_embedder(model, pooling))(
            run.params, packed[side], packed[f"{side}_segments"], packed[f"{side}_where"], None)
        np.testing.assert_allclose(np.asarray(together), np.asarray(alone), atol=1e-5)


def test_a_packed_stage_without_dropout_trains_the_unpacked_stage(tiny_run):
    """``--pack`` with ``--dropout 0``: the same losses and parameters as the padded stage
    (to rounding), hard negatives mined by BM25 included, in fewer rows per side."""
    from clozax.train.contrastive.stage import make_stage, train_in_memory

    run = load_run(tiny_run)
    base = dict(steps=3, batch_size=8, seq_len=24, dropout=0.0, negatives="bm25",
                negatives_skip=0)
    plain, plain_losses = train_in_memory(run, StageSettings(**base))
    packed, packed_losses = train_in_memory(run, StageSettings(**base, pack=True))
    np.testing.assert_allclose(packed_losses, plain_losses, rtol=1e-4)
    import jax

    a, b = (np.concatenate([np.asarray(x).ravel() for x in jax.tree.leaves(p)])
            for p in (plain, packed))
    assert np.linalg.norm(b - a) <= 1e-5 * np.linalg.norm(a)
    stage = make_stage(run, StageSettings(**base, pack=True), 3)
    assert stage.packed["query"] < 8  # first sentences: several to a 24-token row


def test_pack_with_minutes_or_chunks_is_one_line(capsys, tiny_run, tmp_path):
    line = one_line_error(capsys, "embed", tiny_run, "--out", tmp_path / "s", "--pack",
                          "--minutes", 1)
    assert "--pack" in line and "--steps" in line
    assert not (tmp_path / "s").exists()


def test_a_key_per_row_draws_each_rows_dropout_as_a_batch_of_one(tiny_run):
    """The stage's dropout (a key per row, so ``--chunks`` changes no number) is drawn inside
    one batched encoder: bitwise the embeddings of the encoder run row by row with each key
    (how it ran, 3-4x slower, before)."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    from clozax.train.contrastive.step import make_embedder

    run = load_run(tiny_run)
    pad = run.specials["pad"]
    embed = make_embedder(dataclasses.replace(run.config.model, dropout=0.1), "mean")
    ids = jnp.asarray(np.random.default_rng(0).integers(5, 200, (6, 16)).astype(np.int32))
    keys = jax.vmap(lambda r: jax.random.fold_in(jax.random.key(3), r))(jnp.arange(6))
    alone = jax.vmap(lambda x, k: embed(run.params, x[None], x[None] != pad, k)[0])(ids, keys)
    batched = embed(run.params, ids, ids != pad, keys)
    np.testing.assert_array_equal(np.asarray(batched), np.asarray(alone))
    assert not np.array_equal(np.asarray(batched),
                              np.asarray(embed(run.params, ids, ids != pad, None)))


def test_corpus_pairs_from_an_imported_run_are_refused_in_one_line_naming_the_ways(
        capsys, tiny_run_copy, tmp_path):
    """An imported encoder has no corpus of its own (``run.json``'s ``dataset`` is None): the
    stage says so and what to do, instead of "trained on dataset 'None'"."""
    _as_imported(tiny_run_copy)
    line = one_line_error(capsys, "embed", tiny_run_copy, "--out", tmp_path / "s", "--steps", 1,
                          "--batch-size", 8)
    assert "has no dataset of its own" in line and "'None'" not in line
    assert "clozax train --init-from" in line and not (tmp_path / "s").exists()


def _as_imported(run) -> None:
    """``run`` made what ``import-hf`` writes: no dataset of its own."""
    info = json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(json.dumps({**info, "dataset": None,
                                              "dataset_fingerprint": None}))


def test_an_imported_encoder_given_data_trains_on_its_train_split_and_retrieves_its_held_out(
        capsys, tiny_run_copy, stdlib_data, tmp_path):
    """``--data`` is an imported encoder's corpus: the stage's pairs from its train split
    (recorded, so the stage's run names the dataset it read) and ``clozax retrieval``'s set from
    its held-out split, the untouched encoder a row of its own."""
    _as_imported(tiny_run_copy)
    out = tmp_path / "s"
    ran = clozax(capsys, "embed", tiny_run_copy, "--out", out, "--data", stdlib_data,
                 "--steps", 2, "--batch-size", 8, "--seq-len", 24, "--max-pairs", 64)
    assert ran.code == 0, ran.err
    info = json.loads((out / "run.json").read_text())
    assert info["stage"]["data"] == str(stdlib_data.absolute())
    assert info["dataset"] == str(stdlib_data.absolute())
    assert "(train split)" in info["stage"]["pairs_source"]
    ran = clozax(capsys, "retrieval", out, "--seeds", 1, "--max-queries", 20, "--out",
                 tmp_path / "r.json")
    assert ran.code == 0, ran.err
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["set"]["split"] == "heldout"
    assert result["set"]["dataset"] == str(stdlib_data.absolute())
    assert {"bm25", "raw", "this_stage", "trained_stage"} <= set(result["rows"])
    # the stage's own --data is the only one its retrieval set may come from
    line = one_line_error(capsys, "retrieval", out, "--data", tmp_path, "--seeds", 1)
    assert "leave --data out" in line


def test_data_for_an_imported_encoder_must_hold_its_tokenizer_and_a_trained_run_its_own(
        capsys, tiny_run_copy, stdlib_data, tmp_path):
    """Data prepared with another tokenizer than the run's, a directory that is no dataset,
    and a trained run's ``--data`` other than the dataset it trained on: one line each,
    nothing written."""
    path = tiny_run_copy / "run.json"
    info = json.loads(path.read_text())
    path.write_text(json.dumps({**info, "dataset_fingerprint": "f" * 64}))  # trained elsewhere
    line = one_line_error(capsys, "embed", tiny_run_copy, "--out", tmp_path / "a", "--data",
                          stdlib_data, "--steps", 1, "--batch-size", 8)
    assert "use the dataset the run was trained on" in line
    _as_imported(tiny_run_copy)
    line = one_line_error(capsys, "embed", tiny_run_copy, "--out", tmp_path / "b", "--data",
                          tmp_path / "missing", "--steps", 1, "--batch-size", 8)
    assert "does not exist" in line
    info = json.loads(path.read_text())
    path.write_text(json.dumps({**info, "tokenizer_sha256": "0" * 64}))  # another tokenizer's
    line = one_line_error(capsys, "embed", tiny_run_copy, "--out", tmp_path / "c", "--data",
                          stdlib_data, "--steps", 1, "--batch-size", 8)
    assert "another tokenizer" in line and "--tokenizer" in line
    assert not any((tmp_path / d).exists() for d in "abc")
