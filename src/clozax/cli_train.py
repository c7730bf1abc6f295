"""``clozax train``'s command line (registered by ``clozax.cli``): parses, then calls
``clozax.train.loop.train`` (or first ``clozax.train.branch.decay_branch`` for a decay branch).
Kept apart because its options (budget, resume, extension, decay branches, several processes)
alone took ``cli.py`` past 400 lines."""

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
        typer.Option(help="Time budget: fixes train.steps once from measured throughput."),
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
        help="A published recipe, scaled to --steps: modernbert (StableAdamW, 30 % masking, "
             "batch ramp, warmup-stable-1-sqrt-decay in two phases).")] = None,
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
    from clozax.train import config as config_lib
    from clozax.train import loop as train_lib
    from clozax.train.run_dir import CONFIG_FILE, read_config

    if decay_from is not None or step is not None:
        from clozax.train.branch import decay_branch

        if None in (decay_from, step, steps) or set_ or minutes or config or preset:
            raise ValueError("a decay branch is --decay-from RUN --step S --steps N --out NEW "
                             "(no --set, --config, --preset or --minutes: it keeps RUN's)")
        resolved, created = decay_branch(decay_from, step, steps, out)
        if created:  # a resume of the branch says nothing of it again
            print(f"branched {out} from {decay_from} step {step}: decaying over {steps} "
                  "updates")
        steps = None
    overrides = list(set_ or [])
    for name, value in (("steps", steps), ("minutes", minutes), ("save_every", save_every),
                        ("eval_every", eval_every)):
        if value is not None:
            overrides.append(f"train.{name}={value}")
    existing = (out / CONFIG_FILE).is_file()
    if resume and not existing:
        raise ValueError(f"--resume given but {out} is not a clozax run; drop --resume to start")
    if extend_to is not None and minutes is not None:
        raise ValueError("--extend-to and --minutes cannot be combined; give one of them")
    # A run's model section comes from its saved config on every re-run.
    run_model = read_config(out)[0].model if existing else None
    if decay_from is None:
        resolved = config_lib.resolve(config, preset, overrides, run_model=run_model)
        if steps is not None and resolved.phases and recipe is None:
            raise ValueError(f"--steps {steps} cannot be combined with [[phases]]: a run in "
                             "phases has the length its phases give; set each phase's steps "
                             "(or use --recipe, which scales its phases to --steps)")
    if recipe is not None:
        from clozax.train.recipes import apply_recipe

        if decay_from is not None:
            raise ValueError("--recipe and --decay-from cannot be combined: a branch keeps "
                             "RUN's recipe")
        resolved = apply_recipe(recipe, resolved)
    result = train_lib.train(data, out, resolved, resume=resume, init_from=init_from,
                             extend_to=extend_to)
    trained = result.final_loss == result.final_loss  # not NaN: this invocation trained
    summary = (f"trained {result.steps} steps into {out}; final train loss "
               f"{result.final_loss:.4f}" if trained else
               f"{out} already has its {result.steps} steps: nothing trained")
    if result.eval:
        rows = f" ({result.eval['rows']:,} rows)" if "rows" in result.eval else ""
        summary += (f"; held-out sample{rows} loss {result.eval['loss']:.4f}, accuracy "
                    f"{result.eval['accuracy']:.4f} (clozax evaluate: the whole set)")
    print(summary)
