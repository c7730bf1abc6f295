"""The commands that read a run (registered by ``clozax.app.cli``): ``status``, ``evaluate``,
``probe``, ``fill``. They parse and call ``clozax.report.status`` and ``clozax.judge``; each
takes ``--step`` (default: the newest committed checkpoint), ``status`` excepted."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from clozax.train import compile_cache

Run = Annotated[Path, typer.Argument(help="Run directory (clozax train).")]
Step = Annotated[int | None, typer.Option(help="Checkpoint step (default: the newest committed "
                                               "one).")]
Every = Annotated[bool, typer.Option(help="Every committed checkpoint, oldest first "
                                          "(RUN/history/: the report's curves over checkpoints).")]


def steps_of(run: Path, step: int | None, every_checkpoint: bool) -> list[int | None]:
    """The checkpoints a command judges: ``[step]``, or every committed one."""
    if not every_checkpoint:
        return [step]
    if step is not None:
        raise ValueError("--step and --every-checkpoint are exclusive; give one of them")
    from clozax.judge import history

    return history.committed_steps(run)


def status(
    run: Annotated[Path, typer.Argument(help="Run directory, live or finished.")],
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")] = False,
):
    """Where a run stands: step, pace and ETA, recent loss, held-out numbers, checkpoints,
    the lock's holder, disk. Reads only; safe beside a live trainer."""
    from clozax.report import status as status_lib

    result = status_lib.run_status(run)
    if json_out:
        print(json.dumps(result, indent=2))
    else:
        status_lib.print_status(result)


def evaluate(
    run: Run,
    mask_seed: Annotated[
        int | None,
        typer.Option(help="Also evaluate on a second mask set drawn with this eval seed "
                     "(corruption transfer, not a new-language test)."),
    ] = None,
    failures: Annotated[
        int, typer.Option(help="Lowest-probability held-out positions saved to failures.jsonl.")
    ] = 20,
    batch_size: Annotated[int, typer.Option(help="Rows per evaluation batch.")] = 64,
    step: Step = None,
    every_checkpoint: Every = False,
    full: Annotated[bool, typer.Option(
        help="Score every held-out row, streamed in bounded memory (eval_full.json), not the "
             "frozen sample.")] = False,
):
    """Held-out metrics on the run's frozen eval masks vs unigram and random-init baselines."""
    compile_cache.enable()
    import sys

    from rich.console import Console
    from rich.progress import Progress

    from clozax.judge import evaluate as evaluate_lib

    options = dict(mask_seed=mask_seed, failures=failures, batch_size=batch_size, full=full)
    bar = Progress(disable=not sys.stderr.isatty(), transient=True)
    if full:
        task = bar.add_task("held-out rows", total=None)
        options["progress"] = lambda done, total: bar.update(task, completed=done, total=total)
    steps, baselines = steps_of(run, step, every_checkpoint), {}
    with bar:
        for s in steps:
            result = evaluate_lib.evaluate_run(run, step=s, baselines=baselines, **options)
            if len(steps) > 1:
                t = result["trained"]
                print(f"step {result['step']}: held-out loss {t['loss']:.4f}, accuracy "
                      f"{t['accuracy']:.4f}")
    console = Console()
    console.print(evaluate_lib.summary_table(result))
    if result["transfer"]:
        d = result["transfer"]["difference"]
        console.print(f"corruption transfer (mask seed {mask_seed} − frozen): accuracy "
                      f"{d['accuracy']:+.4f}, loss {d['loss']:+.4f}")
    names = ((evaluate_lib.FULL_FILE, evaluate_lib.FULL_FAILURES_FILE) if full
             else (evaluate_lib.EVAL_FILE, evaluate_lib.FAILURES_FILE))
    console.print(f"wrote {run / names[0]} and {run / names[1]}")


def probe(
    run: Run,
    task: Annotated[
        Path | None,
        typer.Option(help="JSONL file with text and label (and group) fields (default: the "
                     "dataset's document labels: train split → train, held-out → test)."),
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of the group split and the bootstrap.")] = 0,
    keep_pretraining_overlap: Annotated[bool, typer.Option(
        help="Score validation/test examples the encoder read in pretraining (default: "
             "dropped and counted).")] = False,
    step: Step = None,
    every_checkpoint: Every = False,
):
    """Linear probe: trained vs random-init encoder vs TF-IDF, split by group, with 95% CIs."""
    compile_cache.enable()
    from rich.console import Console

    from clozax.judge import probe as probe_lib

    console = Console()
    for s in steps_of(run, step, every_checkpoint):
        result = probe_lib.probe_run(run, task=task, seed=seed, step=s,
                                     keep_pretraining_overlap=keep_pretraining_overlap)
        console.print(probe_lib.summary_table(result))
    console.print(f"wrote {run / probe_lib.PROBE_FILE}")


def fill(
    run: Run,
    text: Annotated[str, typer.Argument(
        help='Text with one or more of the run\'s mask token, e.g. "a [MASK] b" (or "a <mask> '
             'b" for a RoBERTa-style tokenizer).')],
    top_k: Annotated[int, typer.Option(help="Predictions per mask.")] = 5,
    json_: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
    step: Step = None,
    every_checkpoint: Every = False,
):
    """Top-k predictions with probabilities at each [MASK] (the run's mask token) in a text."""
    compile_cache.enable()
    from rich.console import Console

    from clozax.judge import fill as fill_lib

    steps = steps_of(run, step, every_checkpoint)
    results = {s: fill_lib.fill(run, text, top_k=top_k, step=s) for s in steps}
    if json_:
        out = results[step] if not every_checkpoint else [
            {"step": s, "masks": r} for s, r in results.items()]
        print(json.dumps(out, ensure_ascii=False, indent=2))
    else:
        for s, r in results.items():
            Console().print(fill_lib.summary_table(r, s))
