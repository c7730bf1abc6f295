"""The retrieval set a run is judged on when the user gives none: built from the dataset's
*held-out* split only, so no query or document is text the encoder or a contrastive stage
trained on (corpus pairs come from the train split).

Construction ``first-sentence→rest`` (named and keyed like the frozen eval-mask set, and
recorded with its digest): each held-out document that has a first sentence and a rest of at
least ``MIN_WORDS`` words each (``data/pairs.py`` ``first_sentence``) puts its rest in the
collection; a keyed sample of at most ``max_queries`` of them asks its first sentence, whose one
relevant document (grade 1) is its own rest. Held-out documents too short to split join the
collection whole, as distractors.

``split="validation"``: the same construction over the train split's validation tenth (a
keyed tenth of its groups, ``data/pairs.py`` ``in_validation``), which a stage told to
(``withhold_validation``) leaves out of its pairs and its mined negatives: what ``clozax
retrieval --learning-rates`` chooses the stage's peak on, so the held-out split is scored once,
with the setting chosen.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from clozax.data.pairs import MIN_WORDS, document_texts, first_sentence
from clozax.data.split import group_key
from clozax.data.tokenizer import load_tokenizer
from clozax.judge.retrieval.beir import RetrievalSet
from clozax.train.run_dir import LoadedRun, open_run_dataset

CONSTRUCTION = "first-sentence→rest"
MAX_QUERIES = 500
SPLITS = ("heldout", "validation")


def heldout_set(run: LoadedRun, key: int = 0, max_queries: int = MAX_QUERIES,
                data: str | None = None, split: str = "heldout") -> tuple[RetrievalSet, dict]:
    """The set and its description (construction, split, key, sizes, digest); ``data``: an
    imported run's dataset (it has none of its own); ``split``: one of ``SPLITS``."""
    if split not in SPLITS:
        raise ValueError(f"unknown retrieval split {split!r}; choose one of {', '.join(SPLITS)}")
    dataset = open_run_dataset(run, None if data is None else Path(data))
    tokenizer = load_tokenizer(run.tokenizer_path)
    texts = (document_texts(dataset, "heldout", tokenizer) if split == "heldout" else
             document_texts(dataset, "train", tokenizer, validation=True))
    documents, askable = {}, []
    for doc_id, text in texts:
        pair = first_sentence(text)
        if pair is None:
            if len(text.split()) >= MIN_WORDS:
                documents[doc_id] = " ".join(text.split())
            continue
        documents[doc_id] = pair[1]
        askable.append((group_key(f"query:{doc_id}", key), doc_id, pair[0]))
    askable.sort()
    chosen = askable[:max_queries]
    if len(chosen) < 2:
        where = ("held-out split" if split == "heldout" else
                 "train split's validation tenth")
        raise ValueError(f"dataset {dataset.path}'s {where} has {len(chosen)} document(s) "
                         "with a first sentence and a rest to ask; prepare a larger corpus or "
                         "a larger --heldout-fraction, or pass --beir DIR")
    queries = {f"q-{doc_id}": head for _, doc_id, head in chosen}
    qrels = {f"q-{doc_id}": {doc_id: 1} for _, doc_id, _ in chosen}
    found = RetrievalSet(documents, queries, qrels)
    digest = hashlib.sha256(json.dumps([documents, queries, qrels], sort_keys=True,
                                       ensure_ascii=False).encode()).hexdigest()
    return found, {"construction": CONSTRUCTION, "split": split, "key": key,
                   "dataset": str(dataset.path), "queries": len(queries),
                   "documents": len(documents), "sha256": digest}
