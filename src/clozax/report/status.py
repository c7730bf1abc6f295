"""``clozax status RUN``: where a live or finished run stands, on one screen or as JSON.

Read from the run's files only, writing nothing and taking no lock, so it is safe beside a
live trainer (and on another host of a shared filesystem): the step and its share of the run,
the pace and ETA of the last log line (aged by the time since it was written), the recent
training losses, the latest held-out numbers (the in-training sample, and ``clozax
evaluate``'s whole set when it ran), each checkpoint (committed; *digested* when its digest is
recorded — status reads no checkpoint's bytes, so it never calls one verified: ``evaluate``,
``fill`` and a resume check the bytes they restore), who holds the run's lock, and the disk the
run takes and has left.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from clozax.core import files, locks
from clozax.train.layout import CHECKPOINT_DIR, CONFIG_FILE, DIGEST_DIR, METRICS_FILE
from clozax.train.observe import clock

RECENT = 5  # training losses shown
TAIL_BYTES = 1 << 20  # metrics.jsonl is read from its end: a long run's file is large


def run_status(run_dir: Path) -> dict:
    """The status of ``run_dir`` as a JSON-ready dict (see the module docstring)."""
    run_dir = Path(run_dir)
    if not (run_dir / CONFIG_FILE).is_file():
        raise ValueError(f"{run_dir} is not a clozax run (no {CONFIG_FILE}); pass the --out "
                         "directory of clozax train")
    total = int(files.read_json(run_dir / CONFIG_FILE)["train"]["steps"])
    records, written = _tail(run_dir / METRICS_FILE)
    logged = [r for r in records if "loss" in r]
    last = logged[-1] if logged else {}
    holder = locks.current_holder(run_dir)
    checkpoints = _checkpoints(run_dir)
    step = max([last.get("step", 0), *(c["step"] for c in checkpoints)])
    age = time.time() - written if written else None
    state = "training" if holder else ("finished" if checkpoints and
                                       checkpoints[-1]["step"] >= total else "stopped")
    evals = [r for r in records if "eval" in r]
    whole = files.read_json(run_dir / "eval.json")
    out = {
        "run": str(run_dir.absolute()), "state": state, "step": step, "steps": total,
        "progress": step / total, "last_log_age_s": None if age is None else round(age, 1),
        "tokens_per_s": last.get("tokens_per_s"), "mfu": last.get("mfu"),
        "elapsed_s": last.get("elapsed_s"),
        "eta_s": None if state != "training" or "eta_s" not in last or age is None
        else max(last["eta_s"] - age, 0.0),
        "recent_losses": [[r["step"], r["loss"]] for r in logged[-RECENT:]],
        "heldout_sample": None if not evals else {"step": evals[-1]["step"], **{
            k: evals[-1]["eval"].get(k) for k in ("loss", "accuracy", "rows", "count")}},
        "heldout_full": None if not whole else {"step": whole["step"], **{
            k: whole["trained"].get(k) for k in ("loss", "accuracy")}},
        "checkpoints": checkpoints,
        "lock": None if holder is None else {
            "command": holder.command, "pid": holder.pid, "host": holder.host,
            "since": holder.since, "heartbeat_age_s": round(time.time() - holder.heartbeat, 1)},
        "disk": _disk(run_dir),
    }
    return out


def _tail(path: Path) -> tuple[list[dict], float | None]:
    """The complete JSON lines of the last ``TAIL_BYTES`` of ``path`` and its modification
    time (a line being written, or cut by a kill, is skipped)."""
    try:
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            f.seek(max(size - TAIL_BYTES, 0))
            data = f.read()
            mtime = os.fstat(f.fileno()).st_mtime
    except FileNotFoundError:
        return [], None
    lines = data.split(b"\n")[1 if size > TAIL_BYTES else 0:]
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return [r for r in records if isinstance(r, dict) and "step" in r], mtime


def _checkpoints(run_dir: Path) -> list[dict]:
    """Each committed step, oldest first: digested when its digest is recorded (its bytes
    not checked here), else not (committed, digest pending or killed before it)."""
    directory = run_dir / CHECKPOINT_DIR
    steps = sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit()) \
        if directory.is_dir() else []
    return [{"step": s, "digested": (run_dir / DIGEST_DIR / f"{s}.json").is_file()}
            for s in steps]


def _disk(run_dir: Path) -> dict:
    used = sum(p.stat().st_size for p in run_dir.rglob("*") if p.is_file())
    return {"run_bytes": used, "free_bytes": shutil.disk_usage(run_dir).free}


def print_status(status: dict, console: Console | None = None) -> None:
    console = console or Console()
    s = status
    table = Table(title=f"{s['run']}: {s['state']}", show_header=False)
    table.add_column(justify="right", style="bold")
    table.add_column()
    table.add_row("step", f"{s['step']:,} / {s['steps']:,} ({100 * s['progress']:.1f} %)")
    pace = []
    if s["tokens_per_s"] is not None:
        pace.append(f"{s['tokens_per_s']:,.0f} tokens/s")
    if s["mfu"] is not None:
        pace.append(f"MFU {100 * s['mfu']:.1f} %")
    if s["elapsed_s"] is not None:
        pace.append(f"elapsed {clock(s['elapsed_s'])}")
    if s["eta_s"] is not None:
        pace.append(f"ETA {clock(s['eta_s'])}")
    if s["last_log_age_s"] is not None:
        pace.append(f"last log line {clock(s['last_log_age_s'])} ago")
    table.add_row("pace", ", ".join(pace) or "-")
    table.add_row("recent loss", ", ".join(f"{st}: {loss:.4f}" for st, loss in
                                          s["recent_losses"]) or "-")
    sample, whole = s["heldout_sample"], s["heldout_full"]
    table.add_row("held-out", "; ".join(filter(None, [
        sample and f"sample ({sample['rows']:,} rows) at step {sample['step']}: loss "
                   f"{sample['loss']:.4f}, accuracy {sample['accuracy']:.4f}",
        whole and f"whole set (clozax evaluate) at step {whole['step']}: loss {whole['loss']:.4f}, "
        f"accuracy {whole['accuracy']:.4f}"])) or "-")
    table.add_row("checkpoints", ", ".join(
        f"{c['step']}{'' if c['digested'] else ' (no digest yet)'}" for c in s["checkpoints"])
        or "none yet")
    lock = s["lock"]
    table.add_row("lock", "free" if lock is None else
                  f'"{lock["command"]}" (pid {lock["pid"]} on {lock["host"]}, since '
                  f'{lock["since"]}, heartbeat {lock["heartbeat_age_s"]:.0f} s ago)')
    d = s["disk"]
    table.add_row("disk", f"{d['run_bytes'] / 2**20:,.1f} MiB in the run, "
                          f"{d['free_bytes'] / 2**30:,.1f} GiB free")
    console.print(table)
