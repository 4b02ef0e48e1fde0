"""Module 19 goodput: the expected fraction of useful time and the checkpoint intervals, as pure functions,
against course/failure_sim.py's fake clock (seeded exponential failures, no ranks) and against the
optimum of the cost model found numerically here, with the expected wall time of a segment written out
in this file from Daly (2006), whose three published cases are checked too.

Tolerances: the fake clock's goodput is an average over a few thousand failures, its standard error
at most 0.3 % here: we allow 1 %. A first-order formula is right to first order only: Young's interval is
checked where save_cost / mtbf = 1e-4 (it is 0.5 % from the optimum there) within 1 %. Daly's estimate
is checked within 0.5 % of the numerical optimum for save_cost / mtbf up to 1/3 (measured: at most
0.28 %); leaving out its -save_cost is 4 % off at 5/360 and 26 % at 1/10.
"""
import math

import pytest

from course.failure_sim import simulate
from course.impl import load

goodput = load("m19_goodput")


def wall_per_segment(interval, save_cost, restart_cost, mtbf):
    """The expected wall time to complete one segment (interval + save_cost without a failure), restarts that
    may fail included: Daly (2006), written out here as the independent reference."""
    return mtbf * math.exp(restart_cost / mtbf) * (math.exp((interval + save_cost) / mtbf) - 1)


def best_interval(save_cost, restart_cost, mtbf):
    """The interval that maximises interval / wall_per_segment, by a ternary search (it has one maximum)."""
    lo, hi = 1e-9 * mtbf, 3 * mtbf
    for _ in range(300):
        a, b = lo + (hi - lo) / 3, hi - (hi - lo) / 3
        if a / wall_per_segment(a, save_cost, restart_cost, mtbf) < b / wall_per_segment(b, save_cost, restart_cost, mtbf):
            lo = a
        else:
            hi = b
    return (lo + hi) / 2


# (step_time, every, save_cost, restart_cost, mtbf): failures rare, frequent, and restarts as long as half an mtbf.
CASES = [(1.0, 10, 2.0, 5.0, 100.0), (1.0, 5, 1.0, 3.0, 20.0), (0.5, 8, 0.5, 10.0, 20.0)]


@pytest.mark.exercises("expected_goodput")
@pytest.mark.parametrize("step_time, every, save_cost, restart_cost, mtbf", CASES)
def test_the_expected_goodput_is_what_the_fake_clock_measures(step_time, every, save_cost, restart_cost, mtbf):
    run = simulate(step_time, every, save_cost, restart_cost, mtbf, steps=400_000, seed=0)
    got = goodput.expected_goodput(every * step_time, save_cost, restart_cost, mtbf)
    assert run.failures > 1000, run
    assert got == pytest.approx(run.goodput, rel=0.01), (
        f"checkpoints every {every} steps of {step_time} s, saves of {save_cost} s, restarts of {restart_cost} s, a "
        f"failure every {mtbf} s on average: your expected_goodput {got:.4f}; the fake clock measured "
        f"{run.goodput:.4f} over {run.failures} failures")


@pytest.mark.exercises("expected_goodput")
def test_the_goodput_reaches_its_limits():
    # No failures (an mtbf of a million intervals): only the saves cost.
    got = goodput.expected_goodput(10.0, 2.0, 5.0, 1e7)
    assert got == pytest.approx(10 / 12, rel=1e-5), f"failures all but absent: goodput {got}, want 10/12 (saves only)"
    # Rare failures: the waste is the saves' share plus, per failure, half a segment and a restart.
    interval, save_cost, restart_cost, mtbf = 10.0, 0.1, 5.0, 1e5
    first_order = save_cost / interval + ((interval + save_cost) / 2 + restart_cost) / mtbf
    waste = 1 - goodput.expected_goodput(interval, save_cost, restart_cost, mtbf)
    assert waste == pytest.approx(first_order, rel=0.01), f"rare failures: waste {waste:.3e}, to first order {first_order:.3e}"


@pytest.mark.exercises("young_interval")
@pytest.mark.parametrize("save_cost, mtbf", [(1.0, 1e4), (30.0, 3e5), (0.01, 100.0)])
def test_young_interval_is_the_optimum_to_first_order(save_cost, mtbf):
    got, best = goodput.young_interval(save_cost, mtbf), best_interval(save_cost, 0.0, mtbf)
    assert got == pytest.approx(best, rel=0.01), (f"save_cost / mtbf = {save_cost / mtbf:g}: your young_interval "
                                                  f"{got:.4g} s, the cost model's optimum {best:.4g} s (ratio {got / best:.3f})")


@pytest.mark.exercises("daly_interval")
@pytest.mark.parametrize("mtbf, published", [(24 * 60, 117), (6 * 60, 57), (15, 9.1)])
def test_daly_interval_gives_the_figures_of_his_paper(mtbf, published):
    # Daly (2006), figures 3-5: delta = 5 min, R = 10 min, M = 24 h, 6 h, 15 min; tau_opt = 117, 57 and 9.1 min.
    got = goodput.daly_interval(5.0, 10.0, mtbf)
    digits = 0 if published > 10 else 1
    assert round(got, digits) == published, (f"saves of 5 min, restarts of 10, a failure every {mtbf} min: your "
                                              f"daly_interval {got:.3f} min; Daly's paper reports {published}")


@pytest.mark.exercises("daly_interval")
@pytest.mark.parametrize("save_cost, mtbf", [(5.0, 360.0), (1.0, 100.0), (10.0, 100.0), (5.0, 15.0)])
def test_daly_interval_is_the_optimum_and_ignores_the_restart(save_cost, mtbf):
    best = best_interval(save_cost, 1.0, mtbf)
    for restart_cost in (0.1, 1.0, 50.0):
        got = goodput.daly_interval(save_cost, restart_cost, mtbf)
        assert got == pytest.approx(best, rel=0.005), (
            f"save_cost {save_cost}, restart_cost {restart_cost}, mtbf {mtbf}: your daly_interval {got:.4f}; the cost "
            f"model's optimum {best:.4f} (ratio {got / best:.4f}), whatever the restart costs")


@pytest.mark.exercises("daly_interval")
def test_saves_longer_than_two_mtbf_checkpoint_every_mtbf():
    assert goodput.daly_interval(50.0, 1.0, 20.0) == pytest.approx(20.0), goodput.daly_interval(50.0, 1.0, 20.0)


@pytest.mark.exercises("daly_interval", "expected_goodput")
def test_the_fake_clock_does_best_at_daly_interval():
    # Steps of 1 s, saves of 2 s, restarts of 5 s, a failure every 100 s: Daly's interval is about 19 steps. The
    # same seeded failures at half and twice that interval give less goodput.
    step_time, save_cost, restart_cost, mtbf = 1.0, 2.0, 5.0, 100.0
    every = round(goodput.daly_interval(save_cost, restart_cost, mtbf) / step_time)
    measured = {k: simulate(step_time, k, save_cost, restart_cost, mtbf, 100_000, seed=7).goodput
                for k in (max(1, every // 2), every, 2 * every)}
    assert max(measured, key=measured.get) == every, f"goodput at every k steps on the fake clock: {measured}"
    best = best_interval(save_cost, restart_cost, mtbf)
    assert abs(every - best) <= 1, f"your daly_interval rounds to {every} steps; the optimum is {best:.2f} s"


@pytest.mark.given
def test_the_planners_goodput_takes_a_step_time():
    # What module 18's planner would call: its predicted step time, the checkpoint's write, a cluster's mtbf.
    result = goodput.goodput(step_time=2.0, save_cost=20.0, restart_cost=600.0, mtbf=3 * 3600.0)
    assert result.every == round(goodput.daly_interval(20.0, 600.0, 3 * 3600.0) / 2.0)
    assert result.goodput == pytest.approx(goodput.expected_goodput(2.0 * result.every, 20.0, 600.0, 3 * 3600.0))
    assert result.effective_step_time == pytest.approx(2.0 / result.goodput)
    with pytest.raises(ValueError, match="mtbf must be a positive number of seconds"):
        goodput.goodput(1.0, 1.0, 1.0, 0.0)
