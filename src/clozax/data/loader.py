"""Batches as a pure function of ``(data_seed, index)``, and a prefetching iterator.

Rows are visited epoch by epoch, each epoch in a permutation that is a pure function of
``(data_seed, epoch)``; batch ``i`` is computable from ``i`` alone, so resuming needs only the
step number (no skipping through the data, no iterator state to save). The last
``rows % batch_size`` rows of each epoch's permutation wait for a later epoch.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from functools import lru_cache

import numpy as np


@lru_cache(maxsize=4)
def epoch_permutation(data_seed: int, epoch: int, rows: int) -> np.ndarray:
    """The row order of one epoch: a pure function of (data_seed, epoch, rows)."""
    return np.random.default_rng([data_seed, epoch]).permutation(rows)


def batch_rows(data_seed: int, index: int, rows: int, batch_size: int) -> np.ndarray:
    """Row indices of global batch ``index`` (0-based)."""
    per_epoch = rows // batch_size
    if per_epoch == 0:
        raise ValueError(
            f"the training split has {rows} rows, fewer than one batch of {batch_size}; "
            "lower train.batch_size or prepare more data"
        )
    epoch, within = divmod(index, per_epoch)
    start = within * batch_size
    return epoch_permutation(data_seed, epoch, rows)[start : start + batch_size]


def stream_rows(data_seed: int, position: int, count: int, rows: int) -> np.ndarray:
    """Rows ``position .. position + count - 1`` of the endless stream of epoch permutations
    (epoch ``e`` is ``epoch_permutation(data_seed, e, rows)``): a run in phases reads each of
    its datasets this way, so batches of changing sizes follow one another without a gap or a
    repeat within an epoch."""
    out, left = [], count
    while left:
        epoch, within = divmod(position, rows)
        take = min(rows - within, left)
        out.append(epoch_permutation(data_seed, epoch, rows)[within:within + take])
        position, left = position + take, left - take
    return np.concatenate(out)


def host_batch(split, rows: np.ndarray) -> dict[str, np.ndarray]:
    """Read rows from the memory-mapped split. Returns (batch, seq) arrays."""
    order = np.argsort(rows, kind="stable")  # read the memmap in ascending order, then restore
    inverse = np.empty_like(order)
    inverse[order] = np.arange(len(order))
    sorted_rows = rows[order]
    return {
        "tokens": np.asarray(split.tokens[sorted_rows], np.int32)[inverse],
        "segments": np.asarray(split.segments[sorted_rows], np.int32)[inverse],
        "word_starts": np.asarray(split.word_starts[sorted_rows], bool)[inverse],
    }


class Prefetcher:
    """Produce batches ``start, start+1, …, stop-1`` on a background thread.

    ``make(i)`` builds batch ``i`` (host read and device transfer); ``depth`` batches are kept
    ready so the step never waits for data when the reader keeps up. The time the consumer
    waited is accumulated in ``wait_seconds``. ``stop_at`` moves the end while it runs (a
    budget revision); batches already made past a lowered end are the consumer's to skip.
    """

    def __init__(self, make: Callable[[int], object], start: int, stop: int, depth: int = 2):
        import time

        self._time = time.perf_counter
        self.wait_seconds = 0.0
        self._make = make
        self._end = stop
        self._next = start  # the consumer's next index
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(start,), daemon=True)
        self._thread.start()

    def stop_at(self, stop: int) -> None:
        self._end = stop

    def _run(self, i: int) -> None:
        try:
            while not self._stop.is_set():
                if i >= self._end:  # idle until the end moves or the consumer closes
                    self._stop.wait(0.01)
                    continue
                item = (i, self._make(i))
                i += 1
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
        except BaseException as e:  # surface reader errors in the consumer
            self._queue.put(("error", e))

    def __iter__(self) -> Iterator:
        return self

    def __next__(self):
        if self._next >= self._end:
            raise StopIteration
        t0 = self._time()
        item = self._queue.get()
        self.wait_seconds += self._time() - t0
        if item[0] == "error":
            raise item[1]
        self._next = item[0] + 1
        return item

    def close(self) -> None:
        self._stop.set()
        try:
            while True:
                self._queue.get_nowait()
        except queue.Empty:
            pass


def padded_batches(n: int, batch_size: int, take) -> Iterator[tuple[np.ndarray, list]]:
    """Indices ``0..n-1`` in batches of ``batch_size``; ``take(idx)`` returns that batch's
    arrays, zero-padded here to ``batch_size`` rows so that every batch has one shape (one
    compilation). Yields ``(idx, arrays)``; rows past ``idx.size`` are padding."""
    for start in range(0, n, batch_size):
        idx = np.arange(start, min(start + batch_size, n))
        arrays = take(idx)
        pad = batch_size - idx.size
        if pad:
            arrays = [np.concatenate([a, np.zeros((pad, *a.shape[1:]), a.dtype)]) for a in arrays]
        yield idx, arrays
