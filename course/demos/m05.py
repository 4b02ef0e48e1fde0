"""`python main.py run 05 [--schedule S] [--microbatches M] [--nproc P]`: train the sharded MLP
with one of module 05's schedules, check every step's loss against the monolith, and report the
bubble the profiler measured, with a timeline picture and a Chrome trace."""
import argparse
import os

import torch.distributed as dist

from course import RESULTS
from course.bubble import format_report
from course.demos import print_losses, same_curve
from course.emulated import EmulatedStage
from course.impl import load, reference
from course.profiler import Profiler, export
from course.trace import chrome_trace


def add_args(parser: argparse.ArgumentParser):
    schedules = reference("m05_schedules").SCHEDULES
    parser.add_argument("--schedule", default="1f1b", help=f"one of {', '.join(schedules)}")
    parser.add_argument("--microbatches", "--chunks", type=int, default=8,
                        help="microbatches per step, M (default 8; --chunks is torch's name for it)")
    # The defaults let the bubble show on 4 ranks sharing 2 cores: a message and its wake-up cost
    # about 1.5 ms each there, so a layer's emulated time must be large beside that (measured:
    # within 1.3 points of (P-1)/(M+P-1) at 12 ms, 3 points off at 5 ms, 12 at 0.5 ms).
    parser.add_argument("--steps", type=int, default=5, help="training steps (default 5; the monolith's run is 50)")
    parser.add_argument("--emulate-ms", type=float, default=12.0,
                        help="emulated device: extra ms per layer forward (twice that backward); 0: CPU only")
    parser.add_argument("--trace", default=str(RESULTS / "m05-trace"),
                        help="write PREFIX.json (Chrome trace) and PREFIX.png (timeline)")


def check_args(args):
    schedules = reference("m05_schedules").SCHEDULES
    if args.schedule not in schedules:
        raise ValueError(f"unknown schedule {args.schedule!r}; choose one of {', '.join(schedules)}")
    cfg = reference("m00_monolith").MLPConfig()
    reference("m04_sharded").check_world_size(cfg, args.world_size)
    if args.microbatches < 1:
        raise ValueError(f"--microbatches must be at least 1, got {args.microbatches}")
    if cfg.batch % args.microbatches != 0:
        raise ValueError(f"a batch of {cfg.batch} cannot be split into {args.microbatches} equal "
                         f"microbatches; use --microbatches that divides {cfg.batch}")
    if args.steps < 1 or args.emulate_ms < 0:
        raise ValueError("--steps must be at least 1 and --emulate-ms at least 0")


def demo(args):
    m00, m02, m04, m05 = (load(s) for s in ("m00_monolith", "m02_comms", "m04_sharded", "m05_schedules"))
    rank, world_size, device = m02.init_distributed()
    cfg = m00.MLPConfig(steps=args.steps)
    stage = m04.ShardedMLP(cfg, rank, world_size).to(device)
    if args.emulate_ms:
        stage = EmulatedStage(stage, args.emulate_ms)
    profiler = Profiler(rank)
    # The schedule receives every microbatch count the command line gives, naive included (it runs the
    # whole batch at once whatever it is told); the report counts the microbatches it really ran.
    _, losses = m05.train(profiler.wrap_schedule(m05.SCHEDULES[args.schedule]), profiler.wrap_stage(stage),
                          profiler.wrap_comms(m02.PipelineComms(rank, world_size, device)), args.microbatches, cfg)
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
            from course.plotting import plot_timeline

            os.makedirs(os.path.dirname(args.trace) or ".", exist_ok=True)
            chrome_trace(profiles, args.trace + ".json")
            plot_timeline(profiles, args.trace + ".png", step=-1,
                          title=f"{args.schedule}, P={world_size}, M={n_microbatches}")
            print(f"trace: {args.trace}.json (open in ui.perfetto.dev), timeline: {args.trace}.png")
