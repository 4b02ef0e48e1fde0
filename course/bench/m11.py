"""Module 11 benchmark: every schedule's bubble measured on the emulated device, simulated and by
formula; peak live activations per rank measured and simulated; and our executor against
torch.distributed.pipelining's same schedule (step time, losses and gradients).

    python main.py bench 11                       # p in {2, 4}, m in {4, 8}, every schedule: ~5 min on 2 cores
    python main.py bench 11 --nproc 4 --microbatches 8 --schedules zbv dualpipev --emulate-ms 8

Runs on CPU ranks in emulated-device mode (course.emulated.EmulatedSplitStage: each layer sleeps
--emulate-ms in F, in I and in W, so τ_F = τ_I = τ_W per stage and every closed form holds). Ours trains
in module 11's train (module 05's loop, keeping the first step's gradients through its `on_step`);
torch runs the same layers with the same sleeps (course/reference_pipelining.py). A step lasts from the first
rank's start to the last rank's end; bubble = the ranks' mean idle fraction in that step. Of the
steps after the first (which pays for warm-up), each row reports the fastest, for ours and torch's
alike: the one least disturbed by other work on a shared machine. Rows a schedule cannot serve (zbv
needs m >= 2p-1, dualpipev m >= 2p, interleaved a multiple of p) are left out.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from course.bench import SelectedModule, report, require_positive
from course.bubble import bubble_rows, stage_costs, timed_steps
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


def _ours(name, n_microbatches, steps, emulate_ms, stages_per_rank):
    pp = world_group()  # the pipeline is every rank of the job
    cfg = m00.MLPConfig(steps=steps)
    schedule = gen.make_schedule(name, pp.size, n_microbatches, stages_per_rank)
    profiler = Profiler(pp.index)
    stages = ex.build_stages(cfg, schedule, pp)
    run = {s: profiler.wrap_split_stage(EmulatedSplitStage(stage, emulate_ms)) for s, stage in stages.items()}
    comms = profiler.wrap_stage_comms(ex.StageComms(pp, schedule.placement, n_microbatches,
                                                    order=schedule.orders[pp.index]))
    first_grads = {}

    def keep_first_grads(step, loss):  # module 05's loop calls it before the optimizer moves the weights
        if step == 0:
            first_grads.update({s: [p.grad.clone() for p in stage.parameters()] for s, stage in stages.items()})
    _, losses = ex.train(schedule, run, comms, cfg, run_step=profiler.wrap_schedule(ex.run_schedule),
                         on_step=keep_first_grads)
    return RankRun(losses, first_grads, export(profiler))


def _same(ours: RankRun, theirs: dict) -> bool:
    """Losses within 1e-6 and gradients within 1e-5 relative (torch scales the summed gradient by 1/M)."""
    losses = all(a is None or abs(a - b) <= 1e-6 for a, b in zip(ours.losses, theirs["losses"]))
    grads = all(((a - b).norm() <= 1e-5 * b.norm()).item() for s, got in ours.first_grads.items()
                for a, b in zip(got, theirs["first_grads"][s], strict=True))
    return losses and grads


def _fastest(steps_per_rank) -> int:
    """The timed step (not the first) with the shortest step: first rank's start to last rank's end."""
    return min(timed_steps(len(steps_per_rank[0])),
               key=lambda s: max(r[s][1] for r in steps_per_rank) - min(r[s][0] for r in steps_per_rank))


def _only_step(profiles, step: int) -> list[dict]:
    """The profiles cut down to one step, as if it were the only one."""
    return [{**p, "steps": [p["steps"][step]], "spans": [{**s, "step": 0} for s in p["spans"] if s["step"] == step]}
            for p in profiles]


def _duration(steps_per_rank, step: int) -> float:
    return max(r[step][1] for r in steps_per_rank) - min(r[step][0] for r in steps_per_rank)


def run(name, world_size, n_microbatches, steps, emulate_ms, stages_per_rank) -> dict:
    from course.reference_pipelining import run_torch_schedule

    schedule = reference("m11_generators").make_schedule(name, world_size, n_microbatches, stages_per_rank)
    ours = run_ranks(_ours, world_size, name, n_microbatches, steps, emulate_ms, stages_per_rank, timeout=300)
    profiles = [r.profile for r in ours]
    fastest = _fastest([p["steps"] for p in profiles])
    costs = stage_costs(schedule, m00.MLPConfig(), emulate_ms)
    rows = bubble_rows(_only_step(profiles, fastest), schedule, costs, stages_per_rank)
    row = {"p": world_size, "m": n_microbatches, "schedule": name, "bubble": rows["summary"]["idle"],
           "simulated": rows["simulated"], "formula": "n/a" if rows["formula"] is None else rows["formula"],
           "diff_pp": 100 * (rows["summary"]["idle"] - rows["simulated"]),
           "peak_live": "/".join(map(str, rows["peak_measured"])), "peak_sim": "/".join(map(str, rows["peak_simulated"])),
           "step_ms": 1e3 * rows["summary"]["step_s"]}
    try:
        theirs = run_ranks(run_torch_schedule, world_size, name, world_size, n_microbatches, steps, emulate_ms,
                           stages_per_rank, timeout=300)
    except Exception as exc:  # e.g. a configuration torch refuses: report it, keep the table
        reason = str(exc).splitlines()[0].split(" raised ", 1)[-1]
        print(f"  (torch.distributed.pipelining refused p={world_size}, m={n_microbatches}, {name}: {reason})")
        row.update(torch_step_ms="n/a", ours_over_torch="n/a", same_as_torch="n/a (refused)")
        return row
    torch_steps = [t["steps"] for t in theirs]
    torch_time = _duration(torch_steps, _fastest(torch_steps))
    row.update(torch_step_ms=1e3 * torch_time, ours_over_torch=rows["summary"]["step_s"] / torch_time,
               same_as_torch=all(_same(o, t) for o, t in zip(ours, theirs)))
    return row


def main(argv):
    parser = argparse.ArgumentParser(prog="main.py bench 11", description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", dest="world_sizes", type=int, nargs="+", default=[2, 4], help="pipeline ranks, p")
    parser.add_argument("--microbatches", "--chunks", type=int, nargs="+", default=[4, 8], help="microbatches, m")
    parser.add_argument("--schedules", nargs="+", default=list(gen.SCHEDULES), choices=list(gen.SCHEDULES))
    parser.add_argument("--stages-per-rank", type=int, default=2, help="interleaved's v")
    parser.add_argument("--steps", type=int, default=3, help="steps per run; the first is not timed")
    # A message and its wake-up cost about 1.5 ms on 4 ranks sharing 2 cores: at 16 ms per layer
    # that is within 2 points of the simulator's free messages (at 4 ms, 2.5-4.7 points off).
    parser.add_argument("--emulate-ms", type=float, default=16.0, help="emulated ms per layer in F, I and W")
    args = parser.parse_args(argv)
    require_positive(parser, args, "stages_per_rank")
    if args.steps < 2:
        parser.error(f"--steps must be at least 2 (the first pays for warm-up and is not timed), got {args.steps}")
    if args.emulate_ms <= 0:
        parser.error(f"--emulate-ms must be positive (the bubble is measured on the emulated device), got {args.emulate_ms:g}")
    plan = check(parser, args)
    torch.set_num_threads(1)
    torch.optim.Adam([torch.zeros(1, requires_grad=True)])  # import torch._dynamo once, not per rank
    rows = []
    for world_size, n_microbatches, name in plan:
        rows.append(run(name, world_size, n_microbatches, args.steps, args.emulate_ms, args.stages_per_rank))
        print(f"  measured p={world_size} m={n_microbatches} {name}", flush=True)
    notes = (f"emulated device: {args.emulate_ms:g} ms per layer in F, in I and in W (τ_B = τ_I + τ_W); {args.steps} steps "
             "per run, the first not timed; each row's step (ours, and torch's) is the fastest of the others. "
             "bubble = the ranks' mean idle fraction, measured; simulated = the "
             "schedule simulator at the emulated stage costs; formula = the chapter's closed form; diff_pp = "
             f"measured - simulated, in points. peak_live: most (stage, microbatch) activations kept per rank. "
             f"interleaved: v = {args.stages_per_rank}. same_as_torch: losses within 1e-6, gradients within 1e-5.")
    report("bench-11", "Module 11: every schedule's bubble measured vs simulated vs formula, and ours vs "
           "torch.distributed.pipelining", rows, notes=notes)


def check(parser, args) -> list[tuple[int, int, str]]:
    """The (p, m, schedule) rows to run; bad options are refused before any rank starts (m must divide
    the batch); rows a schedule cannot serve (its own refusal, or stages that do not cut the model
    evenly) are left out, said once."""
    plan, left_out = [], []
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
                plan.append((world_size, n_microbatches, name))
    if left_out:
        print("left out: " + "; ".join(left_out))
    if not plan:
        parser.error("no schedule can serve these options")
    return plan
