"""Hard negatives for the contrastive stage, mined from the pairs' own corpus by BM25
(``clozax embed --negatives bm25``), and a pair file's given negatives checked.

For query ``i``, BM25 (``data/bm25.py``) ranks every pair's positive text. Its own positive is
passed over, and so is any text equal to its positive or to the query (after whitespace and
case are normalised): such a "negative" would teach the encoder to push the answer away. Of
what is left, the first ``skip`` are passed over too, because the documents BM25 ranks highest
are the likeliest to be unlabelled positives (the false negatives that RocketQA and GPL filter
out; Qu et al. 2021 skip the top of the ranking for the same reason). The next one is the hard
negative. A query with no such document among BM25's matches has no negative and its pair is
dropped, counted. ``Mined.records`` says, for every kept pair, which positive became its
negative and at what rank, so the stage can write them beside its run.
"""

from __future__ import annotations

from dataclasses import dataclass

from clozax.data.bm25 import bm25_run
from clozax.data.pairs import Pairs

SKIP = 3  # the ranks past the query's own positive passed over as likely false negatives
DEPTH = 20  # further ranks looked at for a negative after the skipped ones


@dataclass(frozen=True)
class Mined:
    """The pairs that have a negative (their order kept), how many had none, and for each
    kept pair ``(pair index in the input, negative's pair index, its BM25 rank)``: 1-based,
    in the query's whole ranking (its own positive included)."""

    pairs: Pairs
    dropped: int
    skip: int
    records: list[tuple[int, int, int]]

    def describe(self) -> str:
        kept = len(self.pairs)
        return (f"BM25 hard negatives for {kept:,} of {kept + self.dropped:,} pairs (ranks "
                f"1-{self.skip} passed over as likely positives"
                + (f"; {self.dropped:,} pair(s) without one dropped" if self.dropped else "")
                + ")")


def mine_bm25(pairs: Pairs, skip: int = SKIP, depth: int = DEPTH) -> Mined:
    """Each query's hard negative among the other pairs' positives (see the module
    docstring); refused in one line when fewer than 2 pairs keep one (a corpus too small, or
    too repetitive, to mine from) or when ``skip`` is negative."""
    if skip < 0 or depth < 1:
        raise ValueError(f"--negatives-skip {skip} must be 0 or more; it is how many of the "
                         "best-ranked documents are passed over as likely positives")
    documents = {f"d{j}": text for j, text in enumerate(pairs.positives)}
    queries = {f"q{i}": text for i, text in enumerate(pairs.queries)}
    ranking = bm25_run(documents, queries, k=1 + skip + depth, keep_identical_ids=True)
    keys = [_normal(t) for t in pairs.positives]
    kept, records = [], []
    for i, query in enumerate(pairs.queries):
        unlike = {keys[i], _normal(query)}
        order = sorted(ranking[f"q{i}"].items(), key=lambda hit: (-hit[1], hit[0]))
        candidates = [(rank, int(d[1:])) for rank, (d, _) in enumerate(order, 1)
                      if int(d[1:]) != i and keys[int(d[1:])] not in unlike]
        if len(candidates) > skip:
            rank, j = candidates[skip]
            kept.append(i)
            records.append((i, j, rank))
    if len(kept) < 2:
        raise ValueError(f"{pairs.source}: BM25 found a hard negative for {len(kept)} of "
                         f"{len(pairs):,} pairs (past the {skip} best-ranked); mining needs a "
                         "larger corpus: add documents, lower --negatives-skip, or train "
                         "without --negatives")
    mined = Pairs([pairs.queries[i] for i in kept], [pairs.positives[i] for i in kept],
                  [pairs.positives[j] for _, j, _ in records],
                  f"{pairs.source}, BM25 hard negatives (skip {skip})")
    return Mined(mined, len(pairs) - len(kept), skip, records)


def drop_equal_negatives(pairs: Pairs) -> tuple[Pairs, int]:
    """A pair file's pairs without those whose given negative is its positive (or its query)
    once whitespace and case are normalised, and how many were dropped: trained on, such a
    pair pushes its own answer away."""
    if pairs.negatives is None:
        return pairs, 0
    keep = [i for i, n in enumerate(pairs.negatives)
            if _normal(n) not in {_normal(pairs.positives[i]), _normal(pairs.queries[i])}]
    if len(keep) == len(pairs):
        return pairs, 0
    return Pairs([pairs.queries[i] for i in keep], [pairs.positives[i] for i in keep],
                 [pairs.negatives[i] for i in keep], pairs.source), len(pairs) - len(keep)


def _normal(text: str) -> str:
    return " ".join(text.split()).casefold()
