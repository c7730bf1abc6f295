"""Corpus inputs at scale: globs and directories of shards, compressed files, text units,
arrow directories, and documents cut into parts so no input shape is held whole."""

from __future__ import annotations

import gzip
import json
import random
import subprocess
import sys

import pytest
import zstandard

from clozax.data import prepare
from clozax.data.corpus import MAX_RUN_CHARS, Accounting, clean, normalise
from clozax.data.pieces import Piece, plan, read_corpus, read_piece
from clozax.data.readers import FieldNames, Layout, RawDocument, Skip, content_group
from clozax.data.sources import MAX_DOCUMENT_CHARS, SEPARATORS, units

pytestmark = pytest.mark.fast  # make test-fast; tests marked slow stay out

WORDS = "alpha beta gamma delta epsilon zeta theta kappa lambda omicron sigma omega".split()


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _texts(corpus, layout: Layout | None = None, fields: FieldNames | None = None):
    records = list(read_corpus(str(corpus), fields or FieldNames(), strict=False,
                               layout=layout or Layout()))
    return records, [r.text for r in records if isinstance(r, RawDocument)]


def test_gz_and_zst_shards_read_like_the_plain_files_in_sorted_order(tmp_path):
    rng = random.Random(0)
    rows = [{"text": f"{_text(rng, 8)} {i}"} for i in range(30)]
    lines = [(json.dumps(r) + "\n").encode() for r in rows]
    plain, packed = tmp_path / "plain", tmp_path / "packed"
    plain.mkdir()
    (packed / "b").mkdir(parents=True)
    (plain / "all.jsonl").write_bytes(b"".join(lines))
    (packed / "a-0.jsonl.gz").write_bytes(gzip.compress(b"".join(lines[:10])))
    (packed / "a-1.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(
        b"".join(lines[10:20])))
    (packed / "b" / "c.jsonl").write_bytes(b"".join(lines[20:]))
    (packed / "notes.txt.zst").write_bytes(zstandard.ZstdCompressor().compress(b"a text file"))
    _, expected = _texts(plain)
    for corpus in (packed, f"{packed}/**/*.jsonl*"):
        _, texts = _texts(corpus)
        assert texts[:30] == expected
    assert _texts(packed)[1][30:] == ["a text file"]
    assert _texts(f"{packed}/a-*")[1] == expected[:20]


def test_corrupt_compressed_shard_is_a_recorded_skip_and_the_rest_is_read(tmp_path):
    rng = random.Random(3)
    rows = b"".join(json.dumps({"text": _text(rng, 50)}).encode() + b"\n" for _ in range(200))
    packed = gzip.compress(rows)
    (tmp_path / "bad.jsonl.gz").write_bytes(packed[: len(packed) // 2])  # truncated
    (tmp_path / "bad.txt.gz").write_bytes(b"not gzip at all")
    (tmp_path / "good.jsonl.gz").write_bytes(gzip.compress(b'{"text": "kept"}\n'))
    records, texts = _texts(tmp_path)
    assert 0 < len(texts) - 1 < 200 and texts[-1] == "kept"
    skips = [r for r in records if isinstance(r, Skip)]
    assert len(skips) == 2 and all("corrupt" in s.reason or "unreadable" in s.reason
                                   for s in skips), skips
    accounting = Accounting()
    list(clean(records, accounting))
    accounting.check()


def test_arrow_stream_from_save_to_disk_reads_rows_with_fields(tmp_path):
    pa = pytest.importorskip("pyarrow")
    table = pa.table({"text": ["one doc", "two doc", None], "g": ["a", "a", "b"]})
    (tmp_path / "ds").mkdir()
    with pa.OSFile(str(tmp_path / "ds" / "data-00000-of-00001.arrow"), "wb") as sink, \
            pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    (tmp_path / "ds" / "state.json").write_text("{}")  # ignored: not a data file
    records, texts = _texts(tmp_path / "ds", fields=FieldNames(group="g"))
    assert texts == ["one doc", "two doc"]
    assert [r.group for r in records if isinstance(r, RawDocument)] == ["a", "a"]
    assert isinstance(records[2], Skip) and "lacks text field" in records[2].reason


def test_text_units_split_a_file_into_paragraphs_or_lines_with_their_groups(tmp_path):
    (tmp_path / "book.txt").write_text("first para\nstill first\n\n  \n\nsecond\nthird line\n")
    _, paragraphs = _texts(tmp_path, Layout("paragraph"))
    assert paragraphs == ["first para\nstill first", "second\nthird line\n"]
    records, lines = _texts(tmp_path, Layout("line"))
    assert [t.strip() for t in lines] == ["first para", "still first", "second", "third line"]
    assert [r.source for r in records] == ["book.txt:1", "book.txt:2", "book.txt:6",
                                           "book.txt:7"]
    assert [r.group for r in records] == [content_group(r.text) for r in records]  # not lines
    assert len({r.group for r in records}) == 4
    records, _ = _texts(tmp_path, Layout("line", group_by="file"))
    assert {r.group for r in records} == {"book.txt"}


def test_units_are_the_same_whatever_the_block_boundaries():
    text = "a\n\nbb\n \n\nccc\nd\n\n" * 7
    whole = list(units(iter([text]), SEPARATORS["paragraph"]))
    assert len([t for _, t, _ in whole if t.strip()]) == 21
    for size in (1, 2, 3, 5):
        blocks = [text[i : i + size] for i in range(0, len(text), size)]
        pieces = list(units(iter(blocks), SEPARATORS["paragraph"]))
        assert [(n, t.strip()) for n, t, _ in pieces] == [(n, t.strip()) for n, t, _ in whole]


def test_a_document_longer_than_the_cap_becomes_parts_of_one_group(tmp_path):
    rng = random.Random(1)
    big = _text(rng, MAX_DOCUMENT_CHARS // 2)  # about 3x the cap
    (tmp_path / "big.txt").write_text(big)
    (tmp_path / "run.txt").write_text("x" * (MAX_DOCUMENT_CHARS + 5))
    records, texts = _texts(tmp_path)
    parts = [r for r in records if r.source.startswith("big.txt")]
    assert len(parts) >= 3 and {r.group for r in parts} == {"big.txt"}
    assert all(len(t) <= MAX_DOCUMENT_CHARS for t in texts)
    assert "".join(r.text for r in parts) == big  # cut at spaces, nothing lost
    assert [len(r.text) for r in records if r.source.startswith("run.txt")] == \
        [MAX_DOCUMENT_CHARS, 5]


def test_a_large_file_read_in_pieces_gives_the_records_of_reading_it_whole(tmp_path):
    rng = random.Random(3)
    rows = [json.dumps({"text": _text(rng, rng.randint(1, 20))}) for _ in range(200)]
    rows[7], rows[50] = "{not json", ""  # a skip and a blank line keep their line numbers
    (tmp_path / "big.jsonl").write_text("\n".join(rows) + "\n")
    seps = ["\n\n", "\n \n\n", "\r\n\r\n", "\n\t\n", "\n"]  # the last: same paragraph
    text = "".join(_text(rng, rng.randint(1, 15)) + rng.choice(seps) for _ in range(300))
    (tmp_path / "big.txt").write_text(text + "end", newline="")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": [_text(rng, 9) for _ in range(200)]}),
                   tmp_path / "big.parquet", row_group_size=20)
    for name, layout in (("big.jsonl", Layout()), ("big.txt", Layout("paragraph")),
                         ("big.txt", Layout("line")), ("big.parquet", Layout())):
        whole, _ = _texts(tmp_path / name, layout)
        the_plan = plan(str(tmp_path / name), layout, 500)
        pieces = [Piece.from_json(p) for p in the_plan["pieces"]]
        assert len(pieces) > 5 and all((p.first, p.stop) == (0, 1) for p in pieces)
        read = [r for p in pieces for r in read_piece(the_plan, p, FieldNames(), layout, False)]
        assert read == whole, name
    # Small files are grouped whole, in sorted order, into pieces of about the size asked for.
    (tmp_path / "many").mkdir()
    for i in range(10):
        (tmp_path / "many" / f"{i}.txt").write_text("x" * 99)
    assert plan(str(tmp_path / "many"), Layout(), 350)["pieces"] == [
        [0, 3, 0, None, 1], [3, 6, 0, None, 1], [6, 9, 0, None, 1], [9, 10, 0, None, 1]]


def test_paragraphs_in_any_script_are_cut_points_and_pieces_read_like_the_whole_file(tmp_path):
    """Cyrillic, CJK, accented and quote-led paragraphs end pieces; a line of no-break or
    ideographic spaces after a blank line is still separator, never a cut."""
    rng = random.Random(5)
    scripts = ["Война и мир — роман Льва Толстого", "长篇小说描写了俄国社会", "Élise était là",
               "“Quoted,” she said", "«Ёлка» и ещё"]
    seps = ["\n\n", "\n\n\n", "\n \n\n", "\n\n\u00a0\n\n", "\n\n\u3000 \n\n", "\r\n\r\n"]
    text = "".join(" ".join(rng.choice(scripts) for _ in range(rng.randint(1, 6))) +
                   rng.choice(seps) for _ in range(400))
    (tmp_path / "book.txt").write_text(text, newline="")
    layout = Layout("paragraph")
    whole, texts = _texts(tmp_path / "book.txt", layout)
    assert len(texts) == 400
    the_plan = plan(str(tmp_path / "book.txt"), layout, 2000)
    pieces = [Piece.from_json(p) for p in the_plan["pieces"]]
    assert len(pieces) > 10
    starts = [text.encode()[p.span.start : p.span.start + 12].decode("utf-8", "ignore")[:1]
              for p in pieces[1:]]
    assert {s for s in starts} <= {t[0] for t in scripts} and len(set(starts)) > 2
    read = [r for p in pieces for r in read_piece(the_plan, p, FieldNames(), layout, False)]
    assert read == whole


@pytest.mark.slow
def test_one_big_text_file_by_paragraph_prepares_with_both_splits_non_empty(tmp_path):
    rng = random.Random(2)
    paragraphs = [_text(rng, rng.randint(5, 30)) for _ in range(400)]
    (tmp_path / "one.txt").write_text("\n\n".join(paragraphs))
    manifest = prepare(tmp_path / "out", corpus=str(tmp_path / "one.txt"),
                       text_unit="paragraph", vocab_size=64, seq_len=32,
                       heldout_fraction=0.1, quiet=True)
    splits = manifest["splits"]
    assert splits["train"]["documents"] > 0 and splits["heldout"]["documents"] > 0
    assert manifest["documents"]["read"] == 400
    with pytest.raises(ValueError, match="heldout split would be empty: all 1 group"):
        prepare(tmp_path / "out2", corpus=str(tmp_path / "one.txt"), text_unit="paragraph",
                group_by="file", vocab_size=64, seq_len=32, quiet=True)


def test_unbroken_runs_are_cut_by_spaces_before_the_tokenizer():
    text = normalise("ab " + "x" * 300 + " cd\n" + "y" * MAX_RUN_CHARS)
    assert [len(w) for w in text.split()] == [2, MAX_RUN_CHARS, MAX_RUN_CHARS, 44, 2,
                                              MAX_RUN_CHARS]


@pytest.mark.slow
def test_peak_memory_does_not_grow_with_one_huge_document(tmp_path):
    """4 MB in one .txt file: today's main peaked at 752 MiB here (the tokenizer holds ~200
    bytes per character of a document); cut into parts and encoded in bounded batches, the
    whole prepare stays near the interpreter's own ~130 MiB."""
    rng = random.Random(0)
    vocab = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
             for _ in range(5000)]
    (tmp_path / "c").mkdir()
    with (tmp_path / "c" / "huge.txt").open("w") as f:
        for _ in range(4_000_000 // 70):
            f.write(" ".join(rng.choice(vocab) for _ in range(12)) + ".\n")
    for i in range(40):
        (tmp_path / "c" / f"small{i}.txt").write_text(" ".join(rng.sample(vocab, 50)))
    # The child reports its own VmHWM: wait4's ru_maxrss would count this (large) pytest
    # process too, since a forked child's high-water mark survives its exec.
    report = tmp_path / "vmhwm"
    # Its workers' peaks come from RUSAGE_CHILDREN (an upper bound: a worker's counts what it
    # was forked from).
    child = ("import resource, sys\nfrom clozax.app.cli import main\ntry:\n    main(sys.argv[2:])\n"
             "finally:\n"
             "    hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM')][0]\n"
             "    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss\n"
             "    open(sys.argv[1], 'w').write(str(max(int(hwm.split()[1]), kids)))\n")
    proc = subprocess.run([sys.executable, "-c", child, str(report), "prepare", "--corpus",
                           str(tmp_path / "c"), "--out", str(tmp_path / "out"), "--quiet",
                           "--vocab-size", "2000"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    peak_mib = int(report.read_text()) / 1024
    assert peak_mib < 300, f"peak RSS {peak_mib:.0f} MiB"
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["caps"]["document_chars"] == MAX_DOCUMENT_CHARS
