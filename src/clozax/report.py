"""``clozax report RUN``: one self-contained HTML page (inline CSS, figures as base64 PNG) from
what a run directory holds, plus the figures as PNG files in ``RUN/report/``.

It reads ``config.json``, ``run.json``, ``metrics.jsonl``, ``eval_masks.json`` and, when present,
``eval.json`` + ``failures.jsonl`` (``clozax evaluate``), ``probe.json`` (``clozax probe``) and
``audit.json`` (``clozax audit``); a missing file makes its section say "not run". The
probability panel runs the latest checkpoint on a fixed, result-independent choice of held-out
positions (``panel_positions``), so it needs the checkpoint and the run's dataset.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import html
import json
import math
import platform
from pathlib import Path

import numpy as np

REPORT_FILE = "report.html"
FIGURE_DIR = "report"
PANEL_EXAMPLES = 6
PANEL_TOP = 5
FAILURES_SHOWN = 10
ACCURACY_RATIO = 2.0  # claim: held-out accuracy >= this many times the unigram baseline
SEPARATION_SE = 4.0  # claim: trained - random init accuracy > this many standard errors


# --------------------------------------------------------------------------- reading


def _read_json(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError:
        return None


def _read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by a kill mid-write
            continue
    return out


def training_curves(records: list[dict]) -> dict[str, np.ndarray]:
    """Train loss and held-out loss/accuracy against tokens; a resumed run may log a step twice,
    the last record of a step wins."""
    by_step = {int(r["step"]): r for r in records if "step" in r}
    steps = sorted(by_step)
    train = [by_step[s] for s in steps if "loss" in by_step[s] and "tokens" in by_step[s]]
    held = [by_step[s] for s in steps if isinstance(by_step[s].get("eval"), dict)
            and "loss" in by_step[s]["eval"]]
    return {
        "train_tokens": np.array([r["tokens"] for r in train], float),
        "train_loss": np.array([r["loss"] for r in train], float),
        "eval_tokens": np.array([r["tokens"] for r in held], float),
        "eval_loss": np.array([r["eval"]["loss"] for r in held], float),
        "eval_accuracy": np.array([r["eval"]["accuracy"] for r in held], float),
    }


# --------------------------------------------------------------------------- claims


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
        detail = f"trained {_pct(t)} vs unigram {_pct(u)} ({ratio:.2f}×)"
        mask_t, mask_u = (evaluation[k].get("by_kind", {}).get("mask", {}).get("accuracy")
                          for k in ("trained", "unigram"))
        if mask_t is not None and mask_u:  # keep positions show the answer; say so
            detail += f"; [MASK] positions alone {_pct(mask_t)} vs {_pct(mask_u)} " \
                      f"({mask_t / mask_u:.2f}×)"
        out.append({"claim": f"held-out accuracy ≥ {ACCURACY_RATIO:g}× unigram",
                    "holds": bool(t >= ACCURACY_RATIO * u), "detail": detail})
        # Two binomial proportions on the same n selected positions (independence is an
        # approximation; the positions are shared, which only makes the difference less noisy).
        se = math.sqrt(max(t * (1 - t), 1e-12) / n + max(r * (1 - r), 1e-12) / n)
        out.append({"claim": "held-out accuracy clearly above random init",
                    "holds": bool(t - r > SEPARATION_SE * se),
                    "detail": f"trained {_pct(t)} vs random init {_pct(r)}: difference "
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
                    "detail": f"trained {_pct(tr['accuracy'])} vs random init "
                              f"{_pct(ri['accuracy'])} {_ci(ri['ci95'])}; paired difference "
                              f"{_pp(diff['accuracy'])} {_ci(diff['ci95'], pp=True)}"})
    if audit is None:
        out.append({"claim": "audit passes", "holds": None, "detail": "not run (clozax audit)"})
    else:
        passed, total, skipped = _audit_counts(audit)
        out.append({"claim": "audit passes", "holds": bool(audit.get("passed")),
                    "detail": f"{passed}/{total} checks pass"
                              + (f", {skipped} skipped" if skipped else "")})
    return out


def _audit_counts(audit: dict) -> tuple[int, int, int]:
    """(passed and not skipped, total, skipped)."""
    checks = audit.get("checks", [])
    skipped = sum(1 for c in checks if c.get("skipped"))
    passed = sum(1 for c in checks if c.get("passed") and not c.get("skipped"))
    return passed, len(checks), skipped


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def _pp(x: float) -> str:
    return f"{100 * x:+.1f} pp"


def _ci(ci, pp: bool = False) -> str:
    lo, hi = ci
    return f"[{100 * lo:+.1f}, {100 * hi:+.1f}] pp" if pp else f"[{100 * lo:.1f}, {100 * hi:.1f}]"


# --------------------------------------------------------------------------- probability panel


def panel_positions(masks, n: int = PANEL_EXAMPLES) -> list[tuple[int, int]]:
    """(mask-set index, slot) of ``n`` positions chosen without looking at any prediction: evenly
    spaced eval rows, in each the first selected slot replaced by [MASK] (else the first one)."""
    from clozax.masking import Kind

    chosen = []
    for i in np.unique(np.linspace(0, masks.rows.size - 1, n).round().astype(int)):
        valid = np.nonzero(masks.valid[i])[0]
        if valid.size == 0:
            continue
        masked = [j for j in valid if int(masks.kinds[i, j]) == Kind.MASK]
        chosen.append((int(i), int(masked[0] if masked else valid[0])))
    return chosen


def probability_panel(run, n: int = PANEL_EXAMPLES) -> list[dict]:
    """The trained model's target probability and top predictions at ``panel_positions``."""
    from tokenizers import Tokenizer

    from clozax import evaluate as ev
    from clozax.masking import KIND_NAMES, Kind

    dataset = ev.open_run_dataset(run)
    masks, _ = ev.load_eval_masks(run.path)
    chosen = panel_positions(masks, n)
    if not chosen:
        return []
    idx = np.array([i for i, _ in chosen])
    sub = ev.EvalMasks(*(a[idx] for a in masks))
    slot_fn = ev.make_slot_fn(run.config.model, PANEL_TOP)
    out = ev.slot_outputs(run.params, run.config.model, dataset.heldout, sub,
                          batch_size=len(chosen), slot_fn=slot_fn)
    tokenizer = Tokenizer.from_file(str(run.tokenizer_path))
    special_ids = sorted(set(dataset.specials.values()))
    examples = []
    for k, (_, j) in enumerate(chosen):
        row, position = int(sub.rows[k]), int(sub.positions[k, j])
        tokens = np.asarray(dataset.heldout.tokens[row])
        examples.append({
            "row": row,
            "position": position,
            "kind": KIND_NAMES[Kind(int(sub.kinds[k, j]))],
            "target": ev.token_text(tokenizer, int(tokens[position])),
            "target_probability": float(np.exp(-out.nll[k, j])),
            "target_rank": int(out.rank[k, j]),
            "top": [[ev.token_text(tokenizer, t), float(p)]
                    for t, p in zip(out.top_ids[k, j], out.top_probs[k, j], strict=True)],
            "text": ev.marked_context(tokenizer, tokens, np.asarray(dataset.heldout.segments[row]),
                                      position, special_ids, width=20),
        })
    return examples


def _tok(text: str) -> str:
    return text.strip().replace("\n", "⏎") or repr(text)


# --------------------------------------------------------------------------- figures


def _figures(run_dir: Path, curves: dict, evaluation: dict | None, panel: list[dict] | None,
             vocab_size: int) -> dict[str, Path]:
    from clozax import figures

    fig_dir = run_dir / FIGURE_DIR
    fig_dir.mkdir(exist_ok=True)
    out = {}
    if curves["train_tokens"].size or curves["eval_tokens"].size:
        series = {}
        if curves["train_tokens"].size:
            series["training loss (batch)"] = (curves["train_tokens"], curves["train_loss"])
        if curves["eval_tokens"].size:
            series["held-out loss (frozen masks)"] = (curves["eval_tokens"], curves["eval_loss"])
        hlines = {f"uniform ln V = {math.log(vocab_size):.2f}": math.log(vocab_size)}
        if evaluation is not None:
            hlines[f"unigram held-out = {evaluation['unigram']['loss']:.2f}"] = \
                evaluation["unigram"]["loss"]
        out["loss"] = figures.line_plot(
            fig_dir / "loss.png", series, xlabel="tokens seen", ylabel="cross-entropy (nats)",
            title="Masked-token loss", hlines=hlines)
    if curves["eval_tokens"].size:
        hlines = {}
        if evaluation is not None:
            hlines = {f"unigram = {_pct(evaluation['unigram']['accuracy'])}":
                      evaluation["unigram"]["accuracy"],
                      f"random init = {_pct(evaluation['random_init']['accuracy'])}":
                      evaluation["random_init"]["accuracy"]}
        out["accuracy"] = figures.line_plot(
            fig_dir / "accuracy.png",
            {"trained (held-out, frozen masks)": (curves["eval_tokens"],
                                                  curves["eval_accuracy"])},
            xlabel="tokens seen", ylabel="masked-token accuracy (top-1)",
            title="Held-out accuracy", hlines=hlines)
    if panel:
        probs = [[e["target_probability"]] + [p for _, p in e["top"]] for e in panel]
        labels = [[_tok(e["target"])] + [_tok(t) for t, _ in e["top"]] for e in panel]
        rows = [f"“{_tok(e['target'])}” (row {e['row']}, pos {e['position']})" for e in panel]
        columns = ["target"] + [f"top {k + 1}" for k in range(PANEL_TOP)]
        out["panel"] = figures.token_panel(
            fig_dir / "probabilities.png", probs, labels, rows=rows, columns=columns,
            title="Trained model on held-out positions: target and top predictions")
    return out


# --------------------------------------------------------------------------- HTML

CSS = """
:root { --ink:#1f2430; --muted:#5b6475; --line:#e3e6ec; --bg:#fafbfc; --accent:#3558d4;
  --pass:#1a7f37; --fail:#c62828; --skip:#a36a00; }
* { box-sizing:border-box; }
body { margin:0; background:var(--bg); color:var(--ink);
  font:15px/1.55 -apple-system,"Segoe UI",Roboto,"Helvetica Neue",Arial,"DejaVu Sans",sans-serif; }
main { max-width:1120px; margin:0 auto; padding:32px 28px 64px; }
h1 { font-size:28px; margin:0 0 4px; } h2 { font-size:21px; margin:40px 0 8px;
  padding-bottom:6px; border-bottom:2px solid var(--line); }
h3 { font-size:16px; margin:20px 0 6px; }
p.sub, .note { color:var(--muted); } .note { font-size:13.5px; }
.cards { display:grid; grid-template-columns:repeat(auto-fit,minmax(240px,1fr)); gap:14px;
  margin:18px 0; }
.card { background:#fff; border:1px solid var(--line); border-radius:10px; padding:14px 16px; }
.card .k { font-size:12.5px; text-transform:uppercase; letter-spacing:.04em; color:var(--muted); }
.card .v { font-size:26px; font-weight:650; margin:2px 0; font-variant-numeric:tabular-nums; }
.card .i { font-size:13.5px; color:var(--muted); }
table { border-collapse:collapse; width:100%; background:#fff; border:1px solid var(--line);
  font-size:14px; margin:8px 0 4px; }
th, td { padding:7px 10px; border-bottom:1px solid var(--line); text-align:left;
  vertical-align:top; }
th { background:#f1f3f7; font-weight:600; } tr:nth-child(even) td { background:#fbfcfd; }
td { overflow-wrap:break-word; } .wrap { overflow-x:auto; }
td.n, th.n { text-align:right; font-variant-numeric:tabular-nums; white-space:nowrap; }
.badge { display:inline-block; padding:1px 8px; border-radius:10px; font-size:12px;
  font-weight:700; color:#fff; white-space:nowrap; }
.PASS { background:var(--pass); } .FAIL { background:var(--fail); }
.SKIP { background:var(--skip); }
.NA { background:#8a93a3; }
mark { background:#ffe08a; padding:0 2px; border-radius:3px; font-weight:600; }
code, pre { font-family:"DejaVu Sans Mono",Menlo,Consolas,monospace; font-size:12.5px; }
pre { background:#fff; border:1px solid var(--line); border-radius:8px; padding:12px;
  overflow:auto; max-height:420px; }
figure { margin:14px 0; background:#fff; border:1px solid var(--line); border-radius:10px;
  padding:10px; } figure img { max-width:100%; display:block; margin:0 auto; }
figcaption { color:var(--muted); font-size:13.5px; margin-top:6px; }
.grid2 { display:grid; grid-template-columns:1fr 1fr; gap:14px; }
@media (max-width:900px) { .grid2 { grid-template-columns:1fr; } }
.notrun { color:var(--muted); font-style:italic; background:#fff; border:1px dashed var(--line);
  border-radius:8px; padding:10px 14px; }
"""

e = html.escape


def _badge(state: bool | None, text: str | None = None) -> str:
    cls = "NA" if state is None else ("PASS" if state else "FAIL")
    return f'<span class="badge {cls}">{e(text or ("not run" if state is None else cls))}</span>'


def _table(header: list[str], rows: list[list[str]], numeric: set[int] = frozenset(),
           groups: list[tuple[str, int]] | None = None) -> str:
    """``rows`` cells are already HTML; ``groups`` adds a header row of (label, span)."""
    top = ""
    if groups:
        top = "<tr>" + "".join(f'<th colspan="{span}" style="text-align:center">{e(label)}</th>'
                               for label, span in groups) + "</tr>"
    th = "".join(f'<th class="{"n" if i in numeric else ""}">{e(h)}</th>'
                 for i, h in enumerate(header))
    body = "".join("<tr>" + "".join(f'<td class="{"n" if i in numeric else ""}">{c}</td>'
                                    for i, c in enumerate(r)) + "</tr>" for r in rows)
    return f'<div class="wrap"><table><thead>{top}<tr>{th}</tr></thead><tbody>{body}</tbody>' \
        "</table></div>"


def _img(path: Path, alt: str, caption: str) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return (f'<figure><img alt="{e(alt)}" src="data:image/png;base64,{data}">'
            f"<figcaption>{caption}</figcaption></figure>")


def _notrun(what: str, command: str) -> str:
    return f'<p class="notrun">{e(what)}: not run — <code>{e(command)}</code></p>'


def _marked(text: str) -> str:
    return e(text).replace("⟦", "<mark>").replace("⟧", "</mark>")


def _card(key: str, value: str, interpretation: str) -> str:
    return (f'<div class="card"><div class="k">{e(key)}</div><div class="v">{e(value)}</div>'
            f'<div class="i">{interpretation}</div></div>')


def _headline(ev: dict | None, probe: dict | None, audit: dict | None) -> str:
    cards = []
    if ev is not None:
        t, u, r = (ev[k]["accuracy"] for k in ("trained", "unigram", "random_init"))
        ratio = f"{t / u:.2g}×" if u > 0 else "∞×"
        cards.append(_card("held-out masked-token accuracy", _pct(t),
                           f"{ratio} the unigram baseline ({_pct(u)}); random init {_pct(r)}; "
                           f"{ev['trained']['count']:,} positions."))
        tp, up = ev["trained"]["perplexity"], ev["unigram"]["perplexity"]
        cards.append(_card("held-out perplexity", f"{tp:,.0f}",
                           f"unigram {up:,.0f}, random init "
                           f"{ev['random_init']['perplexity']:,.0f}: lower is better."))
    else:
        cards.append(_card("held-out accuracy", "—", "not run: <code>clozax evaluate RUN</code>"))
    if probe is not None:
        res = probe["results"]
        tr, ri, tf = res["trained"], res["random_init"], res["tfidf"]
        d = probe["trained_minus_random_init"]
        verdict = ("pretraining helps the linear probe" if d["ci95"][0] > 0 else
                   "no difference from random init that the CI can resolve")
        if tf["accuracy"] > tr["accuracy"]:
            verdict += "; bag-of-words TF-IDF is still stronger at this scale"
        cards.append(_card("probe accuracy (unseen modules)", _pct(tr["accuracy"]),
                           f"95 % CI {_ci(tr['ci95'])}; random init {_pct(ri['accuracy'])} "
                           f"{_ci(ri['ci95'])}; TF-IDF {_pct(tf['accuracy'])}. {verdict}."))
    else:
        cards.append(_card("probe accuracy", "—", "not run: <code>clozax probe RUN</code>"))
    if audit is not None:
        passed, total, skipped = _audit_counts(audit)
        skip_note = f" {skipped} skipped (see table)." if skipped else ""
        cards.append(_card("objective audit", f"{passed}/{total} PASS",
                           ("no leak, exact gradients, token-weighted accumulation, disjoint "
                            "splits." if audit.get("passed") else "at least one check FAILED — "
                            "see the audit table.") + skip_note))
    else:
        cards.append(_card("objective audit", "—", "not run: <code>clozax audit RUN</code>"))
    rows = [[e(c["claim"]), _badge(c["holds"], None if c["holds"] is None else
                                   ("holds" if c["holds"] else "does not hold")), e(c["detail"])]
            for c in claims(ev, probe, audit)]
    return ('<div class="cards">' + "".join(cards) + "</div><h3>Claims</h3>"
            + _table(["claim", "result", "measured"], rows))


def _eval_section(ev: dict | None, current_step: int | None) -> str:
    if ev is None:
        return _notrun("Held-out evaluation", "clozax evaluate RUN")
    models = ("trained", "unigram", "random_init")
    rows = []
    for kind in ("all", "mask", "random", "keep"):
        per = [ev[m] if kind == "all" else ev[m]["by_kind"].get(kind, {}) for m in models]
        if not per[0].get("count"):
            continue
        cells = [e(kind if kind != "all" else "all selected"), f"{per[0]['count']:,}"]
        cells += [_pct(p["accuracy"]) for p in per] + [_pct(p["top5_accuracy"]) for p in per]
        cells += [f"{p['loss']:.3f}" for p in per]
        rows.append(cells)
    header = ["corruption kind", "positions"] + ["trained", "unigram", "random init"] * 3
    groups = [("", 2), ("accuracy (top-1)", 3), ("top-5 accuracy", 3), ("loss (nats)", 3)]
    s = ev.get("schedule", {})
    note = (f"Frozen eval-mask set: {s.get('rows')} held-out rows, {s.get('selected')} selected "
            f"positions, rate {s.get('rate')} ({s.get('unit')}), corruption "
            f"{s.get('corruption')}, eval seed {s.get('eval_seed')}; checkpoint step "
            f"{ev.get('step')}. Every number is one sum over all selected positions divided once "
            "by their count. <i>keep</i> positions show the original token, so they are easier.")
    stale = ""
    if current_step is not None and ev.get("step") != current_step:
        stale = (f'<p class="notrun">eval.json is from step {ev.get("step")} but the latest '
                 f"checkpoint is step {current_step}; re-run <code>clozax evaluate RUN</code>.</p>")
    transfer = ""
    if ev.get("transfer"):
        tr = ev["transfer"]
        diff = tr.get("difference", {})
        transfer = (f"<h3>Corruption transfer</h3><p class='note'>{e(tr.get('label', ''))}: "
                    f"mask seed {tr.get('mask_seed')}, accuracy {_pct(tr['trained']['accuracy'])} "
                    f"({_pp(diff.get('accuracy', 0.0))}), loss {tr['trained']['loss']:.3f} "
                    f"({diff.get('loss', 0.0):+.3f}).</p>")
    return (stale + _table(header, rows, numeric=set(range(1, 11)), groups=groups)
            + f'<p class="note">{note}</p>' + transfer)


def _val_accuracy(result: dict) -> str:
    """Validation accuracy at the chosen C (probe.json stores one per C of the grid)."""
    val = result.get("val_accuracy")
    if isinstance(val, dict):
        c = result.get("C")
        chosen = [val[k] for k in (f"{c:g}" if isinstance(c, int | float) else None, str(c))
                  if k in val]
        val = chosen[0] if chosen else max(val.values(), default=None)
    return _pct(val) if isinstance(val, int | float) else "—"


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


def _probe_section(probe: dict | None) -> str:
    if probe is None:
        return _notrun("Downstream probe", "clozax probe RUN")
    names = {"trained": "trained encoder (frozen)", "random_init": "random-init encoder (frozen)",
             "tfidf": "TF-IDF"}
    rows = [[e(label), _pct(r["accuracy"]), _ci(r["ci95"]), f"{r.get('C')}",
             _val_accuracy(r)] for key, label in names.items() if (r := probe["results"].get(key))]
    d = probe["trained_minus_random_init"]
    rows.append(["trained − random init (paired)", _pp(d["accuracy"]),
                 _ci(d["ci95"], pp=True), "", ""])
    rows.append(["majority class", _pct(probe["majority_class_accuracy"]), "", "", ""])
    task = probe.get("task", {})
    classes = task.get("classes", {})
    split = task.get("split", {})
    facts = f"{task.get('source')}; {len(classes)} classes kept ({', '.join(classes)})"
    if split:
        facts += "; " + ", ".join(f"{name} {part.get('examples')} examples in {part.get('groups')}"
                                  " groups" for name, part in split.items())
    return (_table(["features", "test accuracy", "95 % CI", "C", "val accuracy"], rows,
                   numeric={1, 2, 3, 4})
            + f'<p class="note">Task: {e(facts)}. {e(probe.get("features", ""))}. '
              f'{e(probe.get("classifier", ""))}. Bootstrap: {e(str(probe.get("bootstrap")))}.'
              "</p>")


def _panel_section(panel: list[dict] | None, figs: dict, error: str | None) -> str:
    if not panel:
        return _notrun("Probability panel", f"needs the checkpoint and dataset ({error})")
    rows = [[_marked(x["text"]), e(_tok(x["target"])), e(x["kind"]),
             f"{x['target_probability']:.3f}", str(x["target_rank"] + 1),
             e(", ".join(f"{_tok(t)} {p:.2f}" for t, p in x["top"]))] for x in panel]
    return (_img(figs["panel"], "probability panel",
                 "Rows: selected held-out positions (evenly spaced eval rows, the first "
                 "[MASK]-replaced slot in each; chosen before looking at predictions). Columns: "
                 "the target, then the model's top predictions; cells are probabilities.")
            + _table(["context (target marked)", "target", "kind", "p(target)", "rank",
                      "top predictions"], rows, numeric={3, 4}))


def _failure_section(cases: list[dict], ev: dict | None) -> str:
    if ev is None and not cases:
        return _notrun("Failure cases", "clozax evaluate RUN")
    shown = cases[:FAILURES_SHOWN]
    rows = [[_marked(c["text"]), e(_tok(c["target"])), e(c["kind"]),
             e(_tok(c.get("input_token", ""))), f"{c['target_probability']:.2e}",
             e(", ".join(f"{_tok(t)} {p:.2f}" for t, p in c["top5"]))] for c in shown]
    return ('<p class="note">The held-out selected positions with the lowest probability on '
            f"the target: where the model is most confidently wrong ({len(shown)} of "
            f"{len(cases)} shown; all in failures.jsonl).</p>"
            + _table(["context (target marked)", "target", "kind", "input", "p(target)",
                      "top-5 predictions"], rows, numeric={4}))


def _audit_section(audit: dict | None) -> str:
    if audit is None:
        return _notrun("Audit", "clozax audit RUN")
    rows = []
    for c in audit.get("checks", []):
        state = "SKIP" if c.get("skipped") else ("PASS" if c.get("passed") else "FAIL")
        rows.append([str(c.get("number", "")), e(c.get("name", "")),
                     f'<span class="badge {state}">{state}</span>',
                     e(_compact(c.get("value", ""))[:200]), e(str(c.get("detail", "")))])
    return (_table(["#", "check", "result", "value", "detail"], rows, numeric={0})
            + f'<p class="note">Audited step {audit.get("step")} on {audit.get("devices")} '
              f"device(s) in {audit.get('seconds')} s.</p>")


def _provenance(run_dir: Path, config: dict, info: dict, masks_meta: dict | None,
                ev: dict | None, probe: dict | None, step: int | None) -> str:
    import jax

    from clozax import __version__

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
        ("report made with", f"clozax {__version__}, jax {jax.__version__}, Python "
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
    table = _table(["", ""], [[e(k), f"<code>{e(v)}</code>"] for k, v in rows])
    return (table + "<h3>Resolved configuration</h3><pre>"
            + e(json.dumps(config, indent=2, sort_keys=True)) + "</pre>")


# --------------------------------------------------------------------------- entry point


def write_report(run_dir: Path) -> Path:
    """Write ``RUN/report.html`` (self-contained) and the figures in ``RUN/report/``; returns
    the HTML path. Sections whose inputs are missing say "not run"."""
    from clozax import model as model_lib
    from clozax.run import load_run, read_config

    run_dir = Path(run_dir)
    run_config, info = read_config(run_dir)  # raises a one-line error for a non-run
    config = run_config.to_dict()
    ev = _read_json(run_dir / "eval.json")
    probe = _read_json(run_dir / "probe.json")
    audit = _read_json(run_dir / "audit.json")
    masks_meta = _read_json(run_dir / "eval_masks.json")
    cases = _read_jsonl(run_dir / "failures.jsonl")
    curves = training_curves(_read_jsonl(run_dir / "metrics.jsonl"))

    panel, panel_error, step, n_params = None, None, None, None
    try:
        run = load_run(run_dir)
        step, n_params = run.step, model_lib.param_count(run.params)
        panel = probability_panel(run)
    except (ValueError, FileNotFoundError) as err:
        panel_error = str(err).splitlines()[0] if str(err) else type(err).__name__
    figs = _figures(run_dir, curves, ev, panel, run_config.model.vocab_size)

    m, t = config["model"], config["train"]
    seq_len = info.get("seq_len", 0)
    tokens = (step or 0) * t["batch_size"] * seq_len
    subtitle = (f"{m['layers']} layers × {m['hidden']} hidden, {m['heads']} heads"
                + (f", {n_params / 1e6:.2f} M parameters" if n_params else "")
                + f"; step {step if step is not None else '—'} of {t['steps']}, "
                  f"{tokens:,} tokens seen (batch {t['batch_size']} × {seq_len}); "
                  f"masking {config['masking']['rate']:.0%} of tokens.")
    curve_html = []
    if "loss" in figs:
        curve_html.append(_img(figs["loss"], "loss curves",
                               "Training loss (per batch, training masks) and held-out loss "
                               "(frozen eval masks) against tokens seen."))
    if "accuracy" in figs:
        curve_html.append(_img(figs["accuracy"], "held-out accuracy",
                               "Held-out masked-token accuracy; dashed: the baselines on the "
                               "same masks (from eval.json)."))
    curves_block = ('<div class="grid2">' + "".join(curve_html) + "</div>" if curve_html
                    else _notrun("Training curves", "clozax train (metrics.jsonl is empty)"))
    generated = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    body = f"""
<main>
<h1>clozax report · {e(run_dir.name)}</h1>
<p class="sub">{e(subtitle)} Generated {generated}.</p>
<h2>Headline</h2>
{_headline(ev, probe, audit)}
<h2>Training</h2>
{curves_block}
<h2>What the model predicts</h2>
{_panel_section(panel, figs, panel_error)}
<h2>Held-out evaluation by corruption kind</h2>
{_eval_section(ev, step)}
<h2>Downstream probe</h2>
{_probe_section(probe)}
<h2>Failure cases</h2>
{_failure_section(cases, ev)}
<h2>Audit</h2>
{_audit_section(audit)}
<h2>Provenance</h2>
{_provenance(run_dir, config, info, masks_meta, ev, probe, step)}
</main>"""
    page = (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>clozax report · {e(run_dir.name)}</title><style>{CSS}</style></head>"
            f"<body>{body}</body></html>\n")
    path = run_dir / REPORT_FILE
    tmp = path.with_suffix(".html.tmp")
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(path)
    return path
