"""Small matplotlib helpers shared by the lesson and the report (headless, Agg backend)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


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
