"""Module 14 cost formulas against numbers written out by hand (test_14_zero.py compares the same
formulas with what ranks really send and keep).

Two buckets of 10 and 7 values of 4 bytes. Under ZeRO over d = 4 they are padded to 12 and 8
(Ψ' = 20); stage 0 keeps them as they are (Ψ = 17). An all-reduce of S bytes sends 2 (d-1)/d S =
1.5 S, an all-gather or reduce-scatter of S bytes in all sends (d-1)/d S = 0.75 S; each step's
small all-reduces (token count, loss, and with clipping under ZeRO the squared norm) carry 8 bytes.

And a live DDP on 2 forked gloo ranks: its rebuilt buckets are module 14's assign_buckets walked over the
order the gradients arrived in, with the first bucket capped at 1 MiB (DDP's default cap) or at the cap given.
"""
import pytest
import torch

from course.costs import StepCost
from course.impl import load
from course.launch import run_ranks

costs = load("m14_costs")
buckets = load("m14_buckets")
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


# --- DDP's rebuilt buckets -------------------------------------------------------------------------
# A live DistributedDataParallel rebuilds its buckets after its first step, in the order the gradients
# arrived (torch/nn/parallel/distributed.py, _BucketCapacityConfig: with the default bucket_cap_mb the first
# bucket is capped at dist._DEFAULT_FIRST_BUCKET_BYTES, 1 MiB, the others at 25 MiB; with a cap given, every
# bucket at that cap). The rebuilt assignment is module 14's walk over the arrival order, its first bucket at
# the first cap and the rest at the cap: assign_buckets twice, its buckets in walk order (lowest index first).

def _ddp_rebuilt_buckets(caps_mb):
    return {cap_mb: _one_ddp(cap_mb) for cap_mb in caps_mb}


def _one_ddp(cap_mb):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(12)])   # 263,168 bytes a layer
    arrived = []   # the order the gradients are final in, seen by a hook DDP does not know about
    for index, param in enumerate(model.parameters()):
        param.register_post_accumulate_grad_hook(lambda p, index=index: arrived.append(index))
    ddp = torch.nn.parallel.DistributedDataParallel(model, **({} if cap_mb is None else {"bucket_cap_mb": cap_mb}))
    for _ in range(2):   # the first step's backward records the order, the second forward rebuilds
        arrived.clear()
        ddp(torch.randn(4, 256)).sum().backward()
    position = {id(p): i for i, p in enumerate(model.parameters())}
    return arrived[:], [[position[id(p)] for p in bucket.parameters()]
                        for bucket in ddp.reducer._get_zeros_like_grad_buckets()]


@pytest.fixture(scope="module")
def ddp_buckets():
    return run_ranks(_ddp_rebuilt_buckets, 2, (None, 0.5), timeout=60)[0]


@pytest.mark.exercises("assign_buckets")
@pytest.mark.parametrize("cap_mb, first_cap", [(None, 2**20), (0.5, 2**19)], ids=["default-cap", "cap-0.5MiB"])
def test_ddps_rebuilt_buckets_are_assign_buckets_with_a_first_bucket_cap(ddp_buckets, cap_mb, first_cap):
    arrived, rebuilt = ddp_buckets[cap_mb]
    params = [p.detach() for p in torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(12)]).parameters()]
    walk = [params[i] for i in arrived]
    first = sorted(buckets.assign_buckets(walk, first_cap), key=min)[0]           # the walk's first closed bucket
    rest = sorted(buckets.assign_buckets(walk[len(first):], int((cap_mb or 25) * 2**20)), key=min)
    want = [[arrived[i] for i in first]] + [[arrived[len(first) + i] for i in bucket] for bucket in rest]
    got = [sorted(bucket, key=arrived.index) for bucket in rebuilt]
    assert got == want, (f"bucket_cap_mb={cap_mb}: DDP's rebuilt buckets (parameter indices in arrival order) are "
                         f"{got}; assign_buckets over the arrival order, its first bucket capped at {first_cap} bytes "
                         f"and the others at the cap, gives {want}")
