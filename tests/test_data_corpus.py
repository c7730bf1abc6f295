"""Reading, cleaning, accounting and the document-level split."""

from __future__ import annotations

import json
import random
import sys

import pytest

from clozax.data import open_dataset, prepare, readers
from clozax.data.corpus import Accounting, clean, normalise
from clozax.data.pieces import read_corpus
from clozax.data.readers import FieldNames, RawDocument, Skip
from clozax.data.split import HELDOUT, TRAIN, assign_split, group_key
from clozax.data.stdlib import read_stdlib

pytestmark = pytest.mark.fast  # make test-fast; tests marked slow stay out

WORDS = "alpha beta gamma delta epsilon zeta theta kappa lambda omicron sigma omega".split()


def _sentence(rng: random.Random, n: int = 12) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n)) + "."


def _bad_corpus(root):
    """One of every kind of bad input next to a few good documents."""
    (root / "sub").mkdir(parents=True)
    (root / "good.txt").write_text("A good   document.\r\nSecond line.\n")
    (root / "sub" / "good2.md").write_text("# Title\n\nAnother good document.")
    (root / "dup.txt").write_text("A good document.\nSecond line.")  # dup after normalising
    (root / "blank.txt").write_text("  \n\t \n")
    (root / "binary.txt").write_bytes(b"abc\x00def")
    (root / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (root / "ignored.bin").write_bytes(b"\x00\x01")  # unsupported suffix: not a document
    lines = [
        json.dumps({"text": "jsonl one"}),
        "{not json",
        json.dumps({"body": "no text field"}),
        json.dumps(["not", "an", "object"]),
        "",
        json.dumps({"text": "jsonl one"}),  # duplicate
        json.dumps({"text": 7}),
    ]
    (root / "data.jsonl").write_text("\n".join(lines) + "\n")
    (root / "locked.txt").write_text("secret")  # made unreadable by _deny_reading
    return root


@pytest.fixture
def _deny_reading(monkeypatch):
    """Make ``locked.txt`` unreadable even when the tests run as root."""
    real = readers.open_bytes

    def open_bytes(path):
        if path.name == "locked.txt":
            raise PermissionError(13, "Permission denied", str(path))
        return real(path)

    monkeypatch.setattr(readers, "open_bytes", open_bytes)


def test_normalise_unifies_line_endings_and_whitespace_runs():
    assert normalise("a \t b\r\nc\rd\n\n\n\ne  ") == "a b\nc\nd\n\ne"
    assert normalise(" \n\t ") == ""


def test_accounting_identity_holds_on_a_corpus_with_every_kind_of_bad_file(
        tmp_path, _deny_reading):
    root = _bad_corpus(tmp_path / "c")
    accounting = Accounting()
    kept = list(clean(read_corpus(str(root), FieldNames(), strict=False), accounting))
    accounting.check()
    assert accounting.read == accounting.kept + accounting.duplicates + accounting.skipped
    assert [d.text for d in kept] == ["jsonl one", "A good document.\nSecond line.",
                                      "# Title\n\nAnother good document."]
    assert accounting.duplicates == 2
    reasons = {s["source"]: s["reason"] for s in accounting.skips}
    assert reasons["binary.txt"].startswith("binary content")
    assert reasons["latin1.txt"].startswith("invalid UTF-8")
    assert reasons["blank.txt"].startswith("empty")
    assert reasons["data.jsonl:2"].startswith("not valid JSON")
    assert reasons["data.jsonl:3"] == "lacks text field 'text'"
    assert reasons["data.jsonl:4"].startswith("not a JSON object")
    assert reasons["data.jsonl:7"].startswith("has a non-string")
    assert reasons["locked.txt"] == "unreadable (Permission denied)"
    assert "ignored.bin" not in reasons


def test_strict_turns_the_first_skip_into_an_error(tmp_path):
    root = _bad_corpus(tmp_path / "c")
    with pytest.raises(ValueError, match="--strict"):
        list(clean(read_corpus(str(root), FieldNames(), strict=True), Accounting()))


def test_stdlib_reader_yields_docstrings_grouped_by_module_without_tests():
    records = list(read_stdlib())
    docs = [r for r in records if isinstance(r, RawDocument)]
    assert len(docs) > 3000
    assert all(isinstance(r, RawDocument | Skip) for r in records)
    groups = {d.group for d in docs}
    assert "json/__init__.py" in groups and "os.py" in groups
    assert not any("/test/" in f"/{g}" or "/tests/" in f"/{g}" or "idle_test" in g
                   or g.split("/")[-1].startswith("test_") or "site-packages" in g
                   for g in groups)
    assert {d.label for d in docs if d.group == "json/decoder.py"} == {"json"}


def _grouped_corpus(path, n_groups=40, per_group=5, seed=1):
    """JSONL with groups and planted duplicates of one group's text in other groups."""
    rng = random.Random(seed)
    rows = []
    for g in range(n_groups):
        for _ in range(per_group):
            rows.append({"text": _sentence(rng), "g": f"group-{g}", "label": f"L{g % 3}"})
    for i in range(0, len(rows), 7):  # cross-group duplicates, with whitespace variations
        rows.append({"text": "  " + rows[i]["text"].replace(" ", "\t"),
                     "g": f"group-{(int(rows[i]['g'][6:]) + 11) % n_groups}", "label": "x"})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def test_split_is_disjoint_in_groups_and_texts_with_planted_duplicates(tmp_path):
    corpus = tmp_path / "c.jsonl"
    _grouped_corpus(corpus)
    out = tmp_path / "ds"
    manifest = prepare(out, corpus=str(corpus), group_field="g", label_field="label",
                       heldout_fraction=0.25, vocab_size=200, seq_len=32, quiet=True)
    dataset = open_dataset(out)
    docs = {s: list(dataset.documents(s)) for s in (TRAIN, HELDOUT)}
    groups = {s: {d["group"] for d in docs[s]} for s in docs}
    ids = {s: {d["id"] for d in docs[s]} for s in docs}
    assert groups[TRAIN] and groups[HELDOUT]
    assert not groups[TRAIN] & groups[HELDOUT]
    assert not ids[TRAIN] & ids[HELDOUT]
    assert manifest["documents"]["duplicates"] > 0
    for split in (TRAIN, HELDOUT):
        assert manifest["splits"][split]["groups"] == len(groups[split])
        assert manifest["splits"][split]["documents"] == len(docs[split])
        for g in groups[split]:
            assert assign_split(group_key(g, 0), 0.25) == split


def test_split_depends_on_the_seed():
    sides = [[assign_split(group_key(f"g{i}", seed), 0.5) for i in range(64)]
             for seed in (0, 1)]
    assert sides[0] != sides[1]
    assert sides[0] == [assign_split(group_key(f"g{i}", 0), 0.5) for i in range(64)]


def test_empty_heldout_split_is_an_error_that_counts_groups(tmp_path):
    corpus = tmp_path / "one"
    corpus.mkdir()
    (corpus / "only.txt").write_text("one file, one group")
    with pytest.raises(ValueError, match=r"split would be empty: all 1 group"):
        prepare(tmp_path / "ds", corpus=str(corpus), quiet=True)
    assert not (tmp_path / "ds").exists()
    assert not list(tmp_path.glob(".ds*"))


def test_parquet_rows_are_documents_with_fields(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = pa.table({"body": ["first row", None, "third row"], "src": ["a", "b", "c"]})
    pq.write_table(table, tmp_path / "rows.parquet")
    accounting = Accounting()
    kept = list(clean(read_corpus(str(tmp_path / "rows.parquet"),
                                  FieldNames(text="body", group="src"), strict=False),
                      accounting))
    assert [(d.text, d.group) for d in kept] == [("first row", "a"), ("third row", "c")]
    assert accounting.skips == [{"source": "rows.parquet:2", "reason": "lacks text field 'body'"}]


def test_parquet_without_pyarrow_is_a_one_line_install_hint(tmp_path, monkeypatch):
    (tmp_path / "rows.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ValueError, match=r"needs pyarrow; pip install 'clozax\[parquet\]'"):
        read_corpus(str(tmp_path), FieldNames(), strict=False)
