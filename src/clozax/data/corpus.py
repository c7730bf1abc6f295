"""Cleaning, exact deduplication and accounting of documents read by ``readers``.

Every record read is counted exactly once: kept, duplicate, or skipped with a reason, so
``read == kept + duplicates + skipped`` always holds (asserted at the end of a run).

Memory does not grow with the corpus: ``prepare`` keeps the digests already seen (and the
split's group keys) in a ``DiskSet``, an SQLite table whose page cache is capped (16 MiB),
instead of a Python set (~150 bytes per document). Exact, so no false positive to state.
"""

from __future__ import annotations

import hashlib
import re
import sqlite3
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from clozax.data.readers import RawDocument, Record, Skip
from clozax.data.split import HELDOUT, TRAIN

# The manifest lists at most this many skips by name; the counts by reason cover the rest.
MAX_LISTED_SKIPS = 1000

# Unbroken runs of non-space characters longer than this are cut by a space before the
# tokenizer: BPE training costs (word length) per merge per distinct word, so one 10 MB "word"
# would stall it for minutes. The built-in corpus's longest run is 89 characters.
MAX_RUN_CHARS = 128
# Page cache of each DiskSet: its whole memory, however many keys it holds.
DISK_SET_CACHE_BYTES = 16 << 20

_HORIZONTAL_SPACE = re.compile(r"[^\S\n]+")
_BLANK_LINES = re.compile(r"\n{3,}")
# Anchored at a run's start, so the search stays linear in the text whatever its runs.
_LONG_RUN = re.compile(rf"(?<!\S)\S{{{MAX_RUN_CHARS + 1},}}")


@dataclass(frozen=True)
class Document:
    """A kept, normalised document. ``id`` is the hex hash of its text."""

    id: str
    text: str
    group: str
    label: str | None
    source: str


@dataclass
class Accounting:
    """Running counts (mutable on purpose: one accumulator, filled while streaming)."""

    read: int = 0
    kept: int = 0
    duplicates: int = 0
    skipped: int = 0
    skips: list[dict[str, str]] = field(default_factory=list)
    skip_reasons: dict[str, int] = field(default_factory=dict)

    def skip(self, source: str, reason: str) -> None:
        self.skipped += 1
        if len(self.skips) < MAX_LISTED_SKIPS:
            self.skips.append({"source": source, "reason": reason})
        kind = reason.split(" (")[0]
        self.skip_reasons[kind] = self.skip_reasons.get(kind, 0) + 1

    def unkeep(self, source: str, reason: str) -> None:
        """A kept document found unusable later (e.g. after tokenization): now a skip."""
        self.kept -= 1
        self.skip(source, reason)

    def merge(self, other: Accounting) -> None:
        """Add the counts of a later part of the corpus (skips listed in corpus order)."""
        self.read += other.read
        self.kept += other.kept
        self.duplicates += other.duplicates
        self.skipped += other.skipped
        self.skips += other.skips[: MAX_LISTED_SKIPS - len(self.skips)]
        for kind, count in other.skip_reasons.items():
            self.skip_reasons[kind] = self.skip_reasons.get(kind, 0) + count

    def check(self) -> None:
        assert self.read == self.kept + self.duplicates + self.skipped, self


def normalise(text: str) -> str:
    """Unix line endings, one space for any run of horizontal whitespace, at most one blank
    line in a row, no whitespace at line ends or around the document."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = _HORIZONTAL_SPACE.sub(" ", text)
    text = "\n".join(line.strip() for line in text.split("\n"))
    text = _BLANK_LINES.sub("\n\n", text).strip()
    return _LONG_RUN.sub(_cut_run, text) if len(text) > MAX_RUN_CHARS else text


def _cut_run(match: re.Match) -> str:
    run = match.group()
    return " ".join(run[i : i + MAX_RUN_CHARS] for i in range(0, len(run), MAX_RUN_CHARS))


class DiskSet:
    """Sets of byte keys in one SQLite file (mutable; one writer). ``add`` says whether the
    key was new. Memory is the page cache, ``DISK_SET_CACHE_BYTES``, not the key count."""

    def __init__(self, path: Path, names: tuple[str, ...]):
        self.db = sqlite3.connect(path, isolation_level=None)
        for pragma in ("journal_mode=OFF", "synchronous=OFF",
                       f"cache_size=-{DISK_SET_CACHE_BYTES // 1024}"):
            self.db.execute(f"PRAGMA {pragma}")
        for name in names:
            self.db.execute(f"CREATE TABLE IF NOT EXISTS {name} (k BLOB PRIMARY KEY) "
                            "WITHOUT ROWID")
        self.db.execute("BEGIN")

    def add(self, name: str, key: bytes) -> bool:
        return self.db.execute(f"INSERT OR IGNORE INTO {name} VALUES (?)", (key,)).rowcount == 1

    def count(self, name: str) -> int:
        return int(self.db.execute(f"SELECT COUNT(*) FROM {name}").fetchone()[0])

    def close(self) -> None:
        self.db.execute("COMMIT")
        self.db.close()


def text_digest(text: str) -> bytes:
    """16-byte hash of a normalised text: the dedup key and the document id."""
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest()


def clean(records: Iterable[Record], accounting: Accounting,
          seen: DiskSet | None = None) -> Iterator[Document]:
    """Normalise, drop empties and exact duplicates (first occurrence wins), count all.
    Digests seen go to ``seen``'s ``digests`` table, or to a Python set when it is None."""
    in_memory: set[bytes] = set()
    for record in records:
        accounting.read += 1
        if isinstance(record, Skip):
            accounting.skip(record.source, record.reason)
            continue
        assert isinstance(record, RawDocument)
        text = normalise(record.text)
        if not text:
            accounting.skip(record.source, "empty after whitespace normalisation")
            continue
        digest = text_digest(text)
        new = seen.add("digests", digest) if seen is not None else digest not in in_memory
        if not new:
            accounting.duplicates += 1
            continue
        if seen is None:
            in_memory.add(digest)
        accounting.kept += 1
        yield Document(id=digest.hex(), text=text, group=record.group, label=record.label,
                       source=record.source)



class CorpusRejected(ValueError):
    """The corpus as read cannot make a dataset (empty, every document skipped, a split
    empty); its fix changes the input or the reading settings, so nothing read is kept."""


def check_corpus(accounting: Accounting, groups: dict[str, int], corpus: str,
                 heldout_fraction: float, seed: int) -> None:
    """``CorpusRejected`` unless the documents kept make both splits (``groups``: distinct
    groups per split)."""
    if accounting.kept == 0:
        if accounting.skipped:
            first = "; ".join(f"{s['source']}: {s['reason']}" for s in accounting.skips[:3])
            raise CorpusRejected(f"every one of the {accounting.read} documents in {corpus} "
                                 f"was skipped (first: {first}); fix the input or "
                                 "--text-field")
        raise CorpusRejected(f"corpus {corpus} has no non-empty documents; add text")
    n_groups = groups[TRAIN] + groups[HELDOUT]
    for split, other in ((HELDOUT, TRAIN), (TRAIN, HELDOUT)):
        if not groups[split]:
            raise CorpusRejected(
                f"the {split} split would be empty: all {n_groups} group(s) hashed into "
                f"{other} at --heldout-fraction {heldout_fraction} --seed {seed}; add "
                "documents from more groups (or --group-field), or change the fraction or seed")
