"""Documentation that runs exactly as written: every block of ``docs/how-to/`` and
``docs/tutorials/`` runs, in the order of ``PAGES``, in one temporary directory, as a reader
who follows the pages one after another would run it.

- a ``bash`` block runs in ``bash -e`` (a failing line fails the page), with the installed
  ``clozax`` and ``python`` first on ``PATH`` and ``HOME`` inside the directory;
- a ``python`` block runs in the installed interpreter;
- a block with a title (```` ```toml title="ext.toml" ````) is the file of that name, written
  where a later command reads it;
- a block whose first line starts ``# not run by the docs test:`` is not run, and the line says
  why (SLURM, Kubernetes, several hosts, a GPU, a download): the reader sees it on the page.

The only change to what is written is ``SIZES``: run lengths, presets and counts, listed here and
in tests/README.md, applied to every block; nothing else is substituted or added.
"""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

from commands import one_line_error

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
BIN = Path(sys.executable).parent

# Reading order: the how-to pages make data/stdlib and runs/x that the tutorials' pages read.
PAGES = (
    "how-to/demo.md", "how-to/prepare.md", "how-to/data-formats.md", "how-to/train.md",
    "how-to/recipe-and-phases.md", "how-to/evaluate.md", "how-to/export.md",
    "tutorials/own-corpus.md", "tutorials/continue-pretraining.md",
    "tutorials/modern-long-context.md", "tutorials/finetune.md", "tutorials/retriever.md",
    "tutorials/several-hosts.md",
    "tutorials/preemption.md", "tutorials/audit.md",
)
NOT_RUN = "# not run by the docs test:"
NOT_RUN_REASONS = ("SLURM", "Kubernetes", "several hosts", "a GPU", "a TPU", "a download")

# (pattern, replacement, what it shrinks): sizes only.
SIZES = (
    (r"--steps \d+", "--steps 2", "a run's length: 2 updates"),
    (r"--step \d+", "--step 2", "the checkpoint a command reads: the 2-update run's last"),
    (r"--minutes \d+(\.\d+)?", "--minutes 0.1", "a time budget: 6 seconds"),
    (r"--preset (small|base)\b", "--preset tiny", "the model: H32 L2"),
    (r"--preset modern-(small|base)\b", "--preset modern-tiny", "the modern model: H32 L3"),
    (r"--seq-len (512|1024)\b", "--seq-len 128", "rows of 128 tokens (modern-tiny's most)"),
    (r"--workers \d+", "--workers 2", "worker processes: the machine's 2 cores"),
    (r"^(clozax finetune (?!.*--predict).*?)( *#.*)?$",
     r"\1 --seeds 2 --epochs 1 --max-train 200 --max-len 64\2",
     "fine-tuning: 2 seeds of 1 epoch on at most 200 training examples of at most 64 tokens"),
    (r"^(\w*steps) = (\d+)", lambda m: f"{m[1]} = {max(1, int(m[2]) // 100)}",
     "a TOML block's step counts, divided by 100"),
)


def blocks(page: Path) -> list[tuple[str, str | None, str]]:
    """``(language, title, text)`` of each fenced block of ``page``, in order."""
    found = re.finditer(r'^```(\w+)(?: +title="([^"]+)")?\n(.*?)^```', page.read_text(),
                        re.S | re.M)
    return [(m[1], m[2], m[3]) for m in found]


def sized(text: str) -> str:
    for pattern, replacement, _ in SIZES:
        text = re.sub(pattern, replacement, text, flags=re.M)
    return text


@pytest.mark.fast
def test_the_reading_order_names_every_how_to_and_tutorial_page():
    pages = {p.relative_to(DOCS).as_posix() for d in ("how-to", "tutorials")
             for p in (DOCS / d).glob("*.md")}
    assert set(PAGES) == pages


# What only a cluster, an accelerator or the network has: a block with one must be left out.
CLUSTER_ONLY = re.compile(r"#SBATCH|\bsrun\b|gcloud|CUDA_VISIBLE_DEVICES|\bhelm\b|"
                          r"dask (scheduler|worker)|--glue-dir|--beir ~/")


@pytest.mark.fast
def test_a_block_left_out_says_why_on_the_page_and_only_cluster_blocks_are():
    for name in PAGES:
        for _, _, text in blocks(DOCS / name):
            first = text.splitlines()[0]
            left_out = first.startswith(NOT_RUN)
            assert not left_out or any(r in first for r in NOT_RUN_REASONS), (name, first)
            assert left_out == bool(CLUSTER_ONLY.search(text)), (name, text[:200])


@pytest.mark.fast
def test_the_sizes_are_listed_where_readers_of_the_suite_look():
    listed = (ROOT / "tests" / "README.md").read_text()
    for _, replacement, _ in SIZES:
        if isinstance(replacement, str):
            shown = replacement.replace("\\1", "...").replace("\\2", "")
            assert f"`{shown.strip()}`" in listed, shown


@pytest.mark.fast
def test_sizes_change_only_the_numbers_they_name():
    assert sized("clozax train --data d --out r --preset small --steps 2000  # x") == \
        "clozax train --data d --out r --preset tiny --steps 2  # x"
    assert sized("clozax finetune runs/x --task t.jsonl   # a comment") == \
        "clozax finetune runs/x --task t.jsonl --seeds 2 --epochs 1 --max-train 200 --max-len 64" \
        "   # a comment"
    assert sized("clozax finetune runs/x --name t --predict new.jsonl") == \
        "clozax finetune runs/x --name t --predict new.jsonl"
    assert sized("steps = 2000\nwarmup_steps = 50\nrate = 0.3") == \
        "steps = 20\nwarmup_steps = 1\nrate = 0.3"


@pytest.mark.slow
@pytest.mark.docs_run
def test_every_tutorial_and_how_to_block_runs_as_written(tmp_path):
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
           "HOME": str(tmp_path / "home"), "COLUMNS": "120"}
    (tmp_path / "home").mkdir()
    ran = 0
    for name in PAGES:
        for number, (language, title, text) in enumerate(blocks(DOCS / name), 1):
            if text.startswith(NOT_RUN):
                continue
            where = f"{name}, block {number}"
            if title:
                (tmp_path / title).write_text(sized(text))
                continue
            command = {"bash": ["bash", "-e", "-o", "pipefail", "-c"],
                       "python": [sys.executable, "-c"]}.get(language)
            if command is None:
                continue  # an output or a file shown, not something a reader runs
            started, cpu_started = time.perf_counter(), _children_cpu_seconds()
            done = subprocess.run([*command, sized(text)], cwd=tmp_path, env=env,
                                  capture_output=True, text=True, timeout=600)
            wall, cpu = time.perf_counter() - started, _children_cpu_seconds() - cpu_started
            print(f"{wall:6.1f} s {cpu:6.1f} CPU-s  {where}")
            assert done.returncode == 0, (
                f"{where} exited {done.returncode}:\n{sized(text)}\n--- output (end) ---\n"
                f"{(done.stdout + done.stderr)[-4000:]}")
            ran += 1
    assert ran >= 15


def _children_cpu_seconds() -> float:
    """User + system seconds of this process's finished children (a block's commands)."""
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def test_the_example_task_files_hold_no_text_of_the_example_corpora(tmp_path, capsys):
    from clozax.data.examples import NAMES, write_examples

    written = dict(write_examples(tmp_path))
    assert {name.rstrip("/") for line in written for name in line.split()} == set(NAMES)
    # run again where they are: refused in one line, nothing replaced
    before = (tmp_path / "train.jsonl").read_bytes()
    assert "already exists" in one_line_error(capsys, "examples", tmp_path)
    assert (tmp_path / "train.jsonl").read_bytes() == before
    corpus = {p.read_text().strip() for p in (tmp_path / "texts").rglob("*.txt")}
    dump = {json.loads(line)["body"] for line in (tmp_path / "dump.jsonl").open()}
    assert corpus == dump and len(corpus) > 1000
    tasks = [json.loads(line) for name in ("labels", "train", "dev", "test", "new")
             for line in (tmp_path / f"{name}.jsonl").open()]
    assert tasks and not {r["text"] for r in tasks} & corpus
    labels = {r["label"] for r in tasks if "label" in r}
    assert len(labels) == 6 and "skipped" not in " ".join(written.values())
    splits = {name: {r["module"] for r in map(json.loads, (tmp_path / f"{name}.jsonl").open())}
              for name in ("train", "dev", "test")}  # by module: none on two sides
    assert not (splits["train"] & splits["dev"] or splits["train"] & splits["test"]
                or splits["dev"] & splits["test"])
    # the retrieval files: pairs and the BEIR-layout set from other modules, no corpus text
    pairs = [json.loads(line) for line in (tmp_path / "query_pairs.jsonl").open()]
    beir = tmp_path / "beir"
    documents = {r["_id"]: r["text"] for r in map(json.loads, (beir / "corpus.jsonl").open())}
    queries = {r["_id"]: r["text"] for r in map(json.loads, (beir / "queries.jsonl").open())}
    qrels = [line.split("\t") for line in (beir / "qrels" / "test.tsv").read_text().splitlines()]
    assert len(pairs) > 300 and len(queries) == 300 and len(qrels) == 301
    assert all(q in queries and d in documents for q, d, _ in qrels[1:])
    pair_texts = {t for r in pairs for t in (r["query"], r["positive"])}
    assert not pair_texts & (set(documents.values()) | set(queries.values()))
    assert not any(any(t in c for c in corpus) for t in list(queries.values())[:50])
