"""Module 05 benchmark: the measured bubble of GPipe and 1F1B against (p-1)/(m+p-1), and our
schedules against PyTorch's own (torch.distributed.pipelining ScheduleGPipe / Schedule1F1B).

    python main.py bench 05                      # p in {2,4}, m in {1,2,4,8,16}: ~2 minutes on 2 cores
    python main.py bench 05 --emulate-ms 12 --steps 4   # slower, overheads relatively smaller

Runs on CPU ranks in emulated-device mode (course.emulated.EmulatedStage: each layer's forward
sleeps --emulate-ms, its backward twice that), so that 4 ranks on 2 cores behave like 4 devices.
Both implementations run the same emulated stage on the same ranks; ours trains in module 05's own
loop (`train`, keeping the first step's gradients through its `on_step`). Step time is the mean over
the steps after the first (which pays for warm-up), from the first rank's start to the last
rank's end. Idle (bubble) = 1 - compute / step time, averaged over ranks.
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course.bench import SelectedModule, report
from course.bubble import step_time, summarize, theoretical_bubble
from course.emulated import EmulatedStage
from course.launch import run_ranks
from course.mesh import world_group
from course.pipeline_options import check_emulation, check_microbatches, check_one_stage_per_rank
from course.profiler import Profiler, export

m00, m02, m04, m05 = (SelectedModule(s) for s in ("m00_monolith", "m02_comms", "m04_sharded", "m05_schedules"))


@dataclass
class RankRun:
    """What one rank of one implementation's run brings back."""
    steps: list          # (start, end) of each step, perf_counter seconds
    losses: list         # each step's loss on the last rank (ours: nothing elsewhere; torch's: None)
    first_grads: list    # the gradients of the first step, to compare the two implementations
    profile: dict | None = None  # ours only: the profiler's export


def _ours(schedule, n_microbatches, steps, emulate_ms):
    cfg = m00.MLPConfig(steps=steps)
    comms = m02.PipelineComms()  # the pipeline is every rank of the job: comms.pp
    stage = m04.ShardedMLP(cfg, comms.pp)
    profiler = Profiler(dist.get_rank())
    first_grads = []

    def keep_first_grads(step, loss):  # module 05's loop calls it before the optimizer moves the weights
        if step == 0:
            first_grads.extend(p.grad.clone() for p in stage.parameters())
    _, losses = m05.train(profiler.wrap_schedule(m05.SCHEDULES[schedule]),
                          profiler.wrap_stage(EmulatedStage(stage, emulate_ms)), profiler.wrap_comms(comms),
                          n_microbatches, cfg, on_step=keep_first_grads)
    profile = export(profiler)
    return RankRun(profile["steps"], losses, first_grads, profile)


def _theirs(schedule, world_size, n_microbatches, steps, emulate_ms):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    rank = dist.get_rank()
    cfg = m00.MLPConfig(steps=steps)
    stage = m04.ShardedMLP(cfg, world_group())
    optimizer = torch.optim.Adam(stage.parameters(), lr=cfg.lr)
    pipe_stage = PipelineStage(EmulatedStage(stage, emulate_ms), rank, world_size, torch.device("cpu"))
    kind = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
    pipe = kind(pipe_stage, n_microbatches, loss_fn=F.cross_entropy)  # scales gradients by 1/M itself
    x, y = m00.make_batch(cfg)
    losses, grads, steps_at = [], None, []
    for step in range(steps):
        optimizer.zero_grad()
        dist.barrier()
        start, microbatch_losses = time.perf_counter(), []
        if rank == 0:
            pipe.step(x)
        elif rank == world_size - 1:
            pipe.step(target=y, losses=microbatch_losses)
        else:
            pipe.step()
        steps_at.append((start, time.perf_counter()))
        losses.append(torch.stack(microbatch_losses).mean().item() if microbatch_losses else None)
        if step == 0:
            grads = [p.grad.clone() for p in stage.parameters()]
        optimizer.step()
    return RankRun(steps_at, losses, grads)


def _same(ours: RankRun, theirs: RankRun) -> bool:
    """Equal up to float32 summation order (the two accumulate microbatch gradients differently)."""
    losses_equal = all(a is None or abs(a - b) <= 1e-6 for a, b in zip(ours.losses[-1:], theirs.losses[-1:]))
    grads_equal = all(((a - b).norm() <= 1e-5 * b.norm()).item()
                      for a, b in zip(ours.first_grads, theirs.first_grads, strict=True))
    return losses_equal and grads_equal


def run(world_size, n_microbatches, schedule, steps, emulate_ms) -> dict:
    ours = run_ranks(_ours, world_size, schedule, n_microbatches, steps, emulate_ms, timeout=300)
    profiles = [r.profile for r in ours]
    summary = summarize(profiles)
    theory = theoretical_bubble(world_size, n_microbatches)
    row = {"p": world_size, "m": n_microbatches, "schedule": schedule,
           "bubble": summary["idle"], "theory": theory, "diff_pp": 100 * (summary["idle"] - theory),
           "peak_live_per_rank": "/".join(str(max(p["peak_live"])) for p in profiles),
           "step_ms": 1e3 * summary["step_s"]}
    try:
        theirs = run_ranks(_theirs, world_size, schedule, world_size, n_microbatches, steps, emulate_ms, timeout=300)
    except Exception as exc:  # e.g. a configuration PyTorch refuses: report it, keep the table
        reason = str(exc).splitlines()[0].split(" raised ", 1)[-1]
        print(f"  (torch.distributed.pipelining refused p={world_size}, m={n_microbatches}, {schedule}: {reason})")
        row.update(torch_step_ms="n/a", ours_over_torch="n/a", same_as_torch="n/a (refused)")
        return row
    ours_time = summary["step_s"]
    torch_time = step_time([t.steps for t in theirs])
    row.update(torch_step_ms=1e3 * torch_time, ours_over_torch=ours_time / torch_time,
               same_as_torch=all(_same(o, t) for o, t in zip(ours, theirs)))
    return row


def main(argv):
    parser = argparse.ArgumentParser(prog="main.py bench 05", description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", dest="world_sizes", type=int, nargs="+", default=[2, 4], help="pipeline ranks, p")
    parser.add_argument("--microbatches", "--chunks", type=int, nargs="+", default=[1, 2, 4, 8, 16],
                        help="microbatches, m")
    parser.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b"], choices=["gpipe", "1f1b"])
    parser.add_argument("--steps", type=int, default=2, help="steps per run; the first is not timed")
    parser.add_argument("--emulate-ms", type=float, default=6.0, help="emulated ms per layer forward")
    args = parser.parse_args(argv)
    check(parser, args)
    torch.set_num_threads(1)
    torch.optim.Adam([torch.zeros(1, requires_grad=True)])  # import torch._dynamo once, not per rank
    rows = []
    for world_size in args.world_sizes:
        for n_microbatches in args.microbatches:
            for schedule in args.schedules:
                rows.append(run(world_size, n_microbatches, schedule, args.steps, args.emulate_ms))
                print(f"  measured p={world_size} m={n_microbatches} {schedule}", flush=True)
    notes = (f"emulated device: {args.emulate_ms:g} ms per layer forward, twice that backward; "
             f"{args.steps} steps per run, the first not timed. bubble = mean idle fraction of the ranks; "
             "theory = (p-1)/(m+p-1). same_as_torch: losses within 1e-6 and gradients within 1e-5 relative.")
    report("bench-05", "Module 05: pipeline bubble, measured vs theory, and ours vs torch.distributed.pipelining",
           rows, notes=notes)


def check(parser, args):
    """Refuse bad arguments before any rank starts, with `run 05`'s own checks for every p and m the
    table will run."""
    try:
        for world_size in args.world_sizes:
            check_one_stage_per_rank(world_size)
        for n_microbatches in args.microbatches:
            check_microbatches(n_microbatches)
        check_emulation(args.steps, args.emulate_ms)
    except ValueError as exc:
        parser.error(str(exc))
