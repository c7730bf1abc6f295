"""The report's sections as data for ``templates/report.html.j2``: tables (header, rows of
cells, numeric columns), cards, notes. Plain strings are escaped by the template; the few cells
that carry markup say so with ``Cell``."""

from __future__ import annotations

import hashlib
import json
import platform
from pathlib import Path
from typing import NamedTuple

from clozax.judge.claims import (
    accounting_lines,
    audit_counts,
    ci,
    claims,
    difference_words,
    pct,
    pp,
)
from clozax.report.figures import token_label


class Cell(NamedTuple):
    """A table cell rendered specially: ``kind`` is "badge" (``cls`` PASS/FAIL/SKIP/NA),
    "marked" (text with the target between ⟦ ⟧) or "code"."""

    text: str
    kind: str
    cls: str = ""


class Table(NamedTuple):
    header: list[str]
    rows: list[list]  # str or Cell
    numeric: frozenset = frozenset()  # right-aligned column indices
    groups: list | None = None  # a header row above: [(label, span)]


def badge(state: bool | None, text: str | None = None) -> Cell:
    cls = "NA" if state is None else ("PASS" if state else "FAIL")
    return Cell(text or ("not run" if state is None else cls), "badge", cls)


def marked(text: str) -> Cell:
    return Cell(text, "marked")


def card(key: str, value: str, note: str, command: str | None = None) -> dict:
    """A headline card; ``command`` is shown as code after the note."""
    return {"key": key, "value": value, "note": note, "command": command}


def measured_steps(ev: dict | None, probe: dict | None, audit: dict | None) -> str | None:
    """A warning when the headline's results come from different checkpoint steps."""
    steps = {name: r.get("step") for name, r in (("evaluate", ev), ("probe", probe),
                                                  ("audit", audit))
             if r is not None and r.get("step") is not None}
    if len(set(steps.values())) <= 1:
        return None
    said = ", ".join(f"{name} at step {step}" for name, step in steps.items())
    return (f"These results are of different checkpoints ({said}): run them with one --step "
            "to compare like with like.")


def _at(result: dict) -> str:
    return f" · step {result['step']}" if result.get("step") is not None else ""


def headline(ev: dict | None, probe: dict | None, audit: dict | None) -> dict:
    cards = []
    if ev is not None:
        # The headline compares runs: at the fixed 15 % when the run's own rate is another.
        fixed = ev.get("fixed_rate")
        at = fixed or ev
        t, u, r = (at[k]["accuracy"] for k in ("trained", "unigram", "random_init"))
        ratio = f"{t / u:.2g}×" if u > 0 else "∞×"
        own = (f" The run's own {ev['schedule']['rate']:.0%} masks: "
               f"{pct(ev['trained']['accuracy'])}." if fixed else "")
        title = f"held-out masked-token accuracy{' at 15 %' if fixed else ''}{_at(ev)}"
        cards.append(card(title, pct(t), f"{ratio} the unigram baseline ({pct(u)}); random init "
                          f"{pct(r)}; {at['trained']['count']:,} positions.{own}"))
        tp, up = ev["trained"]["perplexity"], ev["unigram"]["perplexity"]
        cards.append(card(f"held-out perplexity{_at(ev)}", f"{tp:,.0f}",
                          f"unigram {up:,.0f}, random init "
                          f"{ev['random_init']['perplexity']:,.0f}: lower is better."))
    else:
        cards.append(card("held-out accuracy", "—", "not run: ", "clozax evaluate RUN"))
    if probe is not None:
        res = probe["results"]
        tr, ri, tf = res["trained"], res["random_init"], res["tfidf"]
        d = probe["trained_minus_random_init"]
        verdict = ("pretraining helps the linear probe" if d["ci95"][0] > 0 else
                   "no difference from random init that the CI can resolve")
        if tf["accuracy"] > tr["accuracy"]:
            verdict += "; bag-of-words TF-IDF is still stronger at this scale"
        cards.append(card(f"probe accuracy (unseen modules){_at(probe)}", pct(tr["accuracy"]),
                          f"95 % CI {ci(tr['ci95'])}; random init {pct(ri['accuracy'])} "
                          f"{ci(ri['ci95'])}; TF-IDF {pct(tf['accuracy'])}. {verdict}."))
    else:
        cards.append(card("probe accuracy", "—", "not run: ", "clozax probe RUN"))
    if audit is not None:
        passed, total, skipped = audit_counts(audit)
        skip_note = f" {skipped} skipped (see table)." if skipped else ""
        cards.append(card(f"objective audit{_at(audit)}", f"{passed}/{total} PASS",
                          ("no leak, exact gradients, token-weighted accumulation, disjoint "
                           "splits." if audit.get("passed") else "at least one check FAILED — "
                           "see the audit table.") + skip_note))
    else:
        cards.append(card("objective audit", "—", "not run: ", "clozax audit RUN"))
    rows = [[c["claim"], badge(c["holds"], None if c["holds"] is None else
                               ("holds" if c["holds"] else "does not hold")), c["detail"]]
            for c in claims(ev, probe, audit)]
    return {"cards": cards, "claims": Table(["claim", "result", "measured"], rows),
            "mixed_steps": measured_steps(ev, probe, audit)}


def evaluation(ev: dict, current_step: int | None) -> dict:
    models = ("trained", "unigram", "random_init")
    rows = []
    for kind in ("all", "mask", "random", "keep"):
        per = [ev[m] if kind == "all" else ev[m]["by_kind"].get(kind, {}) for m in models]
        if not per[0].get("count"):
            continue
        cells = [kind if kind != "all" else "all selected", f"{per[0]['count']:,}"]
        cells += [pct(p["accuracy"]) for p in per] + [pct(p["top5_accuracy"]) for p in per]
        cells += [f"{p['loss']:.3f}" for p in per]
        rows.append(cells)
    header = ["corruption kind", "positions"] + ["trained", "unigram", "random init"] * 3
    groups = [("", 2), ("accuracy (top-1)", 3), ("top-5 accuracy", 3), ("loss (nats)", 3)]
    stale = None
    if current_step is not None and ev.get("step") != current_step:
        stale = {"eval_step": ev.get("step"), "current": current_step}
    transfer = None
    if ev.get("transfer"):
        tr = ev["transfer"]
        diff = tr.get("difference", {})
        transfer = {"label": tr.get("label", ""), "mask_seed": tr.get("mask_seed"),
                    "accuracy": pct(tr["trained"]["accuracy"]),
                    "accuracy_diff": pp(diff.get("accuracy", 0.0)),
                    "loss": f"{tr['trained']['loss']:.3f}",
                    "loss_diff": f"{diff.get('loss', 0.0):+.3f}"}
    return {"table": Table(header, rows, frozenset(range(1, 11)), groups),
            "schedule": ev.get("schedule", {}), "step": ev.get("step"), "stale": stale,
            "transfer": transfer}


def _val_accuracy(result: dict) -> str:
    """Validation accuracy at the chosen C (probe.json stores one per C of the grid)."""
    val = result.get("val_accuracy")
    if isinstance(val, dict):
        c = result.get("C")
        chosen = [val[k] for k in (f"{c:g}" if isinstance(c, int | float) else None, str(c))
                  if k in val]
        val = chosen[0] if chosen else max(val.values(), default=None)
    return pct(val) if isinstance(val, int | float) else "—"


def probe_section(probe: dict) -> dict:
    names = {"trained": "trained encoder (frozen)", "random_init": "random-init encoder (frozen)",
             "tfidf": "TF-IDF"}
    rows = [[label, pct(r["accuracy"]), ci(r["ci95"]), f"{r.get('C')}", _val_accuracy(r)]
            for key, label in names.items() if (r := probe["results"].get(key))]
    d = probe["trained_minus_random_init"]
    rows.append(["trained − random init (paired)", pp(d["accuracy"]), ci(d["ci95"], pp=True),
                 "", ""])
    rows.append(["majority class", pct(probe["majority_class_accuracy"]), "", "", ""])
    task = probe.get("task", {})
    classes = task.get("classes", {})
    split = task.get("split", {})
    facts = f"{task.get('source')}; {len(classes)} classes kept ({', '.join(classes)})"
    if split:
        facts += "; " + ", ".join(
            f"{name} {part.get('examples')} examples"
            + (f" in {part['groups']} groups" if part.get("groups") else "")
            for name, part in split.items())
    facts += "".join(f"; {line}" for line in accounting_lines(task))
    return {"table": Table(["features", "test accuracy", "95 % CI", "C", "val accuracy"], rows,
                           frozenset({1, 2, 3, 4})),
            "facts": facts, "features": probe.get("features", ""),
            "classifier": probe.get("classifier", ""), "bootstrap": str(probe.get("bootstrap"))}


def finetune_section(result: dict) -> dict:
    """One fine-tuned task (``RUN/finetune/TASK/result.json``): each encoder at the rate chosen
    on validation, its test metric's mean ± std over seeds and worst seed, then the baselines."""
    task, metric = result["task"], result["task"]["metric"]

    def num(x):
        return f"{x:.4f}"

    rows = []
    for name, r in result["encoders"].items():
        sel = r["selected"]
        m = sel["test"][metric]
        rows.append([name.replace("_", "-") + " encoder", f"{sel['learning_rate']:g}",
                     f"{num(m['mean'])} ± {num(m['std'])}", num(m["worst"]),
                     f"{sel['seconds_per_job']:.1f}"])
    if "tfidf" in result:
        rows.append(["TF-IDF + logistic regression", f"C={result['tfidf']['C']:g}",
                     num(result["tfidf"]["test"][metric]), "", ""])
    rows.append(["constant predictor", "", num(result["constant_baseline"]["test"][metric]),
                 "", ""])
    d = result.get("trained_minus_random_init")
    ex = task["examples"]
    facts = (f"{task['name']} ({task['kind']}, {task['source']}): train {ex['train']}, "
             f"validation {ex['validation']}, test {ex['test']} examples; "
             f"{result['protocol']['seeds']} seeds × learning rates "
             f"{result['protocol']['learning_rates']}, {result['protocol']['epochs']} epochs, "
             f"{result['protocol']['head']} head")
    if d:
        facts += f"; trained − random init {difference_words(d)}"
    if result.get("trained_minus_tfidf"):
        facts += f"; trained − TF-IDF {difference_words(result['trained_minus_tfidf'])}"
    facts += "".join(f"; {line}" for line in accounting_lines(task))
    return {"table": Table(["encoder", "learning rate", f"test {metric} (mean ± std)",
                            "worst seed", "s / job"], rows, frozenset({1, 2, 3, 4})),
            "facts": facts}


RETRIEVAL_ROWS = (("bm25", "BM25"), ("raw", "raw encoder (no stage)"),
                  ("this_stage", "this stage's run"), ("random_init_stage", "random init + stage"),
                  ("trained_stage", "trained + stage"))


def retrieval_section(result: dict) -> dict:
    """``RUN/retrieval.json`` (``clozax retrieval``): each row's nDCG@10, MRR@10 and
    Recall@100 (a stage row: the mean over seeds and the worst seed's nDCG@10), and the
    differences with their intervals."""
    rows = []
    for key, name in RETRIEVAL_ROWS:
        r = result["rows"].get(key)
        if r is None:
            continue
        worst = (f"{min(s['ndcg@10'] for s in r['per_seed']):.4f}" if "per_seed" in r else "")
        rows.append([name, f"{r['ndcg@10']:.4f}", worst, f"{r['mrr@10']:.4f}",
                     f"{r['recall@100']:.4f}"])
    st, found = result["stage"], result["set"]
    facts = (f"{found['queries']:,} queries over {found['documents']:,} documents "
             f"({found['construction']}); stage: {st['pairs']} pairs, {st['steps']} steps of "
             f"{st['batch_size']}, {st['seeds']} seeds")
    facts += "".join(f"; nDCG@10 {name.replace('_', ' ')} {difference_words(d)}"
                     for name, d in result["differences_ndcg@10"].items())
    return {"table": Table(["encoder", "nDCG@10 (mean over seeds)", "worst seed", "MRR@10",
                            "Recall@100"], rows, frozenset({1, 2, 3, 4})), "facts": facts}


def panel_table(panel: list[dict]) -> Table:
    rows = [[marked(x["text"]), token_label(x["target"]), x["kind"],
             f"{x['target_probability']:.3f}", str(x["target_rank"] + 1),
             ", ".join(f"{token_label(t)} {p:.2f}" for t, p in x["top"])] for x in panel]
    return Table(["context (target marked)", "target", "kind", "p(target)", "rank",
                  "top predictions"], rows, frozenset({3, 4}))


def failures_table(cases: list[dict]) -> Table:
    rows = [[marked(c["text"]), token_label(c["target"]), c["kind"],
             token_label(c.get("input_token", "")), f"{c['target_probability']:.2e}",
             ", ".join(f"{token_label(t)} {p:.2f}" for t, p in c["top5"])] for c in cases]
    return Table(["context (target marked)", "target", "kind", "input", "p(target)",
                  "top-5 predictions"], rows, frozenset({4}))


def _compact(value, depth: int = 0) -> str:
    """A check's value on one line: floats to 4 significant digits, long lists shortened."""
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        return "; ".join(f"{k} {_compact(v, depth + 1)}" for k, v in value.items())
    if isinstance(value, list | tuple):
        items = [_compact(v, depth + 1) for v in value[:6]]
        return "[" + ", ".join(items) + (", …" if len(value) > 6 else "") + "]"
    if isinstance(value, str) and len(value) > 24 and " " not in value:  # hashes, paths
        return value[:12] + "…"
    return str(value)


def audit_table(audit: dict) -> Table:
    rows = []
    for c in audit.get("checks", []):
        state = "SKIP" if c.get("skipped") else ("PASS" if c.get("passed") else "FAIL")
        rows.append([str(c.get("number", "")), c.get("name", ""), Cell(state, "badge", state),
                     _compact(c.get("value", ""))[:200], str(c.get("detail", ""))])
    return Table(["#", "check", "result", "value", "detail"], rows, frozenset({0}))


def provenance(run_dir: Path, info: dict, masks_meta: dict | None, ev: dict | None,
               probe: dict | None, step: int | None, versions: dict) -> Table:
    tok = run_dir / "tokenizer.json"
    tok_state = "missing"
    if tok.is_file():
        same = hashlib.sha256(tok.read_bytes()).hexdigest() == info.get("tokenizer_sha256")
        tok_state = "file matches" if same else "FILE DIFFERS"
    mask_sha = (masks_meta or {}).get("sha256")
    mask_state = ""
    if ev is not None and mask_sha:
        mask_state = (" (eval.json used this set)" if ev.get("eval_masks_sha256") == mask_sha
                      else " (eval.json used a DIFFERENT set)")
    rows = [
        ("run directory", str(run_dir.absolute())),
        ("checkpoint step", str(step) if step is not None else "no checkpoint"),
        ("trained with", f"clozax {info.get('clozax_version')}, jax {info.get('jax_version')}"),
        ("report made with", f"clozax {versions['clozax']}, jax {versions['jax']}, Python "
                             f"{platform.python_version()}"),
        ("seeds", f"train.seed {info.get('seed')} (init, data and mask keys), eval seed "
                  f"{info.get('eval_seed')}" + (f", probe seed {probe['task'].get('seed')}"
                                                 if probe else "")),
        ("dataset", str(info.get("dataset"))),
        ("dataset fingerprint", str(info.get("dataset_fingerprint"))),
        ("tokenizer sha256", f"{info.get('tokenizer_sha256')} ({tok_state})"),
        ("eval-mask sha256", f"{mask_sha}{mask_state}"),
        ("initialised from", str(info.get("init_from"))),
    ]
    return Table(["", ""], [[k, Cell(v, "code")] for k, v in rows])


def config_json(config: dict) -> str:
    return json.dumps(config, indent=2, sort_keys=True)
