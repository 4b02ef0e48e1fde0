"""Timeline pictures of pipeline runs (given): ranks as rows, compute blocks coloured by microbatch.

Forward blocks are solid, backward blocks hatched; waits are thin grey bars, so the bubble is the
white and grey between the blocks.
"""
from __future__ import annotations

import matplotlib
from matplotlib.figure import Figure


def plot_timeline(profiles: list[dict], path=None, step: int = -1, title: str = "", ax=None):
    """Draw one step of every rank's profile (`course.profiler.export` dicts) on `ax` (a notebook's
    axes), or on a figure of its own saved to `path`. The own figure is a bare `Figure`, not pyplot's:
    it needs no display and leaves the backend alone, so a notebook importing this still shows plots."""
    n_steps = len(profiles[0]["steps"])
    step = step % n_steps
    origin = min(p["steps"][step][0] for p in profiles)
    n_microbatches = 1 + max((s["microbatch"] or 0) for p in profiles for s in p["spans"])
    colours = matplotlib.colormaps["tab20" if n_microbatches > 10 else "tab10"]
    own_figure = ax is None
    if own_figure:
        figure = Figure(figsize=(11, 0.6 * len(profiles) + 1.2))
        ax = figure.add_subplot()
    for p in profiles:
        row = p["rank"]
        for s in p["spans"]:
            if s["step"] != step:
                continue
            start, width = (s["start"] - origin) * 1e3, (s["end"] - s["start"]) * 1e3
            if s["kind"] in ("forward", "backward"):
                ax.barh(row, width, left=start, height=0.8, color=colours(s["microbatch"] % colours.N),
                        hatch="//" if s["kind"] == "backward" else None, edgecolor="black", linewidth=0.4)
                if width > 0:
                    ax.text(start + width / 2, row, str(s["microbatch"]), ha="center", va="center", fontsize=7)
            elif s["kind"] == "wait":
                ax.barh(row, width, left=start, height=0.15, color="0.7")
    ax.set_yticks(range(len(profiles)), [f"rank {p['rank']}" for p in profiles])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the step started (solid: forward, hatched: backward, grey: waiting)")
    ax.set_title(title)
    if own_figure and path is not None:
        figure.tight_layout()
        figure.savefig(path, dpi=110)
    return ax
