"""The bubble of a profiled pipeline run, and what theory says it should be (given).

A step lasts from the first rank's start to the last rank's end; a rank's idle fraction (its
bubble) is 1 - its compute / that step time. `profiles` are the ranks' `course.profiler.export`
dicts. Module 05's theory is one formula (`theoretical_bubble`); module 11's is the schedule
simulator and each schedule's closed form (`bubble_rows`, for `run 11` and `bench 11`).
"""
from __future__ import annotations

from fractions import Fraction

from course.impl import reference
from course.profiler import COMPUTE
from course.simulate import Costs, simulate_schedule


def theoretical_bubble(world_size: int, n_microbatches: int) -> float:
    """Idle fraction of a GPipe or 1F1B step with equal stages and free messages: (p-1)/(m+p-1)."""
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
                 f"(theory (p-1)/(m+p-1) = {theoretical_bubble(world_size, n_microbatches):.1%})")
    return "\n".join(lines)


def stage_costs(schedule, cfg, emulate_ms: float) -> Costs:
    """The emulated device's τ_F, τ_I and τ_W of one stage of `schedule`, in ms (equal:
    course/emulated.py's EmulatedSplitStage sleeps `emulate_ms` per layer in each), or unit costs
    when nothing is emulated."""
    if not emulate_ms:
        return Costs()
    per_stage = Fraction(emulate_ms).limit_denominator(1000) * (cfg.layers // schedule.n_stages)
    return Costs(F=per_stage, I=per_stage, W=per_stage)


def bubble_rows(profiles, schedule, costs: Costs, stages_per_rank: int = 2) -> dict:
    """Module 11's bubble of a measured run (`profiles`) beside the simulator's at `costs` and the
    schedule's closed form (the reference's bubble_formula; None where it does not hold), and the
    peak live (stage, microbatch) activations per rank, measured and simulated."""
    timeline = simulate_schedule(schedule.orders, schedule.placement, costs)
    try:
        formula = float(reference("m11_generators").bubble_formula(
            schedule.name, schedule.world_size, schedule.n_microbatches, costs, stages_per_rank))
    except ValueError:  # outside where the closed form holds (e.g. zbh1 with m < p): the simulator still answers
        formula = None
    return {"summary": summarize(profiles), "simulated": float(timeline.bubble), "formula": formula,
            "peak_measured": [max(p["peak_live"]) for p in profiles], "peak_simulated": timeline.peak_live,
            "step_simulated_ms": float(timeline.makespan)}
