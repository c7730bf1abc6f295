"""Observability for training: metrics.jsonl, a rich progress bar, optional TensorBoard and
Weights & Biases (``train/wandb_log.py``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from clozax.core import files
from clozax.train import wandb_log
from clozax.train.layout import CONFIG_FILE, METRICS_FILE


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


def scalars(record: dict) -> dict[str, float]:
    """A metrics line's scalars, as TensorBoard and W&B get them: ``train/loss``, ...,
    ``eval/accuracy``, ..."""
    out = {f"train/{key}": record[key] for key in ("loss", "lr", "grad_norm", "tokens_per_s",
                                                    "mfu", "data_wait_share") if key in record}
    out.update({f"eval/{key}": value for key, value in (record.get("eval") or {}).items()
                if isinstance(value, (int, float)) and key != "rows"})
    return out


def _step_of(line: str) -> int | None:
    """The step of a metrics line (None for a line cut short by a kill)."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


def clock(seconds: float) -> str:
    """``1:02:03`` / ``2:03``: a duration for a log line."""
    seconds = max(int(round(seconds)), 0)
    h, rest = divmod(seconds, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


class Pace:
    """Throughput and time of the log lines, measured from the end of this process's first
    step (its compile is not throughput): tokens/s over the steps since the last line (time
    spent evaluating and saving excluded), MFU against ``peak`` FLOP/s (None: unknown), the
    share of that time the step waited for data, elapsed wall time since the command started,
    and the ETA at the wall seconds per step so far (evaluations and saves included)."""

    def __init__(self, tokens_per_step: int, flops_per_token: float, peak: float | None,
                 started: float, end: int):
        self.tokens_per_step, self.flops_per_token = tokens_per_step, flops_per_token
        self.peak, self.started, self.end = peak, started, end
        self.first: tuple[int, float] | None = None  # (step, time) when measuring began
        self.last: tuple[int, float, float] | None = None  # (step, time, waited) at last line

    def begin(self, step: int, now: float, waited: float) -> None:
        """The first step of this process finished (compiled and ran) at ``now``."""
        self.first, self.last = (step, now), (step, now, waited)

    def exclude(self, seconds: float) -> None:
        """``seconds`` of the interval were spent evaluating or saving, not training."""
        if self.last is not None:
            step, at, waited = self.last
            self.last = (step, at + seconds, waited)

    def fields(self, step: int, now: float, waited: float) -> dict:
        out = {"elapsed_s": round(now - self.started, 3)}
        if self.last is None or step <= self.last[0]:
            return out  # only the compiling step so far: no rate to give
        last_step, at, before = self.last
        seconds = max(now - at, 1e-9)
        rate = (step - last_step) * self.tokens_per_step / seconds
        out["tokens_per_s"] = rate
        out["data_wait_share"] = round(min(max((waited - before) / seconds, 0.0), 1.0), 4)
        if self.peak is not None:
            out["mfu"] = round(rate * self.flops_per_token / self.peak, 5)
        first_step, first_at = self.first
        out["eta_s"] = round((now - first_at) / (step - first_step) * (self.end - step), 1)
        self.last = (step, now, waited)
        return out


class TrainLog:
    """What a run reports. Only one process of a multi-process job reports (``enabled``).
    ``config``'s ``train.wandb_project`` turns W&B on (a missing ``wandb`` fails here, first)."""

    def __init__(self, run_dir: Path, console: Console | None = None, enabled: bool = True,
                 config=None):
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self.console = console or Console(stderr=True, highlight=False)
        self.progress: Progress | None = None
        self.task = None
        self._tb = None
        self._config = config
        project = config.train.wandb_project if config is not None and enabled else None
        self._wandb_project, self._wandb = project, None
        self._wandb_module = wandb_log.require() if project else None
        self._last_record: dict = {}

    def info(self, message: str) -> None:
        if self.enabled:
            self.console.print(message)

    def header(self, *, devices, platform, dtype, params, batch_tokens, steps, start,
               microbatches, fsdp=False, processes=1, peak: str = "", attention: str = "") -> None:
        if not self.enabled:
            return
        placement = "sharded (fsdp)" if fsdp and devices > 1 else "replicated"
        self.console.print(
            f"clozax train: {devices} {platform} device(s)"
            + (f" in {processes} processes" if processes > 1 else "") + f", compute {dtype}, "
            f"{params / 1e6:.2f}M parameters {placement}, effective batch {batch_tokens} tokens "
            f"({microbatches} microbatch(es)), steps {start}->{steps}"
            + (f"; attention {attention}" if attention else "") + (f"; {peak}" if peak else "")
        )

    def start(self, total: int, completed: int) -> None:
        if not self.enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        writer = _summary_writer()
        self._tb = writer(str(self.run_dir / "tensorboard")) if writer is not None else None
        if self._wandb_module is not None:  # the config the run directory records, resolved
            saved = self.run_dir / CONFIG_FILE
            config = json.loads(saved.read_text()) if saved.is_file() else self._config.to_dict()
            self._wandb = wandb_log.WandbLog(  # its one line unwrapped: a command to copy
                self._wandb_module, self.run_dir, self._wandb_project, config,
                lambda line: self.console.print(line, soft_wrap=True, markup=False))
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
        tags = scalars(record)
        if self._tb is not None:
            for tag, value in tags.items():
                self._tb.add_scalar(tag, value, record["step"])
        if self._wandb is not None:
            self._wandb.log(tags, record["step"])
        if "eval" in record:
            ev = record["eval"]
            self.console.print(
                f"step {record['step']}: train loss {record['loss']:.4f} | held-out sample "
                f"({ev['rows']:,} rows) loss "
                f"{ev['loss']:.4f} acc {ev['accuracy']:.4f} top5 {ev['top5_accuracy']:.4f} "
                f"ppl {ev['perplexity']:.1f} ({ev['count']} positions)"
            )
        elif self.progress is not None and self.progress.disable and "lr" in record:
            self.console.print(step_line(record, self.progress.tasks[0].total))

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
        try:
            if self._tb is not None:
                self._tb.close()
        finally:  # W&B's run is finished whatever TensorBoard's close did
            if self._wandb is not None:
                wandb_run, self._wandb = self._wandb, None
                wandb_run.finish()


def step_line(record: dict, total: int) -> str:
    """One log line off a terminal (SLURM, nohup): where the run is and how fast it goes."""
    parts = [f"step {record['step']}/{total}: loss {record['loss']:.4f} lr {record['lr']:.2e}"]
    if "tokens_per_s" in record:
        rate = f"{record['tokens_per_s']:,.0f} tok/s"
        if "mfu" in record:
            rate += f" mfu {100 * record['mfu']:.1f}%"
        parts.append(f"{rate} data wait {100 * record['data_wait_share']:.0f}%")
    timing = f"elapsed {clock(record['elapsed_s'])}"
    if "eta_s" in record:
        timing += f" eta {clock(record['eta_s'])}"
    parts.append(timing)
    return " | ".join(parts)
