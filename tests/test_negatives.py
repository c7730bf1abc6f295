"""Hard negatives mined by BM25 from the pairs' own corpus, and a pair file's given negatives
checked: what is passed over (the pair's own positive, copies of it, the likeliest false
negatives), what is dropped and counted, and the one-line refusals."""

from __future__ import annotations

import pytest

from clozax.data.negatives import drop_equal_negatives, mine_bm25
from clozax.data.pairs import Pairs

pytestmark = pytest.mark.fast

TOPICS = ["socket connection timeout network", "parse json decoder string",
          "thread lock queue worker", "gzip compress stream bytes", "date time zone calendar",
          "regular expression pattern match", "http request header cookie",
          "random number generator seed"]


def _pairs(n_per_topic: int = 3) -> Pairs:
    queries, positives = [], []
    for t, topic in enumerate(TOPICS):
        for k in range(n_per_topic):
            queries.append(f"{topic} question {k}")
            positives.append(f"{topic} answer {k} " + " ".join(f"w{t}x{k}y{m}" for m in range(5)))
    return Pairs(queries, positives, None, "test pairs")


def test_each_negative_is_another_pairs_positive_past_the_skipped_ranks():
    pairs = _pairs()
    mined = mine_bm25(pairs, skip=0)
    assert mined.dropped == 0 and len(mined.pairs) == len(pairs)
    for (i, j, rank), negative in zip(mined.records, mined.pairs.negatives, strict=True):
        assert j != i and negative == pairs.positives[j]
        assert rank >= 1
        # the best-ranked other document shares the query's topic: a hard negative
        assert pairs.queries[i].split(" question")[0] in negative


def test_skipping_passes_over_the_best_ranked_documents():
    pairs = _pairs(n_per_topic=4)
    first, skipped = mine_bm25(pairs, skip=0), mine_bm25(pairs, skip=2)
    assert all(b[2] > a[2] for a, b in zip(first.records, skipped.records, strict=True))
    assert skipped.skip == 2 and "ranks 1-2 passed over" in skipped.describe()


def test_a_copy_of_the_positive_or_the_query_is_never_its_negative():
    pairs = _pairs()
    positives = list(pairs.positives)
    positives[1] = "  " + positives[0].upper() + " "  # pair 1's positive is pair 0's, recased
    copied = Pairs(pairs.queries, positives, None, "test pairs")
    mined = mine_bm25(copied, skip=0)
    chosen = {i: j for i, j, _ in mined.records}
    assert chosen[0] != 1 and chosen[1] != 0


def test_a_query_without_a_negative_among_the_matches_is_dropped_and_counted():
    pairs = _pairs()
    lone = Pairs([*pairs.queries, "zebra"], [*pairs.positives, "zebra stripes savanna"], None,
                 "test pairs")
    mined = mine_bm25(lone, skip=0)
    assert mined.dropped == 1 and len(mined.pairs) == len(pairs)
    assert "zebra" not in mined.pairs.queries
    assert "1 pair(s) without one dropped" in mined.describe()


def test_a_corpus_too_small_to_mine_from_is_one_line():
    pairs = Pairs(["alpha beta", "gamma delta"], ["alpha beta text", "gamma delta text"], None,
                  "tiny pairs")
    with pytest.raises(ValueError) as e:
        mine_bm25(pairs, skip=3)
    assert "\n" not in str(e.value) and "tiny pairs" in str(e.value)
    assert "larger corpus" in str(e.value)


def test_a_given_negative_equal_to_its_positive_is_dropped_and_counted():
    pairs = Pairs(["q one", "q two", "q three"], ["p one", "p two", "p three"],
                  ["n one", " P  TWO", "q three"], "pair file x")
    kept, dropped = drop_equal_negatives(pairs)
    assert dropped == 2 and kept.queries == ["q one"] and kept.negatives == ["n one"]
    assert drop_equal_negatives(Pairs(["a"], ["b"], None, "x")) == (Pairs(["a"], ["b"], None,
                                                                          "x"), 0)
