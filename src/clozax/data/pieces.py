"""The corpus cut into pieces: the unit of work of reading (one worker reads one piece) and of
the data shards (a piece's kept documents of a split are packed into one shard).

A piece is a run of consecutive whole files of about ``piece_bytes`` in all, or a byte range of
one large uncompressed JSONL or text file (``--text-unit line`` or ``paragraph``), cut where a
line (JSONL, line) or a paragraph (paragraph) ends, with the number of its first line so sources
read ``file:line`` as when the whole file is read, or a run of a large parquet file's row
groups. Compressed and arrow files, and text files read as one document (``--text-unit file``),
are never cut.

The plan is a function of the corpus (its files, their sizes and the cut points in their bytes)
and ``piece_bytes`` only, never of ``--workers``: so the output does not depend on how many
processes read it. Finding the cuts reads each large file once, counting line ends in blocks
(bounded memory).
"""

from __future__ import annotations

import json
import platform
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from clozax.data.readers import (
    FieldNames,
    Layout,
    Record,
    Span,
    check_files,
    guard,
    read_file,
    relative_name,
)
from clozax.data.sources import file_kind, find_files
from clozax.data.stdlib import read_stdlib, stdlib_root_checked

# A corpus of more than this many pieces gets larger pieces (``piece_bytes`` is a floor), so a
# 100 GB corpus is thousands of shards, not tens of thousands.
MAX_PIECES = 4096
_BLOCK = 1 << 20
_OVERLAP = 1 << 12  # bytes kept between blocks so a cut pattern can span two of them
# Where a piece may end: just after a line end, or after a run of blank lines whose next line
# holds a character that is not whitespace (``_ends_paragraphs``), in any script: so the whole
# file's paragraph separator (``sources.SEPARATORS``) ends exactly there too.
_BLANK = rb"[ \t\r\x0b\x0c]*\n"
_CUTS = {"line": re.compile(rb"\n"),
         "paragraph": re.compile(rb"\n" + _BLANK + rb"(?:" + _BLANK + rb")*")}


@dataclass(frozen=True)
class Piece:
    """Files ``[first, stop)`` of the plan's file list; when one file is cut, ``span`` is the
    byte range of it this piece reads."""

    first: int
    stop: int
    span: Span = Span()

    def to_json(self) -> list:
        return [self.first, self.stop, self.span.start, self.span.end, self.span.line]

    @staticmethod
    def from_json(row: list) -> Piece:
        return Piece(row[0], row[1], Span(row[2], row[3], row[4]))


def plan(corpus: str, layout: Layout, piece_bytes: int) -> dict:
    """``{"files": [[path, name, size, mtime_ns], …], "pieces": [Piece.to_json(), …]}`` for
    ``corpus`` (``"stdlib"`` is one piece, ``"stdlib"`` naming the Python version read).
    ``ValueError`` for a bad path or a missing optional reader."""
    if corpus == "stdlib":
        stdlib_root_checked()
        return {"files": [], "pieces": [Piece(0, 0).to_json()],
                "stdlib": platform.python_version()}
    files, base = find_files(corpus)
    check_files(files)
    stats = [p.stat() for p in files]
    sizes = [s.st_size for s in stats]
    piece_bytes = max(piece_bytes, -(-sum(sizes) // MAX_PIECES))
    pieces: list[Piece] = []
    first, held = 0, 0  # the run of whole files not yet made a piece, and its bytes
    for i, (path, size) in enumerate(zip(files, sizes, strict=True)):
        rule = _cut_rule(path, layout)
        if size > piece_bytes and (rule is not None or file_kind(path)[0] == "parquet"):
            spans = _spans(path, size, piece_bytes, rule) if rule else _row_groups(path,
                                                                                   piece_bytes)
            if len(spans) > 1:
                if first < i:
                    pieces.append(Piece(first, i))
                pieces += [Piece(i, i + 1, span) for span in spans]
                first, held = i + 1, 0
                continue
        if held and held + size > piece_bytes:
            pieces.append(Piece(first, i))
            first, held = i, 0
        held += size
    if first < len(files):
        pieces.append(Piece(first, len(files)))
    return {"files": [[str(p), relative_name(p, base), st.st_size, st.st_mtime_ns]
                      for p, st in zip(files, stats, strict=True)],
            "pieces": [p.to_json() for p in pieces]}


def piece_identity(the_plan: dict, i: int) -> str:
    """What piece ``i``'s records depend on: its files (names, sizes, modification times) and
    its range; equal identities read the same records."""
    piece = Piece.from_json(the_plan["pieces"][i])
    return json.dumps([the_plan["pieces"][i], the_plan["files"][piece.first : piece.stop],
                       the_plan.get("stdlib")])


def _cut_rule(path: Path, layout: Layout) -> re.Pattern | None:
    kind, compression = file_kind(path)
    if compression is not None:
        return None
    if kind == "jsonl":
        return _CUTS["line"]
    if kind == "text" and layout.text_unit != "file":
        return _CUTS[layout.text_unit]
    return None


def _spans(path: Path, size: int, piece_bytes: int, rule: re.Pattern) -> list[Span]:
    """Byte ranges of about ``piece_bytes``, each ending just after a match of ``rule`` found
    at or after its nominal end, with their first line numbers; one pass over the file."""
    cuts = [(0, 1)]  # (offset, number of the line starting there)
    base, line, data = 0, 1, b""  # data: the file's bytes from offset base, not yet counted
    goal = piece_bytes
    with path.open("rb") as f:
        while block := f.read(_BLOCK):
            data += block
            while base + len(data) > goal:
                end = _find_cut(rule, data, max(goal - base, 0))
                if end is None or base + end >= size:
                    break
                line += data.count(b"\n", 0, end)
                data, base = data[end:], base + end
                cuts.append((base, line))
                goal = base + piece_bytes
            counted = max(len(data) - _OVERLAP, 0)
            line += data.count(b"\n", 0, counted)
            data, base = data[counted:], base + counted
    ends = [start for start, _ in cuts[1:]] + [None]
    return [Span(start, end, first) for (start, first), end in zip(cuts, ends, strict=True)]


def _find_cut(rule: re.Pattern, data: bytes, start: int) -> int | None:
    """The first cut at or after ``start`` in ``data``: the end of a match of ``rule`` that
    ends the paragraphs there (None: none yet; more bytes may show one)."""
    for match in rule.finditer(data, start):
        if rule is _CUTS["line"] or _ends_paragraphs(data, match.end()):
            return match.end()
    return None


def _ends_paragraphs(data: bytes, at: int) -> bool:
    """Whether the line starting at ``at`` holds a character that is not whitespace (as
    ``str.isspace`` and the separator's ``\\s`` see it: no-break and ideographic spaces are
    whitespace): then the separator before it ends at ``at``. Bytes that do not decode — an
    incomplete character at the end of ``data`` — count as whitespace, so a doubt is no cut."""
    stop = data.find(b"\n", at)
    return bool(data[at : len(data) if stop < 0 else stop].decode("utf-8", "ignore").strip())


def _row_groups(path: Path, piece_bytes: int) -> list[Span]:
    """Runs of a parquet file's row groups of about ``piece_bytes`` compressed, with the number
    of each run's first row (a file pyarrow cannot open stays whole: its reader skips it)."""
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(path).metadata
    except Exception:  # pyarrow's own error types for a corrupt file
        return [Span()]
    spans, first, row, held, rows = [], 0, 1, 0, 0
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        size = sum(group.column(c).total_compressed_size for c in range(group.num_columns))
        if held and held + size > piece_bytes:
            spans.append(Span(first, g, row))
            first, row, held, rows = g, row + rows, 0, 0
        held, rows = held + size, rows + group.num_rows
    spans.append(Span(first, meta.num_row_groups, row))
    return spans if len(spans) > 1 else [Span()]


def read_piece(the_plan: dict, piece: Piece, fields: FieldNames, layout: Layout,
               strict: bool) -> Iterator[Record]:
    """Every record of one piece, in corpus order (``ValueError`` on a skip when strict)."""
    if not the_plan["files"]:
        return guard(read_stdlib(), strict)
    files = the_plan["files"]

    def records() -> Iterator[Record]:
        for path, rel, *_ in files[piece.first : piece.stop]:
            yield from read_file(Path(path), rel, fields, layout, piece.span)

    return guard(records(), strict)


def read_corpus(corpus: str, fields: FieldNames, strict: bool,
                layout: Layout | None = None, piece_bytes: int = 1 << 22) -> Iterator[Record]:
    """Every record of ``corpus`` (``"stdlib"``, a directory, a glob or one supported file):
    its pieces one after another, as ``prepare``'s workers read them. The path is checked
    now, not on first iteration, so a bad path fails before any work."""
    layout = layout or Layout()
    the_plan = plan(corpus, layout, piece_bytes)
    return (record for row in the_plan["pieces"]
            for record in read_piece(the_plan, Piece.from_json(row), fields, layout, strict))


def piece_costs(the_plan: dict) -> list[int]:
    """Bytes each piece reads, about: its files' sizes, the byte range it reads of a cut
    file, or for parquet its share of the file's pieces (one pass over the plan)."""
    pieces = [Piece.from_json(p) for p in the_plan["pieces"]]
    per_file = Counter(p.first for p in pieces)
    costs = []
    for piece in pieces:
        sizes = [row[2] for row in the_plan["files"][piece.first : piece.stop]]
        if piece.span.whole:
            costs.append(sum(sizes))
        elif file_kind(Path(the_plan["files"][piece.first][0]))[0] != "parquet":
            end = sizes[0] if piece.span.end is None else piece.span.end
            costs.append(end - piece.span.start)
        else:
            costs.append(sizes[0] // per_file[piece.first])
    return costs
