"""``clozax prepare`` end to end: determinism, atomic writes, opening, and CLI errors."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from clozax.app.cli import main
from clozax.data import open_dataset, prepare
from clozax.data.dataset import verify_files

pytestmark = pytest.mark.fast  # make test-fast; tests marked slow stay out

WORDS = "one two three four five six seven eight nine ten eleven twelve".split()


def _corpus(root: Path, n_files: int = 30, seed: int = 0) -> Path:
    rng = random.Random(seed)
    (root / "docs").mkdir(parents=True)
    for i in range(n_files):
        text = "\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 40)))
                         for _ in range(rng.randint(1, 3)))
        (root / "docs" / f"file{i:02d}.txt").write_text(text)
    return root / "docs"


def _cli(*args: str, env: dict | None = None, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "clozax.app.cli", "prepare", *args], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})}, **kw)


def _files(directory: Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes()
            for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_same_seed_gives_byte_identical_output_in_two_processes(tmp_path):
    corpus = _corpus(tmp_path)
    args = ["--corpus", str(corpus), "--vocab-size", "120", "--seq-len", "32",
            "--heldout-fraction", "0.2", "--quiet"]
    runs = [_cli("--out", str(tmp_path / name), *args) for name in ("a", "b")]
    for run in runs:
        _, err = run.communicate(timeout=120)
        assert run.returncode == 0, err
    a, b = _files(tmp_path / "a"), _files(tmp_path / "b")
    assert sorted(a) == sorted(b) == sorted([
        "manifest.json", "tokenizer.json",
        *(f"{s}/{n}" for s in ("train", "heldout")
          for n in ("unigram_counts.npy", *(f"shard-00000.{k}" for k in (
              "tokens.npy", "segments.npy", "word_starts.npy", "documents.jsonl"))))])
    assert a == b


def _kill_before_rename(out: Path, args: list[str]) -> None:
    """Start prepare, wait until its temporary directory is complete, SIGKILL it."""
    run = _cli("--out", str(out), *args, env={"CLOZAX_TEST_PAUSE_BEFORE_RENAME": "60"})
    deadline = time.monotonic() + 60
    while not list(out.parent.glob(f".{out.name}.partial-*/manifest.json")):
        assert run.poll() is None, run.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.05)
    run.send_signal(signal.SIGKILL)
    run.communicate()


@pytest.mark.slow
def test_killed_run_leaves_no_partial_output_and_keeps_the_old_one(tmp_path):
    corpus = _corpus(tmp_path)
    out = tmp_path / "ds"
    args = ["--corpus", str(corpus), "--vocab-size", "120", "--seq-len", "32",
            "--heldout-fraction", "0.2", "--quiet"]
    _kill_before_rename(out, args)
    assert not out.exists()
    prepare(out, corpus=str(corpus), vocab_size=120, seq_len=32, heldout_fraction=0.2,
            quiet=True)
    before = _files(out)
    _kill_before_rename(out, [*args, "--seq-len", "16", "--overwrite"])
    assert _files(out) == before
    assert list(tmp_path.glob(".ds.partial-*"))  # the killed runs' leftovers, hidden
    prepare(out, corpus=str(corpus), vocab_size=120, seq_len=32, heldout_fraction=0.2,
            quiet=True, overwrite=True)
    assert not list(tmp_path.glob(".ds.*"))  # cleaned by the next run


def test_existing_output_is_refused_unless_overwrite(tmp_path):
    corpus = _corpus(tmp_path)
    opts = dict(corpus=str(corpus), vocab_size=120, seq_len=32, heldout_fraction=0.2,
                quiet=True)
    prepare(tmp_path / "ds", **opts)
    with pytest.raises(ValueError, match="already exists; pass --overwrite"):
        prepare(tmp_path / "ds", **opts)
    manifest = prepare(tmp_path / "ds", overwrite=True, **{**opts, "seq_len": 16})
    assert open_dataset(tmp_path / "ds").seq_len == 16 == manifest["seq_len"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_open_dataset_exposes_arrays_and_rejects_tampering(tmp_path):
    corpus = _corpus(tmp_path)
    out = tmp_path / "ds"
    manifest = prepare(out, corpus=str(corpus), vocab_size=120, seq_len=32,
                       heldout_fraction=0.2, quiet=True)
    ds = open_dataset(out)
    assert ds.train.tokens.dtype == np.uint16 and isinstance(ds.train.tokens, np.memmap)
    assert ds.train.tokens.shape == (manifest["splits"]["train"]["rows"], 32)
    assert ds.specials == {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4}
    assert ds.vocab_size <= 120 and ds.fingerprint == manifest["fingerprint"]
    assert 0 < manifest["packing_efficiency"] <= 1
    d = manifest["documents"]
    assert d["read"] == d["kept"] + d["duplicates"] + d["skipped"]

    with pytest.raises(ValueError, match="no manifest.json; run `clozax prepare --out"):
        open_dataset(tmp_path)
    with pytest.raises(ValueError, match="does not exist"):
        open_dataset(tmp_path / "nope")
    tok = out / "tokenizer.json"
    tok.write_text(tok.read_text() + " ")
    with pytest.raises(ValueError, match="does not match the sha256"):
        open_dataset(out)
    prepare(out, corpus=str(corpus), vocab_size=120, seq_len=32, heldout_fraction=0.2,
            quiet=True, overwrite=True)
    np.save(out / "heldout/shard-00000.segments.npy", np.zeros((1, 32), np.uint16))
    with pytest.raises(ValueError, match=r"heldout/shard-00000.segments.npy has shape \(1, 32\)"):
        open_dataset(out)


def test_dataset_identity_covers_split_seed_seq_len_and_every_file(tmp_path):
    corpus = _corpus(tmp_path)
    opts = dict(corpus=str(corpus), vocab_size=120, heldout_fraction=0.2, quiet=True)
    base = prepare(tmp_path / "a", seq_len=32, seed=0, **opts)
    other_seed = prepare(tmp_path / "b", seq_len=32, seed=1, **opts)
    other_len = prepare(tmp_path / "c", seq_len=64, seed=0,
                        tokenizer=tmp_path / "a" / "tokenizer.json", **opts)
    assert len({base["fingerprint"], other_seed["fingerprint"], other_len["fingerprint"]}) == 3
    assert other_len["identity"]["tokenizer_sha256"] == base["identity"]["tokenizer_sha256"]
    assert verify_files(open_dataset(tmp_path / "a")) == []

    # An edited manifest and a resized file are caught on every open ...
    out = tmp_path / "a"
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["identity"]["split"]["seed"] = 7
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="fingerprint does not match its identity"):
        open_dataset(out)
    manifest["identity"]["split"]["seed"] = 0
    (out / "manifest.json").write_text(json.dumps(manifest))
    documents = out / "train/shard-00000.documents.jsonl"
    with documents.open("a") as f:
        f.write("\n")
    with pytest.raises(ValueError, match="train/shard-00000.documents.jsonl has .* bytes, the "
                                         "manifest recorded"):
        open_dataset(out)
    # ... a flipped byte of the same size only by reading every byte (clozax audit --data).
    documents.write_bytes(documents.read_bytes()[:-1])
    tokens = out / "train/shard-00000.tokens.npy"
    data = bytearray(tokens.read_bytes())
    data[-1] ^= 0x01
    tokens.write_bytes(bytes(data))
    assert [m.split(":")[0] for m in verify_files(open_dataset(out))] == [
        "train/shard-00000.tokens.npy"]


def test_documents_without_a_selectable_token_are_skipped_with_their_reason(tmp_path):
    corpus = tmp_path / "c.jsonl"
    rows = [{"text": " ".join(WORDS[i % len(WORDS)] for i in range(k, k + 20)) + f" {k}"}
            for k in range(60)]
    rows += [{"text": "\u200b\u200b\u200b"}, {"text": "[MASK] [MASK]"}]
    corpus.write_text("\n".join(json.dumps(r) for r in rows))
    manifest = prepare(tmp_path / "ds", corpus=str(corpus), vocab_size=120, seq_len=32,
                       heldout_fraction=0.2, quiet=True)
    d = manifest["documents"]
    assert d["read"] == d["kept"] + d["duplicates"] + d["skipped"] and d["skipped"] == 2
    assert manifest["skip_reasons"] == {"empty after tokenization": 1,
                                        "no non-special token after tokenization": 1}
    assert sum(s["documents"] for s in manifest["splits"].values()) == d["kept"] == 60
    ds = open_dataset(tmp_path / "ds")
    special = np.isin(ds.train.tokens, list(ds.specials.values()))
    for row in range(ds.train.rows):  # every row has a token masking may select
        assert (~special[row] & (ds.train.segments[row] > 0)).any()


def _bad_inputs(tmp_path: Path) -> dict[str, tuple[list[str], str]]:
    corpus = _corpus(tmp_path)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_text(" \n\t\n")
    (tmp_path / "empty" / "b.md").write_text("")
    (tmp_path / "nothing").mkdir()
    (tmp_path / "nothing" / "x.csv").write_text("a,b")
    (tmp_path / "binary").mkdir()
    (tmp_path / "binary" / "a.txt").write_bytes(b"\x00\x01\x02")
    (tmp_path / "binary" / "b.txt").write_bytes(b"\xff\xfe")
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{oops\n')
    (tmp_path / "late.jsonl").write_text('{"text": "fine"}\n' * 40 + '{oops\n')
    (tmp_path / "exists").mkdir()
    c = ["--corpus", str(corpus), "--quiet", "--heldout-fraction", "0.2"]
    return {
        "missing path": (["--corpus", str(tmp_path / "missing")], "does not exist"),
        "no supported files": (["--corpus", str(tmp_path / "nothing")], "no supported files"),
        "empty corpus": (["--corpus", str(tmp_path / "empty")], "was skipped"),
        "all binary": (["--corpus", str(tmp_path / "binary")], "a.txt: binary content"),
        "strict": (["--corpus", str(tmp_path / "bad.jsonl"), "--strict"],
                   "bad.jsonl:2: not valid JSON"),
        "strict, in a worker": (["--corpus", str(tmp_path / "late.jsonl"), "--strict",
                                 "--workers", "2", "--shard-bytes", "100"],
                                "late.jsonl:41: not valid JSON"),
        "seq-len small": ([*c, "--seq-len", "4"], "--seq-len 4 is outside [8, 8192]"),
        "seq-len large": ([*c, "--seq-len", "9000"], "--seq-len 9000 is outside"),
        "vocab too small": ([*c, "--vocab-size", "12"], "--vocab-size 12 is too small"),
        "heldout empty": ([*c, "--heldout-fraction", "0.0001"], "heldout split would be empty"),
        "output exists": ([*c], "already exists; pass --overwrite"),
        "given tokenizer missing": ([*c, "--tokenizer", str(tmp_path / "t.json")],
                                    "tokenizer file"),
        "unknown executor": ([*c, "--executor", "ray"], "--executor 'ray' is unknown; use one "
                             "of local, dask"),
        "scheduler without dask": ([*c, "--scheduler", "tcp://h:8786"],
                                   "--scheduler names a Dask scheduler; pass --executor dask"),
        "specials without a tokenizer": ([*c, "--special-tokens", "mask=<m>"],
                                         "pass --tokenizer with it"),
        "bad specials": ([*c, "--tokenizer", str(tmp_path / "t.json"), "--special-tokens",
                          "mask"], "--special-tokens entry 'mask' is not NAME=STRING"),
    }


def test_cli_bad_inputs_exit_2_with_one_line_error(tmp_path, capsys):
    for name, (args, expected) in _bad_inputs(tmp_path).items():
        out = tmp_path / ("exists" if name == "output exists" else f"out-{len(name)}")
        with pytest.raises(SystemExit) as exit_info:
            main(["prepare", "--out", str(out), "--quiet", *args])
        captured = capsys.readouterr()
        assert exit_info.value.code == 2, name
        lines = captured.err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), (name, captured.err)
        assert expected in lines[0].replace("\n", ""), (name, lines[0])
        assert name == "output exists" or not out.exists(), name
        left = list(tmp_path.glob(f".{out.name}.partial-*"))
        # What was read is kept: the pieces before a bad row, or all of them when the
        # tokenizer's settings are what failed (another --vocab-size reuses the reading).
        if name in ("strict, in a worker", "vocab too small"):
            assert len(left) == 1 and f"the finished part is kept in {left[0]}" in lines[0]
        else:
            assert not left, name  # nothing left behind


def test_a_full_disk_while_saving_the_tokenizer_is_one_line(tmp_path, capsys, monkeypatch):
    # tokenizers raises a bare Exception("No space left on device (os error 28)"), not an
    # OSError; it escaped as a 30-line traceback.
    from clozax.data import tokenizer
    from commands import one_line_error

    class FullDisk:
        def save(self, path):
            raise Exception("No space left on device (os error 28)")  # noqa: TRY002

    monkeypatch.setattr(tokenizer, "train_tokenizer", lambda *a, **k: FullDisk())
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for k in range(40):  # a group per file: some land in the held-out split
        (corpus / f"{k}.txt").write_text("".join(f"line {i} of file {k}\n\n" for i in range(5)))
    line = one_line_error(capsys, "prepare", "--out", tmp_path / "out", "--corpus", corpus,
                          "--quiet", "--workers", "1")
    assert line.startswith("error: No space left on device: free space on that disk")
    assert not (tmp_path / "out").exists()


@pytest.mark.fast
def test_a_system_error_is_one_line_and_a_bug_is_not_hidden():
    from clozax.app.cli import system_error_line

    assert system_error_line(OSError(28, "No space left on device", "/data/x")) == (
        "No space left on device (/data/x): free space on that disk or write somewhere "
        "else; what was finished is kept")
    assert system_error_line(Exception("Permission denied (os error 13)")).startswith(
        "Permission denied: fix that")
    assert system_error_line(KeyError("x")) is None  # a bug keeps its traceback


@pytest.mark.slow
def test_cli_error_in_a_subprocess_has_no_traceback(tmp_path):
    run = _cli("--out", str(tmp_path / "o"), "--corpus", str(tmp_path / "missing"))
    out, err = run.communicate(timeout=60)
    assert run.returncode == 2
    assert err.startswith("error: corpus path") and "Traceback" not in err + out
    assert len(err.strip().splitlines()) == 1


def test_manifest_records_what_the_lead_needs(tmp_path):
    corpus = _corpus(tmp_path)
    manifest = prepare(tmp_path / "ds", corpus=str(corpus), vocab_size=120, seq_len=32,
                       heldout_fraction=0.2, quiet=True)
    on_disk = json.loads((tmp_path / "ds" / "manifest.json").read_text())
    assert on_disk == manifest
    for key in ("documents", "skipped", "splits", "tokenizer", "seq_len", "packing_efficiency",
                "seed", "identity", "fingerprint", "clozax_version", "format_version"):
        assert key in manifest
    for split in ("train", "heldout"):
        assert set(manifest["splits"][split]) >= {"documents", "groups", "rows", "tokens",
                                                  "pad_tokens"}
        s = manifest["splits"][split]
        assert s["rows"] * 32 == s["tokens"] + s["pad_tokens"]
    assert set(manifest["tokenizer"]) >= {"file", "sha256", "vocab_size", "trained_on",
                                          "specials", "model", "lowercase"}


def test_overwrite_refuses_a_directory_that_is_not_a_dataset(tmp_path):
    corpus = _corpus(tmp_path)
    precious = tmp_path / "home"
    precious.mkdir()
    (precious / "thesis.tex").write_text("years of work")
    with pytest.raises(ValueError, match="not a clozax dataset"):
        prepare(precious, corpus=str(corpus), overwrite=True, quiet=True)
    assert (precious / "thesis.tex").read_text() == "years of work"


def test_unknown_prepare_option_lists_the_valid_ones(tmp_path):
    with pytest.raises(ValueError, match="unknown prepare option.*seq_lenn.*valid: corpus"):
        prepare(tmp_path / "ds", seq_lenn=64)


def test_rows_longer_than_512_are_packed_for_models_configured_for_them(tmp_path):
    corpus = tmp_path / "long.jsonl"
    rng = random.Random(3)
    corpus.write_text("".join(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(
        900))}) + "\n" for _ in range(12)))
    manifest = prepare(tmp_path / "ds", corpus=str(corpus), vocab_size=120, seq_len=1024,
                       heldout_fraction=0.3, quiet=True)
    ds = open_dataset(tmp_path / "ds")
    assert ds.train.tokens.shape == (manifest["splits"]["train"]["rows"], 1024)
    assert max(int(np.count_nonzero(ds.train.segments[r] == 1)) for r in range(ds.train.rows)) \
        > 512  # one document's piece longer than the old cap


def test_reordering_or_prepending_jsonl_rows_moves_no_document_across_the_split(tmp_path):
    """A row's default group is its content, not its line number; with every document its
    own group, the groups counted without a set equal the documents."""
    rng = random.Random(4)
    rows = [json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))})
            for _ in range(150)]
    moved = rows[::-1]
    rng.shuffle(moved)
    moved.insert(0, json.dumps({"text": "a new first row"}))
    sides, manifests = [], []
    for name, lines in (("a", rows), ("b", moved)):
        (tmp_path / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
        manifests.append(prepare(tmp_path / name, corpus=str(tmp_path / f"{name}.jsonl"),
                                 vocab_size=64, seq_len=32, heldout_fraction=0.25, quiet=True))
        ds = open_dataset(tmp_path / name)
        sides.append({d["id"]: split for split in ("train", "heldout")
                      for d in ds.documents(split)})
    assert len(sides[1]) == len(sides[0]) + 1 and all(sides[1][i] == s
                                                      for i, s in sides[0].items())
    for manifest in manifests:
        splits = manifest["splits"]
        assert splits["heldout"]["documents"] > 10
        assert all(s["groups"] == s["documents"] for s in splits.values())
