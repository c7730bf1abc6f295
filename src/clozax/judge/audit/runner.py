"""Running the audit: the numbered checks in order, each isolated (a crashing custom piece is a
failed check), written as ``audit.json``."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import jax
import numpy as np

from clozax import __version__
from clozax.core import files, objective
from clozax.core.keys import Keys
from clozax.core.train_state import init_params
from clozax.core.vocab import Vocabulary
from clozax.data.dataset import Dataset
from clozax.judge.audit.accumulation_checks import (
    check_device_accumulation,
    check_microbatch_accumulation,
)
from clozax.judge.audit.data_checks import (
    check_data_disjoint,
    check_data_identity,
    check_eval_masks,
    check_packing_accounting,
    check_tokenizer,
    open_dataset_for_audit,
)
from clozax.judge.audit.distribution_checks import (
    check_corruption_mix,
    check_eligibility,
    sample_stats,
)
from clozax.judge.audit.objective_checks import (
    check_analytic_gradient,
    check_empty_selection,
    check_initial_loss,
    check_no_leak,
    check_unselected_zero_grad,
    dense_logit_gradients,
)
from clozax.judge.audit.pipeline import (
    CheckResult,
    Pipeline,
    default_boundary,
    default_logits_fn,
    default_make_step,
    default_masker,
    default_zero_head,
    train_batches,
)
from clozax.train.config import RunConfig
from clozax.train.run_dir import load_run, open_run_dataset

AUDIT_FILE = "audit.json"
CHECKS = (
    "no_leak", "corruption_mix", "initial_loss", "unselected_zero_grad", "analytic_gradient",
    "microbatch_accumulation", "device_accumulation", "eligibility", "data_disjoint",
    "tokenizer", "packing_accounting", "eval_masks", "empty_selection", "data_identity",
)
DATA_CHECKS = ("data_disjoint", "tokenizer", "packing_accounting", "data_identity")


def _safe(name: str, fn) -> CheckResult:
    try:
        return fn()
    except Exception as e:  # a broken custom piece is a failed check, not a crashed audit
        return CheckResult(name, False, None, f"error: {type(e).__name__}: {e}")


def run(
    config: RunConfig,
    dataset: Dataset,
    *,
    params=None,
    masker: Callable | None = None,
    logits_fn: Callable | None = None,
    loss_fn: Callable | None = None,
    make_step: Callable | None = None,
    boundary: Callable | None = None,
    zero_head: Callable | None = None,
    run_dir: Path | None = None,
    devices=None,
    batches: int = 200,
    leak_batches: int = 4,
    only: Collection[str] | None = None,
) -> dict:
    """Run the audit's checks on the pieces given (defaults: clozax's own for ``config``).

    ``params`` default to a fresh init from the run's init key. ``run_dir`` enables the
    run-file checks (tokenizer copy, eval masks). ``batches`` training batches feed the
    eligibility and corruption-mix counts, the first ``leak_batches`` the leak check.
    ``only`` restricts the checks run (names from ``CHECKS``). Returns the report dict:
    ``{"passed": bool, "checks": [{"number", "name", "passed", "value", "detail", "skipped"}]}``.
    """
    unknown = sorted(set(only or ()) - set(CHECKS))
    if unknown:
        raise ValueError(f"unknown audit check(s) {unknown}; valid: {', '.join(CHECKS)}")
    wanted = [c for c in CHECKS if only is None or c in only]
    vocab = Vocabulary(dataset.vocab_size, dataset.specials)
    keys = Keys.from_seed(config.train.seed)
    pipe = Pipeline(
        config=config, vocab=vocab, seq_len=dataset.seq_len,
        params=params if params is not None else init_params(config.model, config.train.seed),
        masker=masker or default_masker(config, vocab, dataset.seq_len),
        logits_fn=logits_fn or default_logits_fn(config.model),
        loss_fn=loss_fn or objective.masked_nll,
        make_step=make_step or default_make_step(vocab, dataset.seq_len),
        boundary=boundary or default_boundary,
        zero_head=zero_head or default_zero_head,
    )
    items = list(train_batches(dataset, config, keys, max(batches, leak_batches, 1)))
    key0, batch0 = items[0]
    lazy: dict[str, Any] = {}

    def stats():
        if "stats" not in lazy:
            lazy["stats"] = sample_stats(pipe, items[:max(batches, 1)])
        return lazy["stats"]

    def grads():
        if "grads" not in lazy:
            lazy["grads"] = dense_logit_gradients(pipe, key0, batch0)
        return lazy["grads"]

    run_dir = Path(run_dir) if run_dir is not None else None
    checks = {
        "no_leak": lambda: check_no_leak(pipe, items[:leak_batches]),
        "corruption_mix": lambda: check_corruption_mix(stats(), pipe),
        "initial_loss": lambda: check_initial_loss(pipe, key0, batch0),
        "unselected_zero_grad": lambda: check_unselected_zero_grad(grads()[0], grads()[2]),
        "analytic_gradient": lambda: check_analytic_gradient(grads()[0], grads()[1]),
        "microbatch_accumulation": lambda: check_microbatch_accumulation(pipe, batch0, keys.mask),
        "device_accumulation": lambda: check_device_accumulation(pipe, batch0, keys.mask,
                                                                 devices),
        "eligibility": lambda: check_eligibility(stats()),
        "data_disjoint": lambda: check_data_disjoint(dataset),
        "tokenizer": lambda: check_tokenizer(dataset, run_dir),
        "packing_accounting": lambda: check_packing_accounting(dataset),
        "eval_masks": lambda: (check_eval_masks(pipe, dataset, run_dir) if run_dir is not None
                               else CheckResult("eval_masks", True, "skipped",
                                                "SKIP: no run directory given", skipped=True)),
        "empty_selection": lambda: check_empty_selection(pipe, batch0),
        "data_identity": lambda: check_data_identity(dataset),
    }
    return _report([_safe(name, checks[name]) for name in wanted],
                   run=run_dir, data=dataset.path)


def _report(results: list[CheckResult], **paths) -> dict:
    checks = [{"number": CHECKS.index(r.name) + 1, **dataclasses.asdict(r)} for r in results]
    return {
        "passed": all(r.passed for r in results),
        "checks": json.loads(json.dumps(checks, default=_jsonable)),
        **{k: str(v) if v is not None else None for k, v in paths.items()},
        "devices": len(jax.devices()),
        "clozax_version": __version__,
        "jax_version": jax.__version__,
    }


def _jsonable(x):
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    return str(x)


def _write(report: dict, directory: Path) -> Path:
    path = Path(directory) / AUDIT_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    return files.write_json(path, report)


def audit_run(run_dir: Path, data: Path | None = None, *, batches: int = 200,
              devices=None) -> dict:
    """Audit a trained run with clozax's own pieces; writes ``RUN/audit.json``.

    The dataset is the one recorded in ``run.json`` unless ``data`` is given.
    """
    start = time.perf_counter()
    loaded = load_run(Path(run_dir))
    dataset = open_run_dataset(loaded, data, opener=open_dataset_for_audit)
    report = run(loaded.config, dataset, params=loaded.params, run_dir=loaded.path,
                 batches=batches, devices=devices)
    report["step"] = loaded.step
    report["seconds"] = round(time.perf_counter() - start, 2)
    report["written"] = str(_write(report, loaded.path))
    return report


def audit_data(data_dir: Path, out: Path | None = None) -> dict:
    """Data-only checks (before training); writes ``out/audit.json`` when ``out`` is given."""
    start = time.perf_counter()
    dataset = open_dataset_for_audit(Path(data_dir))
    results = [_safe(name, fn) for name, fn in (
        ("data_disjoint", lambda: check_data_disjoint(dataset)),
        ("tokenizer", lambda: check_tokenizer(dataset)),
        ("packing_accounting", lambda: check_packing_accounting(dataset)),
        ("data_identity", lambda: check_data_identity(dataset)),
    )]
    report = _report(results, run=None, data=dataset.path)
    report["seconds"] = round(time.perf_counter() - start, 2)
    report["written"] = str(_write(report, out)) if out is not None else None
    return report
