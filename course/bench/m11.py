"""Module 11 benchmark: every schedule's bubble measured on the emulated device, simulated and by
formula, in the synchronous step and within each rank's own span; peak live activations per rank
measured and simulated; and our executor against torch.distributed.pipelining's same schedule (step
time, losses and gradients; torch has every schedule but ZB-H2).

    python main.py bench 11                       # p in {2, 4}, m in {4, 8}, every schedule: ~10 min on 2 cores
    python main.py bench 11 --nproc 4 --microbatches 8 --schedules zbv dualpipev --emulate-ms 8

Runs on CPU ranks in emulated-device mode (course.emulated.EmulatedSplitStage: each layer sleeps
--emulate-ms in F, in I and in W, so τ_F = τ_I = τ_W per stage and every closed form holds). Ours trains
in module 11's train (module 05's loop), whose `on_step` keeps the first step's gradients and runs one
step of torch's same schedule (course/reference_pipelining.py's TorchSchedule: the same layers with the
same sleeps) after each of ours, on the same ranks: a CPU that gets busier or quieter (other jobs on a
shared machine) slows both alike. A step lasts from the first rank's start to the last rank's end;
the first pays for warm-up and is not timed. step_ms is the median of the others, ours_over_torch the
median of the step-by-step ratios (ours' step s over torch's step s), and the bubble columns are read
off our step of median length: bubble = the ranks' mean idle fraction in that step, span_bubble = 1 -
the ranks' mean compute / the longest rank's own span (first compute to last), the zero-bubble
paper's convention, as if the optimizer did not wait for every rank. Rows a schedule cannot serve
(zbv needs m >= 2p-1, dualpipev m >= 2p, the looped schedules an m that max(1, m // p) divides) are
left out, said once.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

from course.bench import SelectedModule, bench_parser, report, require_positive, start
from course.bubble import bubble_rows, median_step, only_step, stage_costs, step_durations
from course.emulated import EmulatedSplitStage
from course.impl import reference
from course.launch import run_ranks
from course.mesh import world_group
from course.pipeline_options import check_microbatches, check_schedule
from course.profiler import Profiler, export

m00, gen, ex = (SelectedModule(s) for s in ("m00_monolith", "m11_generators", "m11_executor"))


@dataclass
class RankRun:
    """What one rank of our run brings back."""
    losses: list          # each step's loss on the rank holding the last stage, nothing elsewhere
    first_grads: dict     # stage -> its gradients after the first step, to compare with torch's
    profile: dict         # the profiler's export


def _both(name, world_size, n_microbatches, steps, emulate_ms, stages_per_rank):
    """Ours and torch's same schedule on this rank, their steps interleaved (ours' step s, then torch's
    step s); torch's result is None where it has no such schedule, the reason (a string) where it
    refused the configuration (in its constructor, on every rank alike)."""
    from course.reference_pipelining import TORCH_SCHEDULES, TorchSchedule

    theirs = None
    if name in TORCH_SCHEDULES:
        try:
            theirs = TorchSchedule(name, world_size, n_microbatches, emulate_ms, stages_per_rank)
        except ValueError as exc:
            theirs = str(exc).splitlines()[0]
    pp = world_group()  # the pipeline is every rank of the job
    cfg = m00.MLPConfig(steps=steps)
    schedule = gen.make_schedule(name, pp.size, n_microbatches, stages_per_rank)
    profiler = Profiler(pp.index)
    stages = ex.build_stages(cfg, schedule, pp)
    run = {s: profiler.wrap_split_stage(EmulatedSplitStage(stage, emulate_ms)) for s, stage in stages.items()}
    comms = profiler.wrap_stage_comms(ex.StageComms(pp, schedule.placement, n_microbatches,
                                                    order=schedule.orders[pp.index]))
    first_grads = {}

    def after_each(step, loss):  # module 05's loop calls it before the optimizer moves the weights
        if step == 0:
            first_grads.update({s: [p.grad.clone() for p in stage.parameters()] for s, stage in stages.items()})
        if isinstance(theirs, TorchSchedule):
            theirs.step()
    _, losses = ex.train(schedule, run, comms, cfg, run_step=profiler.wrap_schedule(ex.run_schedule),
                         on_step=after_each)
    return RankRun(losses, first_grads, export(profiler)), theirs.result() if isinstance(theirs, TorchSchedule) else theirs


def _same(ours: RankRun, theirs: dict) -> bool:
    """Losses within 1e-6 and gradients within 1e-5 relative (torch scales the summed gradient by 1/M)."""
    losses = all(a is None or abs(a - b) <= 1e-6 for a, b in zip(ours.losses, theirs["losses"]))
    grads = all(((a - b).norm() <= 1e-5 * b.norm()).item() for s, got in ours.first_grads.items()
                for a, b in zip(got, theirs["first_grads"][s], strict=True))
    return losses and grads


def run(name, world_size, n_microbatches, steps, emulate_ms, stages_per_rank) -> dict:
    schedule = reference("m11_generators").make_schedule(name, world_size, n_microbatches, stages_per_rank)
    per_rank = run_ranks(_both, world_size, name, world_size, n_microbatches, steps, emulate_ms, stages_per_rank,
                         timeout=600)
    ours, theirs = [o for o, _ in per_rank], [t for _, t in per_rank]
    profiles = [r.profile for r in ours]
    ours_s = step_durations([p["steps"] for p in profiles])
    costs = stage_costs(schedule, m00.MLPConfig(), emulate_ms)
    rows = bubble_rows(only_step(profiles, median_step(ours_s)), schedule, costs, stages_per_rank)
    row = {"p": world_size, "m": n_microbatches, "schedule": name, "bubble": rows["summary"]["idle"],
           "simulated": rows["simulated"], "formula": "n/a" if rows["formula"] is None else rows["formula"],
           "diff_pp": 100 * (rows["summary"]["idle"] - rows["simulated"]),
           "span_bubble": rows["summary"]["span_idle"], "span_sim": rows["span_simulated"],
           "peak_live": "/".join(map(str, rows["peak_measured"])), "peak_sim": "/".join(map(str, rows["peak_simulated"])),
           "step_ms": 1e3 * statistics.median(ours_s.values())}
    if theirs[0] is None:
        row.update(torch_step_ms="n/a", ours_over_torch="n/a", same_as_torch="n/a (not in torch)")
        return row
    if isinstance(theirs[0], str):
        print(f"  (torch.distributed.pipelining refused p={world_size}, m={n_microbatches}, {name}: {theirs[0]})")
        row.update(torch_step_ms="n/a", ours_over_torch="n/a", same_as_torch="n/a (refused)")
        return row
    torch_s = step_durations([t["steps"] for t in theirs])
    row.update(torch_step_ms=1e3 * statistics.median(torch_s.values()),
               ours_over_torch=statistics.median(ours_s[s] / torch_s[s] for s in ours_s),
               same_as_torch=all(_same(o, t) for o, t in zip(ours, theirs)))
    return row


def main(argv):
    parser = bench_parser("11", __doc__)
    parser.add_argument("--nproc", dest="world_sizes", type=int, nargs="+", default=[2, 4], help="pipeline ranks, p")
    parser.add_argument("--microbatches", "--chunks", type=int, nargs="+", default=[4, 8], help="microbatches, m")
    parser.add_argument("--schedules", nargs="+", default=list(gen.SCHEDULES), choices=list(gen.SCHEDULES))
    parser.add_argument("--stages-per-rank", type=int, default=2, help="the looped schedules' v (interleaved, interleaved_zb)")
    parser.add_argument("--steps", type=int, default=5,
                        help="steps per run (default 5); the first is not timed, the others' median is")
    # A message and its wake-up cost about 1.5 ms on 4 ranks sharing 2 cores: at 16 ms per layer
    # that is within 2 points of the simulator's free messages (at 4 ms, 2.5-4.7 points off).
    parser.add_argument("--emulate-ms", type=float, default=16.0, help="emulated ms per layer in F, I and W")
    args = start(parser, argv, check)
    rows = []
    for world_size, n_microbatches, name in args.plan:
        rows.append(run(name, world_size, n_microbatches, args.steps, args.emulate_ms, args.stages_per_rank))
        print(f"  measured p={world_size} m={n_microbatches} {name}", flush=True)
    notes = (f"emulated device: {args.emulate_ms:g} ms per layer in F, in I and in W (τ_B = τ_I + τ_W); {args.steps} steps "
             "per run, the first not timed; ours' and torch's steps interleaved on the same ranks. step_ms: median "
             "step; ours_over_torch: median of the step-by-step ratios; the bubble columns are read off our step of "
             "median length. bubble = the ranks' mean idle fraction of the synchronous step, measured; simulated = "
             "the schedule simulator at the emulated stage costs; formula = the chapter's closed form; diff_pp = "
             "measured - simulated, in points. span_bubble / span_sim = 1 - mean compute / the longest rank's own "
             "span, measured / simulated (the zero-bubble paper's convention). peak_live: most (stage, microbatch) "
             f"activations kept per rank. interleaved, interleaved_zb: v = {args.stages_per_rank}. same_as_torch: "
             "losses within 1e-6, gradients within 1e-5.")
    report("bench-11", "Module 11: every schedule's bubble measured vs simulated vs formula, and ours vs "
           "torch.distributed.pipelining", rows, notes=notes)


def check(parser, args):
    """Refuse bad options before any rank starts (m must divide the batch), and keep in args.plan the
    (p, m, schedule) rows to run; rows a schedule cannot serve (its own refusal, or stages that do not
    cut the model evenly) are left out, said once."""
    require_positive(parser, args, "stages_per_rank")
    if args.steps < 2:
        parser.error(f"--steps must be at least 2 (the first pays for warm-up and is not timed), got {args.steps}")
    if args.emulate_ms <= 0:
        parser.error(f"--emulate-ms must be positive (the bubble is measured on the emulated device), got {args.emulate_ms:g}")
    args.plan, left_out = [], []
    for world_size in args.world_sizes:
        for n_microbatches in args.microbatches:
            if world_size < 2:
                parser.error(f"--nproc must be at least 2, got {world_size}")
            try:
                check_microbatches(n_microbatches)
            except ValueError as exc:
                parser.error(str(exc))
            for name in args.schedules:
                try:
                    check_schedule(name, world_size, n_microbatches, args.stages_per_rank)
                except ValueError as exc:
                    left_out.append(f"p={world_size} m={n_microbatches} {name} ({str(exc).split(';')[0]})")
                    continue
                args.plan.append((world_size, n_microbatches, name))
    if left_out:
        print("left out: " + "; ".join(left_out))
    if not args.plan:
        parser.error("no schedule can serve these options")
