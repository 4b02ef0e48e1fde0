"""Module 15 all-gather KV (Llama 3's variant): on c = 4 ranks, both layouts, against
torch.nn.functional.scaled_dot_product_attention on the whole sequence (output, and the q, k and v
gradients by autograd) and the lse against a float64 log-sum-exp of the masked scores, the forward
and the backward checked apart; in bf16; and the collectives it issues, counted by the group's log.

Tolerance, float64: the ranks add the same terms in another order (gradients summed over the pieces
and reduce-scattered over the ranks): measured up to 1.8e-15 absolute (torch 2.13 CPU); the issue's
bound is 1e-10. Keys gathered in the ranks' order instead of position order, or gradients
scattered to the wrong ranks, are off by O(1).
bf16 (zig-zag): as tests/test_15_ring_attention.py explains: the lse within 1e-5 of one process's
(module 06's attention in bf16 on the whole sequence: measured 5e-8); o, dq, dk, dv within one
process's error against float64 plus 2^-7 (each rank's dk and dv are rounded to bf16 once before the
float32 sum: measured at most 1.0 rounding more than one process, over 8 seeds); the reduce-scattered
gradients float32, 4 bytes a value.
"""
import functools

import pytest
import torch
import torch.distributed as dist

from course.impl import load
from course.launch import run_ranks
from course.mesh import init_mesh

from attention_checks import NAMES, beyond_bf16_rounding, one_process_bf16, whole_attention  # tests/attention_checks.py

allgather = load("m15_allgather_kv")
layout = load("m15_layout")

f64, BF16 = torch.float64, torch.bfloat16
B, T, H, K, D, C = 2, 16, 4, 2, 4, 4


def inputs(seed=1):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, T, heads, D, generator=g, dtype=f64) for heads in (H, K, K))
    return q, k, v, torch.randn(B, T, H * D, generator=g, dtype=f64)


RUNS = [(kind, f64) for kind in layout.LAYOUTS] + [("zigzag", BF16)]


def _allgather(q, k, v, do):
    mesh = init_mesh({"c": dist.get_world_size()})
    group, results = mesh.group("c"), {}
    for kind, dtype in RUNS:
        split = layout.SequenceLayout(kind, q.shape[1], group.size)
        mine = [split.shard(t, group.index).to(dtype).contiguous() for t in (q, k, v, do)]
        attention = allgather.AllGatherKVAttention(group, kind, chunk=3)
        start = len(mesh.log)
        o, lse = attention.forward(*mine[:3])
        grads = attention.backward(mine[3], *mine[:3], o, lse)
        log = [(c.op, c.payload_bytes, c.axis, c.label) for c in mesh.log[start:]]
        results[kind, dtype] = (o, lse, *grads, log)
    return results


@functools.cache
def results():
    return run_ranks(_allgather, C, *inputs(), timeout=60)


FORWARD, BACKWARD = (0, 1), (2, 3, 4)  # which of NAMES each pass computes


def joined(kind, dtype):
    """The ranks' (o, lse, dq, dk, dv) put back in position order; lse as (B, H, T)."""
    split = layout.SequenceLayout(kind, T, C)
    got = [split.unshard([r[kind, dtype][i] for r in results()], dim=-1 if i == 1 else 1) for i in range(5)]
    got[1] = got[1].reshape(B, H, T)
    return got


def too_far(kind, which):
    """The float64 results (`which` of NAMES) farther than 1e-10 from SDPA and autograd."""
    got, expected = joined(kind, f64), whole_attention(*inputs())
    return [f"{NAMES[i]}: {(got[i] - expected[i]).abs().max().item():.1e}" for i in which
            if not (got[i] - expected[i]).abs().max() <= 1e-10]


@pytest.mark.exercises("AllGatherKVAttention.gather_kv", "AllGatherKVAttention.forward")
@pytest.mark.parametrize("kind", ["zigzag", "contiguous"])
def test_all_gather_kv_forward_equals_attention_on_the_whole_sequence(kind):
    wrong = too_far(kind, FORWARD)
    assert not wrong, (f"c={C}, {kind} layout, float64: forward above 1e-10 from SDPA and a float64 log-sum-exp on "
                       f"the whole sequence: " + "; ".join(wrong))


@pytest.mark.exercises("AllGatherKVAttention.backward", "AllGatherKVAttention.gather_kv",
                       "AllGatherKVAttention.forward")
@pytest.mark.parametrize("kind", ["zigzag", "contiguous"])
def test_all_gather_kv_backward_equals_autograd_on_the_whole_sequence(kind):
    wrong = too_far(kind, BACKWARD)
    assert not wrong, (f"c={C}, {kind} layout, float64: backward above 1e-10 from autograd on the whole sequence, "
                       f"first in the order computed: " + "; ".join(wrong))


@pytest.mark.exercises("AllGatherKVAttention.gather_kv", "AllGatherKVAttention.forward")
def test_all_gather_kv_forward_in_bf16_is_one_process_attention():
    got, alone = joined("zigzag", BF16), one_process_bf16(*inputs())
    lse_error = ((got[1].double() - alone[1].double()).abs().max() / alone[1].double().abs().max()).item()
    assert got[1].dtype == torch.float32 and lse_error <= 1e-5, \
        (f"c={C}, zigzag, bf16: lse is {got[1].dtype}, {lse_error:.1e} from one process's float32 lse (relative); "
         f"expected float32 within 1e-5, as module 06's attention returns it")
    wrong = beyond_bf16_rounding(joined("zigzag", BF16), inputs(), FORWARD[:1])
    assert not wrong, (f"c={C}, zigzag, bf16: o (bf16) farther from float64 SDPA than one process's bf16 attention "
                       f"plus two bf16 roundings (2^-7 of the largest |o|): " + "; ".join(wrong))


@pytest.mark.exercises("AllGatherKVAttention.backward", "AllGatherKVAttention.gather_kv",
                       "AllGatherKVAttention.forward")
def test_all_gather_kv_backward_in_bf16_reduce_scatters_float32_gradients():
    # This rank's shard of dk and dv: 2 * B * T/c * K * D = 128 values; summed in float32 (lse's dtype), 512 bytes.
    values = 2 * B * (T // C) * K * D
    for rank, per_rank in enumerate(results()):
        shards = [(op, size) for op, size, _, label in per_rank["zigzag", BF16][5] if label == "dkv"]
        assert shards == [("reduce_scatter", 4 * values)], \
            (f"rank {rank}, zigzag, bf16: the gradients' reduce-scatter (op, shard bytes) {shards}; expected one of "
             f"{4 * values} bytes: {values} values of 4 bytes, summed in lse's dtype (float32), not the values' bf16")
    wrong = beyond_bf16_rounding(joined("zigzag", BF16), inputs(), BACKWARD)
    assert not wrong, (f"c={C}, zigzag, bf16: gradients (bf16) farther from float64 autograd than one process's bf16 "
                       f"attention plus two bf16 roundings (2^-7 of the largest value): " + "; ".join(wrong))


@pytest.mark.exercises("AllGatherKVAttention.gather_kv", "AllGatherKVAttention.forward",
                       "AllGatherKVAttention.backward")
def test_one_gather_forward_and_a_gather_and_a_reduce_scatter_backward():
    # This rank's k and v stacked: 2 * B * T/c * K * D * 8 = 1,024 bytes; the gradients' shard the same
    # (float64). Forward: one all-gather; backward: the keys gathered again, the gradients reduce-scattered.
    shard = 2 * B * (T // C) * K * D * 8
    expected = [("all_gather", shard, "c", "kv"), ("all_gather", shard, "c", "kv"),
                ("reduce_scatter", shard, "c", "dkv")]
    for rank, per_rank in enumerate(results()):
        for kind in layout.LAYOUTS:
            assert per_rank[kind, f64][5] == expected, \
                f"rank {rank}, {kind}: collectives (op, payload, axis, label) {per_rank[kind, f64][5]}, expected " \
                f"{expected}"
