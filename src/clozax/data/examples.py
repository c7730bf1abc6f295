"""Example inputs made from the built-in corpus: the files the tutorials and how-to pages read
(``clozax examples DIR``), so every documented command runs before a reader brings their own.

The built-in corpus's documents (stdlib docstrings; group = module file, label = top-level
package) are split by a keyed hash of the group into a *pretraining* part and a *task* part, so
no task example is a document the example corpora hold (a fine-tune or probe on a run pretrained
on them has nothing to exclude):

- pretraining part: ``texts/PACKAGE/`` (one ``.txt`` per document; a text file's label is
  its top directory), ``book.txt`` (paragraphs),
  ``dump.jsonl`` and ``dump.jsonl.zst`` (fields ``body``, ``site``, ``label``), ``crawl/*/``
  (``.jsonl.zst``, for a glob), ``hf_saved_dataset/`` (an arrow stream as ``datasets``'
  ``save_to_disk`` writes one);
- task part: ``labels.jsonl`` (``text``, ``label`` = package, ``module``), ``train.jsonl`` /
  ``dev.jsonl`` / ``test.jsonl`` (the same, split by group), ``new.jsonl`` (texts to predict),
  ``pairs.csv`` (``premise``, ``hypothesis``, ``label``: same package or not), ``sts.tsv``
  (``sentence1``, ``sentence2``, ``label``: 5 × the two word sets' Jaccard similarity),
  ``ner.conll`` (a word and a BIO tag per line: ``B-CODE`` for a word that is code);
  ``query_pairs.jsonl`` (``query``, ``positive``: a docstring's first sentence and the rest,
  for ``clozax embed --pairs``) and ``beir/`` (the same construction in BEIR's layout:
  ``corpus.jsonl``, ``queries.jsonl``, ``qrels/test.tsv``), from modules on two sides of a
  keyed split, so the pairs hold no text of the retrieval set.

They teach the commands, not the model: the labels are simple functions of the text. Files that
need an optional package (``.zst``: zstandard; arrow: pyarrow) are skipped, and said, without it.
"""

from __future__ import annotations

import csv
import io
import json
import re
from collections import Counter
from pathlib import Path

from clozax.data.pairs import first_sentence
from clozax.data.readers import RawDocument
from clozax.data.split import group_key
from clozax.data.stdlib import read_stdlib

PRETRAINING_SHARE = 0.6  # of the built-in corpus's module files
MAX_PRETRAINING_DOCS = 3000
MAX_CHARS = 1500  # per example document (the first paragraphs of a long docstring)
TASK_CLASSES, PER_CLASS = 6, 80
QUERIES = 300  # the BEIR-layout set's queries
NAMES = ("texts", "book.txt", "dump.jsonl", "dump.jsonl.zst", "crawl", "hf_saved_dataset",
         "labels.jsonl", "train.jsonl", "dev.jsonl", "test.jsonl", "new.jsonl", "pairs.csv",
         "sts.tsv", "ner.conll", "query_pairs.jsonl", "beir")
_CODE_WORD = re.compile(r"^`*(\w+\(\)|\w+_\w+|\w+\.\w+\w)`*[.,:;]?$")


def write_examples(out: Path) -> list[tuple[str, str]]:
    """Write every example file under ``out``; ``(name, what)`` per file written or skipped.
    Refuses (``ValueError``) when one of them is there already: nothing of yours is mixed in
    or replaced."""
    there = [name for name in NAMES if (out / name).exists()]
    if there:
        raise ValueError(f"{out / there[0]} already exists; clozax examples writes "
                         f"{', '.join(NAMES)}: give it a directory without them")
    pretraining, task = _split(_documents())
    out.mkdir(parents=True, exist_ok=True)
    written = (_pretraining_files(out, pretraining) + _task_files(out, task)
               + _retrieval_files(out, task))
    return written


def _documents() -> list[RawDocument]:
    docs = []
    for record in read_stdlib():
        if isinstance(record, RawDocument) and len(record.text.split()) >= 5:
            docs.append(RawDocument(_head(record.text), record.group, record.label,
                                    record.source))
    return docs


def _head(text: str) -> str:
    """Whole paragraphs of ``text`` up to ``MAX_CHARS`` (at least the first)."""
    kept, size = [], 0
    for paragraph in text.split("\n\n"):
        if kept and size + len(paragraph) > MAX_CHARS:
            break
        kept.append(paragraph)
        size += len(paragraph) + 2
    return "\n\n".join(kept).strip()


def _share(key: str) -> float:
    """A uniform number in [0, 1) from ``key`` (the split's keyed hash, seed 0)."""
    return group_key(key, 0) / 2.0**64


def _split(docs: list[RawDocument]) -> tuple[list[RawDocument], list[RawDocument]]:
    """By module file; a task document whose text a corpus document also has (the same
    docstring in two modules) is left out."""
    pretraining = [d for d in docs if _share("examples:" + d.group) < PRETRAINING_SHARE]
    pretraining = pretraining[:MAX_PRETRAINING_DOCS]
    seen = {_normal(d.text) for d in pretraining}
    task = [d for d in docs if _share("examples:" + d.group) >= PRETRAINING_SHARE
            and _normal(d.text) not in seen]
    return pretraining, task


def _normal(text: str) -> str:
    return " ".join(text.lower().split())


def _pretraining_files(out: Path, docs: list[RawDocument]) -> list[tuple[str, str]]:
    texts, counters = out / "texts", Counter()
    for d in docs:  # one file per document, in a directory per package (its label)
        module = d.group.removesuffix(".py").replace("/", ".")
        counters[module] += 1
        path = texts / d.label / f"{module}-{counters[module]:03d}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(d.text + "\n")
    (out / "book.txt").write_text("\n\n".join(d.text.replace("\n\n", "\n") for d in docs) + "\n")
    rows = [{"body": d.text, "site": d.group, "label": d.label} for d in docs]
    _write_jsonl(out / "dump.jsonl", rows)
    written = [("texts/", f"{len(docs)} .txt files, one docstring each, in "
                          f"{len({d.label for d in docs})} directories (label: the package)"),
               ("book.txt", f"{len(docs)} paragraphs"),
               ("dump.jsonl", f"{len(rows)} records: body, site, label")]
    written += _compressed(out, rows) + _arrow(out, docs)
    return written


def _compressed(out: Path, rows: list[dict]) -> list[tuple[str, str]]:
    try:
        import zstandard
    except ImportError:
        return [("dump.jsonl.zst, crawl/", "skipped: pip install 'clozax[zstd]'")]
    compress = zstandard.ZstdCompressor().compress
    (out / "dump.jsonl.zst").write_bytes(compress(_jsonl_bytes(rows)))
    half = len(rows) // 2
    for part, chunk in enumerate((rows[:half], rows[half:])):
        (out / "crawl" / f"part-{part}").mkdir(parents=True, exist_ok=True)
        records = [{"text": r["body"]} for r in chunk]
        (out / "crawl" / f"part-{part}" / "docs.jsonl.zst").write_bytes(
            compress(_jsonl_bytes(records)))
    return [("dump.jsonl.zst", "dump.jsonl, zstd-compressed"),
            ("crawl/", "2 .jsonl.zst files (field text) in two directories")]


def _arrow(out: Path, docs: list[RawDocument]) -> list[tuple[str, str]]:
    try:
        import pyarrow as pa
    except ImportError:
        return [("hf_saved_dataset/", "skipped: pip install 'clozax[parquet]'")]
    table = pa.table({"text": [d.text for d in docs], "label": [d.label for d in docs]})
    (out / "hf_saved_dataset").mkdir(exist_ok=True)
    with pa.OSFile(str(out / "hf_saved_dataset" / "data-00000-of-00001.arrow"), "wb") as sink, \
            pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return [("hf_saved_dataset/", f"an arrow stream of {len(docs)} rows: text, label")]


def _task_files(out: Path, docs: list[RawDocument]) -> list[tuple[str, str]]:
    counts = Counter(d.label for d in docs)
    classes = sorted(sorted(counts, key=lambda c: (-counts[c], c))[:TASK_CLASSES])
    taken: Counter = Counter()
    labelled = []
    for d in docs:
        if d.label in classes and taken[d.label] < PER_CLASS:
            taken[d.label] += 1
            labelled.append({"text": d.text, "label": d.label, "module": d.group})
    _write_jsonl(out / "labels.jsonl", labelled)
    splits: dict[str, list[dict]] = {"train": [], "dev": [], "test": []}
    for row in labelled:
        share = _share("split:" + row["module"])
        splits["train" if share < 0.5 else "dev" if share < 0.75 else "test"].append(row)
    for name, rows in splits.items():
        _write_jsonl(out / f"{name}.jsonl", rows)
    _write_jsonl(out / "new.jsonl", [{"text": r["text"]} for r in splits["test"][:20]])
    sentences = [_first_sentence(d.text) for d in docs]
    pairs = _write_table(out / "pairs.csv", _pairs(docs, sentences))
    sts = _write_table(out / "sts.tsv", _similarity(sentences))
    ner = _write_conll(out / "ner.conll", sentences)
    return [("labels.jsonl", f"{len(labelled)} texts, {len(classes)} labels (package)"),
            ("train.jsonl dev.jsonl test.jsonl",
             " / ".join(str(len(splits[s])) for s in splits) + " of them, split by module"),
            ("new.jsonl", "20 texts without labels"),
            ("pairs.csv", f"{pairs} pairs: premise, hypothesis, label (same package or not)"),
            ("sts.tsv", f"{sts} pairs: sentence1, sentence2, label (0-5 word overlap)"),
            ("ner.conll", f"{ner} sentences, BIO tags (B-CODE: a word that is code)")]


def _retrieval_files(out: Path, docs: list[RawDocument]) -> list[tuple[str, str]]:
    """A pair file from half the task modules, a BEIR-layout set from the other half."""
    split = {True: [], False: []}
    for d in docs:
        pair = first_sentence(d.text)
        if pair is not None:
            split[_share("retrieval:" + d.group) < 0.5].append((d, pair))
    _write_jsonl(out / "query_pairs.jsonl", [{"query": q, "positive": p}
                                             for _, (q, p) in split[True]])
    # a docstring two modules share (the same text on both sides) stays with the pairs
    seen = {_normal(t) for _, pair in split[True] for t in pair}
    beir = out / "beir"
    held = [(d, pair) for d, pair in split[False] if not {_normal(t) for t in pair} & seen]
    (beir / "qrels").mkdir(parents=True, exist_ok=True)
    _write_jsonl(beir / "corpus.jsonl", [{"_id": f"d{i}", "title": "", "text": p}
                                         for i, (_, (_, p)) in enumerate(held)])
    asked = held[:QUERIES]
    _write_jsonl(beir / "queries.jsonl", [{"_id": f"q{i}", "text": q}
                                          for i, (_, (q, _)) in enumerate(asked)])
    (beir / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\n" + "".join(
        f"q{i}\td{i}\t1\n" for i in range(len(asked))))
    return [("query_pairs.jsonl", f"{len(split[True])} query/positive pairs (first sentence "
                                  "↔ the rest)"),
            ("beir/", f"{len(asked)} queries over {len(held)} documents, BEIR's layout "
                      "(other modules than the pairs')")]


def _first_sentence(text: str) -> str:
    line = " ".join(text.split("\n\n")[0].split())
    return line.split(". ")[0].rstrip(".")


def _pairs(docs: list[RawDocument], sentences: list[str], n: int = 400) -> list[dict]:
    """A sentence and its neighbour (often the same module) or a keyed-random one."""
    rows = []
    for i in range(min(n, len(docs) - 1)):
        j = i + 1 if i % 2 == 0 else int(_share(f"pair:{i}") * len(docs))
        rows.append({"premise": sentences[i], "hypothesis": sentences[j],
                     "label": "same" if docs[i].label == docs[j].label else "different"})
    return rows


def _similarity(sentences: list[str], n: int = 300) -> list[dict]:
    """A sentence and its first half (every third) or a keyed-random one; the score is 5 x
    the Jaccard similarity of their lowercased word sets."""
    rows = []
    for i in range(min(n, len(sentences))):
        a = sentences[i]
        b = " ".join(a.split()[: max(1, len(a.split()) // 2)]) if i % 3 == 0 else \
            sentences[int(_share(f"sts:{i}") * len(sentences))]
        x, y = set(a.lower().split()), set(b.lower().split())
        rows.append({"sentence1": a, "sentence2": b,
                     "label": f"{5 * len(x & y) / max(1, len(x | y)):.2f}"})
    return rows


def _write_conll(path: Path, sentences: list[str], n: int = 300) -> int:
    """Sentences with at least one word that is code (``name()``, ``a_b``, ``a.b``) first."""
    coded = [s for s in sentences if any(_CODE_WORD.match(w) for w in s.split()[:40])]
    seen = set(coded)
    blocks = []
    for sentence in (coded + [s for s in sentences if s not in seen])[:n]:
        words = sentence.split()[:40]
        blocks.append("\n".join(f"{w} {'B-CODE' if _CODE_WORD.match(w) else 'O'}"
                                for w in words))
    path.write_text("\n\n".join(blocks) + "\n")
    return len(blocks)


def _write_table(path: Path, rows: list[dict]) -> int:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(rows[0]),
                            delimiter="\t" if path.suffix == ".tsv" else ",")
    writer.writeheader()
    writer.writerows(rows)
    path.write_text(buffer.getvalue())
    return len(rows)


def _jsonl_bytes(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode()


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_bytes(_jsonl_bytes(rows))
