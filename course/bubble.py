"""The bubble of a profiled pipeline run, and what theory says it should be (given).

A step lasts from the first rank's start to the last rank's end; a rank's idle fraction (its
bubble) is 1 - its compute / that step time. `profiles` are the ranks' `course.profiler.export`
dicts. Module 05's theory is one formula (`theoretical_bubble`); module 11's is the schedule
simulator and each schedule's closed form (`bubble_rows`, for `run 11` and `bench 11`).

That is the course's convention: the synchronous step, the optimizer waiting for every rank. The
zero-bubble paper measures each rank's own span instead (its first action to its last: the
optimizer's synchronisation bypassed), and several papers divide by the ideal compute rather than
by the step. `in_convention` reads a simulated timeline in each, and `PUBLISHED` holds the published
figures module 11's chapter puts beside the simulator's (`conventions_table`).
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Callable

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


def step_durations(steps_per_rank: list[list[tuple[float, float]]]) -> dict[int, float]:
    """Each timed step (`timed_steps`) and its seconds, from the first rank's start to the last rank's end."""
    return {s: max(r[s][1] for r in steps_per_rank) - min(r[s][0] for r in steps_per_rank)
            for s in timed_steps(len(steps_per_rank[0]))}


def median_step(durations: dict[int, float]) -> int:
    """The step of median duration (the shorter of the two middle ones): a typical step, from which a
    benchmark reads the bubble of a run whose steps other jobs on a shared machine disturbed unevenly."""
    return sorted(durations, key=durations.get)[(len(durations) - 1) // 2]


def only_step(profiles: list[dict], step: int) -> list[dict]:
    """The profiles cut down to one step, as if it were the only one."""
    return [{**p, "steps": [p["steps"][step]], "spans": [{**s, "step": 0} for s in p["spans"] if s["step"] == step]}
            for p in profiles]


def summarize(profiles: list[dict], skip_first: bool = True) -> dict:
    """Per-rank and overall step time, compute and idle fraction, averaged over the timed steps; and
    the per-rank-span bubble (`span_idle`): 1 - the ranks' mean compute / the longest rank's own span
    (its first compute to its last), the zero-bubble paper's convention."""
    steps = timed_steps(len(profiles[0]["steps"]), skip_first)
    step_s = step_time([p["steps"] for p in profiles], skip_first)
    ranks, longest = [], [0.0] * len(steps)
    for p in profiles:
        compute = sum(s["end"] - s["start"] for s in p["spans"] if s["kind"] in COMPUTE
                      and s["step"] in steps) / len(steps)
        for i, step in enumerate(steps):
            work = [s for s in p["spans"] if s["kind"] in COMPUTE and s["step"] == step]
            if work:
                longest[i] = max(longest[i], max(s["end"] for s in work) - min(s["start"] for s in work))
        ranks.append({"rank": p["rank"], "step_s": step_s, "compute_s": compute,
                      "idle": 1 - compute / step_s, "peak_live": max(p["peak_live"])})
    mean_compute, span_s = sum(r["compute_s"] for r in ranks) / len(ranks), sum(longest) / len(longest)
    return {"step_s": step_s, "ranks": ranks, "idle": sum(r["idle"] for r in ranks) / len(ranks),
            "span_idle": 1 - mean_compute / span_s if span_s else 0.0}


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
            "span_simulated": float(in_convention(timeline, "span rate")),
            "peak_measured": [max(p["peak_live"]) for p in profiles], "peak_simulated": timeline.peak_live,
            "step_simulated_ms": float(timeline.makespan)}


# --- the conventions bubbles are published in ---
CONVENTIONS = {  # name -> how a timeline is read in it (in_convention)
    "step": "idle fraction of the synchronous step, all ranks: Σ idle / (p × step) (the course's)",
    "span idle": "idle time inside the longest rank's own span, first action to last (optimizer sync bypassed)",
    "span rate": "(longest rank span - its compute) / longest rank span",
    "span / compute": "(longest rank span - its compute) / its compute",
    "step / compute": "idle per rank in the synchronous step / its compute",
    "idlest rank": "idle time of the idlest rank in the synchronous step",
}


def in_convention(timeline, convention: str) -> Fraction:
    """A simulated step's bubble in one of CONVENTIONS. A rank's compute is the time it was busy (an
    overlapped pair counts τ_F&B); a rank's span runs from its first action to its last."""
    computes = [timeline.makespan - idle for idle in timeline.idle]
    spans = timeline.spans_of_ranks()
    longest = max(spans)
    span_idle, compute = max((s - c, c) for s, c in zip(spans, computes) if s == longest)
    idlest = max(range(len(computes)), key=lambda r: timeline.idle[r])
    return {"step": timeline.bubble, "span idle": span_idle, "span rate": span_idle / longest,
            "span / compute": span_idle / compute, "step / compute": timeline.idle[idlest] / computes[idlest],
            "idlest rank": timeline.idle[idlest]}[convention]


@dataclass(frozen=True)
class Published:
    """One published bubble figure, and the schedule and sizes it is evaluated at here."""
    source: str                  # who published it, and where
    figure: str                  # as published, in the source's own notation
    formula: Callable            # (p, m, v, costs) -> the figure's value (in the course's symbols)
    schedule: str
    convention: str              # a key of CONVENTIONS: how the source counts
    world_size: int = 4
    n_microbatches: int = 8
    costs: Costs = Costs()       # τ_F = τ_I = τ_W = 1 per stage unless said
    stages_per_rank: int = 2
    atomic_pairs: bool = False
    agrees: bool = True          # False: the source's figure is not its own convention's (the chapter says why)

    def published(self) -> Fraction:
        return Fraction(self.formula(self.world_size, self.n_microbatches, self.stages_per_rank, self.costs))

    def timeline(self):
        schedule = reference("m11_generators").make_schedule(self.schedule, self.world_size, self.n_microbatches,
                                                            self.stages_per_rank)
        return simulate_schedule(schedule.orders, schedule.placement, self.costs, self.atomic_pairs)


# Short names; the chapter gives each source in full under the table.
ZB, ZB_README, ZB_SPACE = "ZB paper", "ZB README", "ZB playground (revised)"
DUALPIPE, MEGATRON = "DualPipe README", "Megatron paper"
OVERLAPPED = Costs(FB=Fraction(2))  # τ_F&B = 2 = max(τ_F, τ_B): the pair as short as its longer half
PUBLISHED = [
    Published(f"{ZB}, Table 2", "1F1B: (p-1)(T_F+T_B+T_W)", lambda p, m, v, c: (p - 1) * (c.F + c.I + c.W),
              "1f1b", "span idle"),
    Published(f"{ZB}, Table 2", "ZB-H1: (p-1)(T_F+T_B-T_W)", lambda p, m, v, c: (p - 1) * (c.F + c.I - c.W),
              "zbh1", "span idle"),
    Published(f"{ZB}, Table 2", "ZB-H2: (p-1)(T_F+T_B-2T_W)", lambda p, m, v, c: (p - 1) * (c.F + c.I - 2 * c.W),
              "zbh2", "span idle"),
    Published(f"{ZB}, bubble rate", "ZB-H2: 0", lambda p, m, v, c: 0, "zbh2", "span rate"),
    Published(f"{ZB}, bubble rate", "ZB-V: 0", lambda p, m, v, c: 0, "zbv", "span rate"),
    Published(ZB_README, "1F1B: (p-1)/m", lambda p, m, v, c: Fraction(p - 1, m), "1f1b", "span / compute"),
    Published(ZB_README, "ZB1P: (p-1)/3m", lambda p, m, v, c: Fraction(p - 1, 3 * m), "zbh1", "span / compute"),
    Published(ZB_README, "ZB2P: 0", lambda p, m, v, c: 0, "zbh2", "span / compute"),
    Published(ZB_README, "ZBV: 0", lambda p, m, v, c: 0, "zbv", "span / compute"),
    Published(ZB_SPACE, "1F1B: (p-1)/(m+p-1)", lambda p, m, v, c: Fraction(p - 1, m + p - 1), "1f1b", "span rate"),
    Published(ZB_SPACE, "ZB1P: (p-1)/3(m+p-1)", lambda p, m, v, c: Fraction(p - 1, 3 * (m + p - 1)), "zbh1",
              "span rate", agrees=False),
    Published(DUALPIPE, "1F1B: (PP-1)(F+B)", lambda p, m, v, c: (p - 1) * (c.F + c.B), "1f1b", "idlest rank"),
    Published(DUALPIPE, "ZB1P: (PP-1)(F+B-2W)", lambda p, m, v, c: (p - 1) * (c.F + c.B - 2 * c.W), "zbh1",
              "idlest rank"),
    Published(DUALPIPE, "DualPipeV: (PP/2-1)(F&B+B-3W), PP = 8, F&B = F+B",
              lambda p, m, v, c: (p - 1) * (c.pair + c.B - 3 * c.W), "dualpipev", "idlest rank", atomic_pairs=True),
    Published(DUALPIPE, "DualPipeV: (PP/2-1)(F&B+B-3W), PP = 8, F&B = 2",
              lambda p, m, v, c: (p - 1) * (c.pair + c.B - 3 * c.W), "dualpipev", "idlest rank", costs=OVERLAPPED,
              atomic_pairs=True),
    Published(MEGATRON, "1F1B: (p-1)/m", lambda p, m, v, c: Fraction(p - 1, m), "1f1b", "step / compute"),
    Published(MEGATRON, "interleaved: (1/v)(p-1)/m", lambda p, m, v, c: Fraction(p - 1, v * m), "interleaved",
              "step / compute"),
]


def _shown(value: Fraction, convention: str) -> str:
    if convention in ("span idle", "idlest rank"):
        return str(value)  # a time, in units of one stage's τ_F
    return f"{float(value):.1%}".replace("%", " %")


def conventions_table() -> str:
    """PUBLISHED as the chapter's markdown table: each figure as published (evaluated at its row's
    sizes), the simulator's reading of the same schedule in the same convention, and the course's
    synchronous-step bubble of that timeline."""
    lines = ["| source | figure, in its notation | schedule (p = 4, m = 8) | convention | published | "
             "simulated, same convention | course's bubble (step) |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in PUBLISHED:
        timeline = row.timeline()
        schedule = row.schedule + (f", v = {row.stages_per_rank}" if row.schedule == "interleaved" else "")
        schedule += ", pairs as one action" if row.atomic_pairs else ""
        schedule += f", τ_F&B = {row.costs.pair}" if row.costs.FB is not None else ""
        lines.append(f"| {row.source} | {row.figure} | {schedule} | {row.convention} | "
                     f"{_shown(row.published(), row.convention)} | {_shown(in_convention(timeline, row.convention), row.convention)} | "
                     f"{_shown(timeline.bubble, 'step')} |")
    return "\n".join(lines)
