"""``clozax report RUN``: one self-contained HTML page (inline CSS, figures as base64 PNG) from
what a run directory holds, plus the figures as PNG files in ``RUN/report/``.

It reads ``config.json``, ``run.json``, ``metrics.jsonl``, ``eval_masks.json`` and, when present,
``eval.json`` + ``failures.jsonl`` (``clozax evaluate``; ``eval_full.json`` of ``--full``),
``probe.json`` (``clozax probe``),
``finetune/*/result.json`` (``clozax finetune``) and ``audit.json`` (``clozax audit``); a
missing file makes its section say "not run". The
probability panel (``clozax.judge.panel``) runs the latest checkpoint, so it needs the
checkpoint and the run's dataset. The page is ``templates/report.html.j2`` (jinja2,
autoescaped) over the data ``clozax.report.sections`` builds.
"""

from __future__ import annotations

import base64
import datetime
from pathlib import Path

import jax
from jinja2 import Environment, PackageLoader, select_autoescape
from markupsafe import Markup, escape

from clozax import __version__
from clozax.core import files
from clozax.core import model as model_lib
from clozax.core.files import read_json
from clozax.judge import history
from clozax.judge.panel import probability_panel
from clozax.report import sections
from clozax.report.figures import report_figures
from clozax.report.inputs import read_jsonl, training_curves
from clozax.train.phases import tokens_at
from clozax.train.run_dir import load_run, read_config

REPORT_FILE = "report.html"
FIGURE_DIR = "report"
FAILURES_SHOWN = 10


def _marked(text: str) -> Markup:
    """Escaped text with the target between ⟦ ⟧ highlighted."""
    return Markup(str(escape(text)).replace("⟦", "<mark>").replace("⟧", "</mark>"))


def _environment() -> Environment:
    env = Environment(loader=PackageLoader("clozax.report", "templates"),
                      autoescape=select_autoescape(["html", "j2"]), keep_trailing_newline=True)
    env.filters["marked"] = _marked
    return env


def _figure(path: Path, alt: str, caption: str) -> dict:
    return {"alt": alt, "caption": caption,
            "data": base64.b64encode(path.read_bytes()).decode("ascii")}


def report_name(step: int | None) -> tuple[str, str]:
    """The page and figure folder of the newest checkpoint's report, or of ``step``'s."""
    return (REPORT_FILE, FIGURE_DIR) if step is None else (f"report-step{step}.html",
                                                           f"report-step{step}")


def write_report(run_dir: Path, step: int | None = None) -> Path:
    """Write ``RUN/report.html`` (self-contained) and the figures in ``RUN/report/``; returns
    the HTML path. Sections whose inputs are missing say "not run". With ``step``: the report
    of that checkpoint (``report-stepN.html``), from the results ``history/`` keeps of it."""
    run_dir = Path(run_dir)
    run_config, info = read_config(run_dir)  # raises a one-line error for a non-run
    config = run_config.to_dict()
    if step is None:
        ev, probe = read_json(run_dir / "eval.json"), read_json(run_dir / "probe.json")
        cases = read_jsonl(run_dir / "failures.jsonl")
    else:
        if step not in (steps := history.committed_steps(run_dir)):
            raise ValueError(f"run {run_dir} has no committed checkpoint at step {step}; it "
                             f"has {', '.join(map(str, steps))}")
        ev, probe = history.at_step(run_dir, "eval", step), history.at_step(run_dir, "probe", step)
        cases = read_jsonl(run_dir / history.HISTORY_DIR / f"failures-{step}.jsonl")
    finetuned = [r for path in sorted((run_dir / "finetune").glob("*/result.json"))
                 if (r := read_json(path)) is not None]
    audit = read_json(run_dir / "audit.json")
    masks_meta = read_json(run_dir / "eval_masks.json")
    curves = training_curves(read_jsonl(run_dir / "metrics.jsonl"))
    page_name, figure_dir = report_name(step)

    panel, panel_error, n_params = None, None, None
    seq_len = info.get("seq_len", 0)
    try:
        run = load_run(run_dir, step)
        step, n_params = run.step, model_lib.param_count(run.params)
        seq_len = run.trained_length  # the checkpoint's rows (a phase's), not --data's
        panel = probability_panel(run)
    except (ValueError, FileNotFoundError) as err:
        panel_error = str(err).splitlines()[0] if str(err) else type(err).__name__
    figs = report_figures(run_dir / figure_dir, curves, ev, panel, run_config.model.vocab_size,
                          history.recorded(run_dir, "eval"))

    m, t = config["model"], config["train"]
    phased = tokens_at(info, step or 0)  # a run in phases: each phase's batches and rows
    tokens = phased if phased is not None else (step or 0) * t["batch_size"] * seq_len
    subtitle = (f"{m['layers']} layers × {m['hidden']} hidden, {m['heads']} heads"
                + (f", {n_params / 1e6:.2f} M parameters" if n_params else "")
                + f"; step {step if step is not None else '—'} of {t['steps']}, "
                  f"{tokens:,} tokens seen"
                + ("" if phased is not None else f" (batch {t['batch_size']} × {seq_len})")
                + f", rows of {seq_len} tokens; masking {config['masking']['rate']:.0%} of "
                  "tokens.")
    curve_figures = []
    if "loss" in figs:
        curve_figures.append(_figure(figs["loss"], "loss curves",
                                     "Training loss (per batch, training masks) and held-out "
                                     "loss against tokens seen: the in-training sample of the "
                                     "frozen eval masks, and the whole set at each checkpoint "
                                     "`clozax evaluate --every-checkpoint` scored."))
    if "accuracy" in figs:
        curve_figures.append(_figure(figs["accuracy"], "held-out accuracy",
                                     "Held-out masked-token accuracy; dashed: the baselines on "
                                     "the same masks (from eval.json)."))
    context = {
        "name": run_dir.name,
        "subtitle": subtitle,
        "generated": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "headline": sections.headline(ev, probe, audit),
        "curves": curve_figures,
        "panel": panel and {
            "figure": _figure(figs["panel"], "probability panel",
                              "Rows: selected held-out positions (evenly spaced eval rows, the "
                              "first [MASK]-replaced slot in each; chosen before looking at "
                              "predictions). Columns: the target, then the model's top "
                              "predictions; cells are probabilities."),
            "table": sections.panel_table(panel)},
        "panel_error": panel_error,
        "evaluation": ev and sections.evaluation(ev, step),
        "full_eval": (read_json(run_dir / "eval_full.json") if page_name == REPORT_FILE
                      else history.at_step(run_dir, "eval_full", step)),
        "probe": probe and sections.probe_section(probe),
        "finetune": [sections.finetune_section(r) for r in finetuned],
        "retrieval": (retrieval := read_json(run_dir / "retrieval.json")) and
        sections.retrieval_section(retrieval),
        "failures": (ev is not None or cases) and {
            "shown": min(len(cases), FAILURES_SHOWN), "total": len(cases),
            "table": sections.failures_table(cases[:FAILURES_SHOWN])},
        "audit": audit and {"table": sections.audit_table(audit), "step": audit.get("step"),
                            "devices": audit.get("devices"), "seconds": audit.get("seconds")},
        "provenance": sections.provenance(run_dir, info, masks_meta, ev, probe, step,
                                          {"clozax": __version__, "jax": jax.__version__}),
        "config_json": sections.config_json(config),
    }
    page = _environment().get_template("report.html.j2").render(context)
    return files.write_text(run_dir / page_name, page)
