"""Fine-tuning tasks: labelled examples read from files, encoded with the run's tokenizer, split.

Kinds (``KINDS``): ``classification`` (one text, one label), ``pair`` (two texts, one label),
``regression`` (one or two texts, a number), ``tokens`` (words with one BIO tag each).

Inputs: JSONL / CSV / TSV / parquet with named fields (``Fields``), CoNLL files (a word per
line, its tag in the last column, blank lines between sentences), the run's own dataset labels
(a prepared corpus's ``label``, grouped by ``group``), or a GLUE task directory in GLUE's own
layout (``GLUE``). Splits come from files (``--validation``, ``--test``), and what is missing is
carved out of the training file by a keyed hash of each example's group (``--group-field``,
else its text, so a repeated text never sits on both sides).

Encoding: ``[CLS] a [SEP]`` or ``[CLS] a [SEP] b [SEP]`` with the run's special ids; longer
inputs are cut to the run's trained length (pairs trim the longer side first, as HF's
``longest_first``) and counted. Token classification labels the first word piece of each word
and ignores the rest (label ``IGNORE``), as HF's examples do.
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from clozax.core import files
from clozax.judge.finetune.heads import METRICS, default_metric

KINDS = ("classification", "pair", "regression", "tokens")
IGNORE = -1  # a position no loss or metric reads
SPLITS = ("train", "validation", "test")
VALIDATION_FRACTION, TEST_FRACTION = 0.1, 0.2
TABLE_SUFFIXES = (".jsonl", ".json", ".csv", ".tsv", ".parquet")
CONLL_SUFFIXES = (".conll", ".conllu", ".iob", ".bio")


@dataclass(frozen=True)
class Fields:
    """Which field of a record holds what."""

    text: str = "text"
    pair: str = "text_pair"
    label: str = "label"
    group: str | None = None
    tokens: str = "tokens"
    tags: str = "tags"


@dataclass
class Raw:
    """Examples before encoding: ``texts`` (one or two strings each) or ``words``; targets;
    groups; where each came from (``file:line``, for messages)."""

    texts: list[tuple[str, ...]] = field(default_factory=list)
    words: list[list[str]] = field(default_factory=list)
    targets: list = field(default_factory=list)
    groups: list[str] = field(default_factory=list)
    where: list[str] = field(default_factory=list)
    # per example, the hex digests of its texts as ``prepare`` keys a document (set where the
    # example *is* a prepared document; otherwise computed from the text: ``judge/overlap.py``)
    digests: list[tuple[str, ...]] = field(default_factory=list)

    def pick(self, keep) -> Raw:
        """The examples ``keep`` (indices), in that order."""
        return Raw(*([getattr(self, f)[i] for i in keep] if getattr(self, f) else []
                     for f in ("texts", "words", "targets", "groups", "where", "digests")))


@dataclass
class Split:
    """Encoded examples: ``ids`` per example (int32), ``y`` (class index, float, or per-token
    int32 labels with ``IGNORE``), ``text`` (for TF-IDF), ``words`` (token tasks)."""

    ids: list[np.ndarray]
    y: list
    text: list[str]
    truncated: int = 0
    # token tasks: per example, the word each labelled position (a word's first piece) reads;
    # a word with no piece (a zero-width space, a soft hyphen) or cut by truncation has none
    word_of: list[np.ndarray] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.ids)

    def select(self, keep: list[int]) -> Split:
        """The examples ``keep`` (indices), in that order."""
        return Split([self.ids[i] for i in keep], [self.y[i] for i in keep],
                     [self.text[i] for i in keep], self.truncated,
                     [self.word_of[i] for i in keep] if self.word_of else [])


@dataclass
class Task:
    name: str
    kind: str
    labels: list[str] | None  # class or tag names (index = class id); None for regression
    splits: dict[str, Split]
    source: str
    metric: str  # what model selection reads on validation
    accounting: dict = field(default_factory=dict)
    pair: bool = False  # two texts per example


# --------------------------------------------------------------------------- reading


def _records(path: Path):
    """(where, record dict) for every row of a table file."""
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        for n, record in files.json_objects(path):
            yield f"{path}:{n}", record
    elif suffix in (".csv", ".tsv"):
        with path.open(encoding="utf-8", newline="") as f:
            reader = csv.DictReader(f, delimiter="\t" if suffix == ".tsv" else ",")
            for n, row in enumerate(reader, 2):
                yield f"{path}:{n}", row
    elif suffix == ".parquet":
        import pyarrow.parquet as pq

        for n, row in enumerate(pq.read_table(path).to_pylist(), 1):
            yield f"{path}:row {n}", row
    else:
        raise ValueError(f"{path}: unknown task file type {suffix!r}; use one of "
                         f"{', '.join(TABLE_SUFFIXES + CONLL_SUFFIXES)}")


def _field(record: dict, name: str, where: str, option: str):
    value = record.get(name)
    if value is None:
        fields = ", ".join(sorted(map(str, record))) or "none"
        raise ValueError(f"{where} has no field {name!r} (its fields: {fields}); pass "
                         f"{option} NAME")
    return value


def _text(record: dict, name: str, where: str, option: str) -> str:
    value = _field(record, name, where, option)
    if not isinstance(value, str):
        raise ValueError(f"{where}: field {name!r} must be a string, not {type(value).__name__}")
    if not value.strip():
        raise ValueError(f"{where}: field {name!r} is empty; drop the example or fill it in")
    return value


def read_table(path: Path, kind: str, fields: Fields, pair: bool,
               labelled: bool = True) -> Raw:
    """A table file's examples (``pair``: two texts each; not ``labelled``: inputs only, for
    prediction, targets None)."""
    raw = Raw()
    for where, record in _records(path):
        if kind == "tokens":
            words = _field(record, fields.tokens, where, "--tokens-field")
            tags = _field(record, fields.tags, where, "--tags-field") if labelled else None
            if not isinstance(words, list) or not words or (
                    labelled and not isinstance(tags, list)):
                raise ValueError(f"{where}: fields {fields.tokens!r} and {fields.tags!r} must "
                                 "be non-empty lists")
            if labelled and len(words) != len(tags):
                raise ValueError(f"{where}: {len(words)} tokens but {len(tags)} tags; give "
                                 "each token one tag")
            raw.words.append([str(w) for w in words])
            raw.targets.append([str(t) for t in tags] if labelled else None)
        else:
            texts = [_text(record, fields.text, where, "--text-field")]
            if pair:
                texts.append(_text(record, fields.pair, where, "--pair-field"))
            raw.texts.append(tuple(texts))
            raw.targets.append(_field(record, fields.label, where, "--label-field")
                               if labelled else None)
        group = record.get(fields.group) if fields.group else None
        raw.groups.append(str(group) if group is not None else "")
        raw.where.append(where)
    if not raw.targets:
        raise ValueError(f"task file {path} has no examples")
    return raw


def read_conll(path: Path) -> Raw:
    """CoNLL-style: one word per line (word first, tag last), a blank line between sentences,
    ``-DOCSTART-`` lines skipped."""
    raw, words, tags, start = Raw(), [], [], 1

    def flush():
        if words:
            raw.words.append(list(words))
            raw.targets.append(list(tags))
            raw.groups.append("")
            raw.where.append(f"{path}:{start}")
        words.clear()
        tags.clear()

    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            parts = line.split()
            if not parts or parts[0] == "-DOCSTART-":
                flush()
                start = n + 1
                continue
            if len(parts) < 2:
                raise ValueError(f"{path}:{n} has a word but no tag; CoNLL lines are "
                                 "'WORD ... TAG'")
            words.append(parts[0])
            tags.append(parts[-1])
    flush()
    if not raw.targets:
        raise ValueError(f"CoNLL file {path} has no sentences")
    return raw


def read_file(path: Path, kind: str, fields: Fields) -> Raw:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"task file {path} does not exist; pass an existing file")
    if path.suffix.lower() in CONLL_SUFFIXES or (kind == "tokens" and path.suffix == ".txt"):
        if kind != "tokens":
            raise ValueError(f"{path} is a CoNLL file; pass --kind tokens")
        return read_conll(path)
    return read_table(path, kind, fields, pair=kind == "pair" or
                      (kind == "regression" and _has_pair_field(path, fields)))


def _has_pair_field(path: Path, fields: Fields) -> bool:
    """A regression file is a pair task (STS-style) when its first record has the pair field
    (or a non-default ``--pair-field`` was given)."""
    if fields.pair != Fields.pair:
        return True
    first = next(iter(_records(path)), None)
    return first is not None and fields.pair in first[1]


# --------------------------------------------------------------------------- splitting


def keyed_hash(seed: int, key: str) -> int:
    """The one keyed hash of task splits and choices: 64 bits of sha256(seed, key)."""
    return int.from_bytes(hashlib.sha256(f"{seed}\x00{key}".encode()).digest()[:8], "big")


def carve(raw: Raw, seed: int, fractions: dict[str, float]) -> dict[str, Raw]:
    """Split ``raw`` by a keyed hash of each example's group (its text when it has none)."""
    bounds = list(zip(itertools.accumulate(fractions.values()), fractions, strict=True))
    parts = {name: [] for name in ["train", *fractions]}
    for i in range(len(raw.targets)):
        key = raw.groups[i] or json.dumps(raw.texts[i] if raw.texts else raw.words[i])
        u = keyed_hash(seed, key) / 2**64
        parts[next((n for b, n in bounds if u < b), "train")].append(i)
    return {name: raw.pick(ix) for name, ix in parts.items()}


# --------------------------------------------------------------------------- encoding


def label_name(value) -> str:
    """A class label's name: a string as written, a boolean ``true``/``false``, a number in its
    shortest form, an integral one as an integer (JSON's ``1`` and ``1.0``, and ``"1"``: ``1``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value).lower() if isinstance(value, bool) else str(value)
    return str(int(value)) if np.isfinite(value) and float(value).is_integer() else str(value)


def _one_form_per_value(raws) -> None:
    """Two label names that read as one number or truth value (``1`` and ``1.0`` as text, ``1``
    and ``true``, ``True`` and ``true``) would be two classes: refused, in one line."""
    seen, pairs = {}, [vw for raw in raws for vw in zip(raw.targets, raw.where, strict=True)]
    for value, where in pairs:
        name, key = label_name(value), None
        with contextlib.suppress(ValueError):  # a name that reads as no number: key None
            key = float({"true": "1", "false": "0"}.get(name.lower(), name))
        first = seen.setdefault(key, (value, where))
        if key is not None and np.isfinite(key) and label_name(first[0]) != name:
            a, b = (json.dumps(v, default=str) for v in (first[0], value))
            raise ValueError(f"labels {a} ({first[1]}) and {b} ({where}) are one value "
                             "written two ways, two classes; write each class one way in "
                             "every file (e.g. all 1/0, or all true/false)")


def _label_names(train: Raw, kind: str) -> list[str] | None:
    if kind == "regression":
        return None
    if kind == "tokens":
        names = sorted({t for tags in train.targets for t in tags})
    else:
        names = sorted({label_name(t) for t in train.targets})
    if len(names) < 2:
        what = "tag" if kind == "tokens" else "class"
        raise ValueError(f"the training split has {len(names)} {what}(es) ({', '.join(names)}); "
                         f"{kind} needs at least 2")
    return names


def _target(value, kind: str, index: dict | None, where: str, split: str):
    if kind == "regression":
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{where}: label {value!r} is not a number; regression needs "
                             "numeric labels") from None
        if not np.isfinite(number):
            raise ValueError(f"{where}: label {value!r} is not finite")
        return number
    key = label_name(value)
    if key not in index:
        raise ValueError(f"{where}: {split} label {key!r} never appears in training; add "
                         "training examples of it or drop it")
    return index[key]


def encode(tokenizer, raw: Raw, kind: str, labels: list[str] | None, specials: dict,
           seq_len: int, split: str, drop_unseen: bool = False) -> tuple[Split, int]:
    """Encode ``raw`` (see the module docstring); returns (split, examples dropped because
    their label is unseen in training, only with ``drop_unseen``)."""
    cls, sep = specials["cls"], specials["sep"]
    index = None if labels is None else {name: i for i, name in enumerate(labels)}
    out, dropped = Split([], [], [], 0), 0
    if kind == "tokens":
        for words, tags, where in zip(raw.words, raw.targets, raw.where, strict=True):
            if tags is None:  # inputs only (prediction): every word's first piece is read
                tags = [labels[0]] * len(words)
            unseen = [t for t in tags if t not in index]
            if unseen:
                if drop_unseen:
                    dropped += 1
                    continue
                raise ValueError(f"{where}: {split} tag {unseen[0]!r} never appears in "
                                 "training; add training examples of it or drop it")
            enc = tokenizer.encode(words, is_pretokenized=True, add_special_tokens=False)
            ids, word_ids = list(enc.ids), list(enc.word_ids)
            if len(ids) > seq_len - 2:
                ids, word_ids = ids[: seq_len - 2], word_ids[: seq_len - 2]
                out.truncated += 1
            y, word_of = [IGNORE], []
            previous = None
            for w in word_ids:
                first = w is not None and w != previous
                y.append(index[tags[w]] if first else IGNORE)
                word_of += [w] if first else []
                previous = w
            y.append(IGNORE)
            out.ids.append(np.asarray([cls, *ids, sep], np.int32))
            out.y.append(np.asarray(y, np.int32))
            out.word_of.append(np.asarray(word_of, np.int32))
            out.text.append(" ".join(words))
        return out, dropped
    for texts, value, where in zip(raw.texts, raw.targets, raw.where, strict=True):
        if kind != "regression" and value is not None and label_name(value) not in index \
                and drop_unseen:
            dropped += 1
            continue
        target = 0 if value is None else _target(value, kind, index, where, split)
        pieces = [tokenizer.encode(t, add_special_tokens=False).ids for t in texts]
        room = seq_len - 1 - len(pieces)  # [CLS] and one [SEP] per text
        if sum(map(len, pieces)) > room:
            out.truncated += 1
            while sum(map(len, pieces)) > room:  # longest first
                longest = max(range(len(pieces)), key=lambda k: (len(pieces[k]), -k))
                pieces[longest] = pieces[longest][:-1]
        ids = [cls]
        for p in pieces:
            ids += [*p, sep]
        out.ids.append(np.asarray(ids, np.int32))
        out.y.append(target)
        out.text.append(" [SEP] ".join(texts))
    return out, dropped


def build(name: str, kind: str, source: str, metric: str, raws: dict[str, Raw], tokenizer,
          specials: dict, seq_len: int, carved: set[str]) -> Task:
    """Encode every split of ``raws``; unseen labels in a ``carved`` split are dropped and
    counted, in a split the user gave they are an error."""
    if kind in ("classification", "pair"):
        _one_form_per_value(raws.values())
    labels = _label_names(raws["train"], kind)
    metric = metric or default_metric(kind, labels)
    if metric not in METRICS[kind] or (metric == "f1" and len(labels) != 2):
        raise ValueError(f"--metric {metric!r} is not scored for a {kind} task"
                         f"{' of ' + str(len(labels)) + ' classes' if labels else ''}; choose "
                         f"one of {', '.join(m for m in METRICS[kind] if m != 'f1')}"
                         f"{', f1 (two classes)' if kind in ('classification', 'pair') else ''}")
    splits, dropped = {}, {}
    for split in [*SPLITS, *sorted(set(raws) - set(SPLITS))]:  # extra tests: test_mismatched
        splits[split], dropped[split] = encode(
            tokenizer, raws[split], kind, labels, specials, seq_len, split,
            drop_unseen=split in carved and split != "train")
        if not len(splits[split]):
            raise ValueError(f"task {name}: the {split} split is empty; give more examples or "
                             f"a --{split} file")
    accounting = {
        "examples": {s: len(splits[s]) for s in splits},
        "truncated_to_seq_len": {s: splits[s].truncated for s in splits},
        "unseen_label_dropped": {s: dropped[s] for s in splits if dropped[s]},
        "seq_len": seq_len,
    }
    pair = bool(raws["train"].texts) and len(raws["train"].texts[0]) == 2
    return Task(name, kind, labels, splits, source, metric, accounting, pair)
