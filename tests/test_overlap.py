"""Pretraining overlap (``judge/overlap.py``): a validation or test example is counted and
dropped when it is a pretraining document, and when most of it was read inside one — a sentence
from a document, a (sentence, rest) pair cut from one, a document with a word changed — but
not when it only shares a phrase with the corpus."""

from __future__ import annotations

import json

import numpy as np
import pytest

from clozax.data.corpus import normalise, text_digest
from clozax.judge import overlap
from clozax.judge.finetune.tasks import Raw

pytestmark = pytest.mark.fast
PLANTED = 40  # examples of each kind, as the review planted them


def _sentence(rng, vocab, lo=12, hi=20) -> str:
    words = list(rng.choice(vocab, size=int(rng.integers(lo, hi))))
    return " ".join(words).capitalize() + "."


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A prepared corpus of paragraphs (several shards; most documents longer than a row, so
    cut into chunks), the train split's documents as sentence lists, and the vocabulary."""
    from clozax.data import prepare
    from clozax.data.dataset import open_dataset

    root = tmp_path_factory.mktemp("overlap")
    rng = np.random.default_rng(0)
    syllables = "ka lo mi ne ru ta vo shi pe da gu zo fi be".split()
    vocab = sorted({"".join(rng.choice(syllables, size=int(rng.integers(2, 4))))
                    for _ in range(600)})
    docs = [[_sentence(rng, vocab) for _ in range(5)] for _ in range(200)]
    (root / "corpus.jsonl").write_text("".join(json.dumps({"text": " ".join(d)}) + "\n"
                                               for d in docs))
    prepare(root / "data", corpus=str(root / "corpus.jsonl"), vocab_size=400, seq_len=48,
            heldout_fraction=0.2, shard_bytes=4000, workers=1, quiet=True)
    dataset = open_dataset(root / "data")
    train_ids = {d["id"] for d in dataset.documents("train")}
    assert len(dataset.manifest["shards"]["train"]) > 1  # the scan crosses shards
    assert any(len(d["chunks"]) > 1 for d in dataset.documents("train"))  # and chunk cuts
    train = [d for d in docs if text_digest(normalise(" ".join(d))).hex() in train_ids]
    return root / "data", train, vocab


def _split(texts: list[tuple[str, ...]]) -> Raw:
    return Raw(texts=texts, targets=["x"] * len(texts))


def _planted(train, vocab):
    """40 of each kind, from distinct train documents, and 40 unrelated examples that each
    share an eight-word phrase with a train document."""
    rng = np.random.default_rng(1)
    sentences = [(d[2],) for d in train[:PLANTED]]
    pairs = [(d[1], " ".join(d[2:])) for d in train[PLANTED : 2 * PLANTED]]
    changed = []
    for d in train[2 * PLANTED : 3 * PLANTED]:
        words = " ".join(d).split(" ")
        at = len(words) // 2
        words[at] = next(w for w in vocab if w != words[at].rstrip(".").lower())
        changed.append((" ".join(words),))
    unrelated = []
    for d in train[: PLANTED]:
        phrase = " ".join(d[3].rstrip(".").split(" ")[:8])
        fresh = _sentence(rng, vocab, 20, 24).rstrip(".")
        unrelated.append((f"{fresh} {phrase} {_sentence(rng, vocab, 8, 10)}",))
    return sentences, pairs, changed, unrelated


def test_a_sentence_a_pair_and_a_changed_document_from_pretraining_are_counted(corpus):
    data, train, vocab = corpus
    sentences, pairs, changed, unrelated = _planted(train, vocab)
    raws = {"train": _split([("a b",)]), "validation": _split(sentences + unrelated[:20]),
            "test": _split(pairs + changed + unrelated[20:])}
    kept, record = overlap.account(raws, {"dataset": str(data)}, keep=False)
    assert record["validation"] == PLANTED  # the sentences
    assert record["test"] == 2 * PLANTED  # the pairs and the changed documents
    assert record["contained_not_exact"] == {"validation": PLANTED, "test": 2 * PLANTED}
    assert kept["validation"].texts == unrelated[:20] and kept["test"].texts == unrelated[20:]


def test_the_scan_finds_the_same_whatever_its_block_of_rows(corpus, monkeypatch):
    data, train, vocab = corpus
    sentences, pairs, changed, _ = _planted(train, vocab)
    raws = {"test": _split(sentences + pairs + changed)}
    whole = overlap.find(raws, [data])
    monkeypatch.setattr(overlap, "BLOCK_ROWS", 3)  # rows and chunk cuts a few at a time
    assert overlap.find(raws, [data]) == whole
    assert whole[0] == {"test": list(range(3 * PLANTED))}


def test_an_example_sharing_only_a_phrase_with_the_corpus_is_not_counted(corpus, monkeypatch):
    data, train, vocab = corpus
    *_, unrelated = _planted(train, vocab)
    shingles = overlap.index_texts(unrelated, _tokenizer(data))
    assert shingles.sizes.min() > overlap.SHINGLE  # long enough to be judged by containment
    raws = {"validation": _split(unrelated), "test": _split(unrelated[:1])}
    kept, record = overlap.account(raws, {"dataset": str(data)}, keep=False)
    assert (record["validation"], record["test"]) == (0, 0)
    assert kept["validation"].texts == unrelated
    monkeypatch.setattr(overlap, "CONTAINMENT", 0.01)  # the shared phrase is found, though
    assert overlap.find(raws, [data])[0] == {"validation": list(range(PLANTED)), "test": [0]}


def test_a_token_tasks_sentence_from_pretraining_is_counted(corpus):
    data, train, _ = corpus
    words = [d[2].split(" ") for d in train[:5]] + [["an", "unseen", "short", "one"]]
    raws = {"test": Raw(words=words, targets=[["O"] * len(w) for w in words])}
    kept, record = overlap.account(raws, {"dataset": str(data)}, keep=False)
    assert record["test"] == 5 and kept["test"].words == words[5:]


def test_overlap_is_dropped_and_recorded_with_its_rule(corpus):
    data, train, vocab = corpus
    sentences, pairs, changed, unrelated = _planted(train, vocab)
    whole = [(" ".join(d),) for d in train[-3:]]
    raws = {"train": _split([("a b",)]), "validation": _split(whole + unrelated[:5]),
            "test": _split(sentences[:4] + pairs[:4] + changed[:4] + unrelated[5:10])}
    kept, record = overlap.account(raws, {"dataset": str(data)}, keep=False)
    assert kept["validation"].texts == unrelated[:5]
    assert kept["test"].texts == unrelated[5:10]
    assert (record["validation"], record["test"]) == (3, 12) and record["excluded"]
    assert record["contained_not_exact"] == {"validation": 0, "test": 12}
    assert record["rule"]["shingle_tokens"] == overlap.SHINGLE
    assert record["rule"]["containment"] == overlap.CONTAINMENT


def test_a_shingle_hashes_the_same_in_any_row_and_position():
    ids = np.arange(30, dtype=np.int64)
    hashes = overlap.window_hashes(ids[None])  # (1, 23)
    shifted = overlap.window_hashes(np.concatenate([[99, 98], ids])[None])  # (1, 25)
    assert hashes.shape == (1, 30 - overlap.SHINGLE + 1)
    assert np.array_equal(hashes[0], shifted[0, 2:])
    assert np.unique(hashes).size == hashes.size  # distinct runs, distinct hashes


def _tokenizer(data):
    from clozax.data.dataset import open_dataset
    from clozax.data.tokenizer import load_tokenizer

    return load_tokenizer(open_dataset(data).tokenizer_path)
