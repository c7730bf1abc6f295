"""Cleaning, exact deduplication and accounting of documents read by ``readers``.

Every record read is counted exactly once: kept, duplicate, or skipped with a reason, so
``read == kept + duplicates + skipped`` always holds (asserted at the end of a run).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from clozax.data.readers import RawDocument, Record, Skip

# The manifest lists at most this many skips by name; the counts by reason cover the rest.
MAX_LISTED_SKIPS = 1000

_HORIZONTAL_SPACE = re.compile(r"[^\S\n]+")
_BLANK_LINES = re.compile(r"\n{3,}")


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

    def check(self) -> None:
        assert self.read == self.kept + self.duplicates + self.skipped, self


def normalise(text: str) -> str:
    """Unix line endings, one space for any run of horizontal whitespace, at most one blank
    line in a row, no whitespace at line ends or around the document."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = _HORIZONTAL_SPACE.sub(" ", text)
    text = "\n".join(line.strip() for line in text.split("\n"))
    return _BLANK_LINES.sub("\n\n", text).strip()


def text_digest(text: str) -> bytes:
    """16-byte hash of a normalised text: the dedup key and the document id."""
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest()


def clean(records: Iterable[Record], accounting: Accounting) -> Iterator[Document]:
    """Normalise, drop empties and exact duplicates (first occurrence wins), count all."""
    seen: set[bytes] = set()  # 16-byte digests: memory grows with kept documents, not text
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
        if digest in seen:
            accounting.duplicates += 1
            continue
        seen.add(digest)
        accounting.kept += 1
        yield Document(id=digest.hex(), text=text, group=record.group, label=record.label,
                       source=record.source)

