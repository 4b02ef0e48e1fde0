"""Module 18, part 5 - the search: every layout of R GPUs costed, those that fit ranked by step time.

`candidates` (given) lists the layouts a model can run on R GPUs: every mesh p x d x c x t with
p d c t = R that the model's dimensions allow (t divides H and K and stays within a node, c cuts
T, d divides B, p leaves each stage a block), every expert split e, ZeRO stage (ZeRO-2 both ways,
but only once a step with a pipeline), microbatch count m, schedule (and for a looped one its
stages a rank v: 2, 4, 8, ...), context variant, recompute option and fp8 choice; `fixed` pins any
of them (the command's --mesh, --zero, ...). `search` costs each one (m18_costs.rank_cost), keeps those whose
memory fits the GPU (minus a reserve for what no formula counts: CUDA's context, the allocator's
fragmentation, NCCL's buffers, the logits of the loss), predicts their step time (m18_step_time)
and ranks them. If nothing fits, it says which candidate came closest.

Layouts that differ only in their recompute option train the same way and differ in memory and
time only: the plan keeps the fastest of those that fit (recompute costs time, so usually the
one that keeps the most that still fits).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from course.costs import StepCost
from .m10_recompute import OPTIONS as RECOMPUTE_OPTIONS   # module 10's: "full" only when fixed
from .m11_generators import LOOPED, SCHEDULES
from .m18_costs import rank_cost
from .m18_layout import CONTEXT_VARIANTS, MIXED, ZERO_STAGES, Layout, Precision, check_layout
from .m18_presets import GPU, Model
from .m18_step_time import StepTime, TimeModel, step_time

RESERVE = 0.1   # of the GPU's memory, kept free for what the formulas do not count
# Module 11's schedules but GPipe, which has 1F1B's bubble and keeps all m microbatches instead of p: never
# better, so only planned when asked for (fixed={"schedule": "gpipe"})
PIPELINES = tuple(name for name in SCHEDULES if name != "gpipe")


@dataclass
class Planned:
    layout: Layout
    cost: StepCost
    time: StepTime | None = None       # None: it does not fit
    memory: int = field(init=False)    # bytes a rank keeps: the sum of cost.memory

    def __post_init__(self):
        self.memory = sum(self.cost.memory.values())


@dataclass
class Plan:
    fits: list[Planned] = field(default_factory=list)   # ranked, fastest first
    closest: Planned | None = None                     # when nothing fits: the smallest memory
    considered: int = 0                                # candidates costed


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def candidates(model: Model, gpus: int, batch: int, gpu: GPU, fixed: dict | None = None) -> list[Layout]:
    """Every layout of `gpus` GPUs this model can run (given); `fixed` maps Layout fields to the only
    value allowed (e.g. {"t": 8, "zero": 1})."""
    fixed, cfg, moe = fixed or {}, model.cfg, model.moe
    choices = {
        # (zero, reduce_once): ZeRO-2 both ways
        "zero": [(z, once) for z in (ZERO_STAGES if moe is None else (0, 1, 2)) for once in ((False, True) if z == 2
                                                                                          else (False,))],
        "recompute": (fixed["recompute"],) if "recompute" in fixed else RECOMPUTE_OPTIONS,
        "fp8": (False, True) if gpu.fp8 else (False,),
    }
    found = []
    for t in divisors(gpus):
        if t > gpu.per_node or (moe is not None and t > 1) or cfg.n_kv_heads % t or cfg.n_heads % t:
            continue
        for c in divisors(gpus // t):
            for p in divisors(gpus // (t * c)):
                d = gpus // (t * c * p)
                if p > cfg.n_layers or batch % d:
                    continue
                experts = [e for e in divisors(math.gcd(moe.n_experts, d * c))] if moe else [1]
                for e in experts:
                    # with a pipeline, fewer microbatches than stages leave most stages idle most of the step
                    for m in (k for k in divisors(batch // d) if p == 1 or k >= p):
                        pipelines = (fixed["schedule"],) if fixed.get("schedule") in SCHEDULES else PIPELINES
                        for schedule in (pipelines if p > 1 else ("none",)):
                            # a looped schedule's stages a rank: 2, 4, 8, ... while each stage keeps a block
                            vs = [2 ** k for k in range(1, 16) if p * 2 ** k <= cfg.n_layers] if schedule in LOOPED \
                                else [2]
                            for v in vs:
                                for cp in (CONTEXT_VARIANTS if c > 1 else ("allgather",)):
                                    base = Layout(p, d, c, t, e, schedule=schedule, m=m, cp=cp, v=v,
                                                  attention=fixed.get("attention", "flash"),
                                                  sequence_parallel=fixed.get("sequence_parallel", True))
                                    if any(getattr(base, k) != val for k, val in fixed.items() if k not in choices
                                           and k != "reduce_once"):
                                        continue
                                    # module 11's closed forms need the warm-up's microbatches: m >= p for
                                    # ZB-H1 and interleaved zero bubble, m >= 2p - 1 for ZB-H2
                                    if m < {"zbh1": p, "interleaved_zb": p, "zbh2": 2 * p - 1}.get(schedule, 0):
                                        continue
                                    try:
                                        check_layout(model, base, batch)
                                    except ValueError:
                                        continue
                                    found += [Layout(p, d, c, t, e, zero, schedule, m, recompute, fp8, cp, once, v,
                                                     base.attention, base.sequence_parallel)
                                              for zero, once in choices["zero"] if fixed.get("zero", zero) == zero
                                              and fixed.get("reduce_once", once) == once
                                              and not (zero == 2 and not once and p > 1)
                                              and not (once and m == 1)   # one micro-step: the same ZeRO-2
                                              for fp8 in choices["fp8"] if fixed.get("fp8", fp8) == fp8
                                              for recompute in choices["recompute"]
                                              if fixed.get("recompute", recompute) == recompute]
    return found


def search(model: Model, gpus: int, batch: int, gpu: GPU, precision: Precision = MIXED,
           time_model: TimeModel = TimeModel(), fixed: dict | None = None) -> Plan:
    """Every candidate costed; those whose memory fits (1 - RESERVE) of the GPU's ranked by predicted step time."""
    budget = (1 - RESERVE) * gpu.memory
    layouts = candidates(model, gpus, batch, gpu, fixed)
    # >>> TODO(m18): the search: cost every candidate, keep those that fit, one per recompute family, fastest first
    # Contract: a Plan: fits holds, for every family of candidates (Layout.family: all choices but the recompute
    #   option) with a member whose memory (rank_cost's, summed) is at most `budget`, the Planned(layout, cost, time)
    #   of the member that fits with the least step time (step_time's; the first in candidates' order on a tie),
    #   fastest first (ties: less memory first); closest is None when anything fits, else the Planned (time None) of
    #   the candidate with the least memory; considered = len(layouts).
    # Question: which candidates are options at all, and of a family that trains alike, which one is the family's?
    # Maths: a layout that does not fit is no option, however fast; among those that fit the step time decides. The
    #   tests compare with a brute force over the same candidates on a GPU where some fit and some do not, and check
    #   the closest miss.
    # Pitfalls: is the first recompute option that fits the fastest (ffn and attention drop different tensors)? Does
    #   a layout whose memory equals the budget fit? When something fits, is there a closest miss to report?
    # Hint 1: how can one pass over the candidates remember the best member of each family, and the smallest miss?
    #   Chapter 18, "The search".
    # Hint 2: fits = {family: argmin over members with memory <= budget of step time}, ranked by (step, memory);
    #   closest = argmin of memory over all, only when fits is empty.
    # Hint 3: best, closest = {}, None
    #         for layout in layouts: planned = Planned(layout, rank_cost(model, layout, batch, precision))
    #             if planned.memory > budget: closest = planned if it keeps less than closest; continue
    #             planned.time = step_time(model, layout, batch, gpu, planned.cost, time_model)
    #             if layout.family not in best or planned.time.step < best[layout.family].time.step: best[...] = planned
    #         fits = best's values sorted by (step time, memory)
    #         return Plan(fits, closest only if fits is empty, len(layouts))
    best, closest = {}, None
    for layout in layouts:
        planned = Planned(layout, rank_cost(model, layout, batch, precision))
        if planned.memory > budget:
            if closest is None or planned.memory < closest.memory:
                closest = planned
            continue
        planned.time = step_time(model, layout, batch, gpu, planned.cost, time_model)
        key = layout.family
        if key not in best or planned.time.step < best[key].time.step:
            best[key] = planned
    fits = sorted(best.values(), key=lambda q: (q.time.step, q.memory))
    return Plan(fits, None if fits else closest, len(layouts))
    # <<<
