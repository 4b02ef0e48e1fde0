"""`python main.py run 05 [--schedule S] [--microbatches m] [--nproc p]`: train the sharded MLP
with one of module 05's schedules, check every step's loss against the monolith, and report the
bubble the profiler measured, with a timeline picture and a Chrome trace."""
import argparse

import torch.distributed as dist

from course.bubble import format_report
from course.demos import print_losses, same_curve
from course.emulated import EmulatedStage
from course.impl import load, reference
from course.pipeline_options import (add_run_options, check_emulation, check_microbatches, check_one_stage_per_rank,
                                     write_trace)
from course.profiler import Profiler, export


def add_args(parser: argparse.ArgumentParser):
    schedules = reference("m05_schedules").SCHEDULES
    parser.add_argument("--schedule", default="1f1b", help=f"one of {', '.join(schedules)}")
    # The defaults let the bubble show on 4 ranks sharing 2 cores: a message and its wake-up cost
    # about 1.5 ms each there, so a layer's emulated time must be large beside that (measured:
    # within 1.3 points of (p-1)/(m+p-1) at 12 ms, 3 points off at 5 ms, 12 at 0.5 ms).
    add_run_options(parser, 12.0, "extra ms per layer forward (twice that backward)", "m05-trace")


def check_args(args):
    schedules = reference("m05_schedules").SCHEDULES
    if args.schedule not in schedules:
        raise ValueError(f"unknown schedule {args.schedule!r}; choose one of {', '.join(schedules)}")
    check_one_stage_per_rank(args.world_size)
    check_microbatches(args.microbatches)
    check_emulation(args.steps, args.emulate_ms)


def demo(args):
    m00, m02, m04, m05 = (load(s) for s in ("m00_monolith", "m02_comms", "m04_sharded", "m05_schedules"))
    rank, world_size, device = m02.init_distributed()
    cfg = m00.MLPConfig(steps=args.steps)
    comms = m02.PipelineComms(device=device)  # the pipeline is every rank of the job: comms.pp
    stage = m04.ShardedMLP(cfg, comms.pp).to(device)
    if args.emulate_ms:
        stage = EmulatedStage(stage, args.emulate_ms)
    profiler = Profiler(rank)
    # The schedule receives every microbatch count the command line gives, naive included (it runs the
    # whole batch at once whatever it is told); the report counts the microbatches it really ran.
    _, losses = m05.train(profiler.wrap_schedule(m05.SCHEDULES[args.schedule]), profiler.wrap_stage(stage),
                          profiler.wrap_comms(comms), args.microbatches, cfg)
    n_microbatches = 1 if args.schedule == "naive" else args.microbatches
    if rank == world_size - 1:
        _, expected = m00.train(cfg)
        print(f"{args.schedule} on {world_size} ranks, {n_microbatches} microbatch{'es' * (n_microbatches > 1)}, "
              f"{cfg.steps} steps:")
        print_losses(losses, expected)
        print(f"  every step's loss equals the monolith's: {same_curve(losses, expected)}")
    profiles = [None] * world_size
    dist.all_gather_object(profiles, export(profiler))
    if rank == 0:
        mode = f"emulated device, {args.emulate_ms:g} ms per layer forward" if args.emulate_ms else "CPU compute only"
        steps = f"mean over steps 2..{cfg.steps}" if cfg.steps > 1 else "one step, warm-up included"
        print(f"\nBubble report ({mode}; {steps}):")
        print(format_report(profiles, n_microbatches))
        if args.trace:
            write_trace(profiles, args.trace, f"{args.schedule}, p={world_size}, m={n_microbatches}")
