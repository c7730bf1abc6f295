"""Reading pieces into spools (in workers), deduplicating them in corpus order (here), and
reading back what was kept: the first phase of ``clozax prepare`` and what the tokenizer reads
(its task, ``train_task``, is in ``data/tokenizer.py``).

Per piece ``i`` (``data/pieces.py``), a worker writes to ``spool/``:
- ``{i}.{split}.jsonl``: the piece's normalised, non-empty documents of each split (by the keyed
  hash of their group), first copies within the piece only, in corpus order;
- ``{i}.keys``: per document, its 16-byte digest, split and 64-bit group key;
- ``{i}.read.json`` last: the piece's accounting; its presence marks the piece read.

Then this process merges the pieces in corpus order (``Dedup``): a digest seen in an earlier
piece makes a later copy a duplicate — so the first occurrence in the corpus wins, whatever the
number of workers — and ``{i}.merge.json`` lists the dropped documents. Digests live in an
on-disk SQLite set (``DiskSet``), so memory does not grow with the corpus. Distinct groups are
counted as runs of equal group keys among the kept documents of a split, in corpus order,
without storing them, when a group can only be a run: a document's content (a long one's parts
are consecutive; equal content is a duplicate) or its file (whose documents are consecutive).
Only ``--group-field`` groups, which may recur anywhere, go into a set as well. The merge
is cheap (16 bytes per document), so resuming a killed prepare simply merges the read pieces
again.
"""

from __future__ import annotations

import hashlib
import heapq
import json
from collections.abc import Iterator
from dataclasses import asdict
from functools import lru_cache
from pathlib import Path

import numpy as np

from clozax.core import files
from clozax.data.corpus import Accounting, DiskSet, clean
from clozax.data.pieces import Piece, read_piece
from clozax.data.readers import FieldNames, Layout
from clozax.data.split import SPLITS, TRAIN, assign_split, group_key

KEYS = np.dtype([("digest", "V16"), ("split", "u1"), ("group", "<u8")])
# A spool line starts with its id: {"id": "<32 hex digits>", …
ID_PREFIX = '{"id": "'
ID_AT = slice(len(ID_PREFIX), len(ID_PREFIX) + 32)


def spool_path(tmp: Path, piece: int, split: str) -> Path:
    return tmp / "spool" / f"{piece:05d}.{split}.jsonl"


def _piece_file(tmp: Path, piece: int, what: str) -> Path:
    return tmp / "spool" / f"{piece:05d}.{what}"


@lru_cache(maxsize=1)  # a worker reads them once, not once per piece (nor a stale copy:
def _setup(tmp: str, *identity: tuple) -> tuple[dict, dict]:  # keyed by the files' identity)
    return (files.read_json(Path(tmp) / "spool" / "plan.json"),
            files.read_json(Path(tmp) / "spool" / "settings.json"))


def read_task(tmp: str, piece: int) -> None:
    """Read, clean and split piece ``piece``; write its spools, keys and accounting."""
    the_plan, settings = _setup(tmp, *(files.identity(Path(tmp) / "spool" / name)[1]
                                       for name in ("plan.json", "settings.json")))
    tmp = Path(tmp)
    records = read_piece(the_plan, Piece.from_json(the_plan["pieces"][piece]),
                         FieldNames(*settings["fields"]), Layout(*settings["layout"]),
                         settings["strict"])
    accounting, keys = Accounting(), bytearray()
    spools = {split: spool_path(tmp, piece, split).open("w", encoding="utf-8")
              for split in SPLITS}
    for doc in clean(records, accounting):
        group = group_key(doc.group, settings["seed"])
        split = assign_split(group, settings["heldout_fraction"])
        keys += bytes.fromhex(doc.id) + SPLITS.index(split).to_bytes(1, "little") + \
            group.to_bytes(8, "little")
        record = {"id": doc.id, "text": doc.text, "group": doc.group, "label": doc.label,
                  "source": doc.source}  # asdict(doc), without its deep copies
        spools[split].write(json.dumps(record, ensure_ascii=False) + "\n")
    for f in spools.values():
        f.close()
    files.write_bytes(_piece_file(tmp, piece, "keys"), bytes(keys))
    files.write_json(_piece_file(tmp, piece, "read.json"), asdict(accounting))


def piece_read(tmp: Path, piece: int) -> bool:
    return _piece_file(tmp, piece, "read.json").is_file()


class Sample:
    """The keyed sample of train documents the tokenizer may be trained on: the ``n`` whose
    keyed hash of the id is smallest (ids are unique after dedup, so exactly ``n``).
    Memory: ``n`` integers."""

    def __init__(self, n: int | None, seed: int):
        self.n, self.seed, self.heap = n, seed, []  # heap: the n smallest keys, negated

    def key(self, doc_id: str) -> int:
        key = b"tokenizer-sample" + self.seed.to_bytes(8, "little", signed=True)
        return int.from_bytes(hashlib.blake2b(bytes.fromhex(doc_id), digest_size=8,
                                              key=key).digest(), "little")

    def offer(self, doc_id: str) -> None:
        if self.n is None:
            return
        key = -self.key(doc_id)
        if len(self.heap) <= self.n:
            heapq.heappush(self.heap, key)
        elif key > self.heap[0]:
            heapq.heapreplace(self.heap, key)

    def threshold(self) -> int | None:
        """The largest key in the sample, or None to take every document."""
        if self.n is None or len(self.heap) <= self.n:
            return None
        return -heapq.nsmallest(2, self.heap)[1]  # the n-th smallest of the n + 1 kept

    def chosen(self, lines: Iterator[str], threshold: int | None) -> Iterator[str]:
        """The texts of the sample (every text when ``threshold`` is None), in order, from
        spool lines; only the chosen ones are parsed (the id is at a fixed place)."""
        for line in lines:
            assert line.startswith(ID_PREFIX), line[:40]
            if threshold is None or self.key(line[ID_AT]) <= threshold:
                yield json.loads(line)["text"]


class Dedup:
    """Merges read pieces in corpus order (see the module docstring); one instance per run."""

    def __init__(self, tmp: Path, sample: Sample, group_runs: bool):
        path = tmp / "spool" / "sets.sqlite"
        path.unlink(missing_ok=True)  # a killed run's half merge is redone from the start
        self.tmp, self.path, self.sample, self.group_runs = tmp, path, sample, group_runs
        self.sets = DiskSet(path, ("digests", *(f"{split}_groups" for split in SPLITS)))
        self.runs = dict.fromkeys(SPLITS, 0)  # with group_runs: runs of equal group keys
        self.last: dict[str, int | None] = dict.fromkeys(SPLITS)
        self.accounting = Accounting()
        self.docs = dict.fromkeys(SPLITS, 0)
        # per split, the pieces with kept documents, in corpus order (one data shard each)
        self.pieces: dict[str, list[int]] = {split: [] for split in SPLITS}

    def merge(self, piece: int) -> None:
        read = files.read_json(_piece_file(self.tmp, piece, "read.json"))
        self.accounting.merge(Accounting(**read))
        keys = np.frombuffer(_piece_file(self.tmp, piece, "keys").read_bytes(), KEYS)
        drop: dict[str, list[int]] = {split: [] for split in SPLITS}
        seen = dict.fromkeys(SPLITS, 0)
        for digest, side, group in keys.tolist():
            split = SPLITS[side]
            if self.sets.add("digests", digest):
                if not self.group_runs:
                    self.sets.add(f"{split}_groups", group.to_bytes(8, "little"))
                elif group != self.last[split]:
                    self.runs[split], self.last[split] = self.runs[split] + 1, group
                if split == TRAIN:
                    self.sample.offer(digest.hex())
            else:
                drop[split].append(seen[split])
            seen[split] += 1
        for split in SPLITS:
            kept = seen[split] - len(drop[split])
            self.accounting.kept -= len(drop[split])
            self.accounting.duplicates += len(drop[split])
            self.docs[split] += kept
            if kept:
                self.pieces[split].append(piece)
        files.write_json(_piece_file(self.tmp, piece, "merge.json"), {"drop": drop})

    def close(self) -> dict[str, int]:
        """Distinct groups per split; the set file is deleted."""
        groups = self.runs if self.group_runs else {
            split: self.sets.count(f"{split}_groups") for split in SPLITS}
        self.sets.close()
        self.path.unlink()
        return groups


def kept_lines(tmp: Path, split: str, pieces: list[int]) -> Iterator[str]:
    """The spool lines of the kept documents of ``split`` in the given pieces, in corpus
    order."""
    for piece in pieces:
        drop = set(files.read_json(_piece_file(tmp, piece, "merge.json"))["drop"][split])
        with spool_path(tmp, piece, split).open(encoding="utf-8") as f:
            for n, line in enumerate(f):
                if n not in drop:
                    yield line


def kept_records(tmp: Path, split: str, pieces: list[int]) -> Iterator[dict]:
    return (json.loads(line) for line in kept_lines(tmp, split, pieces))

