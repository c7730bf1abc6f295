"""Pretraining overlap: which validation and test examples of a downstream task the encoder
read while pretraining, found by the key ``prepare`` deduplicates by (the 16-byte digest of the
normalised text, ``clozax.data.corpus``).

What the encoder read: the train split of every dataset its run names (the run's ``--data``,
each phase's, and, for a run started ``--init-from`` another, that run's, back to the first). An
imported encoder's pretraining corpus is not known: its overlap is ``"unknown"``. An example
overlaps when the digest of any of its texts (a token task: its words joined by spaces) is a
pretraining document's; an example that is a prepared document carries its own id
(``Raw.digests``). By default overlapping validation and test examples are dropped before
anything is scored (the headline is on text the encoder never saw); ``keep`` keeps and counts
them. The scan streams each dataset's document index, so memory is the task's size.
"""

from __future__ import annotations

from pathlib import Path

from clozax.data.corpus import normalise, text_digest
from clozax.data.dataset import open_dataset
from clozax.judge.finetune.tasks import Raw
from clozax.train.run_dir import read_config


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
    if raw.words:
        return [(text_digest(normalise(" ".join(w))).hex(),) for w in raw.words]
    return [tuple(text_digest(normalise(t)).hex() for t in texts) for texts in raw.texts]


def evaluated(raws: dict[str, Raw]) -> list[str]:
    """The splits a score is read from: all but train (validation, test, MNLI's
    test_mismatched)."""
    return [s for s in raws if s != "train"]


def find(raws: dict[str, Raw], datasets: list[Path]) -> dict[str, list[int]]:
    """Indices of each evaluated split's examples whose text is a pretraining document."""
    wanted: dict[str, list[tuple[str, int]]] = {}
    for split in evaluated(raws):
        for i, digests in enumerate(digests_of(raws[split])):
            for d in digests:
                wanted.setdefault(d, []).append((split, i))
    hits: dict[str, set[int]] = {split: set() for split in evaluated(raws)}
    for path in datasets:
        dataset = open_dataset(path, check_tokenizer=False)
        for doc in dataset.documents("train"):  # streamed, shard by shard
            for split, i in wanted.get(doc["id"], ()):
                hits[split].add(i)
    return {split: sorted(ix) for split, ix in hits.items()}


def account(raws: dict[str, Raw], info: dict, keep: bool) -> tuple[dict[str, Raw], dict]:
    """The task's splits without (or, ``keep``, with) the validation and test examples seen in
    pretraining, and ``pretraining_overlap`` as ``result.json`` records it."""
    datasets, unknown = pretraining_datasets(info)
    missing = [str(p) for p in datasets if not p.is_dir()]
    if unknown is None and missing:
        unknown = f"its pretraining dataset {missing[0]} is not here"
    if unknown is not None:
        return raws, {**{s: "unknown" for s in evaluated(raws)}, "why": unknown}
    hits = find(raws, datasets)
    record = {**{s: len(hits[s]) for s in evaluated(raws)},
              "checked_against": [f"{p} (train split)" for p in datasets],
              "key": "blake2b-128 of the normalised text (prepare's dedup key)",
              "excluded": not keep}
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
