"""Figures (headless, Agg backend): small matplotlib helpers shared by the lesson and the
report, and the report's own figures."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from clozax.judge.claims import pct  # noqa: E402


def line_plot(
    path: Path,
    series: dict[str, tuple],
    *,
    xlabel: str,
    ylabel: str,
    title: str,
    hlines: dict[str, float] | None = None,
    logy: bool = False,
) -> Path:
    """One or more labelled (x, y) series; optional labelled horizontal reference lines."""
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for label, (x, y) in series.items():
        ax.plot(x, y, label=label, linewidth=1.8, marker="o" if len(x) <= 12 else None)
    for i, (label, value) in enumerate((hlines or {}).items()):
        ax.axhline(value, linestyle="--", linewidth=1.2, color=f"C{len(series) + i}", label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if logy:
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(frameon=False)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)


def heatmap(
    path: Path,
    values,
    *,
    rows: list[str],
    columns: list[str],
    xlabel: str,
    ylabel: str,
    title: str,
    colorbar_label: str,
    fmt: str = "{:.3f}",
) -> Path:
    """A labelled heatmap with every cell annotated with its value."""
    values = np.asarray(values, dtype=float)
    width = max(5.0, 1.3 * len(columns) + 2.5)
    height = max(3.0, 0.6 * len(rows) + 1.8)
    fig, ax = plt.subplots(figsize=(width, height), dpi=120)
    image = ax.imshow(values, cmap="viridis", vmin=0.0, vmax=max(1e-9, float(values.max())))
    ax.set_xticks(range(len(columns)), labels=columns, rotation=30 if len(columns) > 4 else 0)
    ax.set_yticks(range(len(rows)), labels=rows)
    threshold = 0.6 * float(values.max()) if values.size else 0.0
    for r in range(values.shape[0]):
        for c in range(values.shape[1]):
            ax.text(
                c,
                r,
                fmt.format(values[r, c]),
                ha="center",
                va="center",
                color="black" if values[r, c] > threshold else "white",
                fontsize=9,
            )
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    fig.colorbar(image, ax=ax, label=colorbar_label, fraction=0.046, pad=0.04)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)


def token_panel(
    path: Path,
    probs,
    labels: list[list[str]],
    *,
    rows: list[str],
    columns: list[str],
    title: str,
    colorbar_label: str = "model probability",
) -> Path:
    """A heatmap whose cells carry their own token label and probability (``labels[r][c]``),
    for panels where every row has different tokens (rows = positions, columns = ranks)."""
    probs = np.asarray(probs, dtype=float)
    width = max(6.0, 1.45 * len(columns) + 3.0)
    height = max(3.0, 0.62 * len(rows) + 1.9)
    fig, ax = plt.subplots(figsize=(width, height), dpi=120)
    vmax = max(1e-9, float(probs.max()))
    image = ax.imshow(probs, cmap="viridis", vmin=0.0, vmax=vmax, aspect="auto")
    ax.set_xticks(range(len(columns)), labels=columns)
    ax.set_yticks(range(len(rows)), labels=rows)
    ax.xaxis.tick_top()
    for r in range(probs.shape[0]):
        for c in range(probs.shape[1]):
            text = labels[r][c]
            text = text if len(text) <= 12 else text[:11] + "…"
            ax.text(c, r, f"{text}\n{probs[r, c]:.3f}", ha="center", va="center", fontsize=8,
                    color="black" if probs[r, c] > 0.6 * vmax else "white")
    ax.set_title(title, pad=28)
    fig.colorbar(image, ax=ax, label=colorbar_label, fraction=0.046, pad=0.04)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)


def token_label(text: str) -> str:
    """A token's text for a figure or table cell: stripped, newlines shown as ⏎."""
    return text.strip().replace("\n", "⏎") or repr(text)


def report_figures(fig_dir: Path, curves: dict, evaluation: dict | None, panel: list[dict] | None,
                   vocab_size: int, checkpoints: list[dict] = ()) -> dict[str, Path]:
    """The report's PNGs in ``fig_dir``: loss curves, held-out accuracy, probability panel
    (each only when its data exists). ``checkpoints``: ``clozax evaluate`` results of each
    scored checkpoint (``judge/history.py``), drawn beside the in-training sample. Returns
    {"loss"|"accuracy"|"panel": path}."""
    whole = (np.asarray([r["tokens_seen"] for r in checkpoints], float),
             {k: np.asarray([r["trained"][k] for r in checkpoints]) for k in ("loss",
                                                                               "accuracy")})
    fig_dir.mkdir(exist_ok=True)
    out = {}
    if curves["train_tokens"].size or curves["eval_tokens"].size:
        series = {}
        if curves["train_tokens"].size:
            series["training loss (batch)"] = (curves["train_tokens"], curves["train_loss"])
        if curves["eval_tokens"].size:
            series["held-out sample, in training"] = (curves["eval_tokens"], curves["eval_loss"])
        if len(checkpoints) > 1:
            series["held-out, whole set (clozax evaluate)"] = (whole[0], whole[1]["loss"])
        hlines = {f"uniform ln V = {math.log(vocab_size):.2f}": math.log(vocab_size)}
        if evaluation is not None:
            hlines[f"unigram held-out = {evaluation['unigram']['loss']:.2f}"] = \
                evaluation["unigram"]["loss"]
        out["loss"] = line_plot(
            fig_dir / "loss.png", series, xlabel="tokens seen", ylabel="cross-entropy (nats)",
            title="Masked-token loss", hlines=hlines)
    if curves["eval_tokens"].size:
        hlines = {}
        if evaluation is not None:
            hlines = {f"unigram = {pct(evaluation['unigram']['accuracy'])}":
                      evaluation["unigram"]["accuracy"],
                      f"random init = {pct(evaluation['random_init']['accuracy'])}":
                      evaluation["random_init"]["accuracy"]}
        series = {"held-out sample, in training": (curves["eval_tokens"],
                                                   curves["eval_accuracy"])}
        if len(checkpoints) > 1:
            series["held-out, whole set (clozax evaluate)"] = (whole[0], whole[1]["accuracy"])
        out["accuracy"] = line_plot(
            fig_dir / "accuracy.png", series,
            xlabel="tokens seen", ylabel="masked-token accuracy (top-1)",
            title="Held-out accuracy", hlines=hlines)
    if panel:
        probs = [[e["target_probability"]] + [p for _, p in e["top"]] for e in panel]
        labels = [[token_label(e["target"])] + [token_label(t) for t, _ in e["top"]]
                  for e in panel]
        rows = [f"“{token_label(e['target'])}” (row {e['row']}, pos {e['position']})"
                for e in panel]
        columns = ["target"] + [f"top {k + 1}" for k in range(len(panel[0]["top"]))]
        out["panel"] = token_panel(
            fig_dir / "probabilities.png", probs, labels, rows=rows, columns=columns,
            title="Trained model on held-out positions: target and top predictions")
    return out
