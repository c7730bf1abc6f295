"""What ``clozax prepare`` shows: its progress bars while it runs and its summary table."""

from __future__ import annotations

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table


def progress_bars(quiet: bool) -> Progress:
    """The bars of prepare's phases with elapsed time and ETA (its totals are known: pieces,
    shards), on stderr; none when ``quiet``."""
    return Progress(
        TextColumn("{task.description:<18}"), BarColumn(), MofNCompleteColumn(),
        TextColumn("docs {task.fields[detail]}"), TimeElapsedColumn(), TextColumn("eta"),
        TimeRemainingColumn(),
        console=Console(stderr=True), disable=quiet, transient=False,
    )


def print_summary(manifest: dict, console: Console, seconds: float | None = None,
                  phases: dict[str, float] | None = None) -> None:
    """Accounting, per-split sizes, packing efficiency and tokenizer hash as one table."""
    d = manifest["documents"]
    console.print(f"documents: read {d['read']:,} = kept {d['kept']:,} + duplicates "
                  f"{d['duplicates']:,} + skipped {d['skipped']:,}")
    for reason, count in manifest["skip_reasons"].items():
        console.print(f"  skipped {count:,}: {reason}")
    table = Table(title=None)
    for column in ("split", "documents", "groups", "rows", "tokens", "pad tokens", "chunked"):
        table.add_column(column, justify="left" if column == "split" else "right")
    for split, s in manifest["splits"].items():
        table.add_row(split, f"{s['documents']:,}", f"{s['groups']:,}", f"{s['rows']:,}",
                      f"{s['tokens']:,}", f"{s['pad_tokens']:,}", f"{s['chunked_documents']:,}")
    console.print(table)
    t = manifest["tokenizer"]
    console.print(f"seq_len {manifest['seq_len']}, packing efficiency "
                  f"{manifest['packing_efficiency']:.4f}, shards " +
                  ", ".join(f"{k} {len(v)}" for k, v in manifest["shards"].items()))
    sample = f", a sample of {t['sample']:,} documents" if t.get("sample") else ""
    console.print(f"tokenizer {t['model']} (trained on {t['trained_on']}{sample}), vocab "
                  f"{t['vocab_size']:,}, sha256 {t['sha256']}")
    if seconds is not None:
        each = ", ".join(f"{k} {v:.1f} s" for k, v in (phases or {}).items())
        console.print(f"prepared in {seconds:.1f} s" + (f" ({each})" if each else ""))
