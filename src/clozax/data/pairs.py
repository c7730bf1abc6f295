"""Text pairs for the contrastive stage (``clozax embed``), and the texts of a split's documents.

Pairs come from a dataset's documents (the run's *train* split only: the held-out split is
what retrieval is judged on) or from the user's file:

- ``simcse``: a document's text twice; the encoder's dropout is the only difference between
  the two views (Gao et al. 2021, unsupervised SimCSE);
- ``first-sentence``: a document's first sentence (its first paragraph's text up to the
  first ". ") ↔ the rest of it, the weak title→body pair a corpus gives without labels;
- ``crops``: two independent crops of one document, each a keyed 10–50 % of its words
  (Contriever's independent cropping);
- a JSONL file: one ``{"query": ..., "positive": ..., "negative": ...}`` per line (``negative``
  optional, on every line or on none).

Every choice is a keyed hash of the document's id, so the pairs are a pure function of the
dataset and the seed. Bad input is one ``ValueError`` line naming the file, the line and the fix.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from clozax.core import files
from clozax.data.packing import BestFitPacker, DocChunk
from clozax.data.split import group_key

KINDS = ("first-sentence", "simcse", "crops")
MIN_WORDS = 3  # each side of a corpus pair has at least this many words
CROP_SHARES = (0.1, 0.5)  # a crop's share of the document's words (Contriever)
# The train groups a stage may be told to leave out of its pairs, so that its settings are
# chosen on retrieval over their documents (``judge/retrieval/heldout_set.py``): a keyed
# tenth, the same for every seed
VALIDATION_FRACTION = 0.1


@dataclass(frozen=True)
class Pairs:
    """Texts side by side: ``queries[i]`` ↔ ``positives[i]`` (and ``negatives[i]``, a hard
    negative, when given); ``source`` says where they came from, in words."""

    queries: list[str]
    positives: list[str]
    negatives: list[str] | None
    source: str

    def __len__(self) -> int:
        return len(self.queries)


def document_texts(dataset, split: str, tokenizer,
                   validation: bool | None = None) -> Iterator[tuple[str, str]]:
    """``(document id, text)`` of each document of ``split``, decoded from its packed chunks
    (special tokens left out), streamed shard by shard. ``validation``: only the documents
    whose group is (True) or is not (False) in the validation tenth (``in_validation``)."""
    part, specials = getattr(dataset, split), set(dataset.specials.values())
    for doc in dataset.documents(split):
        if validation is not None and in_validation(doc) != validation:
            continue
        ids: list[int] = []
        for row, segment in doc.get("chunks") or []:
            piece = np.asarray(part.tokens[row])[np.asarray(part.segments[row]) == segment]
            ids += [int(t) for t in piece if int(t) not in specials]
        if ids:
            yield str(doc["id"]), tokenizer.decode(ids)


def in_validation(document: dict) -> bool:
    """Whether a train document (its manifest record) is in the validation tenth: a keyed
    tenth of the train split's *groups* (the document itself when it has none), as the
    held-out split is cut by group, so that validation stands to the pairs as the held-out
    split does (a built-in docstring's module-mates are on its side)."""
    group = document.get("group") or document["id"]
    return group_key(f"validation:{group}", 0) / 2**64 < VALIDATION_FRACTION


def first_sentence(text: str) -> tuple[str, str] | None:
    """``(first sentence, the rest)`` of ``text``, or None when either has fewer than
    ``MIN_WORDS`` words. The first sentence ends at the first ". " of the first paragraph (or
    with the paragraph)."""
    words = " ".join(text.split())
    paragraph = " ".join(text.split("\n\n")[0].split())
    cut = paragraph.find(". ")
    head = paragraph if cut < 0 else paragraph[:cut + 1]
    rest = words[len(head):].strip()
    if len(head.split()) < MIN_WORDS or len(rest.split()) < MIN_WORDS:
        return None
    return head, rest


def crop(words: list[str], key: str, seed: int) -> str:
    """A keyed crop of ``words``: a share of them drawn from ``CROP_SHARES``, at a keyed
    start (at least ``MIN_WORDS`` words)."""
    low, high = CROP_SHARES
    share = low + (high - low) * group_key(f"share:{key}", seed) / 2**64
    length = min(len(words), max(MIN_WORDS, round(share * len(words))))
    start = group_key(f"start:{key}", seed) % (len(words) - length + 1)
    return " ".join(words[start:start + length])


def corpus_pairs(documents, kind: str, seed: int, source: str,
                 limit: int | None = None) -> Pairs:
    """Pairs of ``kind`` from ``(id, text)`` documents; documents that cannot give one (too
    short) are passed over. ``limit``: at most that many, the keyed-hash first."""
    if kind not in KINDS:
        raise ValueError(f"unknown pair kind {kind!r}; choose one of {', '.join(KINDS)} or "
                         "pass a JSONL file of query/positive pairs")
    out: list[tuple[int, str, str]] = []
    for doc_id, text in documents:
        if kind == "first-sentence":
            pair = first_sentence(text)
        elif kind == "simcse":
            words = " ".join(text.split())
            pair = (words, words) if len(words.split()) >= MIN_WORDS else None
        else:
            words = text.split()
            pair = ((crop(words, f"a:{doc_id}", seed), crop(words, f"b:{doc_id}", seed))
                    if len(words) >= 2 * MIN_WORDS else None)
        if pair is not None:
            out.append((group_key(f"order:{doc_id}", seed), *pair))
    out.sort(key=lambda p: p[0])  # a keyed order: the limit takes a keyed sample
    out = out[:limit] if limit is not None else out
    return Pairs([q for _, q, _ in out], [p for _, _, p in out], None,
                 f"{kind} pairs from {source}")


def read_pair_file(path: Path) -> Pairs:
    """The pairs of a JSONL file (see the module docstring), refused in one line when it is
    empty, has one pair, a line that is not an object with non-empty ``query`` and
    ``positive`` strings, or ``negative`` on some lines only."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"pair file {path} does not exist; pass a JSONL file of "
                         '{"query": ..., "positive": ...} lines')
    queries, positives, negatives, missing = [], [], [], 0
    for n, record in files.json_objects(path):
        queries.append(_text(record, "query", path, n))
        positives.append(_text(record, "positive", path, n))
        if record.get("negative") is None:
            missing += 1
        else:
            negatives.append(_text(record, "negative", path, n))
    if len(queries) < 2:
        raise ValueError(f"pair file {path} has {len(queries)} pair(s); the in-batch negatives "
                         "of a contrastive stage need at least 2 — add pairs")
    if negatives and missing:
        raise ValueError(f"pair file {path} gives a negative on {len(negatives)} of "
                         f"{len(queries)} lines; give one on every line or on none")
    return Pairs(queries, positives, negatives or None, f"pair file {path}")


def _text(record: dict, field: str, path: Path, n: int) -> str:
    value = record.get(field)
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{path}:{n} has no non-empty string {field!r}; every line needs "
                         "'query' and 'positive' (and 'negative' is optional)")
    return value


def tokenize(tokenizer, texts: list[str], length: int, cls: int, sep: int,
             pad: int) -> np.ndarray:
    """``texts`` as ``[CLS] ids [SEP]`` rows [N, length] int32, cut to ``length`` and padded
    with ``pad`` (the mask is ``ids != pad``)."""
    return tokenize_counting(tokenizer, texts, length, cls, sep, pad)[0]


def tokenize_counting(tokenizer, texts: list[str], length: int, cls: int, sep: int,
                      pad: int) -> tuple[np.ndarray, int]:
    """``tokenize``'s rows, and how many of the texts were longer than a row and cut."""
    tokenizer.no_padding()
    tokenizer.no_truncation()
    out, cut = np.full((len(texts), length), pad, np.int32), 0
    for i, encoding in enumerate(tokenizer.encode_batch(texts, add_special_tokens=False)):
        ids = [cls, *encoding.ids[:length - 2], sep]
        cut += len(encoding.ids) > length - 2
        out[i, :len(ids)] = ids
    return out, cut


def pack_texts(rows: np.ndarray, pad: int, at_least: int = 0) -> tuple[np.ndarray, ...]:
    """Token rows [N, L] (``tokenize``'s: one text each, ``pad`` after it) packed several to a
    row by ``data/packing.py``'s best fit: ``(ids [R, L], segments [R, L], where [N, 2])``,
    text ``i`` as segment ``where[i, 1] + 1`` of row ``where[i, 0]``; ``R`` at least
    ``at_least`` (the rows past those the texts fill hold one segment of padding each, so no
    row is without a token to attend to)."""
    n, length = rows.shape
    lengths = (rows != pad).sum(axis=1)
    emitted = []
    packer = BestFitPacker(length, pad, emitted.append, window=max(n, 1))
    for i in np.argsort(-lengths, kind="stable"):  # longest first: best fit decreasing
        ids = rows[i, :lengths[i]].tolist()
        packer.add(DocChunk(doc=int(i), chunk=0, ids=ids, word_starts=[True] * len(ids)))
    packer.flush()
    count = max(len(emitted), at_least)
    ids = np.full((count, length), pad, np.int32)
    segments = np.ones((count, length), np.int32)  # the padding rows' one segment
    where = np.zeros((n, 2), np.int32)
    for r, row in enumerate(emitted):
        ids[r], segments[r] = row.tokens, row.segments
        for doc, _, segment in row.placements:
            where[doc] = (r, segment - 1)
    return ids, segments, where
