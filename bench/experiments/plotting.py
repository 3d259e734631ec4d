"""The one place figures are made: matplotlib on the Agg backend (no display), saved as PNG.

Experiments pass data; this module owns the look (size, dpi, grid) so every figure matches."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # before pyplot: the experiments run headless, in CI and over ssh
import matplotlib.pyplot as plt  # noqa: E402

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def figure(ncols: int = 1, title: str = "", width_in: float = 6.0, height_in: float = 3.6):
    """A figure with ncols side-by-side axes (a list, even for one)."""
    fig, axes = plt.subplots(1, ncols, figsize=(width_in * ncols, height_in), squeeze=False)
    if title:
        fig.suptitle(title)
    for ax in axes[0]:
        ax.grid(True, alpha=0.3)
    return fig, list(axes[0])


def bars(ax, labels: list[str], values: list[float], ylabel: str, fmt: str = "{:.0f}", colors=None) -> None:
    """A bar per label, each with its value written above it."""
    xs = range(len(labels))
    drawn = ax.bar(xs, values, color=colors)
    ax.set_xticks(list(xs), labels, fontsize=8)
    ax.set_ylabel(ylabel)
    for bar, v in zip(drawn, values):
        ax.annotate(fmt.format(v), (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=8)


def save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=110)
    plt.close(fig)
    return path


def is_png(path: str | Path) -> bool:
    path = Path(path)
    return path.is_file() and path.stat().st_size > len(PNG_SIGNATURE) and \
        path.read_bytes()[:len(PNG_SIGNATURE)] == PNG_SIGNATURE
