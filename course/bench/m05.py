"""Module 05 benchmark: the measured bubble of GPipe and 1F1B against (p-1)/(m+p-1), and our
schedules against PyTorch's own (torch.distributed.pipelining ScheduleGPipe / Schedule1F1B).

    python main.py bench 05                      # p in {2,4}, m in {1,2,4,8,16}: ~10 minutes on 2 cores
    python main.py bench 05 --emulate-ms 6 --steps 9    # faster, overheads relatively larger

Runs on CPU ranks in emulated-device mode (course.emulated.EmulatedStage: each layer's forward
sleeps --emulate-ms, 12 ms by default as in `run 05`, its backward twice that), so that 4 ranks on 2
cores behave like 4 devices: a message and its wake-ups cost about 1.5 ms there, and on a machine
that other jobs share a rank may wait longer for a core; the longer the emulated layer, the smaller
that share of a step.
Both implementations run the same emulated stage on the same ranks, their steps interleaved: ours
trains in module 05's own loop (`train`), whose `on_step` keeps the first step's gradients and runs
one step of PyTorch's schedule after each of ours, so that a CPU that gets busier or quieter (other
jobs on a shared machine) slows both alike. A step lasts from the first rank's start to the last
rank's end; the first step pays for warm-up and is not timed. step_ms is the median of the timed
steps, ours_over_torch the median of the step-by-step ratios (ours' step s over torch's step s).
Idle (bubble) = 1 - compute / step time, per rank, averaged over the ranks, read off our step of
median length.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course.bench import SelectedModule, bench_parser, report, start
from course.bubble import median_step, only_step, step_durations, summarize, theoretical_bubble
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


class TorchPipeline:
    """PyTorch's schedule on this rank's emulated stage, one timed step per call of `step()`."""

    def __init__(self, schedule, world_size, n_microbatches, emulate_ms):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        self.rank, self.world_size = dist.get_rank(), world_size
        cfg = m00.MLPConfig()
        self.stage = m04.ShardedMLP(cfg, world_group())
        self.optimizer = torch.optim.Adam(self.stage.parameters(), lr=cfg.lr)
        pipe_stage = PipelineStage(EmulatedStage(self.stage, emulate_ms), self.rank, world_size, torch.device("cpu"))
        kind = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
        self.pipe = kind(pipe_stage, n_microbatches, loss_fn=F.cross_entropy)  # scales gradients by 1/M itself
        self.x, self.y = m00.make_batch(cfg)
        self.run = RankRun([], [], [])

    def step(self):
        self.optimizer.zero_grad()
        dist.barrier()
        began, microbatch_losses = time.perf_counter(), []
        if self.rank == 0:
            self.pipe.step(self.x)
        elif self.rank == self.world_size - 1:
            self.pipe.step(target=self.y, losses=microbatch_losses)
        else:
            self.pipe.step()
        self.run.steps.append((began, time.perf_counter()))
        self.run.losses.append(torch.stack(microbatch_losses).mean().item() if microbatch_losses else None)
        if not self.run.first_grads:
            self.run.first_grads = [p.grad.clone() for p in self.stage.parameters()]
        self.optimizer.step()


def _both(schedule, world_size, n_microbatches, steps, emulate_ms):
    """Ours and PyTorch's on this rank, their steps interleaved; PyTorch's run is the reason it refused
    the configuration (a string) where it did (it refuses in its constructor, on every rank alike)."""
    try:
        theirs = TorchPipeline(schedule, world_size, n_microbatches, emulate_ms)
    except ValueError as exc:  # e.g. 1F1B with fewer microbatches than stages
        theirs = str(exc).splitlines()[0]
    cfg = m00.MLPConfig(steps=steps)
    comms = m02.PipelineComms()  # the pipeline is every rank of the job: comms.pp
    stage = m04.ShardedMLP(cfg, comms.pp)
    profiler = Profiler(dist.get_rank())
    first_grads = []

    def after_each(step, loss):  # module 05's loop calls it before the optimizer moves the weights
        if step == 0:
            first_grads.extend(p.grad.clone() for p in stage.parameters())
        if isinstance(theirs, TorchPipeline):
            theirs.step()
    _, losses = m05.train(profiler.wrap_schedule(m05.SCHEDULES[schedule]),
                          profiler.wrap_stage(EmulatedStage(stage, emulate_ms)), profiler.wrap_comms(comms),
                          n_microbatches, cfg, on_step=after_each)
    profile = export(profiler)
    return RankRun(profile["steps"], losses, first_grads, profile), theirs.run if isinstance(theirs, TorchPipeline) else theirs


def _same(ours: RankRun, theirs: RankRun) -> bool:
    """Equal up to float32 summation order (the two accumulate microbatch gradients differently)."""
    losses_equal = all(a is None or abs(a - b) <= 1e-6 for a, b in zip(ours.losses[-1:], theirs.losses[-1:]))
    grads_equal = all(((a - b).norm() <= 1e-5 * b.norm()).item()
                      for a, b in zip(ours.first_grads, theirs.first_grads, strict=True))
    return losses_equal and grads_equal


def run(world_size, n_microbatches, schedule, steps, emulate_ms) -> dict:
    per_rank = run_ranks(_both, world_size, schedule, world_size, n_microbatches, steps, emulate_ms, timeout=600)
    ours, theirs = [o for o, _ in per_rank], [t for _, t in per_rank]
    profiles = [r.profile for r in ours]
    ours_s = step_durations([r.steps for r in ours])
    summary = summarize(only_step(profiles, median_step(ours_s)))
    theory = theoretical_bubble(world_size, n_microbatches)
    row = {"p": world_size, "m": n_microbatches, "schedule": schedule,
           "bubble": summary["idle"], "theory": theory, "diff_pp": 100 * (summary["idle"] - theory),
           "peak_live_per_rank": "/".join(str(max(p["peak_live"])) for p in profiles),
           "step_ms": 1e3 * statistics.median(ours_s.values())}
    if isinstance(theirs[0], str):
        print(f"  (torch.distributed.pipelining refused p={world_size}, m={n_microbatches}, {schedule}: {theirs[0]})")
        row.update(torch_step_ms="n/a", ours_over_torch="n/a", same_as_torch="n/a (refused)")
        return row
    torch_s = step_durations([t.steps for t in theirs])
    row.update(torch_step_ms=1e3 * statistics.median(torch_s.values()),
               ours_over_torch=statistics.median(ours_s[s] / torch_s[s] for s in ours_s),
               same_as_torch=all(_same(o, t) for o, t in zip(ours, theirs)))
    return row


def main(argv):
    parser = bench_parser("05", __doc__)
    parser.add_argument("--nproc", dest="world_sizes", type=int, nargs="+", default=[2, 4], help="pipeline ranks, p")
    parser.add_argument("--microbatches", "--chunks", type=int, nargs="+", default=[1, 2, 4, 8, 16],
                        help="microbatches, m")
    parser.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b"], choices=["gpipe", "1f1b"])
    parser.add_argument("--steps", type=int, default=7,
                        help="steps per run (default 7); the first is not timed, the others' median is")
    parser.add_argument("--emulate-ms", type=float, default=12.0,
                        help="emulated ms per layer forward (default 12: the demo's; its backward twice that)")
    args = start(parser, argv, check)
    rows = []
    for world_size in args.world_sizes:
        for n_microbatches in args.microbatches:
            for schedule in args.schedules:
                rows.append(run(world_size, n_microbatches, schedule, args.steps, args.emulate_ms))
                print(f"  measured p={world_size} m={n_microbatches} {schedule}", flush=True)
    notes = (f"emulated device: {args.emulate_ms:g} ms per layer forward, twice that backward; {args.steps} steps "
             "per run, the first not timed; ours' and torch's steps interleaved on the same ranks. step_ms: median "
             "step; ours_over_torch: median of the step-by-step ratios. bubble = mean idle fraction of the ranks in "
             "our step of median length; theory = (p-1)/(m+p-1). same_as_torch: losses within 1e-6 and gradients "
             "within 1e-5 relative.")
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
