"""The ``clozax`` command line. It only parses arguments and calls library functions.

Errors: bad arguments and any ``ValueError`` from the library print one line
(``error: ...``) and exit 2; ``--debug`` (anywhere on the line) shows the traceback instead; a
training stopped by a signal exits ``128 + signal`` after its checkpoint.

``train`` and ``finetune`` have their options in ``app/train.py`` and ``app/finetune.py``;
the commands that read a run (``status``, ``evaluate``, ``probe``, ``fill``) are in
``app/judge.py``.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path
from typing import Annotated

import typer
from typer.exceptions import TyperException

from clozax.app import judge as cli_judge
from clozax.app.embed import embed, retrieval
from clozax.app.finetune import finetune
from clozax.app.judge import evaluate, fill, probe, status
from clozax.app.train import train
from clozax.train import compile_cache, distributed, hostmem
from clozax.train.interrupts import EXIT_CODES, Interrupted

app = typer.Typer(
    name="clozax",
    help="Masked-language-model pretraining in JAX, with an objective you can audit.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _root() -> None:
    """Masked-language-model pretraining in JAX, with an objective you can audit.

    Add --debug anywhere to see a traceback instead of the one-line error.
    """


@app.command()
def lesson(
    out: Annotated[
        Path | None,
        typer.Option(help="Directory for lesson.json and the two PNG figures."),
    ] = None,
):
    """Reproduce the lesson's one-head fixture and run every check it makes."""
    from clozax.app import lesson as lesson_mod

    lesson_mod.run(out=out)


@app.command()
def prepare(
    out: Annotated[Path, typer.Option(help="Dataset directory to create.")],
    corpus: Annotated[
        str,
        typer.Option(help="'stdlib', a directory, a quoted glob or one file: .txt/.md/.jsonl "
                     "(also .gz/.zst), .parquet, .arrow (datasets' save_to_disk)."),
    ] = "stdlib",
    text_field: Annotated[str, typer.Option(help="JSONL/parquet field with the text.")] = "text",
    group_field: Annotated[
        str | None,
        typer.Option(help="JSONL/parquet field naming the group kept on one side of the "
                     "split (default: each document is its own group)."),
    ] = None,
    label_field: Annotated[
        str | None, typer.Option(help="JSONL/parquet field with a label for probes.")
    ] = None,
    text_unit: Annotated[str, typer.Option(
        help="A .txt/.md document: 'file', 'paragraph' or 'line'.")] = "file",
    group_by: Annotated[str, typer.Option(
        help="Split group without --group-field: 'document' or 'file'.")] = "document",
    heldout_fraction: Annotated[
        float, typer.Option(help="Share of groups held out (by keyed hash of the group).")
    ] = 0.05,
    seed: Annotated[int, typer.Option(help="Key of the split hash.")] = 0,
    tokenizer_model: Annotated[str, typer.Option(
        help="'bpe' (deterministic) or 'wordpiece' (NOT reproducible: HF tokenizers' wordpiece "
        "trainer differs run to run, huggingface/tokenizers #1794).")] = "bpe",
    tokenizer: Annotated[
        Path | None,
        typer.Option(help="Use this tokenizer.json unchanged instead of training one: its "
                     "specials BERT's [PAD] [UNK] [CLS] [SEP] [MASK], RoBERTa's <pad> <unk> <s> "
                     "</s> <mask>, or named with --special-tokens."),
    ] = None,
    special_tokens: Annotated[str | None, typer.Option(
        help="With --tokenizer: its special strings where they differ from BERT's and "
             "RoBERTa's, e.g. 'mask=<blank>,cls=<bos>' (names: pad unk cls sep mask).")
    ] = None,
    vocab_size: Annotated[int, typer.Option(help="Vocabulary size of a trained tokenizer.")] = 8192,
    tokenizer_sample: Annotated[int | None, typer.Option(
        help="Train the tokenizer on this many train documents (a keyed sample).")] = None,
    lowercase: Annotated[bool, typer.Option(help="Lowercase text in the tokenizer.")] = True,
    seq_len: Annotated[int, typer.Option(
        help="Tokens per packed row (8..8192; at most the model's max_positions: 512 for the "
             "BERT presets, 1024 for modern-small).")] = 128,
    strict: Annotated[
        bool, typer.Option(help="Stop at the first unreadable, binary or malformed input "
                           "instead of skipping it.")
    ] = False,
    overwrite: Annotated[
        bool, typer.Option(help="Replace an existing output directory (atomically).")
    ] = False,
    shard_bytes: Annotated[int, typer.Option(
        help="Input bytes per piece (one worker's task, one data shard).")] = 1 << 22,
    workers: Annotated[int | None, typer.Option(
        help="Cores to use (default: all; at most the cores and the pieces), or with --executor "
             "dask the local cluster's processes; the output is the same for any number.")
    ] = None,
    executor: Annotated[str, typer.Option(
        help="Where pieces are read and packed: 'local' (processes here) or 'dask' (a Dask "
             "cluster; pip install 'clozax[cluster]'); the output is the same bytes.")
    ] = "local",
    scheduler: Annotated[str | None, typer.Option(
        help="With --executor dask: the scheduler's address (tcp://host:8786), whose workers "
             "mount --out at the same path; default: a local cluster of --workers processes.")
    ] = None,
    discard_partial: Annotated[bool, typer.Option(
        help="Delete an unfinished prepare of --out with other settings (kept otherwise).")
    ] = False,
    quiet: Annotated[bool, typer.Option(help="No progress bar or summary.")] = False,
):
    """Read a corpus, split it by document group, train a frozen tokenizer, pack rows."""
    options = dict(locals())  # every option above is a PrepareConfig field, or quiet
    from clozax.data import prepare as prepare_dataset

    prepare_dataset(options.pop("out"), **options)


@app.command()
def examples(
    out: Annotated[Path, typer.Argument(help="Directory to write the example files into.")],
):
    """Write example inputs made from the built-in corpus: the files the tutorials read."""
    from clozax.data.examples import write_examples

    for name, what in write_examples(out):
        print(f"{name:34} {what}")


app.command()(train)


@app.command()
def export(
    run: Annotated[Path, typer.Argument(help="Run directory (clozax train or import-hf).")],
    out: Annotated[Path, typer.Argument(help="New directory for the transformers files.")],
    step: Annotated[int | None, typer.Option(help="Checkpoint step (default: latest).")] = None,
    verify: Annotated[
        bool, typer.Option(help="Load the export in transformers (needs torch) and compare "
                           "logits with clozax on a few sentences.")
    ] = False,
    sentence_transformers: Annotated[bool, typer.Option(
        "--sentence-transformers",
        help="Also write the files SentenceTransformer(OUT) loads (pooling, similarity).")
    ] = False,
    pooling: Annotated[str | None, typer.Option(
        help="With --sentence-transformers: 'mean' (the real tokens' mean) or 'cls'; default: "
             "a contrastive stage's own pooling (another is refused), else mean.")
    ] = None,
    normalize: Annotated[bool, typer.Option(
        help="With --sentence-transformers: unit-length embeddings (a Normalize module).")
    ] = False,
):
    """Write a run as a Hugging Face transformers model + tokenizer directory."""
    from clozax import interop
    from clozax.interop.sentence import sentence_parity, sentence_pooling
    from clozax.train.run_dir import read_config

    if sentence_transformers:  # a stage's own pooling: the export and --verify both use it
        pooling = sentence_pooling(read_config(run)[1], pooling, run)
    interop.export_run(run, out, step, pooling if sentence_transformers else None, normalize)
    print(f"exported {run} to {out}")
    if verify:
        texts = ["the quick brown fox jumps over the lazy dog", "a short one", "hello world"]
        diff = interop.hf_parity(run, out, texts)
        print(f"max |clozax - transformers| on {len(texts)} sentences: {diff:.2e}")
        if sentence_transformers:
            diff = sentence_parity(run, out, texts, pooling, normalize)
            print(f"max |clozax - SentenceTransformer.encode| on {len(texts)} sentences: "
                  f"{diff:.2e}")


@app.command("import-hf")
def import_hf(
    hf_dir: Annotated[Path, typer.Argument(help="Local save_pretrained directory "
                                           "(safetensors only).")],
    out: Annotated[Path, typer.Argument(help="New clozax run directory.")],
):
    """Import a BertForMaskedLM / RobertaPreLayerNormForMaskedLM / ModernBertForMaskedLM (or
    bare encoder) as a run."""
    from clozax import interop

    interop.import_hf(hf_dir, out)
    print(f"imported {hf_dir} into {out}")


@app.command()
def audit(
    run: Annotated[
        Path | None, typer.Argument(help="Run directory to audit (omit with --data).")
    ] = None,
    data: Annotated[
        Path | None,
        typer.Option(help="Dataset directory. Without RUN: data-only checks before training; "
                     "with RUN: use it instead of the dataset recorded in run.json."),
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option(help="Directory for audit.json in data-only mode (a run audit writes "
                     "RUN/audit.json)."),
    ] = None,
    batches: Annotated[
        int, typer.Option(help="Training batches sampled by the eligibility checks.")
    ] = 200,
):
    """Check the objective's invariants on a run (or a dataset); exit 1 if any check fails."""
    compile_cache.enable()
    from clozax.judge import audit as audit_lib

    if run is None and data is None:
        raise ValueError("pass a run directory (clozax audit RUN) or --data DIR for data-only "
                         "checks")
    if run is not None and out is not None:
        raise ValueError("--out is for data-only audits; a run audit writes RUN/audit.json")
    if batches < 1:
        raise ValueError(f"--batches {batches} must be >= 1")
    if run is not None:
        report = audit_lib.audit_run(run, data=data, batches=batches)
    else:
        report = audit_lib.audit_data(data, out)
    audit_lib.print_report(report)
    if not report["passed"]:
        raise SystemExit(1)


for command in (status, evaluate, probe, finetune, embed, retrieval, fill):  # --help's order
    app.command()(command)


@app.command()
def report(
    run: Annotated[Path, typer.Argument(help="Run directory (clozax train).")],
    step: cli_judge.Step = None,
    every_checkpoint: Annotated[bool, typer.Option(
        help="First evaluate every committed checkpoint not yet scored, so the curves over "
             "checkpoints cover them all.")] = False,
):
    """Write RUN/report.html (self-contained) and its figures in RUN/report/; with --step N,
    RUN/report-stepN.html from that checkpoint's results."""
    compile_cache.enable()
    from clozax.report import page as report_lib

    if every_checkpoint:
        from clozax.judge import evaluate as evaluate_lib
        from clozax.judge import history

        for s in cli_judge.steps_of(run, step, every_checkpoint):
            if history.at_step(run, "eval", s) is None:
                t = evaluate_lib.evaluate_run(run, step=s)["trained"]
                print(f"step {s}: held-out loss {t['loss']:.4f}, accuracy {t['accuracy']:.4f}")
    print(report_lib.write_report(run, step=step))


@app.command()
def demo(
    out: Annotated[Path, typer.Option(help="Demo directory (data/, run/).")] = Path("runs/demo"),
    steps: Annotated[
        int | None, typer.Option(help="Training steps (default: 600, mask rate 0.4; ~8 min).")
    ] = None,
    preset: Annotated[str, typer.Option(help="Model shape preset.")] = "small",
    quick: Annotated[
        bool, typer.Option(help="Small vocabulary, batch, eval, probe and audit (smoke test).")
    ] = False,
):
    """Prepare the built-in corpus, train, evaluate, probe, audit and report (resumable)."""
    if not quick:  # the kept arena (train/hostmem.py), before JAX starts: the whole demo 937 ->
        hostmem.keep_freed_memory()  # 884 s of stages, peak RSS 2.40 -> 2.80 GB (2026-12-04);
    compile_cache.enable()  # --quick is all compiling, which the one arena slows
    from clozax.app import demo as demo_lib

    summary = demo_lib.run_demo(out, steps=steps, preset=preset, quick=quick)
    if not summary["audit"]["passed"]:
        raise SystemExit(1)


def _fail(message: str, code: int = 2, label: str = "error") -> None:
    from rich.console import Console
    from rich.markup import escape

    # escaped: a message's own brackets ("[MASK]", "clozax[wandb]") are text, not markup
    Console(stderr=True, highlight=False).print(f"[bold red]{label}:[/] {escape(message)}",
                                                soft_wrap=True)
    raise SystemExit(code)


def main(argv: list[str] | None = None) -> None:
    """Entry point: one-line errors with exit code 2 unless ``--debug`` is given; a run stopped
    by a signal exits ``128 + signal`` (143 SIGTERM, 130 SIGINT) after its checkpoint. In a
    multi-process job a process that fails leaves at once (``os._exit``), without JAX's
    shutdown barrier, so the others' heartbeat ends the job in seconds instead of a hang."""
    try:
        _main(argv)
    except SystemExit as e:
        if e.code not in (0, None) and distributed.joined():
            _leave(e.code if isinstance(e.code, int) else 1)
        raise
    except BaseException:
        if distributed.joined():
            traceback.print_exc()
            _leave(1)
        raise


def _leave(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _main(argv: list[str] | None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    try:
        app(args=argv, prog_name="clozax", standalone_mode=False)
    except typer.Exit as e:  # --help and friends
        raise SystemExit(e.exit_code) from None
    except typer.Abort:  # Ctrl-C outside training's own handling (which saves first)
        _fail("interrupted (Ctrl-C); what was finished is kept: run the same command to "
              "continue", code=EXIT_CODES["SIGINT"])
    except Interrupted as e:
        _fail(str(e), code=e.exit_code, label="stopped")
    except TyperException as e:  # usage errors: unknown option, bad value, missing argument
        if debug:
            raise
        if type(e).__name__ == "NoArgsIsHelpError":  # typer has already printed the help
            raise SystemExit(0) from None
        message = e.format_message() if hasattr(e, "format_message") else str(e)
        _fail((message.splitlines() or [type(e).__name__])[0])
    except (ValueError, FileNotFoundError, NotADirectoryError, PermissionError) as e:
        if debug:
            raise
        _fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
    except Exception as e:  # a system error, also from a library that wraps its errno
        line = None if debug else system_error_line(e)
        if line is None:
            raise
        _fail(line)


def system_error_line(error: Exception) -> str | None:
    """One line for an operating-system error — an ``OSError``, or a library's exception that
    carries the errno only in its message, as the tokenizers' Rust ``(os error 28)`` does —
    or None for any other exception (a bug: its traceback is wanted)."""
    import errno as errno_lib
    import re

    code = error.errno if isinstance(error, OSError) else None
    if code is None:
        found = re.search(r"\(os error (\d+)\)", str(error))
        code = int(found.group(1)) if found else None
    if code is None:
        return None
    where = getattr(error, "filename", None)
    fix = ("free space on that disk or write somewhere else" if code == errno_lib.ENOSPC else
           "fix that and run the same command again")
    return (f"{os.strerror(code)}{f' ({where})' if where else ''}: {fix}; what was finished "
            "is kept")


if __name__ == "__main__":
    main()
