"""Checks of the data and the run's files: split disjointness, tokenizer provenance, packing
accounting, and the frozen eval-mask set."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from clozax.core.files import file_sha256
from clozax.data.dataset import (
    Dataset,
    fingerprint,
    open_dataset,
    verify_files,
)
from clozax.data.split import SPLITS
from clozax.judge.audit.pipeline import CheckResult, Pipeline, default_masker
from clozax.train import heldout


def open_dataset_for_audit(path: Path) -> Dataset:
    """``open_dataset``, except that a tokenizer file not matching the manifest is left to the
    tokenizer check to report instead of refusing to open."""
    return open_dataset(path, check_tokenizer=False)


def check_eval_masks(pipe: Pipeline, dataset: Dataset, run_dir: Path) -> CheckResult:
    """Recompute with the run's configured masker: the one ``train`` built the set with."""
    try:
        stored, meta = heldout.load_eval_masks(run_dir)
    except ValueError as e:
        return CheckResult("eval_masks", False, None, str(e))
    config = pipe.config
    masker = default_masker(config, pipe.vocab, pipe.seq_len)
    rebuilt = heldout.build_eval_masks(dataset.heldout, masker, config.train.eval_seed,
                                        config.train.eval_rows)
    stored_sha = heldout.set_sha256(stored, meta, dataset.heldout)  # by the file's own rule
    rebuilt_sha = heldout.set_sha256(rebuilt, meta, dataset.heldout)
    passed = stored_sha == meta["sha256"] == rebuilt_sha
    return CheckResult("eval_masks", passed,
                       {"recorded": meta["sha256"], "stored": stored_sha, "rebuilt": rebuilt_sha},
                       f"sha256 {stored_sha[:12]} recorded and rebuilt from eval_seed "
                       f"{config.train.eval_seed}" if passed else
                       f"recorded {meta['sha256'][:12]}, stored {stored_sha[:12]}, rebuilt "
                       f"{rebuilt_sha[:12]}: the set is not the one eval_seed gives")


def check_data_disjoint(dataset: Dataset) -> CheckResult:
    """Groups and document hashes of the two splits, streamed: the held-out ones are kept in
    sets (the small side), then every train document is looked up."""
    held_groups, held_ids = set(), set()
    for d in dataset.documents(SPLITS[1]):
        held_groups.add(d["group"])
        held_ids.add(d["id"])
    train_docs, shared_groups, shared_ids = 0, set(), set()
    for d in dataset.documents(SPLITS[0]):
        train_docs += 1
        if d["group"] in held_groups:
            shared_groups.add(d["group"])
        if d["id"] in held_ids:
            shared_ids.add(d["id"])
    train_groups = dataset.manifest["splits"][SPLITS[0]]["groups"]
    value = {"shared_groups": len(shared_groups), "shared_documents": len(shared_ids)}
    if shared_groups or shared_ids:
        examples = sorted(map(str, shared_groups))[:2] + sorted(shared_ids)[:2]
        return CheckResult("data_disjoint", False, value,
                           f"{len(shared_groups)} group(s) and {len(shared_ids)} document "
                           f"hash(es) are in both splits, e.g. {examples}")
    return CheckResult("data_disjoint", True, value,
                       f"{train_groups}/{len(held_groups)} groups and {train_docs}/"
                       f"{len(held_ids)} document hashes (train/held-out), none shared")


def check_tokenizer(dataset: Dataset, run_dir: Path | None = None) -> CheckResult:
    tok = dataset.manifest["tokenizer"]
    problems = []
    if tok.get("trained_on") not in ("train", "given"):
        problems.append(f"manifest says the tokenizer was trained on {tok.get('trained_on')!r}")
    data_sha = file_sha256(dataset.tokenizer_path)
    value = {"trained_on": tok.get("trained_on"), "manifest": tok["sha256"], "dataset": data_sha}
    if data_sha != tok["sha256"]:
        problems.append(f"dataset tokenizer file sha256 {data_sha[:12]} != manifest "
                        f"{tok['sha256'][:12]}")
    if run_dir is not None:
        info = json.loads((run_dir / "run.json").read_text())
        run_sha = file_sha256(run_dir / "tokenizer.json")
        value |= {"run_recorded": info.get("tokenizer_sha256"), "run_file": run_sha}
        if run_sha != info.get("tokenizer_sha256"):
            problems.append(f"run tokenizer.json sha256 {run_sha[:12]} != run.json "
                            f"{str(info.get('tokenizer_sha256'))[:12]}")
        if info.get("tokenizer_sha256") != tok["sha256"]:
            problems.append("run.json tokenizer sha256 differs from the dataset's")
    if problems:
        return CheckResult("tokenizer", False, value, "; ".join(problems))
    where = "dataset and run" if run_dir is not None else "dataset"
    return CheckResult("tokenizer", True, value,
                       f"trained on {tok.get('trained_on')}; sha256 {data_sha[:12]} matches in "
                       f"{where}")


def check_packing_accounting(dataset: Dataset) -> CheckResult:
    m = dataset.manifest
    seq_len = dataset.seq_len
    problems = []
    d = m["documents"]
    if d["read"] != d["kept"] + d["duplicates"] + d["skipped"]:
        problems.append(f"read {d['read']} != kept {d['kept']} + duplicates {d['duplicates']} "
                        f"+ skipped {d['skipped']}")
    kept = 0
    for name in SPLITS:
        s, split = m["splits"][name], getattr(dataset, name)
        kept += s["documents"]
        if s["rows"] * seq_len != s["tokens"] + s["pad_tokens"]:
            problems.append(f"{name}: rows x seq_len {s['rows'] * seq_len} != tokens "
                            f"{s['tokens']} + pad {s['pad_tokens']}")
        counts = np.zeros(dataset.vocab_size, np.int64)  # real tokens per id, streamed
        for start in range(0, split.rows, 4096):
            real_mask = np.asarray(split.segments[start : start + 4096]) > 0
            counts += np.bincount(np.asarray(split.tokens[start : start + 4096])[real_mask]
                                  .astype(np.int64), minlength=dataset.vocab_size)
        real = int(counts.sum())
        if split.rows != s["rows"] or real != s["tokens"]:
            problems.append(f"{name}: arrays hold {split.rows} rows / {real} real tokens, "
                            f"manifest {s['rows']} / {s['tokens']}")
        if not np.array_equal(counts, dataset.unigram_counts(name)):
            problems.append(f"{name}: the stored unigram counts (evaluate's baseline) differ "
                            "from the arrays' tokens")
        listed = sum(1 for _ in dataset.documents(name))
        if listed != s["documents"]:
            problems.append(f"{name}: {listed} documents listed, manifest {s['documents']}")
    if kept != d["kept"]:
        problems.append(f"split documents sum to {kept}, manifest kept {d['kept']}")
    value = {"documents": d, "splits": {n: {k: m["splits"][n][k] for k in
                                              ("rows", "tokens", "pad_tokens", "documents")}
                                          for n in SPLITS}}
    if problems:
        return CheckResult("packing_accounting", False, value, "; ".join(problems))
    return CheckResult("packing_accounting", True, value,
                       f"read {d['read']} = kept {d['kept']} + duplicates {d['duplicates']} + "
                       f"skipped {d['skipped']}; rows x {seq_len} = tokens + pad in both "
                       "splits; arrays, unigram counts and documents.jsonl agree with the manifest")


def check_data_identity(dataset: Dataset) -> CheckResult:
    """Every byte of every data file against the sha256 the manifest recorded at prepare time,
    and the fingerprint against the identity it hashes (opening checks only sizes)."""
    problems = verify_files(dataset)
    if fingerprint(dataset.manifest["identity"]) != dataset.fingerprint:
        problems.insert(0, "the fingerprint does not hash the manifest's identity")
    n_files = len(dataset.manifest["identity"]["files"])
    value = {"fingerprint": dataset.fingerprint, "files": n_files,
             "mismatches": problems}
    if problems:
        return CheckResult("data_identity", False, value, "; ".join(problems))
    return CheckResult("data_identity", True, value,
                       f"{n_files} data files match their sha256; fingerprint "
                       f"{dataset.fingerprint[:12]} hashes the identity")
