"""Observability for training: metrics.jsonl, a rich progress bar, optional TensorBoard."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from clozax.core import files

METRICS_FILE = "metrics.jsonl"


def _summary_writer():
    """tensorboardX's ``SummaryWriter`` (the optional extra), or None when not installed.

    tensorboardX imports torch, when installed, only to accept torch tensors (measured: 2.6 s
    of every ``clozax train``'s start-up on this machine); clozax logs floats, so torch is
    hidden from that one import (unless something imported it already).
    """
    hide = "torch" not in sys.modules
    if hide:
        sys.modules["torch"] = None  # ``import torch`` raises ImportError meanwhile
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        return None
    finally:
        if hide:
            del sys.modules["torch"]
    return SummaryWriter


def _step_of(line: str) -> int | None:
    """The step of a metrics line (None for a line cut short by a kill)."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


class TrainLog:
    """What a run reports. Only one process of a multi-process job reports (``enabled``)."""

    def __init__(self, run_dir: Path, console: Console | None = None, enabled: bool = True):
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self.console = console or Console(stderr=True, highlight=False)
        self.progress: Progress | None = None
        self.task = None
        self._tb = None
        self._last_record: dict = {}

    def info(self, message: str) -> None:
        if self.enabled:
            self.console.print(message)

    def header(self, *, devices, platform, dtype, params, batch_tokens, steps, start,
               microbatches, fsdp=False, processes=1) -> None:
        if not self.enabled:
            return
        placement = "sharded (fsdp)" if fsdp and devices > 1 else "replicated"
        self.console.print(
            f"clozax train: {devices} {platform} device(s)"
            + (f" in {processes} processes" if processes > 1 else "") + f", compute {dtype}, "
            f"{params / 1e6:.2f}M parameters {placement}, effective batch {batch_tokens} tokens "
            f"({microbatches} microbatch(es)), steps {start}->{steps}"
        )

    def start(self, total: int, completed: int) -> None:
        if not self.enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        writer = _summary_writer()
        self._tb = writer(str(self.run_dir / "tensorboard")) if writer is not None else None
        self.progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[tps]} tok/s"),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=self.console,
            disable=not sys.stderr.isatty(),
        )
        self.progress.start()
        self.task = self.progress.add_task("train", total=total, completed=completed,
                                           loss="-", tps="-")

    def forget_after(self, step: int) -> None:
        """Drop the lines of steps after ``step`` from ``metrics.jsonl`` (a run resumed from
        the checkpoint of ``step`` logs them again, with the same numbers)."""
        path = self.run_dir / METRICS_FILE
        if not self.enabled or not path.is_file():
            return
        lines = path.read_text().splitlines(keepends=True)
        kept = [line for line in lines if _step_of(line) is not None and _step_of(line) <= step]
        if len(kept) != len(lines):
            files.write_text(path, "".join(kept))

    def metrics(self, record: dict) -> None:
        if not self.enabled:
            return
        with open(self.run_dir / METRICS_FILE, "a") as f:
            f.write(json.dumps(record, sort_keys=True, allow_nan=False) + "\n")
        self._last_record = record
        if self._tb is not None:
            step = record["step"]
            for key in ("loss", "lr", "grad_norm", "tokens_per_s"):
                if key in record:
                    self._tb.add_scalar(f"train/{key}", record[key], step)
            for key, value in (record.get("eval") or {}).items():
                if isinstance(value, (int, float)):
                    self._tb.add_scalar(f"eval/{key}", value, step)
        if "eval" in record:
            ev = record["eval"]
            self.console.print(
                f"step {record['step']}: train loss {record['loss']:.4f} | held-out loss "
                f"{ev['loss']:.4f} acc {ev['accuracy']:.4f} top5 {ev['top5_accuracy']:.4f} "
                f"ppl {ev['perplexity']:.1f} ({ev['count']} positions)"
            )
        elif self.progress is not None and self.progress.disable and "lr" in record:
            self.console.print(
                f"step {record['step']}: loss {record['loss']:.4f} "
                f"lr {record.get('lr', 0):.2e} {record.get('tokens_per_s', 0):.0f} tok/s"
            )

    def advance(self, step: int, loss: float | None = None) -> None:
        """Move the bar to ``step``; ``loss`` when one was read (at sync points only)."""
        if self.progress is not None:
            fields = {}
            if loss is not None:
                tps = self._last_record.get("tokens_per_s")
                fields = {"loss": f"{loss:.4f}", "tps": f"{tps:,.0f}" if tps else "-"}
            self.progress.update(self.task, completed=step, **fields)

    def retotal(self, total: int) -> None:
        """The run's length changed (a ``--minutes`` revision)."""
        if self.progress is not None:
            self.progress.update(self.task, total=total)

    def stop(self) -> None:
        if self.progress is not None:
            self.progress.stop()
        if self._tb is not None:
            self._tb.close()
