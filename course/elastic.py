"""Module 19's job under torchrun, restarted through its failures (given): what `python main.py run 19` and
the long checks run.

    controller (main.py run 19)            torchrun --max-restarts N (c10d)          the ranks
    writes RUN_DIR/job.json   ---------->  starts R ranks: python -m course.elastic RUN_DIR
    Killer: SIGKILL (or SIGUSR2: hang)     a rank dies -> stops the others (SIGTERM),
      a random rank every S seconds        starts R fresh ones (attempt + 1)  ---->  resume from the last
    reads RUN_DIR/events.jsonl  <-------------------------------------------------  complete checkpoint;
                                                                                     log every event

Every rank appends what happens to it to RUN_DIR/events.jsonl, one JSON object a line (its start, each
step, each save's blocking time, the error or signal that ended it); the controller's killer reads it
to find the ranks' process ids, and the demo reads it afterwards to tell the story: each failure, who
noticed it and when, the restart, the steps lost.

The rendezvous is c10d's, made reliable on restart: torchrun's agent shares its rendezvous TCP store
with the ranks by default, and restarted ranks then read the previous attempt's gloo addresses from
it ("Gloo connectFullMesh failed ... Connection refused", 3 restarts of 5 on this project's machine).
TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 gives every attempt a store of its own (4 of 4).

No process is left behind: torchrun runs in a session of its own, with a parent-death signal (if the
controller dies, torchrun gets SIGTERM and stops its ranks); each rank dies with torchrun (SIGKILL);
the controller stops torchrun on every way out (the run's end, its timeout, Ctrl-C, SIGTERM) and kills
any rank the events name that is still alive.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from course import REPO

STARTUP_TIMEOUT_S = 300.0   # the heartbeat's timeout until the first steps are measured (imports, loading)
STOP_GRACE_S = 15.0         # torchrun's time to stop its ranks after SIGTERM, before SIGKILL


@dataclass(frozen=True)
class Job:
    """Everything a rank needs to build the job (the controller writes it as RUN_DIR/job.json)."""
    mesh: dict
    dim: int = 64
    layers: int = 2
    seq_len: int = 64
    batch: int = 8
    microbatches: int = 2
    steps: int = 300
    every: int = 20          # a checkpoint every this many steps
    lr: float = 3e-3
    seed: int = 0
    slack: float = 10.0      # the heartbeat's timeout: slack x the typical step (m19_detect.step_timeout)
    warmup: int = 5          # steps measured before the timeout is set
    staging: str = "async"  # async, default (DCP's staging, before async_save returns) or sync (module 17's save)
    dtype: str = "float32"

    def save(self, run_dir: Path):
        (run_dir / "job.json").write_text(json.dumps(dataclasses.asdict(self)))

    @staticmethod
    def read(run_dir: Path) -> "Job":
        return Job(**json.loads((run_dir / "job.json").read_text()))


class Events:
    """RUN_DIR/events.jsonl: appended by every process, one line a write (O_APPEND keeps lines whole)."""

    def __init__(self, path: Path):
        self.path = Path(path)

    def log(self, event: str, **fields):
        line = json.dumps({"event": event, "time": time.time(), "pid": os.getpid(), **fields}) + "\n"
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)

    def read(self) -> list[dict]:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return []
        return [json.loads(line) for line in text.splitlines() if line.endswith("}")]


# --- one rank of the job (under torchrun, or forked by a benchmark) ---------------------------

def config_of(job: Job, vocab_size: int):
    """The job's Llama: 4 query and 2 key/value heads, FFN 11 M / 4 (as module 17's run)."""
    from course.impl import reference
    LlamaConfig = reference("m06_llama_block").LlamaConfig
    return LlamaConfig(dim=job.dim, n_heads=4, n_kv_heads=2, head_dim=job.dim // 4, ffn_dim=job.dim * 11 // 4,
                       n_layers=job.layers, max_seq_len=job.seq_len, vocab_size=vocab_size)


def run_job(job: Job, root: Path, events: Events | None, heartbeat=None, on_step=None) -> list[float]:
    """This rank's part of the job: module 17's model on the job's mesh, module 19's reader, checkpointer and
    loop (the implementation selected: steps/ or solutions/), every step timed; after `job.warmup` steps the
    heartbeat's timeout from the learner's step_timeout. Rank 0 logs the steps and the saves."""
    import torch
    import torch.distributed as dist

    from course.chars import load_chars
    from course.impl import load, reference
    from course.mesh import init_mesh

    trainer, detect = load("m17_trainer"), load("m19_detect")
    data, checkpointing, resilient = load("m19_data"), load("m19_async_checkpoint"), load("m19_resilient")
    composition, checkpoints = reference("m17_composition"), reference("m17_checkpoint")
    text = load_chars()
    cfg = config_of(job, text.vocab_size)
    model = trainer.ComposedLlama(cfg, init_mesh(composition.full_sizes(job.mesh)), job.microbatches, "1f1b",
                                  seed=job.seed, dtype=getattr(torch, job.dtype))
    sampler = data.ShuffledSequences(text.train, cfg.max_seq_len, job.batch, job.seed)
    description = checkpoints.describe(cfg, text.chars)
    checkpointer = (SyncCheckpointer(root, description) if job.staging == "sync"
                    else checkpointing.AsyncCheckpointer(root, description, job.staging))
    rank, attempt = dist.get_rank(), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    timed_saves(checkpointer, events if rank == 0 else None, attempt)
    times, last = [], [time.perf_counter()]

    def step_done(step: int, loss: float):
        now = time.perf_counter()
        times.append(now - last[0])
        last[0] = now
        if heartbeat is not None:
            heartbeat.beat()
            if len(times) == job.warmup:
                heartbeat.timeout = detect.step_timeout(times[1:], job.slack)   # the first step pays the load
                if events is not None and rank == 0:
                    events.log("timeout", attempt=attempt, seconds=heartbeat.timeout, steps=times[1:])
        if events is not None and rank == 0:
            events.log("step", attempt=attempt, step=step + 1, loss=loss, seconds=times[-1], first=len(times) == 1)
        if on_step is not None:
            on_step(step, loss)
    return resilient.train(model, sampler, job.steps, checkpointer, job.every, job.lr, job.microbatches, step_done)


class SyncCheckpointer:
    """Module 17's save behind the checkpointer's interface (m19_async_checkpoint): training waits for the whole
    write (the baseline that benchmarks compare the asynchronous saves with)."""

    def __init__(self, root, description: dict):
        self.root, self.description = Path(root), description

    def save(self, model, optimizer, train_state: dict, step: int):
        from course.impl import load
        load("m17_checkpoint").save(model, optimizer, train_state, self.root, step, self.description)

    def before_update(self):
        pass

    def close(self):
        pass


def forked_attempt(job: Job, root: Path, events: Events, attempt: int, kill_at: float, victim: int):
    """One attempt of the job on a forked rank (course.launch.run_ranks): rank `victim` SIGKILLs itself at
    time.monotonic() == kill_at (at once if that has passed: a failure during the restart), whatever it is doing.
    Returns the losses (every step's, after the last attempt)."""
    import torch.distributed as dist
    os.environ["TORCHELASTIC_RESTART_COUNT"] = str(attempt)
    if dist.get_rank() == 0:
        events.log("start", rank=0, attempt=attempt)
    if dist.get_rank() == victim:
        def kill():
            time.sleep(max(0.0, kill_at - time.monotonic()))
            os.kill(os.getpid(), signal.SIGKILL)
        threading.Thread(target=kill, daemon=True).start()
    return run_job(job, root, events)


def timed_saves(checkpointer, events: Events | None, attempt: int):
    """Time what each save blocks training for: its start (`save`) and the wait before the next update
    (`before_update`), wrapped on this instance; logged as one "save" event a save (rank 0)."""
    save, before_update = checkpointer.save, checkpointer.before_update
    pending = {}

    def timed_save(model, optimizer, state, step):
        began = time.perf_counter()
        save(model, optimizer, state, step)
        pending.update(step=step, started=time.perf_counter() - began)

    def timed_before_update():
        began = time.perf_counter()
        before_update()
        if pending and events is not None:
            events.log("save", attempt=attempt, step=pending["step"], started=pending["started"],
                       waited=time.perf_counter() - began)
        pending.clear()
    checkpointer.save, checkpointer.before_update = timed_save, timed_before_update


def rank_main(run_dir: Path):
    """One rank under torchrun: `python -m course.elastic RUN_DIR`."""
    from course.launch import _die_with_parent
    _die_with_parent()   # if torchrun's agent is killed outright, its ranks go with it
    events, job = Events(run_dir / "events.jsonl"), Job.read(run_dir)
    rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    events.log("start", rank=rank, attempt=attempt)

    def stopped(signum, frame):   # torchrun stopping this rank because another failed
        events.log("stopped", rank=rank, attempt=attempt, signal=signal.Signals(signum).name)
        os._exit(128 + signum)

    def hang(signum, frame):      # the killer's --hang: alive, silent, connections open
        events.log("hung", rank=rank, attempt=attempt)
        while True:
            time.sleep(3600)
    signal.signal(signal.SIGTERM, stopped)
    signal.signal(signal.SIGUSR2, hang)

    import torch
    import torch.distributed as dist

    from course.impl import load
    torch.set_num_threads(1)
    dist.init_process_group("gloo")

    def expired(late, where):
        events.log("expired", rank=rank, attempt=attempt, late=late, where=where)
        os._exit(1)
    heartbeat = load("m19_detect").Heartbeat(STARTUP_TIMEOUT_S, on_expiry=expired)
    try:
        losses = run_job(job, run_dir / "checkpoints", events, heartbeat)
    except Exception as exc:   # a peer died (connection closed), or the learner's code raised
        first = re.sub(r"^\[[^\]]*\] ", "", (str(exc).splitlines() or [""])[0])   # gloo's [file:line] prefix
        first = first.split(" This is typically")[0]                                  # and its advice
        events.log("error", rank=rank, attempt=attempt, message=f"{type(exc).__name__}: {first}"[:300])
        os._exit(1)   # not a normal exit: the checkpoint's background thread may be stuck on a dead peer
    heartbeat.stop()
    if rank == 0:
        events.log("done", attempt=attempt, losses=losses)
    dist.destroy_process_group()


# --- the controller ----------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _parent_death_signal(signum: int):
    """preexec_fn: the child gets `signum` if the thread that started it dies (Linux)."""
    def set_it():
        if sys.platform.startswith("linux"):
            import ctypes
            ctypes.CDLL(None).prctl(1, signum)   # PR_SET_PDEATHSIG
    return set_it


@contextlib.contextmanager
def torchrun(run_dir: Path, nproc: int, max_restarts: int, impl: str):
    """torchrun running the job in `run_dir` (its own output in RUN_DIR/torchrun.log); stopped, with every rank,
    on the way out of the block whatever the way."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
               "--max-restarts", str(max_restarts), "--rdzv-backend", "c10d", "--rdzv-endpoint",
               f"127.0.0.1:{free_port()}", "--rdzv-id", f"m19-{os.getpid()}", "--monitor-interval", "0.1",
               "--log-dir", str(run_dir / "torchrun-logs"),   # else a torchelastic_* folder left in /tmp
               "-m", "course.elastic", str(run_dir)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "COURSE_IMPL": impl,
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("TORCHELASTIC_RUN_ID", None)
    with open(run_dir / "torchrun.log", "w") as log:
        agent = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True, preexec_fn=_parent_death_signal(signal.SIGTERM))
    try:
        yield agent
    finally:
        stop(agent, Events(run_dir / "events.jsonl"))


def stop(agent: subprocess.Popen, events: Events):
    """torchrun stopped (SIGTERM: it stops its ranks; then SIGKILL), and every rank the events name killed."""
    from course.interrupts import signals_deferred
    with signals_deferred():
        if agent.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(agent.pid, signal.SIGTERM)
            try:
                agent.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(agent.pid, signal.SIGKILL)
                agent.wait()
        for e in events.read():
            if e["event"] == "start":
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(e["pid"], signal.SIGKILL)


class Killer(threading.Thread):
    """Ends a random rank (seeded) `every` seconds into each attempt's training (counted from the attempt's
    first step, so that each attempt makes progress), `failures` times: SIGKILL, or with `hang` SIGUSR2 (the
    rank stops, alive and silent). With `after_steps` the kill lands once the attempt has logged that many
    steps instead: a test must not depend on how fast the machine is (a fast one finishes a short job before
    any wall-clock deadline). Each kill is logged as a "kill" event."""

    def __init__(self, events: Events, nproc: int, every: float, failures: int, hang: bool, seed: int,
                 after_steps: int | None = None):
        super().__init__(name="killer", daemon=True)
        self.events, self.nproc, self.every, self.failures, self.hang = events, nproc, every, failures, hang
        self.after_steps = after_steps
        self.rng, self.done = random.Random(seed), threading.Event()

    def run(self):
        for _ in range(self.failures):
            attempt, began = self._next_attempt_training()
            if attempt is None or not self._wait_for_the_moment(attempt, began):
                return
            rank = self.rng.randrange(self.nproc)
            pids = {e["rank"]: e["pid"] for e in self.events.read() if e["event"] == "start" and e["attempt"] == attempt}
            steps = self._steps_of(attempt)
            how = signal.SIGUSR2 if self.hang else signal.SIGKILL
            with contextlib.suppress(ProcessLookupError, KeyError):
                os.kill(pids[rank], how)
                self.events.log("kill", rank=rank, attempt=attempt, signal=how.name, after_step=max(steps, default=0))

    def _steps_of(self, attempt: int) -> list[int]:
        return [e["step"] for e in self.events.read() if e["event"] == "step" and e["attempt"] == attempt]

    def _wait_for_the_moment(self, attempt: int, began: float) -> bool:
        """True when it is time to kill `attempt`; False when the killer was told it is done."""
        if self.after_steps is None:
            return not self.done.wait(self.every - (time.time() - began))
        while len(self._steps_of(attempt)) < self.after_steps:
            if self.done.wait(0.01):
                return False
        return True

    def _next_attempt_training(self):
        """(attempt, when its first step was logged) for an attempt not yet killed, or (None, None) when done."""
        killed = {e["attempt"] for e in self.events.read() if e["event"] == "kill"}
        while not self.done.wait(0.05):
            for e in self.events.read():
                if e["event"] == "step" and e["attempt"] not in killed:
                    return e["attempt"], e["time"]
        return None, None


if __name__ == "__main__":
    rank_main(Path(sys.argv[1]))
