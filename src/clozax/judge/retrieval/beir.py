"""A retrieval set in BEIR's layout on disk: ``corpus.jsonl`` (``_id``, ``title``, ``text``),
``queries.jsonl`` (``_id``, ``text``) and ``qrels/SPLIT.tsv`` (``query-id``, ``corpus-id``,
``score``, with a header row), as BEIR's ``GenericDataLoader`` reads them. A document's text is
its title and its text joined by a space, as BEIR's dense models encode it.

Bad input is one ``ValueError`` line naming the file (and line) and the fix: a missing file, a
malformed line, a duplicate id, an empty corpus, queries without qrels, qrels naming a query or
document that is not there; a ``title`` or ``text`` that is not a string (absent or ``null`` is
empty); a judged query whose text is empty; a score that is not an integer grade (``1.7``:
BEIR's loader reads grades with ``int``; ``2.0`` is read as 2); a (query, document) pair judged
on two rows (BEIR's loader would keep the last silently; a repeated row is almost always a
mistake, so it is refused, naming both lines). Grades may be negative (scored as
``metrics.py`` says).
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path

from clozax.core import files


@dataclass(frozen=True)
class RetrievalSet:
    """Documents and queries by id, and the graded judgements of the queries scored."""

    documents: dict[str, str]
    queries: dict[str, str]
    qrels: dict[str, dict[str, int]]


def read_beir(directory: Path, split: str = "test") -> RetrievalSet:
    """The set in ``directory``; only the queries the ``split``'s qrels judge."""
    directory = Path(directory)
    paths = {"corpus": directory / "corpus.jsonl", "queries": directory / "queries.jsonl",
             "qrels": directory / "qrels" / f"{split}.tsv"}
    for path in paths.values():
        if not path.is_file():
            raise ValueError(f"{path} is missing; a BEIR folder holds corpus.jsonl, "
                             f"queries.jsonl and qrels/{split}.tsv")
    documents = {}
    for i, r, number in _records(paths["corpus"]):
        title, text = (_text(r, field, paths["corpus"], number) for field in ("title", "text"))
        documents[i] = " ".join(t for t in (title, text) if t)
    if not documents:
        raise ValueError(f"{paths['corpus']} has no document; give one JSON object per line "
                         "with _id and text")
    queries = {i: (_text(r, "text", paths["queries"], number), number)
               for i, r, number in _records(paths["queries"])}
    qrels = _qrels(paths["qrels"])
    for query, judged in qrels.items():
        if query not in queries:
            raise ValueError(f"{paths['qrels']} judges query {query!r}, which "
                             f"{paths['queries'].name} does not have; add it or remove its "
                             "rows")
        text, number = queries[query]
        if not text.strip():
            raise ValueError(f"{paths['queries']}:{number} query {query!r} has an empty text "
                             "and is judged in the qrels; give it its text or remove its rows")
        missing = next((d for d in judged if d not in documents), None)
        if missing is not None:
            raise ValueError(f"{paths['qrels']} names document {missing!r} for query "
                             f"{query!r}, which {paths['corpus'].name} does not have; add it "
                             "or remove the row")
    if not any(g >= 1 for judged in qrels.values() for g in judged.values()):
        raise ValueError(f"{paths['qrels']} judges no document relevant (score >= 1); "
                         "queries without relevant documents cannot be scored")
    return RetrievalSet(documents, {q: queries[q][0] for q in qrels}, qrels)


def _records(path: Path):
    seen = set()
    for number, record in files.json_objects(path):
        if "_id" not in record:
            raise ValueError(f"{path}:{number} has no _id; every line of a BEIR file needs "
                             "one")
        key = str(record["_id"])
        if key in seen:
            raise ValueError(f"{path}:{number} repeats _id {key!r}; ids must be unique")
        seen.add(key)
        yield key, record, number


def _text(record: dict, field: str, path: Path, number: int) -> str:
    """``record[field]`` as a string: absent or null is empty, anything else but a string is
    an error naming the line."""
    value = record.get(field)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ValueError(f"{path}:{number} has a {field} that is not a string "
                         f"({type(value).__name__} {str(value)[:40]!r}); write it as a JSON "
                         "string")
    return value


def _qrels(path: Path) -> dict[str, dict[str, int]]:
    qrels: dict[str, dict[str, int]] = {}
    lines: dict[tuple[str, str], int] = {}
    with path.open(encoding="utf-8", newline="") as f:
        rows = csv.reader(f, delimiter="\t")
        header = next(rows, None)
        if header is None or [h.strip() for h in header[:3]] != ["query-id", "corpus-id",
                                                                 "score"]:
            raise ValueError(f"{path} must start with the header query-id, corpus-id, score "
                             "(tab-separated), as BEIR's qrels do")
        for number, row in enumerate(rows, 2):
            if not row:
                continue
            try:
                query, doc, score = row[0], row[1], float(row[2])
            except (IndexError, ValueError):
                raise ValueError(f"{path}:{number} is not query-id, corpus-id, score; fix or "
                                 "remove the line") from None
            if not math.isfinite(score) or not score.is_integer():
                raise ValueError(f"{path}:{number} has score {row[2].strip()!r}, which is not "
                                 "an integer grade; qrels grades are integers (0 = not "
                                 "relevant, 1, 2, ... = more relevant)")
            if (query, doc) in lines:
                raise ValueError(f"{path}:{number} judges query {query!r} and document "
                                 f"{doc!r} again (first on line {lines[query, doc]}); keep "
                                 "one row per pair")
            lines[query, doc] = number
            qrels.setdefault(query, {})[doc] = int(score)
    if not qrels:
        raise ValueError(f"{path} has no judgement; queries without qrels cannot be scored")
    return qrels
