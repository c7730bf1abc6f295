"""The on-disk dataset format: writing it shard by shard, and opening it memory-mapped.

Layout of a dataset directory (``FORMAT_VERSION`` 3)::

    manifest.json               accounting, split sizes, tokenizer, seq_len, the shard index,
                                identity and fingerprint
    tokenizer.json              the frozen tokenizer (sha256 in the manifest)
    {split}/shard-{k}.tokens.npy       (rows_k, seq_len) uint16, or uint32 when vocab > 65536
    {split}/shard-{k}.segments.npy     (rows_k, seq_len) uint16: 1..n per piece, 0 = padding
    {split}/shard-{k}.word_starts.npy  (rows_k, seq_len) bool: first token of a word
    {split}/shard-{k}.documents.jsonl  one line per document: index (within the shard, in
                                corpus order), id, group, label, source, tokens (body tokens
                                without specials) and chunks: [[row, segment], ...] (shard rows)
    {split}/unigram_counts.npy  (vocab,) int64: how often each id occurs as a real token

``manifest["shards"][split]`` is the index: each shard's name, rows and documents, in order;
a split's global row and document numbers run through the shards in that order
(``data/shards.py``). A shard's ``documents.jsonl`` lines are written when a document's last
chunk is placed, so they are not in corpus order; sort by ``index`` to restore it.

Identity: ``manifest["identity"]`` holds everything that determines the rows — each split's
document ids (a hash, in order), the split seed, held-out fraction and group field, ``seq_len``,
the packer version and shard size, the tokenizer's sha256 — and the size and sha256 of every
data file (every shard); ``manifest["fingerprint"]`` is the sha256 of that identity.
``open_dataset`` checks cheaply (the fingerprint against the identity, every file's size);
``verify_files`` reads every byte (``clozax audit --data``). Runs and eval-mask sets record the
fingerprint, so a re-prepared dataset is never taken for the original.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import numpy as np

from clozax.core.files import file_sha256
from clozax.core.vocab import SPECIAL_NAMES
from clozax.data.packing import PackedRow
from clozax.data.shards import ARRAYS, RowArray, iter_documents, shard_files
from clozax.data.split import SPLITS

FORMAT_VERSION = 3
_NPY_HEADER_BYTES = 128  # fixed, so the row count can be rewritten in place at the end
_ROWS_PER_WRITE = 1024


def unigram_file(split: str) -> str:
    return f"{split}/unigram_counts.npy"


def data_files(index: dict[str, list[dict]]) -> list[str]:
    """Relative paths of every data file the shard index implies, in a fixed order."""
    names = []
    for split in SPLITS:
        for shard in index[split]:
            names += shard_files(split, shard["name"]).values()
        names.append(unigram_file(split))
    return names


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def _npy_header(dtype: np.dtype, shape: tuple[int, int]) -> bytes:
    descr = np.lib.format.dtype_to_descr(dtype)
    text = f"{{'descr': {descr!r}, 'fortran_order': False, 'shape': {shape}, }}"
    body_len = _NPY_HEADER_BYTES - 10
    assert len(text) < body_len, text
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", body_len) + \
        (text.ljust(body_len - 1) + "\n").encode("latin1")


class SplitWriter:
    """Appends packed rows of one shard to its ``.npy`` files and documents to its JSONL, and
    counts each id's real tokens (``counts``, (vocab,) int64).

    Rows are buffered a few at a time and the ``.npy`` headers rewritten with the final row
    count on ``close``, so memory does not grow with the corpus.
    """

    def __init__(self, directory: Path, split: str, name: str, seq_len: int,
                 vocab_size: int, dtype: np.dtype):
        self.seq_len = seq_len
        self.dtypes = {"tokens": dtype, "segments": np.dtype(np.uint16),
                       "word_starts": np.dtype(bool)}
        paths = {kind: directory / rel for kind, rel in shard_files(split, name).items()}
        paths["documents"].parent.mkdir(parents=True, exist_ok=True)
        self.files: dict[str, IO[bytes]] = {}
        for kind in ARRAYS:
            f = paths[kind].open("wb")
            f.write(_npy_header(self.dtypes[kind], (0, seq_len)))
            self.files[kind] = f
        self.documents = paths["documents"].open("w", encoding="utf-8")
        self.buffer: dict[str, list[np.ndarray]] = {kind: [] for kind in ARRAYS}
        self.pending: dict[int, tuple[dict, int]] = {}  # doc -> (record, chunks left)
        self.counts = np.zeros(vocab_size, np.int64)
        self.rows = 0
        self.tokens = 0  # non-pad tokens

    def add_document(self, index: int, record: dict, chunks: int) -> None:
        """Register a document before its pieces are packed."""
        record = {"index": index, **record, "chunks": [None] * chunks}
        self.pending[index] = (record, chunks)

    def write_row(self, row: PackedRow) -> None:
        self.buffer["tokens"].append(row.tokens.astype(self.dtypes["tokens"]))
        self.buffer["segments"].append(row.segments)
        self.buffer["word_starts"].append(row.word_starts)
        self.tokens += int(np.count_nonzero(row.segments))
        for doc, chunk, segment in row.placements:
            record, left = self.pending[doc]
            record["chunks"][chunk] = [self.rows, segment]
            if left == 1:
                del self.pending[doc]
                self.documents.write(json.dumps(record, ensure_ascii=False) + "\n")
            else:
                self.pending[doc] = (record, left - 1)
        self.rows += 1
        if len(self.buffer["tokens"]) >= _ROWS_PER_WRITE:
            self._drain()

    def _drain(self) -> None:
        if self.buffer["tokens"]:
            tokens, segments = np.stack(self.buffer["tokens"]), np.stack(self.buffer["segments"])
            self.counts += np.bincount(tokens[segments > 0].astype(np.int64),
                                       minlength=self.counts.size)
        for name in ARRAYS:
            if self.buffer[name]:
                self.files[name].write(np.stack(self.buffer[name]).tobytes())
                self.buffer[name] = []

    def close(self) -> None:
        self._drain()
        assert not self.pending, f"{len(self.pending)} documents never fully placed"
        for name in ARRAYS:
            f = self.files[name]
            f.seek(0)
            f.write(_npy_header(self.dtypes[name], (self.rows, self.seq_len)))
            f.close()
        self.documents.close()


@dataclass(frozen=True)
class Split:
    """One split's arrays, read-only: memmaps for a one-shard split, else ``RowArray``s that
    read through the shard index (both index like NumPy arrays)."""

    tokens: np.ndarray | RowArray  # (rows, seq_len) uint16 or uint32
    segments: np.ndarray | RowArray  # (rows, seq_len) uint16, 0 = padding
    word_starts: np.ndarray | RowArray  # (rows, seq_len) bool

    @property
    def rows(self) -> int:
        return int(self.tokens.shape[0])


@dataclass(frozen=True)
class Dataset:
    """A prepared dataset directory (see the module docstring for the layout)."""

    path: Path
    manifest: dict
    train: Split
    heldout: Split

    @property
    def seq_len(self) -> int:
        return int(self.manifest["seq_len"])

    @property
    def vocab_size(self) -> int:
        return int(self.manifest["tokenizer"]["vocab_size"])

    @property
    def specials(self) -> dict[str, int]:
        return {name: int(self.manifest["tokenizer"]["specials"][name]) for name in SPECIAL_NAMES}

    @property
    def special_strings(self) -> dict[str, str]:
        """Each special's string (recorded since the specials of any style; else read)."""
        from clozax.data.tokenizer import load_tokenizer, special_strings

        return self.manifest["tokenizer"].get("special_strings") or special_strings(
            load_tokenizer(self.tokenizer_path), self.specials)

    @property
    def tokenizer_path(self) -> Path:
        return self.path / self.manifest["tokenizer"]["file"]

    @property
    def tokenizer_sha256(self) -> str:
        return str(self.manifest["tokenizer"]["sha256"])

    @property
    def fingerprint(self) -> str:
        """sha256 of everything that determines the rows (see the module docstring)."""
        return str(self.manifest["fingerprint"])

    def documents(self, split: str):
        """The split's document records, streamed (global rows and indices)."""
        return iter_documents(self.path, split, self.manifest["shards"][split])

    def unigram_counts(self, split: str) -> np.ndarray:
        """(vocab,) int64 count of each id among the split's real (non-pad) tokens."""
        return np.load(self.path / unigram_file(split))


def fingerprint(identity: dict) -> str:
    """The sha256 of an identity dict in canonical JSON."""
    text = json.dumps(identity, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


def file_records(directory: Path, names: list[str]) -> dict[str, dict]:
    """Size and sha256 of each named data file of a dataset directory."""
    return {name: {"bytes": (directory / name).stat().st_size,
                   "sha256": file_sha256(directory / name)} for name in names}


def verify_files(dataset: Dataset) -> list[str]:
    """Every data file's sha256 against the identity (reads every byte); the mismatches."""
    recorded = dataset.manifest["identity"]["files"]
    names = data_files(dataset.manifest["shards"])
    found = file_records(dataset.path, names)
    return [f"{name}: sha256 {found[name]['sha256'][:12]}, manifest {recorded[name]['sha256'][:12]}"
            for name in names if found[name]["sha256"] != recorded[name]["sha256"]]


def open_dataset(path: str | Path, check_tokenizer: bool = True) -> Dataset:
    """Open and validate a dataset directory written by ``clozax prepare``. Without
    ``check_tokenizer``, a tokenizer file not matching the manifest is left to the caller
    (the audit reports it as a failed check)."""
    path = Path(path)
    redo = f"run `clozax prepare --out {path} --overwrite` to rebuild it"
    if not path.is_dir():
        raise ValueError(f"dataset {path} does not exist; run `clozax prepare --out {path}` "
                         "first")
    manifest_path = path / "manifest.json"
    if not manifest_path.is_file():
        raise ValueError(f"dataset {path} has no manifest.json; run `clozax prepare --out "
                         f"{path}` first")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        seq_len = int(manifest["seq_len"])
        tokenizer = manifest["tokenizer"]
        specials = {name: int(tokenizer["specials"][name]) for name in SPECIAL_NAMES}
        vocab_size = int(tokenizer["vocab_size"])
        splits = {name: int(manifest["splits"][name]["rows"]) for name in SPLITS}
        if manifest.get("format_version") == FORMAT_VERSION:
            for split in SPLITS:
                [(str(s["name"]), int(s["rows"])) for s in manifest["shards"][split]]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"dataset {path} has an unreadable manifest.json ({type(e).__name__}: "
                         f"{e}); {redo}") from None
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"dataset {path} has format_version {manifest.get('format_version')!r}"
                         f", this clozax reads {FORMAT_VERSION}; {redo}")
    if any(not 0 <= i < vocab_size for i in specials.values()):
        raise ValueError(f"dataset {path} has special ids {specials} outside its vocabulary of "
                         f"{vocab_size}; {redo}")
    tokenizer_path = path / tokenizer["file"]
    if not tokenizer_path.is_file():
        raise ValueError(f"dataset {path} lacks {tokenizer['file']}; {redo}")
    if check_tokenizer and file_sha256(tokenizer_path) != tokenizer["sha256"]:
        raise ValueError(f"dataset {path}: {tokenizer['file']} does not match the sha256 in "
                         f"manifest.json (was it edited?); {redo}")
    expected_dtypes = {"tokens": token_dtype(vocab_size), "segments": np.dtype(np.uint16),
                       "word_starts": np.dtype(bool)}
    opened = {}
    for split, rows in splits.items():
        index = manifest["shards"][split]
        if sum(s["rows"] for s in index) != rows:
            raise ValueError(f"dataset {path}: the {split} shard index sums to "
                             f"{sum(s['rows'] for s in index)} rows, the manifest says {rows}; "
                             f"{redo}")
        arrays = {}
        for kind in ARRAYS:
            def open_shard(k, kind=kind, split=split, index=index):
                return _open_array(path, shard_files(split, index[k]["name"])[kind],
                                   (index[k]["rows"], seq_len), expected_dtypes[kind], redo)
            if len(index) == 1:
                arrays[kind] = open_shard(0)
            else:
                for k in range(len(index)):  # headers only: shards are mapped on first use
                    _open_array(path, shard_files(split, index[k]["name"])[kind],
                                (index[k]["rows"], seq_len), expected_dtypes[kind], redo,
                                header_only=True)
                arrays[kind] = RowArray(open_shard, [s["rows"] for s in index], seq_len,
                                        expected_dtypes[kind])
        opened[split] = Split(**arrays)
    _check_identity(path, manifest, redo)
    return Dataset(path=path, manifest=manifest, train=opened["train"],
                   heldout=opened["heldout"])


def _check_identity(path: Path, manifest: dict, redo: str) -> None:
    """The cheap identity check on every open: the fingerprint matches the identity it hashes,
    the identity agrees with the manifest, and every data file has its recorded size."""
    identity = manifest.get("identity")
    if not isinstance(identity, dict) or manifest.get("fingerprint") != fingerprint(identity):
        raise ValueError(f"dataset {path}: manifest.json's fingerprint does not match its "
                         f"identity (was it edited?); {redo}")
    if (identity.get("seq_len") != manifest["seq_len"]
            or identity.get("tokenizer_sha256") != manifest["tokenizer"]["sha256"]):
        raise ValueError(f"dataset {path}: manifest.json's identity disagrees with its seq_len or "
                         f"tokenizer (was it edited?); {redo}")
    names = data_files(manifest["shards"])
    if sorted(names) != sorted(identity.get("files", {})):
        raise ValueError(f"dataset {path}: the shard index and the identity's file list "
                         f"disagree (was manifest.json edited?); {redo}")
    for name in names:
        file, record = path / name, identity["files"].get(name, {})
        if not file.is_file():
            raise ValueError(f"dataset {path} lacks {name}; {redo}")
        if file.stat().st_size != record.get("bytes"):
            raise ValueError(f"dataset {path}: {name} has {file.stat().st_size} bytes, the "
                             f"manifest recorded {record.get('bytes')} (was it changed?); {redo}")


def _open_array(path: Path, rel: str, shape: tuple[int, int], dtype: np.dtype, redo: str,
                header_only: bool = False) -> np.ndarray | None:
    """The file memory-mapped after checking its shape and dtype (only checked, reading just
    the ``.npy`` header, when ``header_only``)."""
    file = path / rel
    if not file.is_file():
        raise ValueError(f"dataset {path} lacks {rel}; {redo}")
    try:
        if header_only:
            with file.open("rb") as f:
                version = np.lib.format.read_magic(f)
                read = (np.lib.format.read_array_header_1_0 if version == (1, 0) else
                        np.lib.format.read_array_header_2_0)
                found_shape, _, found_dtype = read(f)
            array = None
        else:
            array = np.load(file, mmap_mode="r")
            found_shape, found_dtype = array.shape, array.dtype
    except (ValueError, OSError) as e:
        raise ValueError(f"dataset {path}: {rel} is not a readable .npy file ({e}); "
                         f"{redo}") from None
    if found_shape != shape or found_dtype != dtype:
        raise ValueError(f"dataset {path}: {rel} has shape {found_shape} {found_dtype}, "
                         f"manifest says {shape} {dtype}; {redo}")
    return array
