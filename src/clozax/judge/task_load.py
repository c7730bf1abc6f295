"""The one task stack of ``probe`` and ``finetune``: where a task's examples come from, how the
splits are made, which validation and test examples are dropped because the encoder read them
in pretraining (``judge/overlap.py``), then encoding (``judge/finetune/tasks.py``).

Sources: task files (``--task``, ``--validation``, ``--test``; a missing split is carved out of
the training file by a keyed hash of each example's group), a GLUE directory (test = GLUE's
dev files, validation carved out of train), or the run's own dataset labels:

- **the dataset's labels** (a prepared corpus's ``label``; for the built-in corpus a docstring's
  top-level stdlib package, grouped by module): the training examples are documents of the
  dataset's *train* split, validation and test are documents of its *held-out* split (split
  between them by a keyed hash, stratified by label: ``HELDOUT_VALIDATION`` of each label's
  documents validate), so no evaluated document
  was pretrained on, by construction (one that nearly repeats a train document is counted and
  dropped by ``judge/overlap.py``'s rule). Each document is its first chunk, exactly the piece
  trained on. Classes: labels with at least ``MIN_EXAMPLES`` training documents that the
  held-out split also has (a class no evaluated example has is not part of the task); at most
  ``MAX_PER_CLASS`` training documents per class (a keyed-hash choice). Every drop and cap is
  counted in the task's accounting (``selection``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from clozax.judge import overlap
from clozax.judge.finetune import glue, tasks
from clozax.train.run_dir import open_run_dataset

MIN_EXAMPLES = 30
MIN_LENGTH = 8  # the shortest --max-len: [CLS], a pair's two [SEP] and a few tokens of each text
MAX_PER_CLASS = 100
HELDOUT_VALIDATION = 1 / 3


@dataclass(frozen=True)
class TaskSpec:
    """Where a task's examples come from, and what is done with them before encoding."""

    train: Path | None = None  # None: the run's dataset labels (or ``glue``)
    validation: Path | None = None
    test: Path | None = None
    kind: str = "classification"
    fields: tasks.Fields = field(default_factory=tasks.Fields)
    glue: str | None = None
    glue_dir: Path | None = None
    name: str | None = None
    metric: str | None = None  # None: the kind's default (``finetune_tasks.default_metric``)
    split_seed: int = 0
    keep_pretraining_overlap: bool = False
    max_per_class: int = MAX_PER_CLASS  # the dataset labels' cap
    max_len: int | None = None  # tokens per example; None: the run's trained length

    def __post_init__(self):
        if self.kind not in tasks.KINDS:
            raise ValueError(f"task kind {self.kind!r} is not one of {', '.join(tasks.KINDS)}")
        if self.glue is not None and self.glue_dir is None:
            raise ValueError("--glue-task needs --glue-dir, the local GLUE folder")
        if self.max_len is not None and self.max_len < MIN_LENGTH:
            raise ValueError(f"--max-len {self.max_len} leaves no room for a text; pass at "
                             f"least {MIN_LENGTH} (tokens per example, [CLS] and [SEP] included)")
        if self.max_per_class < MIN_EXAMPLES:
            raise ValueError(f"max_per_class={self.max_per_class} is below {MIN_EXAMPLES}; "
                             "raise it")

    def task_name(self) -> str:
        if self.name:
            return self.name
        if self.glue:
            return self.glue
        return Path(self.train).stem if self.train else "labels"


def load_task(spec: TaskSpec, run, tokenizer) -> tasks.Task:
    """The task ``spec`` names, its evaluated splits checked against the run's pretraining
    data, encoded with the run's tokenizer at its trained length (or ``spec.max_len``, at
    most that: each text cut to fit, the cuts counted per split)."""
    length = _length(spec, run)
    raws, kind, source, metric, carved, selection = _raws(spec, run, tokenizer)
    raws, seen = overlap.account(raws, run.info, spec.keep_pretraining_overlap)
    task = tasks.build(spec.task_name(), kind, source, metric, raws, tokenizer, run.specials,
                       length, carved=carved)
    task.accounting["pretraining_overlap"] = seen
    if selection:
        task.accounting["selection"] = selection
    return task


def _length(spec: TaskSpec, run) -> int:
    """Tokens per example: the run's trained length, or ``spec.max_len`` when it is shorter
    (positions past the trained length were never trained, so a longer one is refused)."""
    if spec.max_len is None:
        return run.trained_length
    if spec.max_len > run.trained_length:
        raise ValueError(f"--max-len {spec.max_len} is past the {run.trained_length} tokens "
                         f"run {run.path} was trained on; pass at most {run.trained_length}")
    return spec.max_len


def _raws(spec: TaskSpec, run, tokenizer):
    """(raws by split, kind, source, metric, carved splits, selection accounting)."""
    if spec.glue:
        train, tests, kind, metric = glue.read_glue(spec.glue_dir, spec.glue)
        raws = {**tasks.carve(train, spec.split_seed,
                              {"validation": tasks.VALIDATION_FRACTION}), **tests}
        return (raws, kind, f"GLUE {spec.glue} ({spec.glue_dir}); test = dev", spec.metric or
                metric, {"validation"}, None)
    if spec.train is None:
        raws, selection = dataset_raws(open_run_dataset(run), tokenizer, spec.split_seed,
                                       spec.max_per_class)
        return (raws, "classification", f"{run.info['dataset']} documents (label): train "
                "split → train, held-out split → validation and test", spec.metric,
                set(tasks.SPLITS), selection)
    raws = {"train": tasks.read_file(spec.train, spec.kind, spec.fields)}
    given = {s: getattr(spec, s) for s in ("validation", "test")}
    for split, path in given.items():
        if path is not None:
            raws[split] = tasks.read_file(path, spec.kind, spec.fields)
    missing = {s: {"validation": tasks.VALIDATION_FRACTION, "test": tasks.TEST_FRACTION}[s]
               for s, p in given.items() if p is None}
    if missing:
        raws.update(tasks.carve(raws["train"], spec.split_seed, missing))
    return raws, spec.kind, str(spec.train), spec.metric, set(missing), None


def dataset_raws(dataset, tokenizer, seed: int, max_per_class: int) -> tuple[dict, dict]:
    """The dataset labels' splits (see the module docstring) and what was dropped or capped."""
    specials = set(dataset.specials.values())
    read = {"train": tasks.Raw(), "heldout": tasks.Raw()}
    for name, raw in read.items():
        split = getattr(dataset, name)
        for doc in dataset.documents(name):  # streamed, shard by shard
            if doc.get("label") is None or not doc.get("chunks"):
                continue
            row, segment = doc["chunks"][0]
            piece = np.asarray(split.tokens[row])[np.asarray(split.segments[row]) == segment]
            raw.texts.append((tokenizer.decode([int(t) for t in piece
                                                if int(t) not in specials]),))
            raw.targets.append(str(doc["label"]))
            raw.groups.append(str(doc.get("group", doc["id"])))
            raw.where.append(f"{dataset.path} {name} document {doc['id'][:12]}")
            raw.digests.append((doc["id"],))
    train, heldout = read["train"], read["heldout"]
    if not train.targets or not heldout.targets:
        raise ValueError(f"dataset {dataset.path} has no document labels in its "
                         f"{'train' if not train.targets else 'held-out'} split; prepare it "
                         "with --label-field, or pass --task FILE")
    counts, evaluated = Counter(train.targets), set(heldout.targets)
    few = sorted(c for c in counts if counts[c] < MIN_EXAMPLES)
    absent = sorted(c for c in counts if counts[c] >= MIN_EXAMPLES and c not in evaluated)
    kept = sorted(set(counts) - set(few) - set(absent))
    if len(kept) < 2:
        raise ValueError(f"dataset {dataset.path}: {len(kept)} label(s) have >= {MIN_EXAMPLES} "
                         "training documents and occur in the held-out split; a task needs "
                         "2 — add labelled documents")
    chosen = []
    for label in kept:
        mine = [i for i, t in enumerate(train.targets) if t == label]
        mine.sort(key=lambda i: tasks.keyed_hash(seed, train.digests[i][0]))
        chosen += mine[:max_per_class]
    validation, test = _split_held_out(heldout, seed, HELDOUT_VALIDATION)
    raws = {"train": train.pick(sorted(chosen)), "validation": heldout.pick(validation),
            "test": heldout.pick(test)}
    selection = {
        "classes": {label: counts[label] for label in kept},
        "min_examples": MIN_EXAMPLES, "max_per_class": max_per_class,
        "dropped_fewer_than_min_examples": {"classes": len(few),
                                            "examples": sum(counts[c] for c in few)},
        "dropped_not_in_heldout": {"classes": len(absent),
                                   "examples": sum(counts[c] for c in absent)},
        "capped_away": sum(counts[c] for c in kept) - len(chosen),
        "heldout_examples": len(heldout.targets),
        "groups": {s: len(set(r.groups)) for s, r in raws.items()},
    }
    return raws, selection


def _split_held_out(raw: tasks.Raw, seed: int, share: float) -> tuple[list[int], list[int]]:
    """(validation, test) example indices, stratified by label: of each label's examples
    (keyed-hash order) ``share`` validate (at least one where it has two), the rest test. By
    document, not group: the held-out split has few groups, of very different sizes, and a
    split by group leaves most labels on one side only."""
    by_label: dict[str, list[int]] = {}
    for i, label in enumerate(raw.targets):
        by_label.setdefault(label, []).append(i)
    validation = []
    for ix in by_label.values():
        ix.sort(key=lambda i: tasks.keyed_hash(seed, f"heldout:{raw.digests[i][0]}"))
        validation += ix[: max(1, round(share * len(ix))) if len(ix) > 1 else 0]
    chosen = set(validation)
    return sorted(validation), [i for i in range(len(raw.targets)) if i not in chosen]


def cap_train(task: tasks.Task, limit: int | None, seed: int) -> tasks.Task:
    """At most ``limit`` training examples (a seeded choice), counted in the accounting."""
    split = task.splits["train"]
    if limit is None or len(split) <= limit:
        return task
    keep = sorted(np.random.default_rng([seed, 7]).permutation(len(split))[:limit].tolist())
    return replace(task, splits={**task.splits, "train": split.select(keep)},
                   accounting={**task.accounting, "train_capped_to": limit})
