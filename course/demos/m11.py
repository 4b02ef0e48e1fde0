"""`python main.py run 11 [--schedule S] [--microbatches m] [--batch B] [--nproc p]`: generate a schedule as data,
print it as a table with the validator's verdict, run it on p ranks, check every step's loss
against the monolith, and report the bubble measured, simulated and by formula, with the peak
live activations per rank, a timeline picture and a Chrome trace."""
import argparse

import torch.distributed as dist

from course.bubble import bubble_rows, stage_costs
from course.demos import print_losses, same_curve
from course.emulated import EmulatedSplitStage
from course.impl import load, reference
from course.mesh import world_group
from course.pipeline_options import (add_run_options, check_emulation, check_microbatches, check_schedule, model_config,
                                     write_trace)
from course.profiler import Profiler, export
from course.reference_pipelining import accumulating_monolith
from course.validate import validate


def add_args(parser: argparse.ArgumentParser):
    schedules = reference("m11_generators").SCHEDULES
    parser.add_argument("--schedule", default="zbv", help=f"one of {', '.join(schedules)} (default zbv)")
    parser.add_argument("--stages-per-rank", type=int, default=2, help="interleaved's and interleaved_zb's v (default 2)")
    parser.add_argument("--batch", type=int, default=model_config().batch,
                        help=f"rows a step, cut into m microbatches (default {model_config().batch}: module 00's)")
    # As in run 05: on 4 ranks sharing 2 cores a message and its wake-up cost about 1.5 ms, so a
    # layer's emulated time must be large beside that for the bubble to be the schedule's.
    add_run_options(parser, 16.0, "extra ms per layer in F, in I and in W", "m11-trace")


def check_args(args):
    """Every refusal before any process starts: the schedule's own (check_arguments), the model's
    (the stages must cut the 16 layers evenly), the batch's, and the validator's on the reference
    schedule (a schedule that could deadlock never runs)."""
    check_microbatches(args.microbatches, args.batch)
    check_emulation(args.steps, args.emulate_ms)
    check_schedule(args.schedule, args.world_size, args.microbatches, args.stages_per_rank)
    validate(reference("m11_generators").make_schedule(args.schedule, args.world_size, args.microbatches,
                                                       args.stages_per_rank))


def demo(args):
    m00, m02, gen, ex = (load(s) for s in ("m00_monolith", "m02_comms", "m11_generators", "m11_executor"))
    # gloo, even with GPUs: messages are matched by their tags (which nccl ignores), on CPU tensors.
    rank, world_size, _ = m02.init_distributed(backend="gloo")
    pp = world_group()  # the pipeline is every rank of the job, in rank order
    cfg = m00.MLPConfig(steps=args.steps, batch=args.batch)
    schedule = gen.make_schedule(args.schedule, pp.size, args.microbatches, args.stages_per_rank)
    if rank == 0:
        print(f"{schedule.name}: p={pp.size}, m={schedule.n_microbatches}, {schedule.n_stages} stages, "
              f"placement (stage -> rank) {list(schedule.placement)}")
        print(schedule.table())
        validate(schedule)  # the learner's list, checked by the given validator
        print("validator: valid (every F has its B, or its I and W; no rank can wait forever)\n", flush=True)
    profiler = Profiler(rank)
    stages = {}
    for index, stage in ex.build_stages(cfg, schedule, pp).items():
        stages[index] = profiler.wrap_split_stage(EmulatedSplitStage(stage, args.emulate_ms) if args.emulate_ms else stage)
    comms = profiler.wrap_stage_comms(ex.StageComms(pp, schedule.placement, schedule.n_microbatches,
                                                     order=schedule.orders[pp.index]))
    _, losses = ex.train(schedule, stages, comms, cfg, run_step=profiler.wrap_schedule(ex.run_schedule))
    gathered = [None] * world_size
    dist.all_gather_object(gathered, (losses, export(profiler)))
    if rank != 0:
        return
    losses, profiles = gathered[schedule.placement[-1]][0], [p for _, p in gathered]
    _, expected = m00.train(cfg)
    print(f"{schedule.name} on {world_size} ranks, {schedule.n_microbatches} microbatches, {cfg.steps} steps "
          f"(losses from rank {schedule.placement[-1]}, which holds the last stage):")
    print_losses(losses, expected)
    print(f"  every step's loss equals the monolith's: {same_curve(losses, expected)}")
    _, accumulated = accumulating_monolith(cfg, schedule.n_microbatches)
    print(f"  ... and the monolith's trained on the same {schedule.n_microbatches} microbatches (gradient "
          f"accumulation): {same_curve(losses, accumulated)}")
    report(profiles, schedule, stage_costs(schedule, cfg, args.emulate_ms), args)
    if args.trace:
        write_trace(profiles, args.trace, f"{schedule.name}, p={world_size}, m={schedule.n_microbatches} "
                                          "(measured, last step)")


def report(profiles, schedule, costs, args):
    rows = bubble_rows(profiles, schedule, costs, args.stages_per_rank)
    mode = f"emulated device, {args.emulate_ms:g} ms per layer in F, I and W" if args.emulate_ms else "CPU compute only"
    steps = f"mean over steps 2..{args.steps}" if args.steps > 1 else "one step, warm-up included"
    print(f"\nBubble report ({mode}; {steps}):")
    print(f"{'rank':>4}  {'step ms':>8}  {'compute ms':>10}  {'idle':>6}  {'peak live (stage, mb)':>21}  {'simulated':>9}")
    for r, peak, predicted in zip(rows["summary"]["ranks"], rows["peak_measured"], rows["peak_simulated"]):
        print(f"{r['rank']:>4}  {r['step_s'] * 1e3:8.2f}  {r['compute_s'] * 1e3:10.2f}  {r['idle']:6.1%}  "
              f"{peak:>21}  {predicted:>9}")
    print(f" all  {rows['summary']['step_s'] * 1e3:8.2f}  {'':>10}  {rows['summary']['idle']:6.1%}  "
          f"(simulated {rows['simulated']:.1%}, closed form "
          + ("n/a here" if rows["formula"] is None else f"{rows['formula']:.1%}") + ")")
    print(f"per-rank-span bubble (the zero-bubble paper's: 1 - compute / the longest rank's own span, as if the "
          f"optimizer did not wait for every rank): {rows['summary']['span_idle']:.1%} (simulated "
          f"{rows['span_simulated']:.1%})")
