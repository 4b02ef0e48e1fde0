"""The bubble of a profiled pipeline run, and what theory says it should be (given).

A step lasts from the first rank's start to the last rank's end; a rank's idle fraction (its
bubble) is 1 - its compute / that step time. `profiles` are the ranks' `course.profiler.export`
dicts.
"""
from __future__ import annotations

from course.profiler import COMPUTE


def theoretical_bubble(world_size: int, n_microbatches: int) -> float:
    """Idle fraction of a GPipe or 1F1B step with equal stages and free messages: (P-1)/(M+P-1)."""
    return (world_size - 1) / (n_microbatches + world_size - 1)


def timed_steps(n_steps: int, skip_first: bool = True) -> range:
    """The steps to average over: all but the first, which pays for warm-up (unless it is the only one)."""
    return range(1 if skip_first and n_steps > 1 else 0, n_steps)


def step_time(steps_per_rank: list[list[tuple[float, float]]], skip_first: bool = True) -> float:
    """Mean seconds per step over the timed steps; `steps_per_rank[r][s]` is rank r's (start, end)
    of step s. A step runs from the first rank's start to the last rank's end."""
    steps = timed_steps(len(steps_per_rank[0]), skip_first)
    return sum(max(r[s][1] for r in steps_per_rank) - min(r[s][0] for r in steps_per_rank)
               for s in steps) / len(steps)


def summarize(profiles: list[dict], skip_first: bool = True) -> dict:
    """Per-rank and overall step time, compute and idle fraction, averaged over the timed steps."""
    steps = timed_steps(len(profiles[0]["steps"]), skip_first)
    step_s = step_time([p["steps"] for p in profiles], skip_first)
    ranks = []
    for p in profiles:
        compute = sum(s["end"] - s["start"] for s in p["spans"] if s["kind"] in COMPUTE
                      and s["step"] in steps) / len(steps)
        ranks.append({"rank": p["rank"], "step_s": step_s, "compute_s": compute,
                      "idle": 1 - compute / step_s, "peak_live": max(p["peak_live"])})
    return {"step_s": step_s, "ranks": ranks, "idle": sum(r["idle"] for r in ranks) / len(ranks)}


def format_report(profiles: list[dict], n_microbatches: int) -> str:
    summary = summarize(profiles)
    world_size = len(profiles)
    lines = [f"{'rank':>4}  {'step ms':>8}  {'compute ms':>10}  {'idle':>6}  {'peak live microbatches':>22}"]
    for r in summary["ranks"]:
        lines.append(f"{r['rank']:>4}  {r['step_s'] * 1e3:8.2f}  {r['compute_s'] * 1e3:10.2f}  "
                     f"{r['idle']:6.1%}  {r['peak_live']:>22}")
    lines.append(f" all  {summary['step_s'] * 1e3:8.2f}  {'':>10}  {summary['idle']:6.1%}  "
                 f"(theory (P-1)/(M+P-1) = {theoretical_bubble(world_size, n_microbatches):.1%})")
    return "\n".join(lines)
