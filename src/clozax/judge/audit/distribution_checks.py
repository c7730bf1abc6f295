"""Checks of the corruption's statistics over many real training batches: eligibility (no pad or
special position selected, the mask id never a target, ...) and the keep/random mix."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from scipy.stats import binom

from clozax.core import masking
from clozax.core.masking import Kind
from clozax.core.vocab import Vocabulary
from clozax.judge.audit.pipeline import CheckResult, Pipeline, specials_key

INTERVAL = 0.999  # binomial interval of the corruption-mix check


def make_batch_stats(pipe: Pipeline):
    """Jitted per-batch counts used by the eligibility and corruption-mix checks."""
    return _batch_stats(pipe.masker, pipe.vocab.size, specials_key(pipe.vocab))


@functools.lru_cache(maxsize=8)
def _batch_stats(masker, size, specials):
    special = jnp.asarray(Vocabulary(size, dict(specials)).special_table())
    mask_id = int(dict(specials)["mask"])

    def stats(key, batch):
        masked, _ = masker(key, batch)
        tokens, sel, kind = batch["tokens"], masked.selected, masked.kind
        random = sel & (kind == Kind.RANDOM)
        return {
            "selected": jnp.sum(sel),
            "pad_selected": jnp.sum(sel & (batch["segments"] == 0)),
            "special_selected": jnp.sum(sel & special[tokens]),
            "mask_target": jnp.sum(sel & (masked.targets == mask_id)),
            "targets_not_clean": jnp.sum(masked.targets != tokens),
            "unselected_changed": jnp.sum(~sel & (masked.inputs != tokens)),
            "random": jnp.sum(random),
            "random_special": jnp.sum(random & special[masked.inputs]),
            "keep": jnp.sum(sel & (kind == Kind.KEEP)),
            "input_equals_target": jnp.sum(sel & (masked.inputs == tokens)),
        }

    return jax.jit(stats)


def sample_stats(pipe: Pipeline, items) -> dict:
    stats = make_batch_stats(pipe)
    totals: dict[str, int] = {}
    n = 0
    for key, batch in items:
        for name, value in stats(key, batch).items():
            totals[name] = totals.get(name, 0) + int(value)
        n += 1
    return {"batches": n, **totals}


def check_eligibility(stats: dict) -> CheckResult:
    bad = {name: stats[name] for name in ("pad_selected", "special_selected", "mask_target",
                                          "random_special", "unselected_changed",
                                          "targets_not_clean") if stats[name]}
    value = {k: stats[k] for k in ("batches", "selected", "pad_selected", "special_selected",
                                    "mask_target", "random_special", "unselected_changed",
                                    "targets_not_clean")}
    if stats["selected"] == 0:
        return CheckResult("eligibility", False, value,
                           f"{stats['batches']} batches had no selected position at all")
    if bad:
        detail = f"over {stats['batches']} batches: " + ", ".join(f"{k}={v}" for k, v in
                                                                   bad.items())
        return CheckResult("eligibility", False, value, detail)
    return CheckResult("eligibility", True, value,
                       f"{stats['selected']} selected positions in {stats['batches']} batches: "
                       "no pad/special selected, mask id never a target, random ids never "
                       "special, unselected inputs untouched")


def check_corruption_mix(stats: dict, pipe: Pipeline) -> CheckResult:
    policy = pipe.config.masking.policy
    pool = masking.allowed_random_ids(pipe.vocab.size, pipe.vocab.special_ids).size
    n, equal = stats["selected"], stats["input_equals_target"]
    p = policy.keep + policy.random / pool
    lo, hi = (int(x) for x in binom.interval(INTERVAL, n, p)) if n else (0, 0)
    passed = n > 0 and lo <= equal <= hi
    value = {"selected": n, "input_equals_target": equal, "fraction": equal / max(n, 1),
             "expected": p, "interval": [lo / max(n, 1), hi / max(n, 1)],
             "random_fraction": stats["random"] / max(n, 1),
             "keep_fraction": stats["keep"] / max(n, 1)}
    detail = (f"{equal}/{n} = {equal / max(n, 1):.4f} of selected inputs equal the target; "
              f"expected {p:.4f}, 99.9 % interval [{lo}, {hi}]")
    return CheckResult("corruption_mix", passed, value, detail)
