"""Module 19, part 1 - detecting a failure: a dead rank, a hung rank, a slow rank.

A dead rank closes its connections: every peer blocked in a collective with it fails at once (gloo:
"Connection closed by peer"), and torchrun's agent sees its exit code. A *hung* rank (a deadlock, a
driver stuck, a process stopped) closes nothing: its peers wait in their next collective for as long
as the group's timeout allows, which is 30 minutes by default on gloo (10 on NCCL). Every rank then
waits for the one rank that will never come, and the job looks alive. So a job sets its collectives'
timeout from what a healthy step takes, measured: long enough that no healthy step trips it, short
enough that a hang surfaces in a bounded time. Every rank blocked in any collective then fails within
that time of entering it, even one whose own peers are alive (they fail too, and its collective with
them ends), and torchrun restarts the job.

A *slow* rank (a throttled GPU, a bad link, a noisy neighbour) trips nothing: the job runs at its pace,
every rank waiting for it at every collective. Only the ranks' own step times show it, compared with
the job's; which ranks to call stragglers is `stragglers`' question.

The timeouts go on the training's groups only (`set_collective_timeout`): the checkpoint's own group
(m19_async_checkpoint) writes to disk, whose time has nothing to do with a step's.
"""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _set_pg_timeout, _world

MIN_TIMEOUT_S = 1.0  # below this, an operating system's scheduling hiccup on a loaded machine reads as a hang


def collective_timeout(step_times: list[float], slack: float) -> float:
    """Seconds after which a collective that has not completed means a dead or hung rank: `slack` times what a
    healthy step of this job takes, as `step_times` (seconds, this rank's recent steps) measured it; at least
    MIN_TIMEOUT_S."""
    # >>> TODO(m19): the collectives' timeout from measured step times
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


def set_collective_timeout(seconds: float, keep=()):
    """Give every process group of this rank (the default one and all the mesh's) a timeout of `seconds` for
    the collectives issued from now on, except the groups in `keep` (given). torch has no public call for
    a group's timeout after it is made; `_set_pg_timeout` is the one its own tests use."""
    for group in list(_world.pg_map):
        if group not in keep and dist.get_backend(group) == "gloo":
            _set_pg_timeout(timedelta(seconds=seconds), group)
