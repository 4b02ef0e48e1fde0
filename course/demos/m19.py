"""`python main.py run 19 [--mesh d=2,t=2] [--steps 300] [--kill-every 8] [--failures 3] [--hang]`: module 17's
model trained under `torchrun --max-restarts N` (c10d rendezvous) by module 19's loop, while a killer ends a
random rank every --kill-every seconds of training (SIGKILL; with --hang, SIGUSR2: the rank stops, alive and
silent, and only the heartbeats find it). Shown as it happens, then told: each failure, who noticed and how
fast, the restart, the checkpoint it resumed from and the steps it lost; the steps done twice compared with
their first computation; the run's goodput."""
import argparse
import math
import time
from datetime import datetime
from pathlib import Path

from course import RESULTS
from course.chars import load_chars
from course.elastic import Events, Job, Killer, config_of, torchrun
from course.impl import reference
from course.launch import RankFailed
from course.mesh import check_mesh, parse_mesh

TIMEOUT_S = 900.0        # the run's default --timeout: torchrun's restarts take seconds each on 2 cores
MIN_KILL_EVERY_S = 1.0   # a step of the smallest job takes up to a second on 2 shared cores
END_MARGIN_S = 20.0      # the demo stops torchrun this long before --timeout, to clean up and tell the story


def add_args(parser: argparse.ArgumentParser):
    parser.add_argument("--mesh", default="d=2,t=2", help="axis=size pairs over p, d, c, t; torchrun starts their "
                        "product of ranks (default d=2,t=2)")
    parser.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    parser.add_argument("--checkpoint-every", type=int, default=20, help="a checkpoint every N steps (default 20)")
    parser.add_argument("--kill-every", type=float, default=8.0,
                        help="seconds of each attempt's training before the killer ends a random rank (default 8)")
    parser.add_argument("--failures", type=int, default=3, help="ranks the killer ends, one an attempt (default 3)")
    parser.add_argument("--max-restarts", type=int, default=3, help="torchrun's --max-restarts (default 3)")
    parser.add_argument("--hang", action="store_true", help="stop the rank (SIGUSR2: alive, silent) instead of "
                        "killing it: the other ranks' heartbeats must find it")
    parser.add_argument("--slack", type=float, default=10.0,
                        help="the heartbeat's timeout, in typical steps (module 19's step_timeout; default 10)")
    parser.add_argument("--staging", default="async", help="async (default), default (DCP's staging before async_save returns) or sync (module 17's save)")
    parser.add_argument("--dim", type=int, default=64, help="width M (default 64)")
    parser.add_argument("--layers", type=int, default=2, help="blocks L (default 2)")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens a sequence, T (default 64)")
    parser.add_argument("--batch", type=int, default=8, help="global batch B (default 8)")
    parser.add_argument("--microbatches", type=int, default=2, help="m (default 2)")
    parser.add_argument("--seed", type=int, default=0, help="the weights', the data's and the killer's seed")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="the run's folder: checkpoints/, events.jsonl, torchrun.log (default results/m19_runs/"
                             "<date-time>)")
    parser.add_argument("--resume", default=None, help="continue the run in DIR (a --checkpoint-dir) from its "
                        "latest complete checkpoint")


def ranks(args) -> int:
    return math.prod(parse_mesh(args.mesh).values())


def job_of(args) -> Job:
    return Job(mesh=parse_mesh(args.mesh), dim=args.dim, layers=args.layers, seq_len=args.seq_len, batch=args.batch,
               microbatches=args.microbatches, steps=args.steps, every=args.checkpoint_every, seed=args.seed,
               slack=args.slack, staging=args.staging)


def check_args(args):
    """One line for a bad option, mesh or checkpoint, before torchrun or any rank starts."""
    if args.max_restarts < 1:
        raise ValueError(f"--max-restarts {args.max_restarts}: a job that restarts needs at least 1")
    if args.checkpoint_every < 1:
        raise ValueError(f"--checkpoint-every {args.checkpoint_every}: the interval between checkpoints must be at "
                         f"least 1 step")
    if not args.kill_every > 0:
        raise ValueError(f"--kill-every {args.kill_every:g}: the killer's interval must be a positive number of seconds")
    if args.kill_every < MIN_KILL_EVERY_S:
        raise ValueError(f"--kill-every {args.kill_every:g}: a killer that fast leaves no step between failures (a "
                         f"step takes up to {MIN_KILL_EVERY_S:g} s here); at least {MIN_KILL_EVERY_S:g}")
    if not 0 <= args.failures <= args.max_restarts:
        raise ValueError(f"--failures {args.failures}: between 0 and --max-restarts ({args.max_restarts}), or "
                         f"torchrun gives up before the run ends")
    if min(args.steps, args.layers, args.seq_len, args.batch, args.microbatches) < 1 or not args.slack > 1:
        raise ValueError("--steps, --layers, --seq-len, --batch and --microbatches must be positive, --slack above 1")
    if args.dim < 8 or args.dim % 8:
        raise ValueError(f"--dim {args.dim}: the model has 4 heads of an even width, so --dim must be a multiple of 8")
    if args.staging not in ("async", "default", "sync"):
        raise ValueError(f"--staging {args.staging!r}: async, default or sync")
    sizes = parse_mesh(args.mesh)
    if "e" in sizes:
        raise ValueError("--mesh: module 19 runs the dense model (no e axis)")
    check_mesh(sizes, ranks(args))
    text = load_chars()
    cfg = config_of(job_of(args), text.vocab_size)
    reference("m17_composition").check_composition(cfg, reference("m17_composition").full_sizes(sizes), args.batch,
                                                   args.microbatches, 1, None)
    checkpoints = reference("m17_checkpoint")
    if args.resume:
        latest = checkpoints.latest_checkpoint(Path(args.resume) / "checkpoints")
        if latest is None:
            raise ValueError(f"--resume {args.resume}: no complete checkpoint (checkpoints/step_NNNNNN/) there")
        checkpoints.check_checkpoint(latest, cfg, text.chars)
        if int(latest.name.removeprefix("step_")) >= args.steps:
            raise ValueError(f"--resume {args.resume}: its latest checkpoint is {latest.name}, at or beyond --steps "
                             f"{args.steps}: ask for more steps")
        args.checkpoint_dir = args.resume
    elif args.checkpoint_dir is None:
        args.checkpoint_dir = str(RESULTS / "m19_runs" / datetime.now().strftime("%Y%m%d-%H%M%S"))
    elif checkpoints.latest_checkpoint(Path(args.checkpoint_dir) / "checkpoints") is not None:
        raise ValueError(f"--checkpoint-dir {args.checkpoint_dir} holds an earlier run's checkpoints: continue it with "
                         f"--resume {args.checkpoint_dir}, or give another folder")


def describe(e: dict, t0: float, kills: list[dict]) -> str | None:
    """One line for an event as it arrives, or None (most steps)."""
    at = f"{e['time'] - t0:7.2f} s"
    kind = e["event"]
    if kind == "start" and e["rank"] == 0:
        return f"{at}  attempt {e['attempt']}: ranks starting"
    if kind == "step" and (e["step"] % 20 == 0 or e.get("first")):
        return f"{at}  step {e['step']:4d}  loss {e['loss']:.4f}"
    if kind == "timeout":
        return f"{at}  heartbeat timeout {e['seconds']:.2f} s (step_timeout of the {len(e['steps'])} steps measured)"
    if kind == "save":
        return f"{at}  checkpoint of step {e['step']} under way: blocked {1e3 * (e['started'] + e['waited']):.1f} ms"
    if kind == "kill":
        return f"{at}  KILLER: rank {e['rank']} ({e['signal']}) after step {e['after_step']}"
    since = f" ({e['time'] - kills[-1]['time']:.2f} s after the failure)" if kills else ""
    if kind == "error":
        return f"{at}  rank {e['rank']}: {e['message'][:90]}{since}"
    if kind == "expired":
        return f"{at}  rank {e['rank']}: heartbeat expired ({e['late']:.2f} s without a step){since}"
    if kind == "stopped":
        return f"{at}  rank {e['rank']}: stopped by torchrun ({e['signal']}){since}"
    if kind == "hung":
        return f"{at}  rank {e['rank']}: stopped, silent"
    return None


def demo(args):
    run_dir = Path(args.checkpoint_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    job, nproc = job_of(args), ranks(args)
    job.save(run_dir)
    events = Events(run_dir / "events.jsonl")
    already = len(events.read())   # a resumed run's folder holds the earlier run's events
    print(f"Mesh {args.mesh} on {nproc} ranks under torchrun --max-restarts {args.max_restarts} (c10d rendezvous, "
          f"a store per attempt); {args.steps} steps of {args.batch} x {args.seq_len} tokens, a checkpoint every "
          f"{args.checkpoint_every} ({args.staging} staging); the killer {'stops' if args.hang else 'kills'} a random "
          f"rank {args.kill_every:g} s into each attempt's training, {args.failures} times.\n  run folder: {run_dir}")
    t0, deadline = time.time(), time.monotonic() + args.timeout - END_MARGIN_S
    with torchrun(run_dir, nproc, args.max_restarts, args.impl) as agent:
        killer = Killer(events, nproc, args.kill_every, args.failures, args.hang, args.seed)
        killer.start()
        seen, kills = already, []
        try:
            while True:
                new = events.read()[seen:]
                seen += len(new)
                for e in new:
                    kills += [e] if e["event"] == "kill" else []
                    if e["event"] == "error" and "TODO(m" in e["message"]:   # no restart can fix an unfinished TODO
                        raise RankFailed(f"rank {e['rank']} of {nproc} raised {e['message']}")
                    line = describe(e, t0, kills)
                    if line:
                        print(line, flush=True)
                if agent.poll() is not None and not new:
                    break
                if time.monotonic() > deadline:
                    print(f"stopping: --timeout {args.timeout:g} s is near")
                    break
                time.sleep(0.1)
        finally:
            killer.done.set()
    tell(events.read()[already:], t0, agent.returncode, run_dir, args)


def tell(log: list[dict], t0: float, returncode, run_dir: Path, args):
    """The story of the run, from its events."""
    print()
    kills = [e for e in log if e["event"] == "kill"]
    starts = {}
    for e in log:
        if e["event"] == "start":
            starts.setdefault(e["attempt"], e["time"])
    first_steps = {}
    for e in log:
        if e["event"] == "step":
            first_steps.setdefault(e["attempt"], e)
    losses_seen: dict[int, list[float]] = {}
    for e in log:
        if e["event"] == "step":
            losses_seen.setdefault(e["step"], []).append(e["loss"])
    for i, kill in enumerate(kills):
        noticed = [e for e in log if e["event"] in ("error", "expired", "stopped") and e["attempt"] == kill["attempt"]
                   and e["rank"] != kill["rank"] and e["time"] >= kill["time"]]
        first = min(noticed, key=lambda e: e["time"]) if noticed else None
        nxt = kill["attempt"] + 1
        print(f"failure {i + 1}: rank {kill['rank']} {'stopped' if kill['signal'] == 'SIGUSR2' else 'killed'} at "
              f"{kill['time'] - t0:.1f} s, after step {kill['after_step']} (attempt {kill['attempt']})")
        if first is not None:
            how = {"error": first.get("message", "")[:70], "expired": "its heartbeat expired",
                   "stopped": "stopped by torchrun"}[first["event"]]
            last = max(e["time"] for e in noticed)
            print(f"  detected {first['time'] - kill['time']:.2f} s later by rank {first['rank']} ({how}); "
                  f"every other rank out {last - kill['time']:.2f} s after the failure")
        if nxt in starts and nxt in first_steps:
            resumed = first_steps[nxt]["step"] - 1
            print(f"  restart: attempt {nxt}'s ranks started {starts[nxt] - kill['time']:.1f} s after the failure, "
                  f"its first step done at +{first_steps[nxt]['time'] - kill['time']:.1f} s; resumed from step "
                  f"{resumed}: {kill['after_step'] - resumed} step(s) lost, done again")
    done = [e for e in log if e["event"] == "done"]
    if not done:
        print(f"the job did not finish (torchrun exited with {returncode}); its log: {run_dir / 'torchrun.log'}")
        return
    losses = done[-1]["losses"]
    redone = {step: seen for step, seen in losses_seen.items() if len(seen) > 1}
    same = all(len(set(seen)) == 1 for seen in redone.values())
    wall = done[-1]["time"] - (starts[min(starts)] if starts else t0)
    step_times = sorted(e["seconds"] for e in log if e["event"] == "step")
    typical = step_times[len(step_times) // 2] if step_times else float("nan")
    blocked = [1e3 * (e["started"] + e["waited"]) for e in log if e["event"] == "save"]
    print(f"\n{len(losses)} steps, {len(kills)} failures, {sum(len(s) - 1 for s in redone.values())} steps done again "
          f"after a restart; loss {losses[0]:.3f} at step 1 -> {losses[-1]:.3f} at step {len(losses)}")
    print(f"every step done again computed the loss of its first run: {'bit for bit' if same else 'NO'} "
          f"({len(redone)} steps)")
    if blocked:
        print(f"each save blocked training for {min(blocked):.1f} to {max(blocked):.1f} ms (median "
              f"{sorted(blocked)[len(blocked) // 2]:.1f} ms)")
    print(f"goodput: {len(losses)} steps x {typical:.3f} s (a typical step) / {wall:.1f} s of wall time = "
          f"{len(losses) * typical / wall:.2f}")
