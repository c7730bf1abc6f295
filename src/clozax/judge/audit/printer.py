"""The audit's report as a table: one numbered PASS/FAIL/SKIP line per check."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table


def print_report(report: dict, console=None) -> None:
    """The checks as a table, one PASS/FAIL/SKIP line each, numbered."""
    console = console or Console()
    title = f"clozax audit of {report.get('run') or report.get('data')}"
    table = Table(title=title, title_justify="left")
    for column in ("#", "check", "result", "detail"):
        table.add_column(column, overflow="fold")
    for c in report["checks"]:
        status = ("[yellow]SKIP[/]" if c.get("skipped") else
                  "[green]PASS[/]" if c["passed"] else "[bold red]FAIL[/]")
        table.add_row(str(c["number"]), c["name"], status, c["detail"])
    console.print(table)
    failed = [c["name"] for c in report["checks"] if not c["passed"]]
    verdict = "[green]all checks passed[/]" if not failed else \
        f"[bold red]{len(failed)} check(s) failed:[/] {', '.join(failed)}"
    written = report.get("written")
    console.print(verdict + (f"; wrote {written}" if written else ""))
