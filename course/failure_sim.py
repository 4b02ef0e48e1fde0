"""A training run that fails, on a fake clock (given): module 19's cost model played out step by step with
seeded failures, no ranks and no sleeping, so a test can run thousands of failures in a fraction of a
second and compare what happens with module 19's formulas (an independent reference: nothing here
calls the learner's code).

The run, as docs/19-failures.md states the model: steps of `step_time` seconds; after every `every` steps
a checkpoint that blocks for `save_cost` seconds; the steps since the last complete checkpoint count
only once it is complete. Failures arrive as a Poisson process of mean gap `mtbf` (exponential gaps,
drawn from one seeded generator), during steps, saves and restarts alike. A failure loses the
steps since the last complete checkpoint, then the job restarts, which takes `restart_cost` seconds
without a failure (a failure during a restart starts it again).
"""
from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class SimulatedRun:
    wall: float          # seconds on the fake clock until the last step counted
    useful: float        # seconds of steps that count: steps x step_time
    failures: int
    lost_steps: int      # steps computed and then lost to a failure
    saves: int           # checkpoints completed

    @property
    def goodput(self) -> float:
        return self.useful / self.wall


def simulate(step_time: float, every: int, save_cost: float, restart_cost: float, mtbf: float, steps: int,
             seed: int = 0) -> SimulatedRun:
    """`steps` useful steps under failures, checkpointed every `every` steps (the last segment may be shorter),
    on a fake clock; returns what it cost."""
    rng = random.Random(seed)
    clock, done, failures, lost, saves = 0.0, 0, 0, 0, 0
    next_failure = rng.expovariate(1 / mtbf)
    while done < steps:
        k = min(every, steps - done)
        end = clock + k * step_time + save_cost
        if end <= next_failure:                 # the segment and its save complete
            clock, done, saves = end, done + k, saves + 1
            continue
        lost += min(k, int((next_failure - clock) / step_time))   # the steps finished before the failure
        clock, failures = next_failure, failures + 1
        while True:                             # restart: needs restart_cost seconds without a failure
            next_failure = clock + rng.expovariate(1 / mtbf)
            if clock + restart_cost <= next_failure:
                clock += restart_cost
                break
            clock, failures = next_failure, failures + 1
    return SimulatedRun(clock, steps * step_time, failures, lost, saves)
