"""One shard of packed rows from one spool shard, in this process or in worker processes.

A shard is a pure function of its spool shard (documents in corpus order), the frozen
tokenizer and ``seq_len``: encode in batches, chunk, best-fit pack, write. So the output is
byte-identical however many workers share the shards, and in whatever order they finish.

Workers are plain subprocesses (``python -m clozax.data.pack TASKS.json``), given their tasks
and returning their results as JSON files, one per shard (``{split}-{k}.result.json``, written
atomically last: it marks the shard finished, which is what a resumed prepare looks for). No
pickle crosses a process boundary. Also here: reading the spool, and the keyed sample of train
documents the tokenizer may be trained on (``--tokenizer-sample``).
"""

from __future__ import annotations

import hashlib
import heapq
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer

from clozax.core import files
from clozax.data.dataset import SplitWriter, token_dtype
from clozax.data.packing import BestFitPacker, chunk_document
from clozax.data.shards import shard_name
from clozax.data.tokenizer import find_specials

# Test hook: when set, sleep this many seconds after each shard packed in this process.
PAUSE_AFTER_SHARD_ENV = "CLOZAX_TEST_PAUSE_AFTER_SHARD"
ENCODE_BATCH = 1024  # documents per encode_batch call; speed only
ENCODE_BATCH_CHARS = 1 << 18  # and at most this many characters; memory only


class WorkerFailed(ValueError):
    """A worker process failed; the shards finished so far are kept for a resumed run."""


def result_path(tmp: Path, split: str, k: int) -> Path:
    return tmp / "results" / f"{split}-{k:05d}.result.json"


def spool_path(tmp: Path, split: str, k: int) -> Path:
    return tmp / "spool" / f"{split}-{k:05d}.jsonl"


def read_spool(path: Path) -> Iterator[dict]:
    with path.open(encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)


def _sample_key(doc_id: str, seed: int) -> int:
    """A document's place in the tokenizer sample: a keyed hash of its id."""
    key = b"tokenizer-sample" + seed.to_bytes(8, "little", signed=True)
    return int.from_bytes(hashlib.blake2b(bytes.fromhex(doc_id), digest_size=8,
                                          key=key).digest(), "little")


def records(spools: list[Path]) -> Iterator[dict]:
    for path in spools:
        yield from read_spool(path)


def sample_threshold(spools: list[Path], sample: int | None, seed: int) -> int | None:
    """The largest sample key among the ``sample`` smallest, or None to take every document.
    Memory: ``sample`` integers (ids are unique after dedup, so exactly ``sample`` pass)."""
    if sample is None:
        return None
    keys = heapq.nsmallest(sample + 1, (_sample_key(r["id"], seed) for r in records(spools)))
    return keys[sample - 1] if len(keys) > sample else None


def sampled_texts(spools: list[Path], threshold: int | None, seed: int) -> Iterator[str]:
    """The texts of the sample ``sample_threshold`` chose (all when it is None), in order."""
    for record in records(spools):
        if threshold is None or _sample_key(record["id"], seed) <= threshold:
            yield record["text"]


def _batches(path: Path) -> Iterator[list[dict]]:
    """Spooled records in batches bounded in count and in characters (the tokenizer's memory
    is ~200 bytes per character of a batch)."""
    batch, chars = [], 0
    for record in read_spool(path):
        batch.append(record)
        chars += len(record["text"])
        if len(batch) == ENCODE_BATCH or chars >= ENCODE_BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def pack_shard(tmp: Path, split: str, k: int, seq_len: int,
               tok: Tokenizer | None = None) -> dict:
    """Encode, chunk and pack spool shard ``k`` of ``split`` into data shard ``k``; returns
    (and writes to ``result_path``) its counts. A document with no token that could ever be
    selected (empty after tokenization, or only specials such as a literal ``[MASK]``) is
    listed in ``skips`` with its reason, so no row can lack an eligible position."""
    tok = tok or Tokenizer.from_file(str(tmp / "tokenizer.json"))
    specials = find_specials(tok)
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    writer = SplitWriter(tmp, split, shard_name(k), seq_len, vocab_size,
                         token_dtype(vocab_size))
    packer = BestFitPacker(seq_len, specials["pad"], writer.write_row)
    special_ids = set(specials.values())
    ids, skips = [], []  # kept documents' ids in corpus order; (source, reason)
    index = chunks = long_docs = n_tokens = 0
    for batch in _batches(spool_path(tmp, split, k)):
        encodings = tok.encode_batch([r["text"] for r in batch], add_special_tokens=False)
        for record, enc in zip(batch, encodings, strict=True):
            if all(i in special_ids for i in enc.ids):
                skips.append([record["source"], "no non-special token after tokenization"
                              if enc.ids else "empty after tokenization"])
                continue
            pieces = chunk_document(index, enc.ids, enc.word_ids, seq_len=seq_len,
                                    cls_id=specials["cls"], sep_id=specials["sep"])
            writer.add_document(index, {"id": record["id"], "group": record["group"],
                                        "label": record["label"], "source": record["source"],
                                        "tokens": len(enc.ids)}, len(pieces))
            for piece in pieces:
                packer.add(piece)
            ids.append(record["id"])
            chunks += len(pieces)
            long_docs += len(pieces) > 1
            n_tokens += len(enc.ids)
            index += 1
    packer.flush()
    writer.close()
    result = {"name": shard_name(k), "rows": writer.rows, "documents": index,
              "tokens": writer.tokens, "chunks": chunks, "chunked_documents": long_docs,
              "skips": skips, "ids": ids, "counts": writer.counts.tolist()}
    files.write_json(result_path(tmp, split, k), result)
    return result


def run_shards(tmp: Path, tasks: list[tuple[str, int]], seq_len: int, workers: int,
               done=lambda: None) -> None:
    """Pack every ``(split, k)`` task not finished yet, over ``workers`` processes (1: here).
    ``done()`` is called once per finished shard. A worker's failure is ``WorkerFailed``."""
    todo = [t for t in tasks if files.read_json(result_path(tmp, *t)) is None]
    (tmp / "results").mkdir(exist_ok=True)
    if workers <= 1 or len(todo) <= 1:
        tok = Tokenizer.from_file(str(tmp / "tokenizer.json"))
        for split, k in todo:
            pack_shard(tmp, split, k, seq_len, tok)
            done()
            if os.environ.get(PAUSE_AFTER_SHARD_ENV):
                time.sleep(float(os.environ[PAUSE_AFTER_SHARD_ENV]))
        return
    procs = []
    for w in range(min(workers, len(todo))):
        spec = tmp / "results" / f"worker-{w}.tasks.json"
        files.write_json(spec, {"tmp": str(tmp), "seq_len": seq_len, "tasks": todo[w::workers]})
        # One tokenizer thread per worker: the workers are the parallelism.
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
        procs.append(subprocess.Popen([sys.executable, "-m", "clozax.data.pack", str(spec)],
                                      env=env, stderr=subprocess.PIPE, text=True))
    for proc in procs:
        _, err = proc.communicate()
        if proc.returncode != 0:
            for other in procs:
                other.kill()
            last = (err or "").strip().splitlines()[-1:] or ["no message"]
            raise WorkerFailed(f"a prepare worker failed (exit {proc.returncode}: {last[0]}); "
                               "finished shards are kept: run the same command to resume")
    for _ in todo:
        done()


def main(argv: list[str]) -> None:
    spec = json.loads(Path(argv[0]).read_text(encoding="utf-8"))
    tmp = Path(spec["tmp"])
    tok = Tokenizer.from_file(str(tmp / "tokenizer.json"))  # one per process: memory stays flat
    for split, k in spec["tasks"]:
        pack_shard(tmp, split, int(k), int(spec["seq_len"]), tok)


if __name__ == "__main__":
    main(sys.argv[1:])
