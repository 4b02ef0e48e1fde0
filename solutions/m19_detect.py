"""Module 19, part 1 - detecting a failure: a dead rank, a hung rank, a slow rank.

A dead rank closes its connections: every peer blocked in a collective or a receive with it fails at
once (gloo: "Connection closed by peer"), and torchrun's agent sees its exit code. A *hung* rank (a
deadlock, a driver stuck, a process stopped) closes nothing: its peers wait in their next collective
or receive for as long as the group allows, 30 minutes by default on gloo (10 on NCCL), and a
pipeline's receives, on gloo, for as long as the group was made with, whatever is set later. Every
rank then waits for the one rank that will never come, and the job looks alive.

So every rank keeps a heartbeat (`Heartbeat`, given): a thread that expects a beat after every step
and, when none comes within the timeout, says where the rank was stuck and ends the process, so that
torchrun stops the others and restarts the job. Every surviving rank is stuck in some step, so every
one of them fails within the timeout of its last beat, whichever peer it waits for. The timeout is
the job's own: long enough that no healthy step trips it, short enough that a hang surfaces in a
bounded time; how to get it from measured steps is `step_timeout`'s question. (NCCL's watchdog thread
does the same for the collectives it launches; torchft and NVIDIA's resiliency extension keep such
heartbeats per rank, with timeouts measured from the run.)

A *slow* rank (a throttled GPU, a bad link, a noisy neighbour) trips nothing: the job runs at its pace,
every rank waiting for it at every collective. Only the ranks' own step times show it, compared with
the job's; which ranks to call stragglers is `stragglers`' question.
"""
from __future__ import annotations

import os
import sys
import threading
import time

import torch

from course.launch import where_running

MIN_TIMEOUT_S = 1.0  # below this, an operating system's scheduling hiccup on a loaded machine reads as a hang


def step_timeout(step_times: list[float], slack: float) -> float:
    """Seconds after which a step that has not finished means a dead or hung rank: `slack` times what a
    healthy step of this job takes, as `step_times` (seconds, this rank's recent steps) measured it; at least
    MIN_TIMEOUT_S."""
    # >>> TODO(m19): the heartbeat's timeout from measured step times
    # Contract: a number of seconds, at least MIN_TIMEOUT_S, that is `slack` times the time of a typical healthy
    #   step of the job. `step_times` are real measurements: the first step after a start or a restart pays for
    #   warm-up (allocations, first calls), a step that saved a checkpoint pays for the save, and the machine adds
    #   noise; the tests hand it such lists and check that the timeout scales with the steps, ignores a few steps
    #   far slower than the rest, and that a hung rank's peers (forked ranks, a real hang) fail within it.
    # The question: which single number summarises "what a step takes" when a few of the measurements are far from
    #   the others, and is unmoved by them? Why does a summary that moves with every outlier make the timeout both
    #   too long (a warm-up of a minute) and unstable?
    # Pitfalls: a summary that one warm-up step can move makes the timeout as long as the warm-up; a constant
    #   (30 minutes) leaves the job hanging that long.
    # Hint 1: sort the measurements: which one is unmoved if the slowest few become ten times slower?
    # Hint 2: the median; the timeout is max(MIN_TIMEOUT_S, slack x the median step time).
    # Hint 3: return max(MIN_TIMEOUT_S, slack * statistics.median(step_times))  (import statistics)
    typical = torch.tensor(step_times, dtype=torch.float64).quantile(0.5).item()
    return max(MIN_TIMEOUT_S, slack * typical)
    # <<<


def stragglers(times: torch.Tensor, factor: float) -> list[int]:
    """The ranks that hold the job back: times[r, s] is rank r's own time for step s (R ranks, k steps: the
    time it computed, not the time it waited for others). A rank is a straggler when its typical step takes
    more than `factor` times the typical rank's typical step. Returns their ranks, in increasing order."""
    # >>> TODO(m19): name the stragglers from every rank's step times
    # Contract: the ranks r whose typical time over their k steps exceeds `factor` times the typical rank's; a rank
    #   that is slow only in a step or two (a garbage collection, a checkpoint) is no straggler, and the answer must
    #   not change when the stragglers are slower still. The tests use 8 to 16 ranks, with one or several slow
    #   ranks, a slow step here and there, and no slow rank at all.
    # The question: two summaries, one over each axis of `times`. Over a rank's steps: what describes its usual
    #   pace, unmoved by a single bad step? Over the ranks: what describes the job's usual pace, unmoved by the very
    #   ranks being looked for?
    # Pitfalls: a summary the stragglers themselves move can hide them; one that a single long pause moves makes a
    #   straggler of a healthy rank; comparing each step separately flags every rank at some step.
    # Hint 1: the same summary twice: over dimension 1 (steps), then over the R values that leaves.
    # Hint 2: per_rank = the median of times[r, :] for each r; typical = the median of per_rank; stragglers are
    #   the r with per_rank[r] > factor * typical.
    # Hint 3: per_rank = times.double().quantile(0.5, dim=1); typical = per_rank.quantile(0.5)
    #         return [r for r in range(len(per_rank)) if per_rank[r] > factor * typical]
    per_rank = times.double().quantile(0.5, dim=1)
    typical = per_rank.quantile(0.5)
    return [r for r in range(len(per_rank)) if per_rank[r] > factor * typical]
    # <<<


class Heartbeat:
    """A thread that expects `beat()` at least every `timeout` seconds once started (given). When a beat is
    late, it calls `on_expiry(seconds since the last beat, where the watched thread is)` once; the default
    prints one line naming the rank and its stuck frame, then ends the process with exit code 1 (torchrun
    then stops the job's other ranks and restarts it). `timeout` may be changed at any time (after the
    first steps have been measured)."""

    def __init__(self, timeout: float, on_expiry=None):
        self.timeout, self.on_expiry = timeout, on_expiry or self.exit
        self.watched = threading.current_thread().ident
        self.last = time.monotonic()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="heartbeat", daemon=True)
        self.thread.start()

    def beat(self):
        self.last = time.monotonic()

    def stop(self):
        self.stopped.set()

    def _watch(self):
        while not self.stopped.wait(min(0.05, self.timeout / 10)):
            late = time.monotonic() - self.last
            if late > self.timeout:
                self.on_expiry(late, where_running(sys._current_frames().get(self.watched)))
                return

    @staticmethod
    def exit(late: float, where: str):
        rank = os.environ.get("RANK", "?")
        print(f"error: rank {rank}: no step finished for {late:.1f} s (stuck at {where}): a peer is dead or hung; "
              f"ending this process so that the job restarts", file=sys.stderr, flush=True)
        os._exit(1)
