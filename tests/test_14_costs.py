"""Module 14 cost formulas against numbers written out by hand (test_14_zero.py compares the same
formulas with what ranks really send and keep).

Two buckets of 10 and 7 values of 4 bytes. Under ZeRO over d = 4 they are padded to 12 and 8
(Ψ' = 20); stage 0 keeps them as they are (Ψ = 17). An all-reduce of S bytes sends 2 (d-1)/d S =
1.5 S, an all-gather or reduce-scatter of S bytes in all sends (d-1)/d S = 0.75 S; each step's
small all-reduces (token count, loss, and with clipping under ZeRO the squared norm) carry 8 bytes.
"""
import pytest

from course.costs import StepCost
from course.impl import load

costs = load("m14_costs")
AR, RS, AG = "all_reduce", "reduce_scatter", "all_gather"


def cost(sent, calls, axis="d"):
    return StepCost({(axis, op): v for op, v in sent.items()}, {(axis, op): v for op, v in calls.items()})


CASES = [
    # stage, d, m, clip: expected
    ((0, 4, 1, False), cost({AR: 1.5 * 17 * 4 + 1.5 * 2 * 8}, {AR: 2 + 2})),
    ((0, 4, 2, True), cost({AR: 1.5 * 17 * 4 + 1.5 * 2 * 8}, {AR: 2 + 2})),  # m = 2 sends once; DDP clips locally
    ((1, 4, 2, True), cost({AR: 1.5 * 20 * 4 + 1.5 * 3 * 8, AG: 0.75 * 20 * 4}, {AR: 2 + 3, AG: 2})),
    ((2, 4, 2, True), cost({AR: 1.5 * 3 * 8, RS: 2 * 0.75 * 20 * 4, AG: 0.75 * 20 * 4}, {AR: 3, RS: 2 * 2, AG: 2})),
    ((2, 4, 1, False), cost({AR: 1.5 * 2 * 8, RS: 0.75 * 20 * 4, AG: 0.75 * 20 * 4}, {AR: 2, RS: 2, AG: 2})),
    ((2, 1, 3, False), cost({}, {AR: 2, RS: 3 * 2, AG: 2})),  # a group of one sends nothing, yet issues its calls
]


@pytest.mark.exercises("traffic")
@pytest.mark.parametrize("args, want", CASES, ids=[f"stage{a[0]}-d{a[1]}-m{a[2]}{'-clip' if a[3] else ''}" for a, _ in CASES])
def test_bytes_and_calls_per_step_by_hand(args, want):
    stage, d, m, clip = args
    got = costs.traffic([10, 7], 4, d, stage, m, clip, axis="d")
    assert (got.sent, got.calls) == (want.sent, want.calls), (
        f"ZeRO-{stage}, d={d}, m={m}, clip={clip}: sent {got.sent} in {got.calls}, expected {want.sent} in {want.calls}")


@pytest.mark.exercises("state")
@pytest.mark.parametrize("stage, d, want", [
    (0, 4, {"parameters": 68, "gradients": 68, "optimizer": 136}),   # 4 copies of the 17 values, unpadded
    (1, 4, {"parameters": 80, "gradients": 80, "optimizer": 40}),    # AdamW's 2 moments of a 5-value shard
    (2, 4, {"parameters": 80, "gradients": 20, "optimizer": 40}),    # and the gradients' shard only
    (2, 1, {"parameters": 68, "gradients": 68, "optimizer": 136}),   # one rank: nothing to shard or pad
])
def test_bytes_kept_per_rank_by_hand(stage, d, want):
    got = costs.state([10, 7], 4, d, stage).memory
    assert got == want, f"ZeRO-{stage} over d={d}: keeps {got}, expected {want}"
