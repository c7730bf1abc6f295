"""Choosing a fine-tuning setting from its jobs' records: per (learning rate, layer decay),
each seed's best-validation epoch and the validation spread over seeds; the setting with the
best mean validation score, its test spread (the only setting with one), and its
best-validation seed, the model kept. Used by ``judge/finetune/protocol.py`` for every encoder
of a task alike (the trained one and its control)."""

from __future__ import annotations

import numpy as np

from clozax.judge.finetune import jobs as jobs_lib


def _spread(values: list[float], higher_is_better: bool = True) -> dict:
    a = np.asarray(values, np.float64)
    return {"mean": float(a.mean()), "std": float(a.std(ddof=1)) if a.size > 1 else 0.0,
            "worst": float(a.min() if higher_is_better else a.max()),
            "per_seed": [float(v) for v in a]}


def seed_rank(validation_score: float, seed: int) -> tuple:
    """Within one setting, the seed kept as the model: the best validation score, then the
    lower seed (``summarise``'s choice and the candidate kept while the jobs run)."""
    return validation_score, -seed


def decay_of(record: dict) -> float:
    return record.get("layer_decay", 1.0)  # a job recorded before the decay grid: none


def summarise(records: list[dict], metric: str) -> dict:
    """Per setting (learning rate, layer decay): each seed's best-validation epoch and the
    validation spread; the setting chosen on mean validation (ties: the lower rate, then the
    weaker decay), its test spreads, and its best-validation seed (the model kept). Only the chosen
    setting carries ``test``: the others keep their validation figures alone, so nothing read
    from the summary (``result.json``) can choose a setting on test. A setting where a seed
    diverged is recorded (each seed's step), never chosen; all: one line."""
    by_setting: dict[tuple[float, float], list[dict]] = {}
    for r in records:
        by_setting.setdefault((r["learning_rate"], decay_of(r)), []).append(r)
    settings, diverged = [], []
    for (lr, decay), rs in sorted(by_setting.items(), key=lambda kv: (kv[0][0], -kv[0][1])):
        rs = sorted(rs, key=lambda r: r["seed"])
        if any("diverged" in r for r in rs):
            diverged.append({"learning_rate": lr, "layer_decay": decay, "seeds": {
                str(r["seed"]): r["diverged"] for r in rs if "diverged" in r}})
            continue
        epochs = [jobs_lib.best_epoch(r, metric) for r in rs]
        kept = [r["per_epoch"][e - 1] for r, e in zip(rs, epochs, strict=True)]
        val = [k["validation"][metric] for k in kept]
        best = max(range(len(rs)), key=lambda k: seed_rank(val[k], rs[k]["seed"]))
        settings.append({"learning_rate": lr, "layer_decay": decay,
                         "seeds": [r["seed"] for r in rs],
                         "epochs": epochs, "validation": _spread(val),
                         "test": {m: _spread([k["test"][m] for k in kept])
                                  for m in sorted(kept[0]["test"])},
                         "best_seed": {"seed": rs[best]["seed"], "epoch": epochs[best],
                                       "validation": kept[best]["validation"]},
                         "seconds_per_job": float(np.mean([r["seconds"] for r in rs]))})
    if not settings:
        rates = ", ".join(f"{lr:g}" for lr in sorted({d["learning_rate"] for d in diverged}))
        raise ValueError(f"fine-tuning diverged at every learning rate ({rates}); pass lower "
                         "rates with --lr")
    chosen = max(settings, key=lambda s: (s["validation"]["mean"], -s["learning_rate"],
                                          s["layer_decay"]))
    settings = [s if s is chosen else {k: v for k, v in s.items() if k != "test"}
                for s in settings]
    return {"settings": settings, "selected": chosen, "diverged": diverged}
