"""Step time against peak memory, with the Pareto front: the settings nothing beats on both."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both coordinates (lower is better),
    in increasing order of the first coordinate."""
    front = [
        i
        for i, (x, y) in enumerate(points)
        if not any((ox <= x and oy <= y) and (ox, oy) != (x, y) for ox, oy in points)
    ]
    return sorted(front, key=lambda i: points[i])


def plot(report: dict[str, Any], path: Path) -> bool:
    """Write the plot as PNG; False (nothing written) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    results = report["results"]
    memory = [r["peak_bytes"] / 2**30 for r in results]
    seconds = [r["step_s_median"] for r in results]
    front = pareto_front(list(zip(memory, seconds)))
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    ax.scatter(memory, seconds, color="tab:blue", zorder=3)
    ax.plot(
        [memory[i] for i in front],
        [seconds[i] for i in front],
        color="tab:orange",
        zorder=2,
        label="Pareto front (nothing is both faster and smaller)",
    )
    for r, x, y in zip(results, memory, seconds):
        ax.annotate(r["mode"], (x, y), textcoords="offset points", xytext=(6, 4), fontsize=8)
    ax.set_xlabel(f"peak memory, GiB ({results[0]['peak_kind']})")
    ax.set_ylabel("median s/step")
    ax.set_ylim(0, max(seconds) * 1.15)  # room for the labels
    ax.set_xlim(0, max(memory) * 1.25)
    env = report["environment"]
    ax.set_title(f"{results[0]['description']}\n{env['device_name']}, torch {env['torch']}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True
