"""The frozen tokenizer, chunking and best-fit packing, and the dataset they write."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models

from clozax.data import open_dataset, prepare
from clozax.data.packing import BestFitPacker, DocChunk, chunk_document, word_start_flags
from clozax.data.split import HELDOUT, TRAIN, assign_split, group_key
from clozax.data.tokenizer import find_specials, load_tokenizer, parse_special_tokens

pytestmark = pytest.mark.fast  # make test-fast; tests marked slow stay out

FILLER = "the of and to in is it that for on with as by this be from or at".split()


def _corpus_with_split_words(path, fraction=0.3, seed=0):
    """Groups on both sides; one planted word only in train, one only in held-out,
    equally often. Returns the groups' sides."""
    rng = random.Random(5)
    sides = {f"g{i}": assign_split(group_key(f"g{i}", seed), fraction) for i in range(30)}
    assert set(sides.values()) == {TRAIN, HELDOUT}
    planted = {TRAIN: "quenfradle", HELDOUT: "zorblaxquint"}
    count = dict.fromkeys(planted, 0)
    rows = []
    for group, side in sides.items():
        for _ in range(4):
            words = [rng.choice(FILLER) for _ in range(10)]
            if count[side] < 24:
                words[rng.randrange(10)] = planted[side]
                words[rng.randrange(10)] = planted[side]
                count[side] += 2
            rows.append({"text": " ".join(words), "group": group})
    assert count[TRAIN] == count[HELDOUT] == 24
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return planted


def test_tokenizer_never_sees_heldout_text(tmp_path):
    corpus = tmp_path / "c.jsonl"
    planted = _corpus_with_split_words(corpus)
    out = tmp_path / "ds"
    manifest = prepare(out, corpus=str(corpus), group_field="group", heldout_fraction=0.3,
                       vocab_size=400, seq_len=32, quiet=True)
    assert manifest["tokenizer"]["trained_on"] == "train"
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert len(tok.encode(planted[TRAIN], add_special_tokens=False).ids) == 1
    assert len(tok.encode(planted[HELDOUT], add_special_tokens=False).ids) > 1
    assert tok.get_vocab_size() <= 400
    assert [tok.id_to_token(i) for i in range(5)] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]",
                                                      "[MASK]"]
    assert tok.encode("the of").tokens[0] == "[CLS]"  # post-processor wraps single inputs


def _long_corpus(path, n_docs=60, seed=3):
    rng = random.Random(seed)
    docs = []
    for i in range(n_docs):
        n = rng.choice([3, 8, 20, 45, 90])  # some far longer than a row of 32
        words = [rng.choice(FILLER + ["packing", "roundtrip", "zebra"]) for _ in range(n)]
        docs.append(f"{' '.join(words)}, number {i}.")
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return docs


def test_packing_round_trips_every_document_in_order(tmp_path):
    corpus = tmp_path / "c.jsonl"
    docs = _long_corpus(corpus)
    out = tmp_path / "ds"
    manifest = prepare(out, corpus=str(corpus), heldout_fraction=0.2, vocab_size=300,
                       seq_len=32, quiet=True)
    ds = open_dataset(out)
    tok = Tokenizer.from_file(str(ds.tokenizer_path))
    cls, sep, pad = ds.specials["cls"], ds.specials["sep"], ds.specials["pad"]
    rebuilt = {}
    for split_name in (TRAIN, HELDOUT):
        split = getattr(ds, split_name)
        seen = np.zeros((split.rows, ds.seq_len), dtype=int)
        records = list(ds.documents(split_name))
        assert sorted(r["index"] for r in records) == list(range(len(records)))
        for r in sorted(records, key=lambda r: r["index"]):
            ids = []
            for row, segment in r["chunks"]:
                where = split.segments[row] == segment
                seen[row] += where
                chunk = split.tokens[row][where].tolist()
                assert chunk[0] == cls and chunk[-1] == sep and len(chunk) >= 2
                assert split.word_starts[row][where][0]
                ids += chunk[1:-1]
            assert len(ids) == r["tokens"]
            rebuilt[r["id"]] = (split_name, r["index"], tok.decode(ids))
        # every non-pad token belongs to exactly one document chunk; padding only at the end
        assert np.array_equal(seen, (split.segments > 0).astype(int))
        assert np.all(split.tokens[split.segments == 0] == pad)
        assert not split.word_starts[split.segments == 0].any()
        assert np.all(np.diff(split.segments.astype(int), axis=1)[split.segments[:, 1:] > 0]
                      >= 0)
    assert len(rebuilt) == len(docs) == manifest["documents"]["kept"]
    assert sorted(text for _, _, text in rebuilt.values()) == sorted(d.lower() for d in docs)
    for split_name in (TRAIN, HELDOUT):  # corpus order within each split is kept
        in_order = [t for s, _, t in sorted(rebuilt.values()) if s == split_name]
        assert in_order == [d.lower() for d in docs if d.lower() in in_order]
    assert manifest["splits"][TRAIN]["chunked_documents"] > 0


def test_chunks_cut_on_word_starts_and_lose_nothing():
    word_ids = [0, 0, 0, 1, 2, 2, 3, 4, 4, 4, 4, 5]
    ids = list(range(100, 112))
    chunks = chunk_document(7, ids, word_ids, seq_len=8, cls_id=2, sep_id=3)
    assert [p.ids[1:-1] for p in chunks] == [[100, 101, 102, 103, 104, 105], [106, 107, 108,
                                             109, 110, 111]]
    assert all(p.word_starts[1] for p in chunks)
    long_word = chunk_document(0, list(range(20)), [0] * 20, seq_len=8, cls_id=2, sep_id=3)
    assert sum(len(p.ids) - 2 for p in long_word) == 20
    assert [p.chunk for p in long_word] == [0, 1, 2, 3]


def test_word_start_flags_mark_first_token_of_each_word_and_specials():
    assert word_start_flags([None, 0, 0, 1, None]) == [True, True, False, True, True]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(2, 16), min_size=1, max_size=200), st.integers(1, 8))
def test_best_fit_packer_places_every_chunk_once_within_rows(lengths, window):
    rows = []
    packer = BestFitPacker(16, pad_id=0, emit=rows.append, window=window)
    for doc, n in enumerate(lengths):
        packer.add(DocChunk(doc=doc, chunk=0, ids=[doc + 1] * n, word_starts=[True] * n))
    packer.flush()
    placed = sorted(d for row in rows for d, _, _ in row.placements)
    assert placed == list(range(len(lengths)))
    for row in rows:
        assert row.tokens.shape == (16,)
        for doc, _, segment in row.placements:
            assert np.count_nonzero(row.segments == segment) == lengths[doc]
            assert np.all(row.tokens[row.segments == segment] == doc + 1)
    assert sum(np.count_nonzero(r.segments) for r in rows) == sum(lengths)


def test_given_tokenizer_without_specials_is_refused_by_name(tmp_path):
    path = tmp_path / "tokenizer.json"
    Tokenizer(models.WordLevel({"[PAD]": 0, "[UNK]": 1, "hello": 2},
                               unk_token="[UNK]")).save(str(path))
    tok = load_tokenizer(path)
    with pytest.raises(ValueError, match=r"lacks special token\(s\) \(bert: \[CLS\] \[SEP\] "
                                         r"\[MASK\]; roberta: <pad> <unk> <s> </s> <mask>\); "
                                         r"name its own with --special-tokens"):
        find_specials(tok)
    with pytest.raises(ValueError, match="maps two special tokens to one id"):
        find_specials(tok, {"cls": "hello", "sep": "hello", "mask": "[PAD]"})
    for bad in ("mask", "mask=", "kind=<x>", "mask=<a>,mask=<b>"):
        with pytest.raises(ValueError, match="is not NAME=STRING"):
            parse_special_tokens(bad)
    assert parse_special_tokens("mask=<blank>, cls=<s>") == {"mask": "<blank>", "cls": "<s>"}


def test_given_tokenizer_is_used_unchanged_with_its_own_special_ids(tmp_path):
    corpus = tmp_path / "c.jsonl"
    _long_corpus(corpus, n_docs=30)
    first = prepare(tmp_path / "a", corpus=str(corpus), vocab_size=300, seq_len=32,
                    heldout_fraction=0.2, quiet=True)
    given_path = tmp_path / "given.json"
    tok = Tokenizer.from_file(str(tmp_path / "a" / "tokenizer.json"))
    vocab = tok.get_vocab()
    # move the specials away from 0..4 by swapping ids with ordinary tokens
    for name, other in (("[PAD]", 10), ("[MASK]", 11)):
        swap = tok.id_to_token(other)
        vocab[name], vocab[swap] = other, vocab[name]
    data = json.loads(tok.to_str())
    data["model"]["vocab"] = vocab
    data["added_tokens"] = [dict(t, id=vocab[t["content"]]) for t in data["added_tokens"]]
    data["post_processor"] = None
    given_path.write_text(json.dumps(data))
    manifest = prepare(tmp_path / "b", corpus=str(corpus), tokenizer=given_path, seq_len=32,
                       heldout_fraction=0.2, quiet=True)
    assert manifest["tokenizer"]["trained_on"] == "given"
    assert manifest["tokenizer"]["specials"]["pad"] == 10
    assert manifest["tokenizer"]["specials"]["mask"] == 11
    assert (tmp_path / "b" / "tokenizer.json").read_bytes() == given_path.read_bytes()
    ds = open_dataset(tmp_path / "b")
    assert np.all(ds.train.tokens[ds.train.segments == 0] == 10)
    # The same documents, but other rows (other ids): the dataset's identity differs.
    ids = "document_ids_sha256"
    assert first["identity"][ids] == manifest["identity"][ids]
    assert first["fingerprint"] != manifest["fingerprint"]
