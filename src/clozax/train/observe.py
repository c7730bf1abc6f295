"""Observability for training: metrics.jsonl, a rich progress bar, optional TensorBoard."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

METRICS_FILE = "metrics.jsonl"


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
        try:
            from tensorboardX import SummaryWriter  # optional extra

            self._tb = SummaryWriter(str(self.run_dir / "tensorboard"))
        except ImportError:
            self._tb = None
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
