"""``clozax train``'s command line (registered by ``clozax.app.cli``): parses, then calls
``clozax.train.loop.train`` (or first ``clozax.train.branch.decay_branch`` for a decay branch).
Kept apart because its options (budget, resume, extension, decay branches, several processes)
alone took ``app/cli.py`` past 400 lines."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from clozax.train import compile_cache, distributed, hostmem


def train(
    data: Annotated[Path, typer.Option(help="Prepared dataset directory (clozax prepare).")],
    out: Annotated[Path, typer.Option(help="Run directory (checkpoints, metrics, eval masks).")],
    steps: Annotated[int | None, typer.Option(help="Number of updates (train.steps).")] = None,
    minutes: Annotated[
        float | None,
        typer.Option(help="Time budget: sets train.steps from measured costs and "
                          "re-estimates it as the run goes."),
    ] = None,
    preset: Annotated[
        str | None, typer.Option(help="Model preset: tiny, small (default), base; modern-tiny, "
                                 "modern-small, modern-base (ModernBERT's architecture).")
    ] = None,
    config: Annotated[Path | None, typer.Option(help="TOML config file.")] = None,
    set_: Annotated[
        list[str] | None,
        typer.Option("--set", help="Override, e.g. --set model.layers=2 (repeatable)."),
    ] = None,
    save_every: Annotated[int | None, typer.Option(help="Checkpoint every N steps.")] = None,
    eval_every: Annotated[int | None, typer.Option(help="Held-out eval every N steps.")] = None,
    resume: Annotated[
        bool, typer.Option(help="Continue from the latest checkpoint in --out (also implied "
                           "when --out is an existing run).")
    ] = False,
    init_from: Annotated[
        Path | None,
        typer.Option(help="Start from another run's parameters (continued pretraining)."),
    ] = None,
    extend_to: Annotated[
        int | None,
        typer.Option(help="Continue a finished run in --out to this many steps, with its "
                     "schedule re-created for the new length (AdamW state kept; recorded)."),
    ] = None,
    decay_from: Annotated[Path | None, typer.Option(
        help="Decay branch: a new --out from this run's stable checkpoint --step, decaying "
             "over --steps updates (optimizer state kept).")] = None,
    step: Annotated[int | None, typer.Option(help="With --decay-from: the checkpoint.")] = None,
    recipe: Annotated[str | None, typer.Option(
        help="A recipe by name: modernbert (published; scaled to --steps: StableAdamW, 30 % "
             "masking, batch ramp, warmup-stable-1-sqrt-decay in two phases) or budget (what "
             "measured to pay in minutes on a CPU: 40 % masking, two microbatches; use it with "
             "--minutes).")] = None,
    coordinator: Annotated[str | None, typer.Option(
        help="Multi-process job: process 0's HOST:PORT (also CLOZAX_COORDINATOR).")] = None,
    num_processes: Annotated[int | None, typer.Option(
        help="Multi-process job: processes (also CLOZAX_NUM_PROCESSES).")] = None,
    process_id: Annotated[int | None, typer.Option(
        help="Multi-process job: this process, 0..N-1 (also CLOZAX_PROCESS_ID).")] = None,
    distributed_: Annotated[str | None, typer.Option("--distributed", help=(
        "'auto': join the job its launcher describes (SLURM, MPI, TPU slice, k8s)."))] = None,
):
    """Pretrain an encoder with masked language modelling on a prepared dataset."""
    hostmem.keep_freed_memory()  # before JAX starts: see clozax.train.hostmem
    if distributed_ not in (None, "auto"):
        raise ValueError(f"--distributed {distributed_!r} is unknown; use --distributed auto or "
                         "give --coordinator/--num-processes/--process-id")
    distributed.initialize(coordinator, num_processes, process_id, auto=distributed_ == "auto")
    compile_cache.enable()
    from clozax.train import loop as train_lib
    from clozax.train.command import Options, resolve_command, summary

    resolved = resolve_command(out, Options(
        steps=steps, minutes=minutes, preset=preset, config=config, set_=tuple(set_ or ()),
        save_every=save_every, eval_every=eval_every, resume=resume, extend_to=extend_to,
        decay_from=decay_from, step=step, recipe=recipe), say=print)
    result = train_lib.train(data, out, resolved, resume=resume, init_from=init_from,
                             extend_to=extend_to)
    print(summary(out, result))
