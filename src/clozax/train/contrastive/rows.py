"""The contrastive stage's pairs as token rows ``{side: [N, L]}``: corpus pairs from the run's
*train* split (``data/pairs.py``; an imported run's from the ``--data`` it is given) or a JSONL
file's, tokenized with the run's tokenizer.

``clozax retrieval`` asks for the same rows twice per seed (the trained encoder and its
random-init control), so the last rows made are kept for the process, keyed by what makes
them — the run's tokenizer (its file's sha256), its dataset (the fingerprint ``run.json``
records, which ``open_run_dataset`` holds the dataset to), its special ids and the settings
that shape the rows — never by where the run is: a run replaced at the same path by another
gets its own rows. A pair file is read again every time (it may have changed).

``negatives="bm25"`` adds a hard negative to each corpus pair, mined by BM25 from the pairs'
own positives (``data/negatives.py``: the query's own positive, copies of it and the
``negatives_skip`` best-ranked passed over; a pair without one dropped, counted); a pair
file's own negatives equal to their positive (or query) are dropped, counted. What was mined,
dropped and cut to the row length is said in the rows' ``source`` (the stage's header line and
``run.json``'s ``pairs_source``), and ``mined_negatives`` gives the mined triples to record.

``pack=True`` (``packed_batch``): each side's texts of a batch packed several to a row
(``data/pairs.py`` ``pack_texts``), into a number of rows fixed for the stage: the most any
of its batches needs (``packed_counts``), so one program runs them all.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np

from clozax.core import files
from clozax.data import pairs as pairs_lib
from clozax.data.negatives import Mined, drop_equal_negatives, mine_bm25
from clozax.data.tokenizer import load_tokenizer
from clozax.train.run_dir import LoadedRun, open_run_dataset

_LAST_ROWS: dict = {}  # content key -> (rows, source, mined): the last pair rows made


def pair_rows(run: LoadedRun, settings) -> tuple[dict, str]:
    """The stage's pairs as token rows ``{side: [N, L]}`` and where they came from, for
    ``settings`` (a ``StageSettings``); refused in one line when they are fewer than a batch."""
    key = _content_key(run, settings)
    if key not in _LAST_ROWS or settings.pairs not in pairs_lib.KINDS:  # a file may change
        _LAST_ROWS.clear()
        _LAST_ROWS[key] = _make_pair_rows(run, settings)
    rows, source, _ = _LAST_ROWS[key]
    if len(rows["query"]) < settings.batch_size:
        raise ValueError(f"{source} gives {len(rows['query'])} pairs, fewer than --batch-size "
                         f"{settings.batch_size}; lower --batch-size or give more pairs")
    return rows, source


def mined_negatives(run: LoadedRun, settings) -> Mined | None:
    """The hard negatives BM25 mined for ``settings``' rows (None without ``negatives``)."""
    pair_rows(run, settings)
    return _LAST_ROWS[_content_key(run, settings)][2]


def _content_key(run: LoadedRun, settings) -> tuple:
    """What the rows are a function of: the tokenizer's bytes, the dataset's fingerprint (the
    run's, or that of the ``--data`` an imported run was given), the special ids, and the pair
    kind, seed, sample size and row length (and the dataset's directory, which the rows'
    ``source`` names)."""
    tokenizer = files.file_sha256(run.tokenizer_path)
    given = (None if settings.data is None or settings.pairs not in pairs_lib.KINDS else
             open_run_dataset(run, Path(settings.data)).fingerprint)  # an imported run's
    return (tokenizer, run.info.get("dataset_fingerprint"), run.info.get("dataset"), given,
            settings.data,
            tuple(sorted(run.specials.items())), settings.pairs, settings.seed,
            settings.max_pairs, settings.seq_len, settings.negatives, settings.negatives_skip,
            settings.withhold_validation)


def _make_pair_rows(run: LoadedRun, settings) -> tuple[dict, str]:
    tokenizer = load_tokenizer(run.tokenizer_path)
    if settings.pairs in pairs_lib.KINDS:
        dataset = open_run_dataset(run, None if settings.data is None else Path(settings.data))
        withheld = settings.withhold_validation
        found = pairs_lib.corpus_pairs(
            pairs_lib.document_texts(dataset, "train", tokenizer,
                                     validation=False if withheld else None),
            settings.pairs, settings.seed, f"{dataset.path} (train split"
            + (", its validation tenth withheld)" if withheld else ")"), settings.max_pairs)
    else:
        found = pairs_lib.read_pair_file(Path(settings.pairs))
    found, mined, notes = _with_negatives(found, settings)
    s = run.specials
    texts = {"query": found.queries, "positive": found.positives}
    if found.negatives is not None:
        texts["negative"] = found.negatives
    rows, cut = {}, 0
    for side, t in texts.items():
        rows[side], n = pairs_lib.tokenize_counting(tokenizer, t, settings.seq_len, s["cls"],
                                                    s["sep"], s["pad"])
        cut += n
    if cut:
        notes.append(f"{cut:,} text(s) longer than --seq-len {settings.seq_len} cut to it")
    return rows, "; ".join([found.source, *notes]), mined


def _with_negatives(found: pairs_lib.Pairs, settings):
    """``found`` with BM25's hard negatives (``negatives="bm25"``) or without a pair file's
    negatives that equal their positive: ``(pairs, mined or None, notes)``."""
    if settings.negatives == "bm25":
        if found.negatives is not None:
            raise ValueError(f"{found.source} gives its own negatives and --negatives bm25 "
                             "would mine others; drop one of them")
        mined = mine_bm25(found, settings.negatives_skip)
        return mined.pairs, mined, [mined.describe()]
    found, dropped = drop_equal_negatives(found)
    return found, None, [f"{dropped:,} pair(s) whose negative equals its positive or query "
                         "dropped"] if dropped else []


def packed_counts(rows: dict, batches: Iterable[np.ndarray], pad: int,
                  multiple: int) -> dict[str, int]:
    """Each side's packed row count for a stage whose batches (pair indices) are ``batches``:
    the most any of them fills, rounded up to a ``multiple`` (the devices)."""
    most = dict.fromkeys(rows, 1)
    for chosen in batches:
        for side, side_rows in rows.items():
            most[side] = max(most[side], len(pairs_lib.pack_texts(side_rows[chosen], pad)[0]))
    return {side: -(-n // multiple) * multiple for side, n in most.items()}


def packed_batch(rows: dict, chosen: np.ndarray, pad: int, counts: dict) -> dict:
    """The batch of pairs ``chosen``, each side packed into ``counts[side]`` rows: ``{side:
    ids, side_segments: …, side_where: …}`` (``make_loss_and_grads(packed=True)``'s)."""
    out = {}
    for side, side_rows in rows.items():
        ids, segments, where = pairs_lib.pack_texts(side_rows[chosen], pad, counts[side])
        out |= {side: ids, f"{side}_segments": segments, f"{side}_where": where}
    return out
