"""GLUE tasks read from a local GLUE directory in GLUE's own layout (the files of the GLUE
benchmark's download: ``CoLA/train.tsv``, ``MNLI/dev_matched.tsv`` ...), nothing downloaded."""

from __future__ import annotations

import csv
from pathlib import Path

from clozax.judge.finetune.tasks import Raw

# GLUE's own files: name -> (kind, text column, pair column, label column, dev file, header,
# selection metric). CoLA's train/dev files have no header: columns are source, label, original
# label, sentence. GLUE's test files carry no labels, so dev is the test split here and the
# validation split is carved out of train (what ModernBERT and Cramming report: dev scores).
# Metrics as GLUE scores them: CoLA Matthews; MRPC and QQP F1 of the positive class (with
# accuracy beside it); STS-B Pearson and Spearman; MNLI accuracy on the matched dev set and,
# as ``mismatched_accuracy``, on the mismatched one; the others accuracy.
GLUE = {
    "cola": ("classification", 3, None, 1, "dev.tsv", False, "matthews"),
    "sst2": ("classification", "sentence", None, "label", "dev.tsv", True, "accuracy"),
    "mrpc": ("pair", "#1 String", "#2 String", "Quality", "dev.tsv", True, "f1"),
    "qqp": ("pair", "question1", "question2", "is_duplicate", "dev.tsv", True, "f1"),
    "stsb": ("regression", "sentence1", "sentence2", "score", "dev.tsv", True,
             "pearson_spearman"),
    "mnli": ("pair", "sentence1", "sentence2", "gold_label",
             ("dev_matched.tsv", "dev_mismatched.tsv"), True, "accuracy"),
    "qnli": ("pair", "question", "sentence", "label", "dev.tsv", True, "accuracy"),
    "rte": ("pair", "sentence1", "sentence2", "label", "dev.tsv", True, "accuracy"),
}
GLUE_DIRS = {"cola": "CoLA", "sst2": "SST-2", "mrpc": "MRPC", "qqp": "QQP", "stsb": "STS-B",
             "mnli": "MNLI", "qnli": "QNLI", "rte": "RTE"}


def read_glue(directory: Path, name: str) -> tuple[Raw, dict[str, Raw], str, str]:
    """(train, test splits, kind, metric) of a GLUE task in its own layout under ``directory``
    (the task's folder, or the GLUE root holding it): ``test`` is the dev set (MNLI's matched),
    ``test_mismatched`` MNLI's mismatched dev set."""
    if name not in GLUE:
        raise ValueError(f"unknown GLUE task {name!r}; use one of {', '.join(GLUE)}")
    kind, text, pair, label, dev, header, metric = GLUE[name]
    directory = Path(directory)
    if (directory / GLUE_DIRS[name]).is_dir():
        directory = directory / GLUE_DIRS[name]
    out = []
    for file in ("train.tsv", *((dev,) if isinstance(dev, str) else dev)):
        path = directory / file
        if not path.is_file():
            raise ValueError(f"GLUE task {name}: {path} does not exist; pass --glue-dir the "
                             f"GLUE folder (holding {GLUE_DIRS[name]}/) or the task's folder")
        raw = Raw()
        with path.open(encoding="utf-8", newline="") as f:
            rows = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
            names = next(rows) if header else None
            for n, row in enumerate(rows, 2 if header else 1):
                record = dict(zip(names, row, strict=False)) if names else dict(enumerate(row))
                where = f"{path}:{n}"
                if any(record.get(c) in (None, "") for c in (text, pair, label)
                       if c is not None):
                    raise ValueError(f"{where} lacks GLUE {name}'s columns; is this GLUE's "
                                     f"own {file}?")
                raw.texts.append(tuple(record[c] for c in (text, pair) if c is not None))
                raw.targets.append(record[label])
                raw.groups.append("")
                raw.where.append(where)
        if not raw.targets:
            raise ValueError(f"GLUE task {name}: {path} has no examples")
        out.append(raw)
    tests = dict(zip(("test", "test_mismatched"), out[1:], strict=False))
    return out[0], tests, kind, metric
