"""Module 19 benchmark: what a save blocks, what a failure costs, how fast a hang is found.

    python main.py bench 19 [--mesh d=2] [--steps 150] [--mtbf 6] [--intervals 2,5,10,20,40] [--slacks 5,10,20]

Three tables, every number measured on forked gloo ranks training module 17's model with module 19's
code (the implementation selected, --impl):

1. Blocking time of one save, by how it is saved: `sync` (module 17's save: the whole write), `default`
   (DCP's async_save, staging before it returns) and `async` (asynchronous staging, awaited before the
   next optimizer step). Columns: the state's bytes on rank 0; `blocked ms`, the time training waited
   (the save call plus the wait before the next update; median over the saves); `step ms`, a step's
   median; `written ms`, from a save's start until its files were written (sync: the same as blocked).
2. Goodput against the checkpoint interval. Each row trains --steps steps, a checkpoint every k steps
   (sync saves: their cost is the one the interval trades against), while failures strike at seeded
   exponential times of mean --mtbf seconds (a random rank SIGKILLs itself; the job starts again in
   fresh forked ranks from the last complete checkpoint, about a second on 2 cores, where torchrun's
   fresh interpreters take 10 to 25). Measured: wall time, failures, goodput = steps x the row's mean
   step (each attempt's first left out) / wall. Formula: module 19's expected_goodput with the row's
   step, the save cost (table 1's sync) and the restart (the mean time from a failure until the next
   attempt's first useful step begins: new ranks, the group, the model, the checkpoint read);
   Daly's and Young's intervals below. A row sees a few failures: its goodput is a noisy
   sample of the formula's expectation.
3. Detection time against the timeout: 4 ranks (p = 2, t = 2), rank 3 stops after 6 steps; each other
   rank's heartbeat expires `detected s` after the stop, against the timeout its step_timeout chose
   from the steps it measured (slack x a typical step); and a rank SIGKILLed instead: the time until
   the first other rank's collective fails.
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import statistics
import tempfile
import time
from pathlib import Path

import torch

from course.bench import report
from course.elastic import Events, Job, forked_attempt, run_job
from course.impl import load, reference
from course.launch import RankFailed, run_ranks
from course.mesh import check_mesh, parse_mesh


def parse(argv):
    parser = argparse.ArgumentParser(prog="main.py bench 19", description=__doc__.split("\n\n")[0])
    parser.add_argument("--mesh", default="d=2", help="the job's mesh for tables 1 and 2 (default d=2)")
    parser.add_argument("--dim", type=int, default=128, help="width M (default 128)")
    parser.add_argument("--layers", type=int, default=2, help="blocks L (default 2)")
    parser.add_argument("--steps", type=int, default=150, help="steps of each goodput run (default 150)")
    parser.add_argument("--saves", type=int, default=5, help="saves timed per row of table 1 (default 5)")
    parser.add_argument("--mtbf", type=float, default=6.0, help="mean seconds between failures (default 6)")
    parser.add_argument("--intervals", default="2,5,10,20,40", help="checkpoint intervals in steps (default 2,5,10,20,40)")
    parser.add_argument("--slacks", default="5,10,20", help="the heartbeat's slack, table 3 (default 5,10,20)")
    parser.add_argument("--seed", type=int, default=0, help="the failures' seed (default 0)")
    args = parser.parse_args(argv)
    if not args.mtbf > 0:
        parser.error(f"--mtbf must be a positive number of seconds, got {args.mtbf:g}")
    try:
        args.intervals = [int(k) for k in args.intervals.split(",")]
        args.slacks = [float(s) for s in args.slacks.split(",")]
    except ValueError:
        parser.error("--intervals takes whole numbers of steps, --slacks numbers, each list separated by commas")
    if min(args.intervals) < 1:
        parser.error(f"--intervals {args.intervals}: a checkpoint interval is at least 1 step")
    if min(args.slacks) <= 1:
        parser.error(f"--slacks {args.slacks}: a slack above 1 (a timeout longer than a typical step)")
    if min(args.steps, args.saves, args.layers) < 1 or args.dim < 8 or args.dim % 8:
        parser.error("--steps, --saves and --layers must be positive, --dim a multiple of 8")
    try:
        sizes = parse_mesh(args.mesh)
        args.world_size = 1
        for size in sizes.values():
            args.world_size *= size
        check_mesh(sizes, args.world_size)
    except ValueError as exc:
        parser.error(str(exc))
    return args


def job_of(args, steps: int, every: int, staging: str) -> Job:
    return Job(mesh=parse_mesh(args.mesh), dim=args.dim, layers=args.layers, seq_len=64, batch=8, microbatches=2,
               steps=steps, every=every, staging=staging)


# --- 1. blocking time --------------------------------------------------------------------------

def _timed_run(job: Job, root: str, events_path: str):
    run_job(job, Path(root), Events(Path(events_path)))


def blocking(args, folder: Path) -> tuple[list[dict], float]:
    rows, sync_cost = [], None
    for staging in ("sync", "default", "async"):
        root, events = folder / staging, Events(folder / f"{staging}.jsonl")
        every = 4
        job = job_of(args, every * args.saves + 2, every, staging)
        run_ranks(_timed_run, args.world_size, job, str(root), str(events.path), timeout=600)
        log = events.read()
        saves = [1e3 * (e["started"] + e["waited"]) for e in log if e["event"] == "save"]
        steps = [1e3 * e["seconds"] for e in log if e["event"] == "step"][2:]
        written = [1e3 * (os.path.getmtime(d / ".metadata") - os.path.getctime(d / "config.json"))
                   for d in sorted(root.iterdir()) if d.is_dir()]
        state = sum(f.stat().st_size for d in root.iterdir() for f in d.iterdir() if f.suffix == ".distcp")
        rows.append({"staging": staging, "state MB (all ranks)": round(state / 1e6 / args.saves, 2),
                     "blocked ms": round(statistics.median(saves), 2), "step ms": round(statistics.median(steps), 2),
                     "written ms": round(statistics.median(written), 1), "saves": len(saves)})
        if staging == "sync":
            sync_cost = statistics.median(saves) / 1e3
    return rows, sync_cost


# --- 2. goodput against the interval ------------------------------------------------------------

def run_with_failures(args, every: int, folder: Path, failure_times: list[float], t0: float, unix_t0: float):
    """The job to args.steps with saves every `every` steps, attempt after attempt, failures at t0 + the given
    times (t0 on the monotonic clock, unix_t0 the same instant on the events' clock); returns (wall, failures,
    restart seconds each, the step times but each attempt's first)."""
    events = Events(folder / f"every-{every}.jsonl")
    job, rng = job_of(args, args.steps, every, "sync"), random.Random(args.seed + every)
    pending, failures, attempt = list(failure_times), 0, 0
    while True:
        kill_at = t0 + pending[0]
        try:
            run_ranks(forked_attempt, args.world_size, job, folder / f"every-{every}", events, attempt, kill_at,
                      rng.randrange(args.world_size), timeout=600)
            break
        except RankFailed as exc:
            if "killed by SIGKILL" not in str(exc) and "Connection closed" not in str(exc) and "Read error" not in str(exc):
                raise
            pending.pop(0)
            failures += 1
            attempt += 1
    wall = time.monotonic() - t0
    log = events.read()
    first_steps = {}
    for e in log:
        if e["event"] == "step":
            first_steps.setdefault(e["attempt"], e)
    steps = [e["seconds"] for e in log if e["event"] == "step" and not e["first"]]
    typical = statistics.mean(steps)
    failed = sorted(failure_times[:failures])
    # From each failure until the next attempt's first step began doing useful work: new ranks, the group, the
    # model, the checkpoint read; the first step's own time beyond a typical step counts as restart too.
    restarts = [first_steps[a + 1]["time"] - typical - (unix_t0 + failed[a])
                for a in range(failures) if a + 1 in first_steps]
    return wall, failures, restarts, steps


def goodput_rows(args, folder: Path, save_cost: float) -> list[dict]:
    goodput = load("m19_goodput")
    rows, measured = [], []
    rng = random.Random(args.seed)
    for every in args.intervals:
        times, t = [], 0.0
        while t < 3600:
            t += rng.expovariate(1 / args.mtbf)
            times.append(t)
        t0, unix_t0 = time.monotonic(), time.time()
        measured.append((every, *run_with_failures(args, every, folder, times, t0, unix_t0)))
    restarts = [r for *_, rs, _ in measured for r in rs]
    restart = statistics.mean(restarts) if restarts else float("nan")
    for every, wall, failures, _, step_times in measured:
        step = statistics.mean(step_times)   # this row's: the machine's load changes from row to row
        rows.append({"every (steps)": every, "step ms": round(1e3 * step, 1), "failures": failures,
                     "wall s": round(wall, 1), "goodput measured": round(args.steps * step / wall, 3),
                     "goodput formula": round(goodput.expected_goodput(every * step, save_cost, restart, args.mtbf), 3)})
    step = statistics.mean(s for *_, steps in measured for s in steps)
    daly, young = goodput.daly_interval(save_cost, restart, args.mtbf), goodput.young_interval(save_cost, args.mtbf)
    notes = (f"save {1e3 * save_cost:.1f} ms (table 1's sync), restart {restart:.2f} s (measured: failure to the next "
             f"attempt's first step, {len(restarts)} restarts), mtbf {args.mtbf:g} s; with the mean step of all rows "
             f"({1e3 * step:.1f} ms), Daly's interval {daly:.2f} s = {daly / step:.1f} steps, Young's {young:.2f} s = "
             f"{young / step:.1f} steps (mean steps, each attempt's first left out). A row sees a few failures: its measured goodput varies by about "
             f"1/sqrt(failures) of its losses")
    return rows, notes


# --- 3. detection against the timeout -----------------------------------------------------------

def _watch_a_hang(slack: float, kill: bool, cfg, hang_at: int = 6, steps: int = 12):
    import torch.distributed as dist

    from course.mesh import init_mesh
    detect, trainer = load("m19_detect"), load("m17_trainer")
    model = trainer.ComposedLlama(cfg, init_mesh(reference("m17_composition").full_sizes({"p": 2, "t": 2})), 2,
                                  "1f1b", dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    expired, times, timeout, noticed = [], [], None, None
    heartbeat = reference("m19_detect").Heartbeat(60.0, on_expiry=lambda late, where: expired.append(time.time()))
    try:
        for step in range(steps):
            tokens = torch.randint(0, cfg.vocab_size, (8, cfg.max_seq_len + 1), generator=generator)
            if step == 4:
                heartbeat.timeout = timeout = detect.step_timeout(times, slack)
                longest = torch.tensor([timeout])
                dist.all_reduce(longest, op=dist.ReduceOp.MAX)
            if step == hang_at and dist.get_rank() == 3:
                began = time.time()
                if kill:
                    dist.destroy_process_group()   # as a killed process: every connection closed at once
                    return ("killed", began, timeout, max(times))
                time.sleep(min(60.0, longest.item() + 2 * max(times) + 2))
                dist.destroy_process_group()
                return ("hung", began, timeout, max(times))
            began = time.perf_counter()
            try:
                model.train_step(tokens[:, :-1], tokens[:, 1:], 2, optimizer)
            except RuntimeError:
                noticed = time.time()
                dist.destroy_process_group()
                break
            times.append(time.perf_counter() - began)
            heartbeat.beat()
    finally:
        heartbeat.stop()
    return ("expired" if expired else "failed", expired[0] if expired else noticed, timeout, max(times))


def detection_rows(args) -> list[dict]:
    cfg = reference("m17_composition").CONFIG
    cfg = type(cfg)(**{**cfg.__dict__, "vocab_size": 62})
    rows = []
    for slack in args.slacks:
        results = run_ranks(_watch_a_hang, 4, slack, False, cfg, timeout=300)
        began = results[3][1]
        late = [when - began for kind, when, *_ in results[:3] if when is not None]
        rows.append({"rank 3": "stops", "slack": slack, "timeout s (median)": round(statistics.median(r[2] for r in results[:3]), 3),
                     "detected s (first)": round(min(late), 3), "detected s (last)": round(max(late), 3),
                     "longest step s": round(max(r[3] for r in results[:3]), 3)})
    results = run_ranks(_watch_a_hang, 4, args.slacks[0], True, cfg, timeout=300)
    began = results[3][1]
    late = [when - began for kind, when, *_ in results[:3] if when is not None]
    rows.append({"rank 3": "dies", "slack": args.slacks[0], "timeout s (median)": round(statistics.median(r[2] for r in results[:3]), 3),
                 "detected s (first)": round(min(late), 3), "detected s (last)": round(max(late), 3),
                 "longest step s": round(max(r[3] for r in results[:3]), 3)})
    return rows


def main(argv):
    args = parse(argv)
    goodput = load("m19_goodput")
    goodput.expected_goodput(1.0, 1.0, 1.0, 1.0)   # the learner's formulas first: an unfinished TODO stops here
    goodput.daly_interval(1.0, 1.0, 1.0)
    folder = Path(tempfile.mkdtemp(prefix="course-bench19-"))
    try:
        rows, save_cost = blocking(args, folder)
        report("bench-19-blocking", "Module 19: what one save blocks training for, by staging", rows)
        rows, notes = goodput_rows(args, folder, save_cost)
        report("bench-19-goodput", f"Module 19: goodput against the checkpoint interval, failures every {args.mtbf:g} s "
               f"on average (seeded), {args.steps} steps", rows, notes=notes)
        report("bench-19-detection", "Module 19: detection time against the heartbeat's timeout (4 ranks, rank 3 "
               "stops or dies after 6 steps)", detection_rows(args))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
