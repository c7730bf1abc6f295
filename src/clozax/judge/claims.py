"""The checkable claims a run's evaluation, probe and audit support, with the thresholds they
are held to, and the number formats they are stated in (the report and the demo print them)."""

from __future__ import annotations

import math

ACCURACY_RATIO = 2.0  # claim: held-out accuracy >= this many times the unigram baseline
SEPARATION_SE = 4.0  # claim: trained - random init accuracy > this many standard errors


def claims(evaluation: dict | None, probe: dict | None, audit: dict | None) -> list[dict]:
    """The demo's checkable claims: ``holds`` is True/False, or None when the input is missing."""
    out = []
    if evaluation is None:
        out += [{"claim": f"held-out accuracy ≥ {ACCURACY_RATIO:g}× unigram", "holds": None,
                 "detail": "not run (clozax evaluate)"},
                {"claim": "held-out accuracy clearly above random init", "holds": None,
                 "detail": "not run (clozax evaluate)"}]
    else:
        t, u, r = (evaluation[k]["accuracy"] for k in ("trained", "unigram", "random_init"))
        n = evaluation["trained"]["count"]
        ratio = t / u if u > 0 else math.inf
        detail = f"trained {pct(t)} vs unigram {pct(u)} ({ratio:.2f}×)"
        mask_t, mask_u = (evaluation[k].get("by_kind", {}).get("mask", {}).get("accuracy")
                          for k in ("trained", "unigram"))
        if mask_t is not None and mask_u:  # keep positions show the answer; say so
            detail += f"; [MASK] positions alone {pct(mask_t)} vs {pct(mask_u)} " \
                      f"({mask_t / mask_u:.2f}×)"
        out.append({"claim": f"held-out accuracy ≥ {ACCURACY_RATIO:g}× unigram",
                    "holds": bool(t >= ACCURACY_RATIO * u), "detail": detail})
        # Two binomial proportions on the same n selected positions (independence is an
        # approximation; the positions are shared, which only makes the difference less noisy).
        se = math.sqrt(max(t * (1 - t), 1e-12) / n + max(r * (1 - r), 1e-12) / n)
        out.append({"claim": "held-out accuracy clearly above random init",
                    "holds": bool(t - r > SEPARATION_SE * se),
                    "detail": f"trained {pct(t)} vs random init {pct(r)}: difference "
                              f"{(t - r) / se:.1f} standard errors (needs > {SEPARATION_SE:g})"})
    if probe is None:
        out.append({"claim": "probe: trained beats random init outside the 95 % CI",
                    "holds": None, "detail": "not run (clozax probe)"})
    else:
        tr, ri = probe["results"]["trained"], probe["results"]["random_init"]
        diff = probe["trained_minus_random_init"]
        holds = tr["accuracy"] > ri["ci95"][1] and diff["ci95"][0] > 0
        out.append({"claim": "probe: trained beats random init outside the 95 % CI",
                    "holds": bool(holds),
                    "detail": f"trained {pct(tr['accuracy'])} vs random init "
                              f"{pct(ri['accuracy'])} {ci(ri['ci95'])}; paired difference "
                              f"{pp(diff['accuracy'])} {ci(diff['ci95'], pp=True)}"})
    if audit is None:
        out.append({"claim": "audit passes", "holds": None, "detail": "not run (clozax audit)"})
    else:
        passed, total, skipped = audit_counts(audit)
        out.append({"claim": "audit passes", "holds": bool(audit.get("passed")),
                    "detail": f"{passed}/{total} checks pass"
                              + (f", {skipped} skipped" if skipped else "")})
    return out


def downstream_claims(finetune: dict | None) -> list[dict]:
    """Whether pretraining paid downstream at this budget, as the demo's own run can show it:
    fine-tuned on the built-in task (``clozax finetune``'s ``result.json``), the trained encoder
    clearly beats its random-init control and TF-IDF (the interval over seeds excludes 0). What
    the demo does not run (WordNet, the modern preset, an adapted published encoder) is
    ``holds`` None, with the command that measures it."""
    out = []
    for key, against in (("trained_minus_random_init", "its random-init control"),
                         ("trained_minus_tfidf", "TF-IDF")):
        claim = f"fine-tuned (built-in task): trained clearly beats {against}"
        d = (finetune or {}).get(key)
        if d is None:
            out.append({"claim": claim, "holds": None, "detail": "not run (clozax finetune)"})
            continue
        out.append({"claim": claim, "holds": is_clear(d) and d["mean"] > 0,
                    "detail": difference_words(d)})
    for claim, where in (
            ("the same on WordNet's categories", "benchmarks/downstream.py RUN --tasks wordnet"),
            ("modern-small beats its random-init control at this budget",
             "benchmarks/budget.py --candidates modern"),
            ("an adapted published encoder beats the same encoder not adapted",
             "benchmarks/adaptation.py: the peak chosen on validation, a second domain")):
        out.append({"claim": claim, "holds": None, "detail": f"not run by the demo ({where})"})
    return out


def audit_counts(audit: dict) -> tuple[int, int, int]:
    """(passed and not skipped, total, skipped)."""
    checks = audit.get("checks", [])
    skipped = sum(1 for c in checks if c.get("skipped"))
    passed = sum(1 for c in checks if c.get("passed") and not c.get("skipped"))
    return passed, len(checks), skipped


def pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def pp(x: float) -> str:
    return f"{100 * x:+.1f} pp"


def ci(interval, pp: bool = False) -> str:
    lo, hi = interval
    return f"[{100 * lo:+.1f}, {100 * hi:+.1f}] pp" if pp else f"[{100 * lo:.1f}, {100 * hi:.1f}]"


def seed_difference(a: list[float], b, level: float = 0.95) -> dict:
    """``mean(a) - mean(b)`` with its ``level`` interval over seeds: Welch's t interval when
    ``b`` is a list of per-seed scores, the one-sample t interval when ``b`` is one fixed number
    (a deterministic baseline: TF-IDF, the constant predictor). ``clear`` only when the interval
    excludes zero; with a single seed on a side there is no interval (``interval`` None, never
    clear, ``note`` says so). Nor when every seed scored the same on each side (no spread: a
    t interval is 0/0, not an exact zero-width one; the seeds did not vary the result, so they
    say nothing about how it would vary): ``interval`` None, never clear, ``same_on_every_seed``
    True and ``note`` "identical on every seed" (a difference of 0) or "the same on every
    seed"."""
    from scipy import stats

    fixed = not isinstance(b, (list, tuple))
    a, b = [float(x) for x in a], [float(b)] if fixed else [float(x) for x in b]
    mean = sum(a) / len(a) - sum(b) / len(b)
    out = {"mean": mean, "seeds": [len(a)] if fixed else [len(a), len(b)], "level": level}
    if len(a) < 2 or (not fixed and len(b) < 2):
        return {**out, "interval": None, "clear": False, "note": "one seed: no interval"}
    if len(set(a)) == 1 and len(set(b)) == 1:  # no spread over seeds: no interval, not clear
        same = "identical on every seed" if mean == 0.0 else "the same on every seed"
        return {**out, "interval": None, "clear": False, "same_on_every_seed": True,
                "note": f"{same}: no spread over seeds, no interval"}
    if fixed:  # the one-sample interval of a around b, shifted to a difference
        low, high = stats.ttest_1samp(a, b[0]).confidence_interval(level)
        low, high = low - b[0], high - b[0]
    else:
        low, high = stats.ttest_ind(a, b, equal_var=False).confidence_interval(level)
    return {**out, "interval": [float(low), float(high)],
            "clear": bool(low > 0.0 or high < 0.0)}


def difference_words(d: dict) -> str:
    """``+3.1 pp [+1.2, +5.0] pp (95 % interval over seeds, clear)`` — one line for a
    ``seed_difference`` (or for a result written before intervals, which had none)."""
    if "interval" not in d:
        return f"{pp(d['mean'])} (no interval recorded: rerun clozax finetune for one)"
    if d["interval"] is None:
        return f"{pp(d['mean'])} ({d['note']})"
    if d["interval"][0] == d["interval"][1]:  # written before zero spread had its own words
        return f"{pp(d['mean'])} (the same on every seed: no spread over seeds, no interval)"
    return f"{pp(d['mean'])} {ci(d['interval'], pp=True)} ({100 * d['level']:.0f} % interval " \
           f"over seeds{', clear' if d['clear'] else ', includes 0: not clear'})"


def is_clear(d: dict) -> bool:
    """A ``seed_difference``'s interval excludes 0 — and is an interval: a zero-width one (a
    result written when every seed scoring the same was called exact) is not clear."""
    interval = d.get("interval")
    return bool(d.get("clear") and interval is not None and interval[0] != interval[1])


def overlap_words(record: dict) -> str:
    """How a printed line says what was done with the overlap."""
    if record.get("test") == "unknown":
        return f"pretraining overlap unknown ({record.get('why')})"
    counts = f"{record['validation']} validation / {record['test']} test examples"
    if record.get("excluded", True):
        return f"pretraining overlap excluded: {counts}"
    return f"PRETRAINING OVERLAP KEPT: {counts} seen in pretraining are scored"


def accounting_lines(task: dict) -> list[str]:
    """What was dropped, capped or excluded from a task (``result.json``'s ``task``), one
    line each, for every command that prints a task's result."""
    lines = []
    if "pretraining_overlap" in task:
        lines.append(overlap_words(task["pretraining_overlap"]))
    sel = task.get("selection")
    if sel:
        lines.append(
            f"classes: {len(sel['classes'])} kept (>= {sel['min_examples']} training examples "
            f"and present in the held-out split); dropped "
            f"{sel['dropped_fewer_than_min_examples']['classes']} with fewer "
            f"({sel['dropped_fewer_than_min_examples']['examples']} examples) and "
            f"{sel['dropped_not_in_heldout']['classes']} absent from the held-out split "
            f"({sel['dropped_not_in_heldout']['examples']}); {sel['capped_away']} training "
            f"examples capped away (at most {sel['max_per_class']} per class)")
    dropped = task.get("unseen_label_dropped") or {}
    if dropped:
        lines.append("dropped for a label unseen in training: " + ", ".join(
            f"{n} {s}" for s, n in dropped.items()))
    truncated = {s: n for s, n in (task.get("truncated_to_seq_len") or {}).items() if n}
    if truncated:
        lines.append(f"cut to {task.get('seq_len')} tokens: " + ", ".join(
            f"{n} {s}" for s, n in truncated.items()))
    if task.get("train_capped_to"):
        lines.append(f"training examples capped to {task['train_capped_to']}")
    return lines
