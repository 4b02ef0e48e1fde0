"""Module 14 buckets: the assignment against PyTorch's own (the one DDP reverses), and by hand.

Reference: `torch.distributed._compute_bucket_assignment_by_size(params, [cap])`, reversed, which is
what DDP's constructor computes (before any bucket is rebuilt from the order gradients arrived in
during a first step). It is private, so where an installed torch lacks it those cases are skipped
and the cases written out by hand below still run.
"""
import pytest
import torch
import torch.distributed as dist

from course.impl import load, reference

buckets = load("m14_buckets")
m00 = reference("m00_monolith")

f64, f32 = torch.float64, torch.float32
# Module 00's MLP, small: 6 layers of 16 x 16 weights (2,048 bytes in float64) and 16 biases (128 bytes),
# then a 2-class head (256 + 16 bytes): 13,328 bytes in all.
MLP = m00.MLPConfig(hidden=16, layers=6, batch=8)


def mlp_params() -> list[torch.Tensor]:
    return list(m00.build_model(MLP).to(f64).parameters())


def pytorchs_assignment(params, cap):
    if not hasattr(dist, "_compute_bucket_assignment_by_size"):
        pytest.skip("this torch has no dist._compute_bucket_assignment_by_size (private API); the hand-written cases run")
    indices, _ = dist._compute_bucket_assignment_by_size(params, [cap])
    return [list(bucket) for bucket in reversed(indices)]


@pytest.mark.exercises("assign_buckets")
@pytest.mark.parametrize("cap, n_buckets", [(1 << 20, 1), (7000, 2), (5000, 3), (2176, 7), (1, 14)],
                         ids=["1-bucket", "2-buckets", "3-buckets", "cap-met-exactly", "one-per-tensor"])
def test_buckets_equal_pytorchs_assignment_reversed(cap, n_buckets):
    params = mlp_params()
    got = buckets.assign_buckets(params, cap)
    want = pytorchs_assignment(params, cap)
    assert len(want) == n_buckets, f"the test expects PyTorch to make {n_buckets} buckets at cap {cap}, it made {len(want)}"
    assert got == want, (f"cap {cap} bytes: buckets {got}, PyTorch's (reversed) {want}: a bucket closes once it holds "
                         f"the cap or more (its last tensor may overshoot); in which order does the backward fill them?")


# Two dtypes, by hand: float32 tensors of 10, 5, 30 and 1 values (40, 20, 120, 4 bytes) at indices 0, 2, 3, 5;
# float64 ones of 10 and 3 values (80, 24 bytes) at 1 and 4. Cap 60 bytes: float64 [1] closes at 80 bytes,
# float32 [0, 2] at exactly 60, [3] at 120; [4] and [5] are still open at the end. Ordered by first index
# [0, 2], [1], [3], [4], [5]; reversed, the order they are sent.
MIXED = [(10, f32), (10, f64), (5, f32), (30, f32), (3, f64), (1, f32)]
MIXED_CASES = [(60, [[5], [4], [3], [1], [0, 2]]),
               (100, [[5], [1, 4], [0, 2, 3]]),      # float32 closes at 40 + 20 + 120; float64 80 + 24
               (10 ** 9, [[1, 4], [0, 2, 3, 5]])]   # nothing closes: one bucket per dtype


@pytest.mark.exercises("assign_buckets")
@pytest.mark.parametrize("cap, want", MIXED_CASES, ids=[str(c) for c, _ in MIXED_CASES])
def test_one_dtype_per_bucket_by_hand(cap, want):
    params = [torch.zeros(n, dtype=dtype) for n, dtype in MIXED]
    got = buckets.assign_buckets(params, cap)
    assert got == want, (f"cap {cap} bytes over float32 and float64 tensors: buckets {got}, expected {want} (one "
                         f"open bucket per dtype; closed at the cap or more; listed in the order the backward fills them)")
    if hasattr(dist, "_compute_bucket_assignment_by_size"):
        assert want == pytorchs_assignment(params, cap), "the hand-written case disagrees with PyTorch (fix the test)"
