"""Finding a corpus's files and opening them as byte streams: paths, directories, globs,
``.gz``/``.zst`` compression, and streamed decoding of text in bounded blocks.

A corpus is ``"stdlib"``, one file, a directory (searched recursively) or a glob pattern
(``**`` allowed, e.g. ``'shards/*.jsonl.zst'``); files are always taken in sorted order, so the
record order (and everything derived from it) does not depend on the file system.
"""

from __future__ import annotations

import codecs
import glob
import gzip
import io
import re
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import IO

# A file's kind comes from its suffix under any compression suffix: data.jsonl.zst is jsonl.
KINDS = {".txt": "text", ".md": "text", ".jsonl": "jsonl", ".parquet": "parquet",
         ".arrow": "arrow"}
COMPRESSIONS = (".gz", ".zst")
COMPRESSIBLE = ("text", "jsonl")  # parquet and arrow compress inside their own format
SUPPORTED = (".txt", ".md", ".jsonl", ".parquet", ".arrow",
             *(f"{s}{c}" for s in (".txt", ".md", ".jsonl") for c in COMPRESSIONS))
BLOCK_BYTES = 1 << 18  # streamed reads: 256 KiB at a time
# Longer documents are cut into parts; the tokenizer's memory is ~200 bytes per character of
# one document, so this keeps a single document's cost near 20 MB.
MAX_DOCUMENT_CHARS = 100_000
MAX_LINE_BYTES = 16 << 20  # one JSONL row; longer ones are skipped without being held
SEPARATORS = {"paragraph": re.compile(r"\n(?:[^\S\n]*\n)+"), "line": re.compile(r"\n")}
_GLOB_CHARS = set("*?[")


class BadBytes(Exception):
    """Content that is not UTF-8 text (binary, invalid encoding, corrupt compression)."""


def file_kind(path: Path) -> tuple[str | None, str | None]:
    """``(kind, compression)`` of a file name; kind ``None`` when unsupported."""
    name = path.name
    compression = next((c for c in COMPRESSIONS if name.endswith(c)), None)
    inner = Path(name[: -len(compression)]) if compression else path
    kind = KINDS.get(inner.suffix)
    if compression and kind not in COMPRESSIBLE:
        return None, compression
    return kind, compression


def find_files(corpus: str) -> tuple[list[Path], Path]:
    """The supported files of a path, directory or glob, sorted, and the base their
    relative names (groups, sources) are taken from. ``ValueError`` when there are none."""
    if _GLOB_CHARS & set(corpus):
        matches = [Path(p) for p in glob.glob(corpus, recursive=True)]
        files = sorted({f for m in matches for f in ([m] if m.is_file() else _walk(m))
                        if file_kind(f)[0]})
        if not files:
            raise ValueError(f"corpus pattern {corpus} matches no supported file; use files "
                             f"ending in {', '.join(SUPPORTED)}")
        return files, _glob_base(corpus)
    root = Path(corpus)
    if not root.exists():
        raise ValueError(f"corpus path {corpus} does not exist; pass an existing file, "
                         "directory or glob pattern, or --corpus stdlib")
    if root.is_file():
        if file_kind(root)[0] is None:
            raise ValueError(f"corpus file {corpus} has an unsupported suffix; use one of "
                             f"{', '.join(SUPPORTED)}")
        return [root], root.parent
    files = sorted(f for f in _walk(root) if file_kind(f)[0])
    if not files:
        raise ValueError(f"corpus directory {corpus} has no supported files; add "
                         f"{', '.join(SUPPORTED)} files")
    return files, root


def _walk(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()] if root.is_dir() else []


def _glob_base(pattern: str) -> Path:
    """The directory above the first path part holding a glob character."""
    parts = Path(pattern).parts
    fixed = [p for p in parts[: next(i for i, p in enumerate(parts) if _GLOB_CHARS & set(p))]]
    return Path(*fixed) if fixed else Path(".")


def _zstandard(path: Path):
    try:
        import zstandard
    except ImportError:
        raise ValueError(f"reading {path.name} and other .zst files needs zstandard; "
                         "pip install 'clozax[zstd]'") from None
    return zstandard


def check_readable(files: list[Path]) -> None:
    """Fail now, before any work, when a needed optional package is missing."""
    if any(file_kind(f)[1] == ".zst" for f in files):
        _zstandard(next(f for f in files if file_kind(f)[1] == ".zst"))


def open_bytes(path: Path) -> IO[bytes]:
    """A buffered binary stream of the file's (decompressed) content."""
    compression = file_kind(path)[1]
    if compression == ".gz":
        return gzip.open(path, "rb")
    if compression == ".zst":
        reader = _zstandard(path).ZstdDecompressor().stream_reader(
            path.open("rb"), read_across_frames=True, closefd=True)
        return io.BufferedReader(reader, buffer_size=BLOCK_BYTES)
    return path.open("rb")


def decompression_errors() -> tuple[type[BaseException], ...]:
    """Exceptions a corrupt compressed stream raises while being read."""
    errors: list[type[BaseException]] = [EOFError, zlib.error, gzip.BadGzipFile]
    try:
        import zstandard

        errors.append(zstandard.ZstdError)
    except ImportError:
        pass
    return tuple(errors)


def text_blocks(handle: IO[bytes], offset: int = 0, length: int | None = None) -> Iterator[str]:
    """Decoded UTF-8 text in blocks of at most ``BLOCK_BYTES`` (``length`` bytes in all when
    given, for a piece of a file whose stream starts at byte ``offset``); ``BadBytes`` naming
    the file offset of the first NUL byte or invalid sequence, or the decompression failure."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    corrupt = decompression_errors()
    left = length
    while True:
        try:
            data = handle.read(BLOCK_BYTES if left is None else min(BLOCK_BYTES, left))
        except corrupt as e:
            raise BadBytes(f"corrupt compressed data ({type(e).__name__})") from None
        if left is not None:
            left -= len(data)
        nul = data.find(b"\x00")
        if nul >= 0:
            raise BadBytes(f"binary content (NUL byte at offset {offset + nul})")
        pending = len(decoder.getstate()[0])  # bytes of a character cut by the last block
        try:
            text = decoder.decode(data, final=not data)
        except UnicodeDecodeError as e:
            raise BadBytes(f"invalid UTF-8 at byte {offset - pending + e.start}") from None
        offset += len(data)
        if text:
            yield text
        if not data:
            return


def decode(data: bytes) -> str:
    """Decode UTF-8 or raise ``BadBytes`` with a reason naming the first problem."""
    nul = data.find(b"\x00")
    if nul >= 0:
        raise BadBytes(f"binary content (NUL byte at offset {nul})")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadBytes(f"invalid UTF-8 at byte {e.start}") from None


def cut_point(text: str, limit: int) -> int:
    """Where to end a part of at most ``limit`` characters: after the last line end, else the
    last space, in its second half; else exactly at ``limit`` (an unbroken run)."""
    for mark in ("\n", " "):
        at = text.rfind(mark, limit // 2, limit)
        if at > 0:
            return at + 1
    return limit


def units(blocks: Iterator[str], separator: re.Pattern | None,
          limit: int = MAX_DOCUMENT_CHARS, line: int = 1,
          tail: bool = True) -> Iterator[tuple[int, str, int]]:
    """``(first line number, text, part)`` of each unit; part 0 = a whole unit, else 1, 2, …
    for the consecutive parts of a unit longer than ``limit``. Linear in the input.

    ``line`` is the number of the first line; ``tail=False`` reads a piece of a file that ends
    just after a complete separator (``data/pieces.py`` cuts there), so that separator ends the
    last unit and no empty unit follows it, as when the whole file is read."""
    buffer, part = "", 0
    for block in blocks:
        buffer += block
        pos = 0
        if separator is not None:
            for match in separator.finditer(buffer):
                if match.end() == len(buffer):
                    break  # the separator may continue in the next block
                text = buffer[pos : match.start()]
                yield line, text, part + 1 if part else 0
                line += buffer.count("\n", pos, match.end())
                pos, part = match.end(), 0
        while len(buffer) - pos > limit:  # an oversized unit: emit a part
            end = pos + cut_point(buffer[pos : pos + limit], limit)
            part += 1
            yield line, buffer[pos:end], part
            pos = end
        buffer = buffer[pos:]
    if not tail and separator is not None:
        end = re.compile(f"(?:{separator.pattern})\\Z").search(buffer)
        buffer = buffer[: end.start()] if end else buffer
        if not buffer and part == 0:
            return
    if buffer or part == 0:
        yield line, buffer, part + 1 if part else 0
