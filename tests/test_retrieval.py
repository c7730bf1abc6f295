"""Retrieval metrics as trec_eval defines them (checked against pytrec_eval, the trec_eval that
BEIR calls), exact top-k search in blocks, and BEIR's layout read with one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from clozax.data.bm25 import bm25_run
from clozax.judge.retrieval import metrics, search
from clozax.judge.retrieval.beir import read_beir

pytestmark = pytest.mark.fast

# A hand-made set: graded judgements (0 = judged not relevant), ties in the run, a query whose
# relevant document is not retrieved, one with no relevant document (scored 0, as pytrec_eval).
QRELS = {
    "q1": {"d1": 2, "d2": 1, "d3": 0, "d9": 1},
    "q2": {"d4": 1},
    "q3": {"d7": 3, "d8": 1},
    "q4": {"d2": 0},
}
RUN = {
    "q1": {"d3": 0.9, "d1": 0.8, "d5": 0.8, "d2": 0.8, "d6": 0.1},
    "q2": {"d1": 0.5, "d2": 0.4},
    "q3": {"d8": 1.0, "d7": 1.0, "d1": 0.2},
    "q4": {"d2": 0.3},
}


def _reference(qrels, run, measures):
    pytrec_eval = pytest.importorskip("pytrec_eval", reason="pip install pytrec-eval-terrier")
    return pytrec_eval.RelevanceEvaluator(qrels, measures).evaluate(run)


def test_ndcg_recall_and_mrr_equal_trec_evals_on_a_hand_made_set_with_ties():
    ours = metrics.per_query(QRELS, RUN, k_recall=100)
    full = _reference(QRELS, RUN, {"ndcg_cut.10", "recall.100"})
    assert set(ours) == set(full) == {"q1", "q2", "q3", "q4"}  # q4: judged grade 0 only
    for q in ours:
        assert ours[q]["ndcg@10"] == pytest.approx(full[q]["ndcg_cut_10"], abs=1e-12)
        assert ours[q]["recall@100"] == pytest.approx(full[q]["recall_100"], abs=1e-12)
    cut = {q: dict(sorted(s.items(), key=lambda x: (x[1], x[0]), reverse=True)[:2])
           for q, s in RUN.items()}  # MRR@2: trec_eval's recip_rank on the run cut at 2
    reference = _reference(QRELS, cut, {"recip_rank"})
    ours = metrics.per_query(QRELS, RUN, k_mrr=2)
    for q in ours:
        assert ours[q]["mrr@2"] == pytest.approx(reference[q]["recip_rank"], abs=1e-12)


def test_metrics_equal_trec_evals_on_random_graded_runs():
    rng = np.random.default_rng(0)
    docs = [f"d{i}" for i in range(60)]
    qrels = {f"q{j}": {d: int(rng.integers(-1, 3)) for d in rng.choice(docs, 8, replace=False)}
             for j in range(30)}  # grades -1 (judged harmful), 0, 1, 2
    run = {q: {d: float(np.round(rng.random(), 2)) for d in docs} for q in qrels}  # ties
    ours = metrics.per_query(qrels, run, k_ndcg=10, k_recall=20)
    full = _reference(qrels, run, {"ndcg_cut.10", "recall.20"})
    assert set(ours) == set(full) == set(qrels)
    for q in ours:
        assert ours[q]["ndcg@10"] == pytest.approx(full[q]["ndcg_cut_10"], abs=1e-12)
        assert ours[q]["recall@20"] == pytest.approx(full[q]["recall_20"], abs=1e-12)


def test_a_negatively_graded_document_is_a_gain_of_0_as_trec_eval_has_it():
    qrels = {"q1": {"d1": -1, "d2": 1}}
    run = {"q1": {"d1": 0.9, "d2": 0.8}}  # the -1 document first, the relevant one second
    ours = metrics.per_query(qrels, run)["q1"]["ndcg@10"]
    assert ours == pytest.approx(1 / np.log2(3), abs=1e-12)  # not (-1 + 1/log2 3) = -0.37
    full = _reference(qrels, run, {"ndcg_cut.10"})
    assert ours == pytest.approx(full["q1"]["ndcg_cut_10"], abs=1e-12)


def test_a_query_judged_only_grade_0_scores_0_and_counts_in_the_mean():
    qrels = {"q1": {"d1": 1}, "q2": {"d1": 0, "d2": 0}}
    run = {"q1": {"d1": 0.9}, "q2": {"d1": 0.9, "d2": 0.8}}
    ours = metrics.per_query(qrels, run)
    assert ours["q2"] == {"ndcg@10": 0.0, "mrr@10": 0.0, "recall@100": 0.0}
    assert metrics.mean(ours) == {"ndcg@10": 0.5, "mrr@10": 0.5, "recall@100": 0.5}
    full = _reference(qrels, run, {"ndcg_cut.10", "recall.100"})  # BEIR: the mean of these
    assert metrics.mean(ours)["ndcg@10"] == pytest.approx(
        np.mean([r["ndcg_cut_10"] for r in full.values()]), abs=1e-12)


def test_a_query_with_an_empty_ranking_scores_0_and_one_without_a_ranking_is_not_scored():
    qrels = {"q1": {"d1": 1}, "q2": {"d1": 1}, "q3": {"d1": 1}}
    run = {"q1": {"d1": 0.9}, "q2": {}}
    ours = metrics.per_query(qrels, run)
    assert set(ours) == set(_reference(qrels, run, {"ndcg_cut.10"})) == {"q1", "q2"}
    assert ours["q2"]["ndcg@10"] == 0.0


def test_blocked_top_k_equals_the_full_sort_for_any_block_size():
    rng = np.random.default_rng(1)
    queries, documents = rng.normal(size=(7, 16)), rng.normal(size=(103, 16))
    documents[50] = documents[10]  # a tie: the lower index first
    scores = queries.astype(np.float32) @ documents.astype(np.float32).T
    expected = np.lexsort((np.broadcast_to(np.arange(103), scores.shape), -scores), axis=1)
    for block in (1, 7, 64, 103, 500):
        s, i = search.top_k(queries, search.blocks(documents, block), k=12)
        assert np.array_equal(i, expected[:, :12])
        assert np.allclose(s, np.take_along_axis(scores, expected[:, :12], 1))
    s, i = search.top_k(queries, search.blocks(documents[:5], 2), k=12)
    assert i.shape == (7, 5)


def test_a_dense_ranking_leaves_out_the_document_whose_id_is_the_querys_and_keeps_k():
    documents = np.eye(4)  # d0..d3; the query "d0" is d0 itself, then d1, d2, d3 in turn
    query = np.array([[1.0, 0.75, 0.5, 0.25]])  # exact in float32
    scores, index = search.top_k(query, search.blocks(documents, 2), k=3)  # k + 1
    doc_ids = ["d0", "d1", "d2", "d3"]
    assert search.as_run(["d0"], doc_ids, scores, index, k=2) == {"d0": {"d1": 0.75, "d2": 0.5}}
    assert search.as_run(["d0"], doc_ids, scores, index, k=2, keep_identical_ids=True) == {
        "d0": {"d0": 1.0, "d1": 0.75}}


def test_the_dense_row_scores_an_arguana_style_set_without_its_self_hits(monkeypatch):
    from types import SimpleNamespace

    from clozax.judge.retrieval import compare
    from clozax.judge.retrieval.beir import RetrievalSet

    # Each query is itself a document of the collection (same id, same text), as in ArguAna;
    # its relevant document is the next most similar one.
    vectors = {"argument a": [1.0, 0.0, 0.0], "counter a": [0.8, 0.6, 0.0],
               "unrelated": [0.0, 0.0, 1.0]}
    monkeypatch.setattr(compare, "encode", lambda params, config, run, texts, *_: np.array(
        [vectors[t] for t in texts], np.float32))
    monkeypatch.setattr(compare, "DEPTH", 1)
    found = RetrievalSet({"a": "argument a", "b": "counter a", "c": "unrelated"},
                         {"a": "argument a"}, {"a": {"b": 1}})
    scores = compare.dense_scores(None, None, SimpleNamespace(trained_length=16), found, 16,
                                  "mean")
    assert scores == {"ndcg@10": 1.0, "mrr@10": 1.0, "recall@100": 1.0}


def _beir(tmp_path: Path, corpus=None, queries=None, qrels=None) -> Path:
    d = tmp_path / "set"
    (d / "qrels").mkdir(parents=True)
    corpus = corpus if corpus is not None else [
        {"_id": "d1", "title": "Paris", "text": "the capital of France"},
        {"_id": "d2", "title": "", "text": "a river"}]
    queries = queries if queries is not None else [{"_id": "q1", "text": "capital of france"},
                                                   {"_id": "q2", "text": "unjudged"}]
    (d / "corpus.jsonl").write_text("".join(json.dumps(r) + "\n" for r in corpus))
    (d / "queries.jsonl").write_text("".join(json.dumps(r) + "\n" for r in queries))
    (d / "qrels" / "test.tsv").write_text(
        qrels if qrels is not None else "query-id\tcorpus-id\tscore\nq1\td1\t1\nq1\td2\t0\n")
    return d


def test_a_beir_folder_reads_title_and_text_and_only_judged_queries(tmp_path):
    s = read_beir(_beir(tmp_path))
    assert s.documents == {"d1": "Paris the capital of France", "d2": "a river"}
    assert s.queries == {"q1": "capital of france"}
    assert s.qrels == {"q1": {"d1": 1, "d2": 0}}


@pytest.mark.parametrize("case, words", [
    ("no qrels file", "qrels/test.tsv is missing"),
    ("empty corpus", "has no document"),
    ("no judgement", "has no judgement"),
    ("unknown query", "judges query 'q9'"),
    ("unknown document", "names document 'd9'"),
    ("no relevant", "judges no document relevant"),
    ("bad header", "must start with the header"),
    ("duplicate id", "repeats _id 'd1'"),
    ("no id", "corpus.jsonl:1 has no _id"),
    ("not json", "queries.jsonl:1 is not valid JSON"),
    ("title not a string", "corpus.jsonl:2 has a title that is not a string"),
    ("text not a string", "corpus.jsonl:1 has a text that is not a string"),
    ("query not a string", "queries.jsonl:1 has a text that is not a string"),
    ("empty query", "queries.jsonl:1 query 'q1' has an empty text"),
    ("fractional score", "test.tsv:2 has score '1.7', which is not an integer grade"),
    ("repeated judgement", "test.tsv:3 judges query 'q1' and document 'd1' again \\(first on "
                           "line 2\\)"),
])
def test_a_bad_beir_folder_is_one_line_naming_the_file(tmp_path, case, words):
    head = "query-id\tcorpus-id\tscore\n"
    d = {
        "no qrels file": lambda: _beir(tmp_path),
        "empty corpus": lambda: _beir(tmp_path, corpus=[]),
        "no judgement": lambda: _beir(tmp_path, qrels=head),
        "unknown query": lambda: _beir(tmp_path, qrels=head + "q9\td1\t1\n"),
        "unknown document": lambda: _beir(tmp_path, qrels=head + "q1\td9\t1\n"),
        "no relevant": lambda: _beir(tmp_path, qrels=head + "q1\td1\t0\n"),
        "bad header": lambda: _beir(tmp_path, qrels="q1\td1\t1\n"),
        "duplicate id": lambda: _beir(tmp_path, corpus=[{"_id": "d1", "text": "a"},
                                                        {"_id": "d1", "text": "b"}]),
        "no id": lambda: _beir(tmp_path, corpus=[{"text": "a"}]),
        "not json": lambda: _beir(tmp_path),
        "title not a string": lambda: _beir(tmp_path, corpus=[
            {"_id": "d1", "text": "a"}, {"_id": "d2", "title": 5, "text": "b"}]),
        "text not a string": lambda: _beir(tmp_path, corpus=[{"_id": "d1", "text": ["a"]}]),
        "query not a string": lambda: _beir(tmp_path, queries=[{"_id": "q1", "text": 3}]),
        "empty query": lambda: _beir(tmp_path, queries=[{"_id": "q1", "text": " "}]),
        "fractional score": lambda: _beir(tmp_path, qrels=head + "q1\td1\t1.7\n"),
        "repeated judgement": lambda: _beir(tmp_path, qrels=head + "q1\td1\t1\nq1\td1\t0\n"),
    }[case]()
    if case == "not json":
        (d / "queries.jsonl").write_text("{not json\n")
    if case == "no qrels file":
        (d / "qrels" / "test.tsv").unlink()
    with pytest.raises(ValueError, match=words) as e:
        read_beir(d)
    assert "\n" not in str(e.value)


def test_a_beir_folder_reads_integer_grades_negative_ones_and_null_titles(tmp_path):
    s = read_beir(_beir(tmp_path, corpus=[{"_id": "d1", "title": None, "text": "a"},
                                          {"_id": "d2", "text": "b"}],
                        qrels="query-id\tcorpus-id\tscore\nq1\td1\t2.0\nq1\td2\t-1\n"))
    assert s.documents == {"d1": "a", "d2": "b"}
    assert s.qrels == {"q1": {"d1": 2, "d2": -1}}


DOCUMENTS = {"d1": "the cat sat on the mat", "d2": "a dog in the fog",
             "d3": "cats and dogs and a zebra", "d4": "a zebra crossing the road"}


def test_bm25_ranks_first_the_document_that_shares_the_querys_words():
    pytest.importorskip("bm25s", reason="pip install 'clozax[retrieval]'")
    run = bm25_run(DOCUMENTS, {"q1": "zebra road", "q2": "dog fog"}, k=10)
    assert metrics.ranked(run["q1"])[0] == "d4" and metrics.ranked(run["q2"])[0] == "d2"


def test_bm25_ranks_only_the_documents_that_match_the_query():
    pytest.importorskip("bm25s", reason="pip install 'clozax[retrieval]'")
    run = bm25_run(DOCUMENTS, {"q1": "zebra road", "q2": "parliament"}, k=10)
    assert metrics.ranked(run["q1"]) == ["d4", "d3"]  # no score-0 filler in id order
    assert run["q2"] == {}  # nothing matches: an empty ranking, scored 0


def test_bm25_leaves_out_the_document_whose_id_is_the_querys_and_keeps_k():
    pytest.importorskip("bm25s", reason="pip install 'clozax[retrieval]'")
    run = bm25_run(DOCUMENTS, {"d4": "zebra road"}, k=1)
    assert list(run["d4"]) == ["d3"]
    assert list(bm25_run(DOCUMENTS, {"d4": "zebra road"}, k=1, keep_identical_ids=True)["d4"]) \
        == ["d4"]
