"""Timeline pictures of pipeline runs (given): ranks as rows, compute blocks coloured by microbatch.

Forward blocks are solid, full backward blocks hatched //; module 11's halves of a backward are told
apart: I (input gradient) hatched the other way, W (weight gradient) dotted and paler. On a rank that holds
several stages, the blocks of its later stages are paler too and labelled stage:microbatch. Waits
(in a receive, or on a send) and a rank's idle end of the step (its work done, the others' not) are
thin grey bars, so the bubble is the grey and the gaps between the blocks. Simulated timelines
(course/simulate.py's Timeline.as_profiles) are drawn the same way, in units instead of ms; a forward
and a backward the simulator ran as one overlapped pair (DualPipe's F&B) get one thick outline.
"""
from __future__ import annotations

import matplotlib
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle


HATCH = {"forward": None, "backward": "//", "input": "\\\\", "weight": ".."}


def plot_timeline(profiles: list[dict], path=None, step: int = -1, title: str = "", ax=None, unit: str = "ms"):
    """Draw one step of every rank's profile (`course.profiler.export` dicts) on `ax` (a notebook's
    axes), or on a figure of its own saved to `path`. The own figure is a bare `Figure`, not pyplot's:
    it needs no display and leaves the backend alone, so a notebook importing this still shows plots."""
    n_steps = len(profiles[0]["steps"])
    step = step % n_steps
    origin = min(p["steps"][step][0] for p in profiles)
    n_microbatches = 1 + max((s["microbatch"] or 0) for p in profiles for s in p["spans"])
    scale = 1e3 if unit == "ms" else 1
    several = any(s.get("stage") is not None and s["stage"] >= len(profiles) for p in profiles for s in p["spans"])
    colours = matplotlib.colormaps["tab20" if n_microbatches > 10 else "tab10"]
    own_figure = ax is None
    if own_figure:
        figure = Figure(figsize=(11, 0.6 * len(profiles) + 1.2))
        ax = figure.add_subplot()
    bars = {}  # (kind, pale) -> lists of rows, widths, starts, colours: one barh call each, not one per block
    for p in profiles:
        row = p["rank"]
        for s in p["spans"]:
            if s["step"] != step:
                continue
            start, width = (s["start"] - origin) * scale, (s["end"] - s["start"]) * scale
            if s["kind"] in HATCH:
                later_stage = s.get("stage") is not None and s["stage"] >= len(profiles)
                pale = s["kind"] == "weight" or later_stage
                group = bars.setdefault((s["kind"], pale), ([], [], [], []))
                for values, value in zip(group, (row, width, start, colours(s["microbatch"] % colours.N))):
                    values.append(value)
                label = f"{s['stage']}:{s['microbatch']}" if several else str(s["microbatch"])
                if width > 0:
                    ax.text(start + width / 2, row, label, ha="center", va="center", fontsize=6 if several else 7)
            elif s["kind"] == "wait":
                bars.setdefault(("wait", False), ([], [], [], []))
                for values, value in zip(bars[("wait", False)], (row, width, start, "0.7")):
                    values.append(value)
    step_end = (max(p["steps"][step][1] for p in profiles) - origin) * scale
    for p in profiles:  # after a rank's last block it idles until the last rank ends the step
        ends = [(s["end"] - origin) * scale for s in p["spans"] if s["step"] == step]
        if ends and max(ends) < step_end:
            for values, value in zip(bars.setdefault(("wait", False), ([], [], [], [])),
                                     (p["rank"], step_end - max(ends), max(ends), "0.7")):
                values.append(value)
    for (kind, pale), (rows, widths, starts, colour) in bars.items():
        if kind == "wait":
            ax.barh(rows, widths, left=starts, height=0.15, color=colour)
        else:
            ax.barh(rows, widths, left=starts, height=0.8, color=colour, alpha=0.45 if pale else 1.0,
                    hatch=HATCH[kind], edgecolor="black", linewidth=0.4)
    for p in profiles:  # an overlapped pair (spans marked "pair", F then B): one outline round both halves
        halves = [s for s in p["spans"] if s["step"] == step and s.get("pair")]
        for forward, backward in zip(halves[::2], halves[1::2]):
            ax.add_patch(Rectangle(((forward["start"] - origin) * scale, p["rank"] - 0.45),
                                   (backward["end"] - forward["start"]) * scale, 0.9, fill=False, linewidth=1.6))
    ax.set_yticks(range(len(profiles)), [f"rank {p['rank']}" for p in profiles])
    ax.invert_yaxis()
    kinds = {s["kind"] for p in profiles for s in p["spans"]}
    legend = "solid: forward, //: backward" + (", \\: I, pale ..: W" if kinds & {"input", "weight"} else "")
    ax.set_xlabel(f"{unit} since the step started ({legend}, grey: waiting or idle)")
    ax.set_title(title)
    if own_figure and path is not None:
        figure.tight_layout()
        figure.savefig(path, dpi=110)
    return ax
