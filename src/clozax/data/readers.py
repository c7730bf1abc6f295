"""Corpus readers: each yields ``RawDocument`` or ``Skip`` records, streaming, in a fixed order.

Files (``data/sources.py`` finds and opens them: directories, globs, ``.gz``/``.zst``) are read
one at a time in sorted order. Plain text (``.txt``/``.md``) is split by ``text_unit``: the whole
file, each paragraph (blank-line separated) or each line is a document; JSONL, parquet (batch by
batch) and arrow files (``datasets``' ``save_to_disk``) give one document per row.

Groups (the unit the split keeps on one side): ``--group-field`` for rows when given; else
``group_by="document"`` makes each document its own group, named by its content
(``content_group``: never by its line number, so reordering or prepending rows moves no
document across the split; a whole text file's is its name), ``group_by="file"`` puts every
document of a file in one group. A text document's label is its top-level subdirectory.

Memory stays bounded whatever the input's shape: text is decoded in blocks, a document longer
than ``MAX_DOCUMENT_CHARS`` is cut into consecutive parts (same group, so same side of the split;
sources ``…#1``, ``…#2``; cuts at a line end or space where possible), and a JSONL line longer
than ``MAX_LINE_BYTES`` is skipped without being held. Anything unreadable becomes a ``Skip``
with a reason, or a ``ValueError`` when ``strict`` is set.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from clozax.data.sources import (
    MAX_DOCUMENT_CHARS,
    MAX_LINE_BYTES,
    SEPARATORS,
    BadBytes,
    check_readable,
    cut_point,
    decode,
    decompression_errors,
    file_kind,
    open_bytes,
    text_blocks,
    units,
)

TEXT_UNITS = ("file", "paragraph", "line")
GROUP_BY = ("document", "file")
_ROW_BATCH = 1024  # parquet/arrow rows per batch

@dataclass(frozen=True)
class RawDocument:
    """One document as read, before cleaning. ``source`` locates it for messages."""

    text: str
    group: str
    label: str | None
    source: str


@dataclass(frozen=True)
class Skip:
    """A document (or a file that would have been one) that was not used, and why."""

    source: str
    reason: str


@dataclass(frozen=True)
class FieldNames:
    """Which JSONL/parquet fields hold the text, the group and the label."""

    text: str = "text"
    group: str | None = None
    label: str | None = None


@dataclass(frozen=True)
class Layout:
    """How files become documents and groups (see the module docstring)."""

    text_unit: str = "file"
    group_by: str = "document"

    def __post_init__(self):
        if self.text_unit not in TEXT_UNITS:
            raise ValueError(f"--text-unit {self.text_unit!r} is unknown; use one of "
                             f"{', '.join(TEXT_UNITS)}")
        if self.group_by not in GROUP_BY:
            raise ValueError(f"--group-by {self.group_by!r} is unknown; use one of "
                             f"{', '.join(GROUP_BY)}")


@dataclass(frozen=True)
class Span:
    """Bytes ``[start, end)`` of a file (``end`` None: to its end), whose first line is number
    ``line``: a piece of a large uncompressed file read by one worker. For parquet, row groups
    ``[start, end)`` whose first row is number ``line``."""

    start: int = 0
    end: int | None = None
    line: int = 1

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.end is None


WHOLE = Span()  # a whole file
Record = RawDocument | Skip


def check_files(files: list[Path]) -> None:
    """Fail now, not after reading other files, when a file needs a package not installed."""
    check_readable(files)
    tables = [p for p in files if file_kind(p)[0] in ("parquet", "arrow")]
    if tables:
        _import_pyarrow(tables[0])


def _import_pyarrow(path: Path):
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"reading {path.name} and other .parquet/.arrow files needs pyarrow; "
                         "pip install 'clozax[parquet]'") from None
    return pa, pq


def guard(records: Iterator[Record], strict: bool) -> Iterator[Record]:
    for record in records:
        if strict and isinstance(record, Skip):
            raise ValueError(f"{record.source}: {record.reason} (--strict is set; fix or remove "
                             "the input, or drop --strict to skip it)")
        yield record


def relative_name(path: Path, base: Path) -> str:
    """A file's name in sources and groups: relative to the corpus base where it lies below."""
    return path.relative_to(base).as_posix() if path.is_relative_to(base) else path.as_posix()


def read_file(path: Path, rel: str, fields: FieldNames, layout: Layout,
              span: Span = WHOLE) -> Iterator[Record]:
    """Every record of one file, or of the byte range ``span`` of an uncompressed JSONL or
    text file (``data/pieces.py`` chooses the ranges at line or paragraph ends)."""
    kind = file_kind(path)[0]
    if kind == "text":
        yield from _read_text(path, rel, layout, span)
        return
    if kind == "arrow":
        rows = _read_arrow(path, rel, fields, layout)
    else:
        rows = {"jsonl": _read_jsonl, "parquet": _read_parquet}[kind](path, rel, fields, layout,
                                                                     span)
    for record in rows:
        yield from split_long(record)


def split_long(record: Record, limit: int = MAX_DOCUMENT_CHARS) -> Iterator[Record]:
    """The record itself, or its consecutive parts when its text exceeds ``limit``."""
    if isinstance(record, Skip) or len(record.text) <= limit:
        yield record
        return
    text, pos, part = record.text, 0, 0
    while pos < len(text):
        end = pos + cut_point(text[pos : pos + limit], limit) if len(text) - pos > limit \
            else len(text)
        part += 1
        yield RawDocument(text[pos:end], record.group, record.label, f"{record.source}#{part}")
        pos = end


def _read_text(path: Path, rel: str, layout: Layout, span: Span) -> Iterator[Record]:
    """Documents of one text file (or span of it) by ``layout.text_unit``, streamed in
    blocks."""
    top = rel.split("/")[0] if "/" in rel else None
    whole_file = layout.text_unit == "file"
    pending: list[RawDocument] = []  # a whole file's single document waits for the end

    def doc(text: str, source: str, group: str | None = None) -> RawDocument:
        group = rel if whole_file or layout.group_by == "file" else group
        return RawDocument(text=text, group=group, label=top, source=source)

    try:
        handle = open_bytes(path)
    except OSError as e:
        yield Skip(rel, f"unreadable ({e.strerror or type(e).__name__})")
        return
    if span.start:
        handle.seek(span.start)
    length = None if span.end is None else span.end - span.start
    pieces = units(text_blocks(handle, span.start, length),
                   None if whole_file else SEPARATORS[layout.text_unit], line=span.line,
                   tail=span.end is None)
    emitted, group = False, None
    try:
        with handle:
            for line, text, part in pieces:
                source = rel if whole_file else f"{rel}:{line}"
                if part:
                    source = f"{source}#{part}"
                if whole_file and part == 0:
                    pending.append(doc(text, source))  # the file may still turn out bad
                    continue
                if not whole_file and not text.strip():
                    continue  # blank units separate nothing; they are not documents
                emitted = True
                if part <= 1:  # a long unit's parts share its first part's group
                    group = content_group(text)
                yield from split_long(doc(text, source, group))
    except (BadBytes, OSError) as e:
        reason = str(e) if isinstance(e, BadBytes) else \
            f"unreadable ({e.strerror or type(e).__name__})"
        here = rel if span.whole else f"{rel}:{span.line}+"
        yield Skip(f"{here}#rest" if emitted else here, reason)
        return
    yield from pending


def content_group(text: str) -> str:
    """A document's default group: a digest of its text (a long one's parts share it)."""
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=12)
    return f"text:{digest.hexdigest()}"


def _from_row(row: object, where: str, fields: FieldNames, group_default: str | None) -> Record:
    if not isinstance(row, dict):
        return Skip(where, f"not a JSON object (got {type(row).__name__})")
    text = row.get(fields.text)
    if not isinstance(text, str):
        missing = fields.text not in row or row.get(fields.text) is None
        what = "lacks" if missing else "has a non-string"
        return Skip(where, f"{what} text field {fields.text!r}")
    found = {}  # the optional group and label fields that were asked for
    for kind, name in (("group", fields.group), ("label", fields.label)):
        if name is not None:
            if row.get(name) is None:
                return Skip(where, f"lacks {kind} field {name!r}")
            found[kind] = str(row[name])
    group = found["group"] if "group" in found else group_default or content_group(text)
    return RawDocument(text=text, group=group, label=found.get("label"), source=where)


def _jsonl_row(line: bytes, where: str, fields: FieldNames, group: str | None) -> Record:
    """One JSONL line as a document, or a skip naming what is wrong with it: bytes that are not
    UTF-8, invalid JSON, nesting too deep to parse, a string that is not valid Unicode (a
    lone surrogate such as "\\ud800", valid JSON and common in crawls), any other
    ``ValueError``."""
    try:
        record = _from_row(json.loads(decode(line)), where, fields, group)
    except BadBytes as e:
        return Skip(where, str(e))
    except json.JSONDecodeError as e:
        return Skip(where, f"not valid JSON ({e.msg})")
    except RecursionError:
        return Skip(where, "JSON nested too deeply to parse")
    except ValueError as e:
        return Skip(where, f"unreadable row ({str(e).splitlines()[0][:120]})")
    if isinstance(record, RawDocument) and (b"\\ud" in line or b"\\uD" in line):
        for name, value in (("text", record.text), ("group", record.group),
                            ("label", record.label)):
            try:
                (value or "").encode("utf-8")
            except UnicodeEncodeError as e:
                return Skip(where, f"not valid Unicode (a lone surrogate "
                            f"{value[e.start]!r} in the {name} field)")
    return record


def _read_jsonl(path: Path, rel: str, fields: FieldNames, layout: Layout,
                span: Span) -> Iterator[Record]:
    try:
        handle = open_bytes(path)
    except OSError as e:
        yield Skip(rel, f"unreadable ({e.strerror or type(e).__name__})")
        return
    number, left = span.line - 1, None if span.end is None else span.end - span.start
    try:
        with handle:
            if span.start:
                handle.seek(span.start)
            while (left is None or left > 0) and (line := handle.readline(MAX_LINE_BYTES + 1)):
                number += 1
                if left is not None:
                    left -= len(line)
                where = f"{rel}:{number}"
                if len(line) > MAX_LINE_BYTES and not line.endswith(b"\n"):
                    while (rest := handle.readline(MAX_LINE_BYTES)) and \
                            not rest.endswith(b"\n"):
                        left = None if left is None else left - len(rest)
                    left = None if left is None else left - len(rest)  # the line's last bytes
                    yield Skip(where, f"line longer than {MAX_LINE_BYTES} bytes (split the row "
                               "into smaller documents)")
                    continue
                if not line.strip():
                    continue  # blank lines separate nothing; they are not documents
                yield _jsonl_row(line, where, fields, rel if layout.group_by == "file"
                                 else None)
    except (OSError, *decompression_errors()) as e:
        yield Skip(f"{rel}:{number + 1}+", f"corrupt compressed data ({type(e).__name__}); "
                   "the rest of the file is skipped")


def _table_rows(batches, rel: str, fields: FieldNames, layout: Layout,
                number: int = 0) -> Iterator[Record]:
    for batch in batches:
        for row in batch.to_pylist():
            number += 1
            where = f"{rel}:{number}"
            group = rel if layout.group_by == "file" else None
            yield _from_row(row, where, fields, group)


def _read_parquet(path: Path, rel: str, fields: FieldNames, layout: Layout,
                  span: Span) -> Iterator[Record]:
    """Rows batch by batch; a piece's ``span`` counts row groups, not bytes, and its ``line``
    is the number of its first row."""
    _, pq = _import_pyarrow(path)
    try:
        parquet = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises its own error types for corrupt files
        yield Skip(rel, f"unreadable parquet ({type(e).__name__}: {e})".splitlines()[0])
        return
    present = set(parquet.schema_arrow.names)
    if fields.text not in present:
        yield Skip(rel, f"lacks text column {fields.text!r}")
        return
    columns = [c for c in (fields.text, fields.group, fields.label) if c in present]
    groups = None if span.whole else list(range(span.start, span.end))
    batches = parquet.iter_batches(batch_size=_ROW_BATCH, columns=columns, row_groups=groups)
    yield from _table_rows(batches, rel, fields, layout, span.line - 1)


def _read_arrow(path: Path, rel: str, fields: FieldNames, layout: Layout) -> Iterator[Record]:
    """An arrow IPC stream (what ``datasets``' ``save_to_disk`` writes) or file, batch by
    batch from a memory map."""
    pa, _ = _import_pyarrow(path)
    try:
        source = pa.memory_map(str(path))
        try:
            reader = pa.ipc.open_stream(source)
        except pa.ArrowInvalid:
            source.seek(0)
            file = pa.ipc.open_file(source)
            reader = (file.get_batch(i) for i in range(file.num_record_batches))
            schema = file.schema
        else:
            schema = reader.schema
    except Exception as e:  # pyarrow's own error types for corrupt files
        yield Skip(rel, f"unreadable arrow ({type(e).__name__}: {e})".splitlines()[0])
        return
    if fields.text not in schema.names:
        yield Skip(rel, f"lacks text column {fields.text!r}")
        return
    columns = [c for c in (fields.text, fields.group, fields.label) if c in schema.names]
    yield from _table_rows((b.select(columns) for b in reader), rel, fields, layout)
