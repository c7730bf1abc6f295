"""Pretraining overlap: which validation and test examples of a downstream task the encoder
read while pretraining, whole or in part.

What the encoder read: the train split of every dataset its run names (the run's ``--data``,
each phase's, and, for a run started ``--init-from`` another, that run's, back to the first). An
imported encoder's pretraining corpus is not known: its overlap is ``"unknown"``.

The rule. An example overlaps when one of its texts (a pair's: either text; a token task: its
words joined by spaces)

- **is** a pretraining document: the 16-byte digest of its normalised text is one that
  ``prepare`` deduplicates by (``clozax.data.corpus``; an example that is a prepared document
  carries its own id, ``Raw.digests``); or
- **is contained in** one: at least ``CONTAINMENT`` of its distinct ``SHINGLE``-token shingles
  (runs of consecutive token ids) occur in a single pretraining document. This finds a sentence
  taken from inside a document, a (sentence, rest) pair cut from one, and a near-duplicate (a
  document with a word changed: a one-token change removes ``SHINGLE`` shingles); shingle
  Jaccard ≥ ``CONTAINMENT``, the near-duplicate rule of dedup tools, implies it.

``SHINGLE`` = 8 tokens is about 5–6 words, the shingle length near-duplicate detection uses
(5 words, Lee et al. 2022); ``CONTAINMENT`` = 0.5: most of the text read verbatim, in one place.
A text with a one-token word changed keeps half its shingles once it is 3 × ``SHINGLE`` - 1
tokens long. Text shared with several documents, a phrase here and there, is not an overlap:
the shingles must meet in one document. A text shorter than ``SHINGLE`` tokens is judged by the
digest only.

Tokens, not decoded text: the pretraining documents are stored as token ids, so the example's
normalised text is encoded by each dataset's own tokenizer (through its normaliser, so its
lowercasing too) and compared with the ids in the rows; nothing is decoded. Shingles are
hashed to 64 bits.

Scale: the test side is small and the corpus is not, so the test side's shingles are built
first (a sorted array), then each train split is streamed once, shard by shard and rows in
blocks, keeping only the windows found in that array. Memory is the task's shingles plus one
shard's document list and hits, whatever the corpus's size. A shard holds its documents whole,
so a document's hits are counted together, those across a chunk cut (a document longer than a
row) included.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

import numpy as np

from clozax.data.corpus import normalise, text_digest
from clozax.data.dataset import open_dataset
from clozax.data.shards import shard_files
from clozax.data.tokenizer import load_tokenizer
from clozax.judge.finetune.tasks import Raw
from clozax.train.run_dir import read_config

SHINGLE = 8  # tokens per shingle
CONTAINMENT = 0.5  # share of a text's shingles that must occur in one pretraining document
BLOCK_ROWS = 2048  # rows hashed at once; memory only
RULE = {"exact": "blake2b-128 of the normalised text (prepare's dedup key)",
        "contained": f">= {CONTAINMENT:g} of the text's distinct {SHINGLE}-token shingles (the "
                     "dataset's tokenizer) in one pretraining document",
        "shingle_tokens": SHINGLE, "containment": CONTAINMENT}
_MULT = np.uint64(0x9E3779B97F4A7C15)


def pretraining_datasets(info: dict) -> tuple[list[Path], str | None]:
    """(dataset directories whose train split the run's encoder read, why unknown or None),
    from ``run.json``'s ``info`` and its ``--init-from`` sources."""
    out: list[Path] = []
    seen: set[str] = set()
    while True:
        if not info.get("dataset"):
            return [], "the encoder was imported, so its pretraining corpus is not known"
        for path in (info["dataset"], *(p["data"] for p in info.get("phases") or [])):
            if Path(path) not in out:
                out.append(Path(path))
        source = info.get("init_from")
        if not source or source in seen:
            return out, None
        seen.add(source)
        try:
            info = read_config(Path(source))[1]
        except ValueError:
            return [], f"the run it started from ({source}) is not here"


def digests_of(raw: Raw) -> list[tuple[str, ...]]:
    """Per example, the digests of its texts (``raw.digests`` where the example set them)."""
    if raw.digests:
        return raw.digests
    return [tuple(text_digest(t).hex() for t in texts) for texts in texts_of(raw)]


def texts_of(raw: Raw) -> list[tuple[str, ...]]:
    """Per example, its normalised texts (a token task's words joined by spaces)."""
    if raw.words:
        return [(normalise(" ".join(w)),) for w in raw.words]
    return [tuple(normalise(t) for t in texts) for texts in raw.texts]


def evaluated(raws: dict[str, Raw]) -> list[str]:
    """The splits a score is read from: all but train (validation, test, MNLI's
    test_mismatched)."""
    return [s for s in raws if s != "train"]


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, elementwise on uint64 (wrapping)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def window_hashes(ids: np.ndarray) -> np.ndarray:
    """(rows, width - SHINGLE + 1) uint64 hash of each run of ``SHINGLE`` ids of ``ids``
    (rows, width); the same run gives the same hash in any row."""
    ids = _mix(np.asarray(ids).astype(np.uint64) + np.uint64(1))  # (rows, width)
    windows = ids.shape[1] - SHINGLE + 1
    out = np.zeros((ids.shape[0], max(windows, 0)), np.uint64)  # (rows, windows)
    for j in range(SHINGLE if windows > 0 else 0):
        out = out * _MULT + ids[:, j : j + windows]
    return _mix(out)


@dataclass(frozen=True)
class Shingles:
    """The evaluated texts' shingles under one tokenizer. A *unit* is one text of one
    example; ``keys`` the sorted distinct shingles, the units holding ``keys[k]`` being
    ``key_units[key_start[k]:key_start[k + 1]]``."""

    keys: np.ndarray  # (k,) uint64, sorted
    key_start: np.ndarray  # (k + 1,) int64
    key_units: np.ndarray  # (pairs,) int64
    sizes: np.ndarray  # (units,) int64: distinct shingles per unit
    example_of: np.ndarray  # (units,) int64: the unit's example (index into ``examples``)


def index_texts(texts: list[tuple[str, ...]], tokenizer) -> Shingles:
    """Encode each example's texts with ``tokenizer`` and index their shingles."""
    flat = [t for ts in texts for t in ts]
    example_of = np.repeat(np.arange(len(texts)), [len(ts) for ts in texts]).astype(np.int64)
    encoded = tokenizer.encode_batch(flat, add_special_tokens=False) if flat else []
    per_unit = [np.unique(window_hashes(np.asarray([e.ids], np.int64))[0]) for e in encoded]
    sizes = np.asarray([h.size for h in per_unit], np.int64)  # (units,)
    hashes = np.concatenate([np.zeros(0, np.uint64), *per_unit])  # (pairs,)
    units = np.repeat(np.arange(len(per_unit)), sizes).astype(np.int64)  # (pairs,)
    order = np.argsort(hashes, kind="stable")
    keys, starts = np.unique(hashes[order], return_index=True)
    return Shingles(keys, np.append(starts, hashes.size).astype(np.int64), units[order], sizes,
                    example_of)


def find(raws: dict[str, Raw], datasets: list[Path]) -> tuple[dict[str, list[int]],
                                                              dict[str, int]]:
    """(indices of each evaluated split's examples that overlap a pretraining document by the
    module's rule, how many of each split only by containment)."""
    examples = [(split, i) for split in evaluated(raws) for i in range(len(raws[split].targets))]
    texts = [t for split in evaluated(raws) for t in texts_of(raws[split])]
    wanted: dict[str, list[int]] = {}
    for e, digests in enumerate(d for split in evaluated(raws) for d in digests_of(raws[split])):
        for d in digests:
            wanted.setdefault(d, []).append(e)
    exact: set[int] = set()
    contained: set[int] = set()
    for path in datasets:
        dataset = open_dataset(path, check_tokenizer=False)
        side = index_texts(texts, load_tokenizer(dataset.tokenizer_path))
        for shard in dataset.manifest["shards"]["train"]:  # streamed, shard by shard
            names = shard_files("train", shard["name"])
            docs = _documents(path / names["documents"])
            exact.update(e for doc in docs for e in wanted.get(doc["id"], ()))
            if side.keys.size and docs:
                contained.update(_contained(side, *_shard_hits(path, names, docs, side),
                                            len(docs)))
    hits: dict[str, set[int]] = {split: set() for split in evaluated(raws)}
    for e in exact | contained:
        hits[examples[e][0]].add(examples[e][1])
    only = {split: 0 for split in evaluated(raws)}
    for e in contained - exact:
        only[examples[e][0]] += 1
    return {split: sorted(ix) for split, ix in hits.items()}, only


def _documents(file: Path) -> list[dict]:
    """One shard's document records (shard-local rows)."""
    with file.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _shard_hits(path: Path, names: dict[str, str], docs: list[dict],
                side: Shingles) -> tuple[np.ndarray, np.ndarray]:
    """(document, key index) of every shingle of one shard's documents that is one of
    ``side.keys``: the windows inside a row's segment, then those across each chunk cut."""
    tokens = np.load(path / names["tokens"], mmap_mode="r")  # (rows, seq_len)
    segments = np.load(path / names["segments"], mmap_mode="r")  # (rows, seq_len)
    rows, segs, keys = _row_hits(tokens, segments, side)
    chunk_key = np.asarray([(row << 16) | seg for doc in docs for row, seg in doc["chunks"]],
                           np.int64)  # (chunks,)
    chunk_doc = np.repeat(np.arange(len(docs)), [len(doc["chunks"]) for doc in docs])
    order = np.argsort(chunk_key)
    doc = chunk_doc[order][np.searchsorted(chunk_key[order], (rows << 16) | segs)]  # (hits,)
    cut_doc, cut_keys = _cut_hits(tokens, segments, docs, side)
    return np.concatenate([doc, cut_doc]), np.concatenate([keys, cut_keys])


def _match(side: Shingles, hashes: np.ndarray, valid: np.ndarray) -> tuple[np.ndarray, ...]:
    """(row, column, key index) of the ``valid`` ``hashes`` (2-D) that are ``side.keys``."""
    k = np.minimum(np.searchsorted(side.keys, hashes), side.keys.size - 1)  # like hashes
    rows, cols = np.nonzero(valid & (side.keys[k] == hashes))
    return rows, cols, k[rows, cols].astype(np.int64)


def _row_hits(tokens, segments, side: Shingles) -> tuple[np.ndarray, ...]:
    """(row, segment, key index) of every window inside one segment of a row whose shingle is
    one of ``side.keys``, read ``BLOCK_ROWS`` rows at a time."""
    found = [np.zeros(0, np.int64)] * 3
    for start in range(0, tokens.shape[0], BLOCK_ROWS):
        seg = np.asarray(segments[start : start + BLOCK_ROWS]).astype(np.int64)  # (block, L)
        hashes = window_hashes(tokens[start : start + BLOCK_ROWS])  # (block, windows)
        windows = hashes.shape[1]  # >= 1: a row holds at least MIN_SEQ_LEN = SHINGLE tokens
        one_segment = (seg[:, :windows] == seg[:, SHINGLE - 1 :]) & (seg[:, :windows] > 0)
        rows, cols, keys = _match(side, hashes, one_segment)
        found = [np.concatenate(p) for p in zip(found, (rows + start, seg[rows, cols], keys),
                                                    strict=True)]
    return tuple(found)


def _cut_hits(tokens, segments, docs: list[dict], side: Shingles) -> tuple[np.ndarray, ...]:
    """(document, key index) of the shingles that span a chunk cut (a document longer than a
    row): the last ``SHINGLE - 1`` body tokens of a chunk joined to the first of the next."""
    cuts = np.asarray([(*a, *b, d) for d, doc in enumerate(docs)
                       for a, b in pairwise(doc["chunks"])],
                      np.int64).reshape(-1, 5)  # (cuts, 5): row, segment, row, segment, doc
    found = [np.zeros(0, np.int64)] * 2
    for start in range(0, len(cuts), BLOCK_ROWS):
        c = cuts[start : start + BLOCK_ROWS]
        joined = np.concatenate([_edge(tokens, segments, c[:, 0], c[:, 1], last=True),
                                 _edge(tokens, segments, c[:, 2], c[:, 3], last=False)],
                                axis=1)  # (block, 2 * SHINGLE - 2), -1 where none
        missing = np.pad(np.cumsum(joined < 0, axis=1), ((0, 0), (1, 0)))  # (block, 2S - 1)
        valid = missing[:, SHINGLE:] == missing[:, : -SHINGLE]  # (block, SHINGLE - 1)
        rows, _, keys = _match(side, window_hashes(np.maximum(joined, 0)), valid)
        found = [np.concatenate(p) for p in zip(found, (c[rows, 4], keys), strict=True)]
    return tuple(found)


def _edge(tokens, segments, rows: np.ndarray, segs: np.ndarray, last: bool) -> np.ndarray:
    """(cuts, SHINGLE - 1) the last (or first) body tokens of each chunk (``rows``, ``segs``),
    without its [CLS]/[SEP]; -1 where the chunk's body is shorter."""
    inside = np.asarray(segments[rows]) == segs[:, None]  # (cuts, L)
    width = inside.shape[1]
    first = inside.argmax(axis=1)[:, None]  # (cuts, 1): [CLS]
    final = width - 1 - inside[:, ::-1].argmax(axis=1)[:, None]  # (cuts, 1): [SEP]
    span = np.arange(SHINGLE - 1)
    cols = final - (SHINGLE - 1) + span if last else first + 1 + span  # (cuts, SHINGLE - 1)
    ok = (cols > first) & (cols < final)
    ids = np.take_along_axis(np.asarray(tokens[rows]).astype(np.int64),
                             np.clip(cols, 0, width - 1), axis=1)
    return np.where(ok, ids, -1)


def _contained(side: Shingles, doc: np.ndarray, keys: np.ndarray, n_docs: int) -> set[int]:
    """The examples with a text of which at least ``CONTAINMENT`` of the distinct shingles
    are among one document's hits (``doc``, ``keys``: a shard's, documents numbered 0..n)."""
    if not doc.size:
        return set()
    pairs = np.unique(doc * side.keys.size + keys)  # distinct (document, shingle)
    doc, keys = pairs // side.keys.size, pairs % side.keys.size
    counts = side.key_start[keys + 1] - side.key_start[keys]  # (pairs,) units per shingle
    first = np.repeat(side.key_start[keys] - (np.cumsum(counts) - counts), counts)
    units = side.key_units[first + np.arange(counts.sum())]  # (expanded,)
    unit_doc, shared = np.unique(units * n_docs + np.repeat(doc, counts), return_counts=True)
    units = unit_doc // n_docs
    over = shared >= CONTAINMENT * side.sizes[units]
    return {int(e) for e in side.example_of[units[over]]}


def account(raws: dict[str, Raw], info: dict, keep: bool) -> tuple[dict[str, Raw], dict]:
    """The task's splits without (or, ``keep``, with) the validation and test examples seen in
    pretraining, and ``pretraining_overlap`` as ``result.json`` records it."""
    datasets, unknown = pretraining_datasets(info)
    missing = [str(p) for p in datasets if not p.is_dir()]
    if unknown is None and missing:
        unknown = f"its pretraining dataset {missing[0]} is not here"
    if unknown is not None:
        return raws, {**{s: "unknown" for s in evaluated(raws)}, "why": unknown}
    hits, only_contained = find(raws, datasets)
    record = {**{s: len(hits[s]) for s in evaluated(raws)},
              "contained_not_exact": only_contained,
              "checked_against": [f"{p} (train split)" for p in datasets],
              "rule": RULE, "excluded": not keep}
    if keep:
        return raws, record
    out = dict(raws)
    for split in evaluated(raws):
        gone = set(hits[split])
        out[split] = raws[split].pick([i for i in range(len(raws[split].targets))
                                       if i not in gone])
        if gone and not out[split].targets:
            raise ValueError(f"all {len(gone)} {split} examples occur in the encoder's "
                             "pretraining data; give others, or pass --keep-pretraining-overlap "
                             "to score them anyway")
    return out, record
