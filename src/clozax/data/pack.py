"""One data shard of packed rows from one piece's kept documents of a split (a ``pack`` task
of ``data/pool.py``).

A shard is a pure function of its documents (corpus order), the frozen tokenizer and
``seq_len``: encode in batches, chunk, best-fit pack, write. So the output is byte-identical
however many workers share the shards, and in whatever order they finish. Its result file
(``results/{split}-{k}.result.json``, written atomically last) marks the shard finished, which
is what a resumed prepare looks for.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path

from tokenizers import Tokenizer

from clozax.core import files
from clozax.data.dataset import SplitWriter, token_dtype
from clozax.data.packing import BestFitPacker, chunk_document
from clozax.data.shards import shard_name
from clozax.data.spool import kept_records

ENCODE_BATCH = 1024  # documents per encode_batch call; speed only
ENCODE_BATCH_CHARS = 1 << 18  # and at most this many characters; memory only


def result_path(tmp: Path, split: str, k: int) -> Path:
    return tmp / "results" / f"{split}-{k:05d}.result.json"


def _batches(records: Iterator[dict]) -> Iterator[list[dict]]:
    """Records in batches bounded in count and in characters (the tokenizer's memory is ~200
    bytes per character of a batch)."""
    batch, chars = [], 0
    for record in records:
        batch.append(record)
        chars += len(record["text"])
        if len(batch) == ENCODE_BATCH or chars >= ENCODE_BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


@lru_cache(maxsize=1)  # loaded once per process and file: memory stays flat across shards
def _tokenizer(path: str, identity: tuple[int, ...]) -> Tokenizer:
    """Keyed by the file's ``identity`` too: one written again at ``path`` (a second prepare
    of the same --out in this process) is read again, never served stale."""
    return Tokenizer.from_file(path)


def pack_task(tmp: str, split: str, k: int, piece: int, seq_len: int,
              specials: dict[str, int]) -> None:
    pack_shard(Path(tmp), split, k, kept_records(Path(tmp), split, [piece]), seq_len,
               _tokenizer(*files.identity(Path(tmp) / "tokenizer.json")), specials)


def pack_shard(tmp: Path, split: str, k: int, records: Iterator[dict], seq_len: int,
               tok: Tokenizer, specials: dict[str, int]) -> dict:
    """Encode, chunk and pack ``records`` into data shard ``k`` of ``split``; returns (and
    writes to ``result_path``) its counts. A document with no token that could ever be
    selected (empty after tokenization, or only specials such as a literal ``[MASK]``) is
    listed in ``skips`` with its reason, so no row can lack an eligible position."""
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    writer = SplitWriter(tmp, split, shard_name(k), seq_len, vocab_size,
                         token_dtype(vocab_size))
    packer = BestFitPacker(seq_len, specials["pad"], writer.write_row)
    special_ids = set(specials.values())
    ids, skips = [], []  # kept documents' ids in corpus order; (source, reason)
    index = chunks = long_docs = n_tokens = 0
    for batch in _batches(records):
        encodings = tok.encode_batch([r["text"] for r in batch], add_special_tokens=False)
        for record, enc in zip(batch, encodings, strict=True):
            if all(i in special_ids for i in enc.ids):
                skips.append([record["source"], "no non-special token after tokenization"
                              if enc.ids else "empty after tokenization"])
                continue
            doc_chunks = chunk_document(index, enc.ids, enc.word_ids, seq_len=seq_len,
                                        cls_id=specials["cls"], sep_id=specials["sep"])
            writer.add_document(index, {"id": record["id"], "group": record["group"],
                                        "label": record["label"], "source": record["source"],
                                        "tokens": len(enc.ids)}, len(doc_chunks))
            for chunk in doc_chunks:
                packer.add(chunk)
            ids.append(record["id"])
            chunks += len(doc_chunks)
            long_docs += len(doc_chunks) > 1
            n_tokens += len(enc.ids)
            index += 1
    packer.flush()
    writer.close()
    result = {"name": shard_name(k), "rows": writer.rows, "documents": index,
              "tokens": writer.tokens, "chunks": chunks, "chunked_documents": long_docs,
              "skips": skips, "ids": ids, "counts": writer.counts.tolist()}
    files.write_json(result_path(tmp, split, k), result)
    return result
