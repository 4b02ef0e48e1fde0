"""`python main.py run 11 [--schedule S] [--microbatches M] [--nproc P]`: generate a schedule as data,
print it as a table with the validator's verdict, run it on P ranks, check every step's loss
against the monolith, and report the bubble measured, simulated and by formula, with the peak
live activations per rank, a timeline picture and a Chrome trace."""
import argparse
import os
from fractions import Fraction

import torch.distributed as dist

from course import RESULTS
from course.bubble import summarize
from course.demos import print_losses, same_curve
from course.emulated import EmulatedSplitStage
from course.impl import load, reference
from course.profiler import Profiler, export
from course.reference_pipelining import accumulating_monolith
from course.simulate import Costs, simulate_schedule
from course.trace import chrome_trace


def add_args(parser: argparse.ArgumentParser):
    schedules = reference("m11_generators").SCHEDULES
    parser.add_argument("--schedule", default="zbv", help=f"one of {', '.join(schedules)} (default zbv)")
    parser.add_argument("--microbatches", "--chunks", type=int, default=8,
                        help="microbatches per step, M (default 8; --chunks is torch's name for it)")
    parser.add_argument("--stages-per-rank", type=int, default=2, help="interleaved's v (default 2)")
    # As in run 05: on 4 ranks sharing 2 cores a message and its wake-up cost about 1.5 ms, so a
    # layer's emulated time must be large beside that for the bubble to be the schedule's.
    parser.add_argument("--steps", type=int, default=5, help="training steps (default 5; the monolith's run is 50)")
    parser.add_argument("--emulate-ms", type=float, default=16.0,
                        help="emulated device: extra ms per layer in F, in I and in W; 0: CPU only")
    parser.add_argument("--trace", default=str(RESULTS / "m11-trace"),
                        help="write PREFIX.json (Chrome trace) and PREFIX.png (timeline)")


def check_args(args):
    """Every refusal before any process starts: the schedule's own (check_arguments), the model's
    (the stages must cut the 16 layers evenly), the batch's, and the validator's on the reference
    schedule (a schedule that could deadlock never runs)."""
    gen, m00 = reference("m11_generators"), reference("m00_monolith")
    gen.check_arguments(args.schedule, args.world_size, args.microbatches, args.stages_per_rank)
    cfg = m00.MLPConfig()
    per_rank = gen.stages_per_rank_of(args.schedule, args.stages_per_rank)
    try:
        reference("m11_stage").check_stages(cfg, args.world_size * per_rank)
    except ValueError as exc:
        raise ValueError(f"{args.schedule} on {args.world_size} ranks, {per_rank} stage(s) each: {exc}") from None
    if cfg.batch % args.microbatches:
        raise ValueError(f"a batch of {cfg.batch} cannot be split into {args.microbatches} equal microbatches; "
                         f"use --microbatches that divides {cfg.batch}")
    if args.steps < 1 or args.emulate_ms < 0:
        raise ValueError("--steps must be at least 1 and --emulate-ms at least 0")
    reference("m11_validate").validate(
        gen.make_schedule(args.schedule, args.world_size, args.microbatches, args.stages_per_rank))


def stage_costs(schedule, cfg, emulate_ms: float) -> Costs:
    """The emulated device's cost of F, I and W on one stage, in ms (F = I = W: EmulatedSplitStage),
    or unit costs when nothing is emulated."""
    if not emulate_ms:
        return Costs()
    per_stage = Fraction(emulate_ms).limit_denominator(1000) * (cfg.layers // schedule.n_stages)
    return Costs(F=per_stage, I=per_stage, W=per_stage)


def bubble_rows(profiles, schedule, costs, stages_per_rank=2) -> dict:
    """Measured (profiles), simulated (the schedule simulator at `costs`) and closed-form bubble,
    and peak live (stage, microbatch) activations per rank, measured and simulated."""
    timeline = simulate_schedule(schedule.orders, schedule.placement, costs)
    summary = summarize(profiles)
    try:
        formula = float(reference("m11_generators").bubble_formula(
            schedule.name, schedule.world_size, schedule.n_microbatches, costs, stages_per_rank))
    except ValueError:  # outside where the closed form holds (e.g. zbh1 with M < P): the simulator still answers
        formula = None
    return {"summary": summary, "simulated": float(timeline.bubble), "formula": formula,
            "peak_measured": [max(p["peak_live"]) for p in profiles], "peak_simulated": timeline.peak_live,
            "step_simulated_ms": float(timeline.makespan)}


def demo(args):
    m00, m02, gen, ex = (load(s) for s in ("m00_monolith", "m02_comms", "m11_generators", "m11_executor"))
    # gloo, even with GPUs: messages are matched by their tags (which nccl ignores), on CPU tensors.
    rank, world_size, _ = m02.init_distributed(backend="gloo")
    cfg = m00.MLPConfig(steps=args.steps)
    schedule = gen.make_schedule(args.schedule, world_size, args.microbatches, args.stages_per_rank)
    if rank == 0:
        print(f"{schedule.name}: P={world_size}, M={schedule.n_microbatches}, {schedule.n_stages} stages, "
              f"placement (stage -> rank) {list(schedule.placement)}")
        print(schedule.table())
        reference("m11_validate").validate(schedule)  # the learner's list, checked by the given validator
        print("validator: valid (every F has its B, or its I and W; no rank can wait forever)\n", flush=True)
    profiler = Profiler(rank)
    stages = {}
    for index, stage in ex.build_stages(cfg, schedule, rank).items():
        stages[index] = profiler.wrap_split_stage(EmulatedSplitStage(stage, args.emulate_ms) if args.emulate_ms else stage)
    comms = profiler.wrap_stage_comms(ex.StageComms(rank, schedule.placement, schedule.n_microbatches,
                                                     order=schedule.orders[rank]))
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
        from course.plotting import plot_timeline

        os.makedirs(os.path.dirname(args.trace) or ".", exist_ok=True)
        chrome_trace(profiles, args.trace + ".json")
        plot_timeline(profiles, args.trace + ".png", step=-1,
                      title=f"{schedule.name}, P={world_size}, M={schedule.n_microbatches} (measured, last step)")
        print(f"trace: {args.trace}.json (open in ui.perfetto.dev), timeline: {args.trace}.png")


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
