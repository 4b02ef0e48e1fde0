# Generated from solutions/m19_goodput.py by `python -m course.skeleton`: fill in the TODOs.
# Grade your work with `python main.py grade 19`. (skeleton 755e0bdb4423)
"""Module 19, part 5 - how often to checkpoint: the goodput of a run that fails, and the interval that
maximises it.

The cost model (docs/19-failures.md states it; every function below is about it, nothing else):

  - the job computes in segments: τ_interval seconds of training steps, then one checkpoint that blocks
    training for τ_save seconds; a segment counts once both are done;
  - failures come one at a time, independently, at a constant rate: the time to the next one is
    exponential with mean τ_mtbf (the job's mean time between failures), whatever happened before,
    and they strike anywhere: during the steps, the save, or a restart;
  - a failure loses the segment in progress (the job resumes from the last complete checkpoint) and
    costs a restart of τ_restart seconds before the next segment can begin (detection, new processes,
    the rendezvous, reading the checkpoint); a failure during a restart starts the restart again.

Goodput Γ is the fraction of wall time that ends up as useful training: τ_interval over the expected
wall time one segment costs. It is a pure function of four times; course/failure_sim.py runs the
same model on a fake clock (seeded failures, no ranks) as an independent check, and `bench 19` runs
real ranks under a real killer.

In Daly's notation (2006), quoted in his convention: δ is τ_save, R is τ_restart, M is τ_mtbf, τ is
τ_interval. Young (1974) writes T_s for the save time, T_f for the mean time to failure, T_c for the
interval. docs/19-failures.md cites both.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


def check_times(**times: float):
    """One line unless every time is a positive, finite number of seconds (given)."""
    for name, value in times.items():
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")


def expected_goodput(interval: float, save_cost: float, restart_cost: float, mtbf: float) -> float:
    """Γ: the expected fraction of wall time spent on steps that count, for checkpoints every `interval`
    seconds of training, each blocking for `save_cost`, restarts of `restart_cost`, and failures at a mean
    of one per `mtbf` seconds (the cost model above). In (0, 1)."""
    check_times(interval=interval, save_cost=save_cost, restart_cost=restart_cost, mtbf=mtbf)
    # TODO(m19): the goodput of the cost model
    # Contract: the expected fraction of wall time that is useful training under the module docstring's model,
    #   exactly (not a first-order estimate): tests/test_19_goodput.py compares it with course/failure_sim.py's
    #   seeded runs of the same model (thousands of failures, within their statistical error) and with the
    #   limits it must reach (no failures: only the saves cost; failures far apart: the first-order waste).
    # The question: a segment is done when interval + save_cost seconds pass without a failure; how long, on
    #   average, does the job take to get there, counting the attempts that failed and the restarts (which can
    #   fail too)? Goodput is the segment's useful part over that expectation.
    # Pitfalls: the first-order estimate (a failure costs half an interval, on average) is wrong when failures
    #   are frequent; the test's short mtbf sees it. A restart that cannot fail makes the restart term too small.
    raise NotImplementedError('TODO(m19): the goodput of the cost model')


def young_interval(save_cost: float, mtbf: float) -> float:
    """Young's first-order optimum: the training time between checkpoints that minimises the time lost,
    to first order in save_cost / mtbf (the docstring's model, failures rare next to the interval)."""
    check_times(save_cost=save_cost, mtbf=mtbf)
    # TODO(m19): Young's interval, to first order
    # Contract: the τ_interval that minimises the fraction of time lost to first order: each checkpoint costs
    #   save_cost once per interval; a failure costs the work done since the last checkpoint. The tests check it
    #   against the exact optimum of expected_goodput when save_cost << mtbf (they agree to first order) and
    #   against Young's own example.
    # The question: to first order, how much work does a failure lose on average, if it strikes at a uniformly
    #   random moment of an interval? Then: which interval balances the saves' cost against the failures'?
    #   (docs/19 derives the same balance for a neighbouring problem: how much to order at a time.)
    # Pitfalls: the work a failure destroys depends on where in the interval it strikes: count it on average, not
    #   at its worst; the restart costs the same whatever the interval.
    raise NotImplementedError("TODO(m19): Young's interval, to first order")


def daly_interval(save_cost: float, restart_cost: float, mtbf: float) -> float:
    """Daly's higher-order optimum: the training time between checkpoints that maximises expected_goodput,
    to the order of Daly's perturbation estimate (exact to a fraction of a percent whenever save_cost < mtbf)."""
    check_times(save_cost=save_cost, restart_cost=restart_cost, mtbf=mtbf)
    # TODO(m19): Daly's interval, to higher order
    # Contract: Daly's (2006) estimate of the interval that maximises expected_goodput: the tests compare it with
    #   the figures his paper reports for its three cases (in minutes) and with a numerical search of
    #   expected_goodput's maximum; it does not depend on restart_cost (the tests vary it). When saves take as long
    #   as two mean times between failures or more, Daly's estimate is to checkpoint every mtbf.
    # The question: set the derivative of τ / E[segment time] to zero: what equation does the optimum solve, and how
    #   does the solution correct Young's when save_cost / mtbf is no longer tiny? What happens to restart_cost?
    # Pitfalls: the estimate is the interval of *training* between saves: the save's own time is not part of it
    #   (every interval save_cost too long otherwise, which the test with frequent failures sees).
    raise NotImplementedError("TODO(m19): Daly's interval, to higher order")


@dataclass(frozen=True)
class Goodput:
    """What failures do to a step time (given): checkpoints every `every` steps, the fraction Γ of wall time
    that is useful, and the step time the job effectively runs at (its step time / Γ)."""
    every: int
    goodput: float
    effective_step_time: float


def goodput(step_time: float, save_cost: float, restart_cost: float, mtbf: float, every: int | None = None) -> Goodput:
    """A planned or measured step time under failures (given): checkpoints every `every` steps (default: Daly's
    interval rounded to whole steps, at least one), and the goodput that gives. Module 18's planner can call it
    with its predicted step time, the checkpoint's write time and a cluster's failure rate: a job of n GPUs
    whose GPUs each fail once in mtbf_gpu seconds fails about once in mtbf_gpu / n."""
    check_times(step_time=step_time)
    if every is None:
        every = max(1, round(daly_interval(save_cost, restart_cost, mtbf) / step_time))
    elif every < 1:
        raise ValueError(f"checkpoints every {every} steps: at least 1")
    fraction = expected_goodput(every * step_time, save_cost, restart_cost, mtbf)
    return Goodput(every, fraction, step_time / fraction)
