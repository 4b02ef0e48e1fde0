"""Module 15 all-gather KV (Llama 3's variant): on c = 4 ranks, both layouts, the gather alone first
(the whole sequence's keys and values, in position order), then the forward, and the backward from a
correct forward's o and lse, checked apart: which queries and keys each call of module 06's
attention gets, then the results against torch.nn.functional.scaled_dot_product_attention on the
whole sequence (output, and the q, k and v gradients by autograd) and the lse against a float64
log-sum-exp of the masked scores; in bf16; and the collectives each pass issues, counted by the
group's log.

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

from course.impl import load, reference
from course.launch import run_ranks
from course.mesh import init_mesh

from attention_checks import (NAMES, AttentionProbe, beyond_bf16_rounding, one_process_bf16,  # tests/attention_checks.py
                              whole_attention, wrong_calls)

allgather = load("m15_allgather_kv")
layout = load("m15_layout")
trusted = reference("m15_allgather_kv")   # a correct forward, to grade the backward alone

f64, BF16 = torch.float64, torch.bfloat16
B, T, H, K, D, C = 2, 16, 4, 2, 4, 4
TIMEOUT_S = 30


def inputs(seed=1):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, T, heads, D, generator=g, dtype=f64) for heads in (H, K, K))
    return q, k, v, torch.randn(B, T, H * D, generator=g, dtype=f64)


RUNS = [(kind, f64) for kind in layout.LAYOUTS] + [("zigzag", BF16)]


def _allgather(q, k, v, do, backward):
    mesh = init_mesh({"c": dist.get_world_size()})
    group, results = mesh.group("c"), {}
    probe = AttentionProbe(allgather, "attention_backward" if backward else "attention_forward")
    for kind, dtype in RUNS:
        split = layout.SequenceLayout(kind, q.shape[1], group.size)
        mine = [split.shard(t, group.index).to(dtype).contiguous() for t in (q, k, v, do)]
        attention = allgather.AllGatherKVAttention(group, kind, chunk=3)
        probe.calls.clear()
        if backward:
            o, lse = trusted.AllGatherKVAttention(group, kind, chunk=3).forward(*mine[:3])
            start = len(mesh.log)
            out = attention.backward(mine[3], *mine[:3], o, lse)
        else:
            gathered = attention.gather_kv(mine[1], mine[2], split)
            start = len(mesh.log)
            out = attention.forward(*mine[:3])
        log = [(c.op, c.payload_bytes, c.axis, c.label) for c in mesh.log[start:]]
        who = f"rank {group.index}, {kind}, {dtype}: your AllGatherKVAttention.{'backward' if backward else 'forward'}"
        wrong = wrong_calls(probe.calls, q.to(dtype), k.to(dtype), split, group.index, None, who,
                            probe.name)
        results[kind, dtype] = (*out, log, wrong) if backward else (*out, log, wrong, gathered)
    probe.restore()
    return results


@functools.cache
def forward_results():
    return run_ranks(_allgather, C, *inputs(), False, timeout=TIMEOUT_S)


@functools.cache
def backward_results():
    return run_ranks(_allgather, C, *inputs(), True, timeout=TIMEOUT_S)


FORWARD, BACKWARD = (0, 1), (2, 3, 4)  # which of NAMES each pass computes


def joined(kind, dtype, which):
    """The ranks' results `which` of NAMES put back in position order; lse as (B, H, T)."""
    results = forward_results() if which == FORWARD else backward_results()
    split = layout.SequenceLayout(kind, T, C)
    got = {i: split.unshard([r[kind, dtype][j] for r in results], dim=-1 if i == 1 else 1)
           for j, i in enumerate(which)}
    if 1 in got:
        got[1] = got[1].reshape(B, H, T)
    return got


def too_far(kind, which):
    """The float64 results (`which` of NAMES) farther than 1e-10 from SDPA and autograd."""
    got, expected = joined(kind, f64, which), whole_attention(*inputs())
    return [f"{NAMES[i]}: {(got[i] - expected[i]).abs().max().item():.1e}" for i in which
            if not (got[i] - expected[i]).abs().max() <= 1e-10]


@pytest.mark.exercises("AllGatherKVAttention.gather_kv")
@pytest.mark.parametrize("kind", ["zigzag", "contiguous"])
def test_gather_kv_returns_the_whole_sequence_in_position_order(kind):
    q, k, v, _ = inputs()
    whole = torch.stack((k, v))
    for rank, per_rank in enumerate(forward_results()):
        gathered = per_rank[kind, f64][-1]
        if gathered.shape != whole.shape or not torch.equal(gathered, whole):
            found = [where for where in range(T) if gathered.shape == whole.shape
                     and torch.equal(gathered[:, :, where], whole[:, :, 0])]
            raise AssertionError(
                f"rank {rank}, {kind}: your AllGatherKVAttention.gather_kv returned {tuple(gathered.shape)} "
                f"{'with time not in position order' if gathered.shape == whole.shape else ''}; expected k and v of "
                f"the whole sequence stacked, {tuple(whole.shape)}, index t holding position t"
                + (f" (position 0 is at index {found[0]})" if found and found[0] else ""))
    for rank, per_rank in enumerate(forward_results()):
        gathers = [entry for entry in per_rank[kind, f64][2] if entry[0] == "all_gather"]
        assert len(gathers) == 1, f"rank {rank}, {kind}: your AllGatherKVAttention.forward issued {len(gathers)} " \
                                  f"all-gathers; expected one (self.gather_kv)"


@pytest.mark.exercises("AllGatherKVAttention.forward", "AllGatherKVAttention.gather_kv")
@pytest.mark.parametrize("kind", ["zigzag", "contiguous"])
def test_all_gather_kv_forward_equals_attention_on_the_whole_sequence(kind):
    for rank, per_rank in enumerate(forward_results()):
        wrong = per_rank[kind, f64][3]
        assert not wrong, f"c={C}, float64: " + "; ".join(wrong)
    wrong = too_far(kind, FORWARD)
    assert not wrong, (f"c={C}, {kind} layout, float64: your AllGatherKVAttention.forward is above 1e-10 from SDPA "
                       f"and a float64 log-sum-exp on the whole sequence: " + "; ".join(wrong)
                       + " (the pieces' results side by side in the local order?)")


@pytest.mark.exercises("AllGatherKVAttention.forward", "AllGatherKVAttention.gather_kv")
def test_all_gather_kv_forward_in_bf16_is_one_process_attention():
    got, alone = joined("zigzag", BF16, FORWARD), one_process_bf16(*inputs())
    lse_error = ((got[1].double() - alone[1].double()).abs().max() / alone[1].double().abs().max()).item()
    assert got[1].dtype == torch.float32 and lse_error <= 1e-5, \
        (f"c={C}, zigzag, bf16: your AllGatherKVAttention.forward's lse is {got[1].dtype}, {lse_error:.1e} from one "
         f"process's float32 lse (relative); expected float32 within 1e-5, as module 06's attention returns it")
    wrong = beyond_bf16_rounding(got, inputs(), FORWARD[:1])
    assert not wrong, (f"c={C}, zigzag, bf16: your AllGatherKVAttention.forward's o (bf16) is farther from float64 "
                       f"SDPA than one process's bf16 attention plus two bf16 roundings (2^-7 of the largest |o|): "
                       + "; ".join(wrong))


@pytest.mark.exercises("AllGatherKVAttention.backward", "AllGatherKVAttention.gather_kv")
@pytest.mark.parametrize("kind", ["zigzag", "contiguous"])
def test_all_gather_kv_backward_equals_autograd_on_the_whole_sequence(kind):
    for rank, per_rank in enumerate(backward_results()):
        wrong = per_rank[kind, f64][4]
        assert not wrong, f"c={C}, float64: " + "; ".join(wrong)
    wrong = too_far(kind, BACKWARD)
    assert not wrong, (f"c={C}, {kind} layout, float64, o and lse from a correct forward: your "
                       f"AllGatherKVAttention.backward is above 1e-10 from autograd on the whole sequence: "
                       + "; ".join(wrong) + ("" if wrong[0].startswith("dq") else
                                             " (dq is right: does block j of the reduce-scatter's input hold rank j's "
                                             "positions?)"))


@pytest.mark.exercises("AllGatherKVAttention.backward", "AllGatherKVAttention.gather_kv")
def test_all_gather_kv_backward_in_bf16_reduce_scatters_float32_gradients():
    # This rank's shard of dk and dv: 2 * B * T/c * K * D = 128 values; summed in float32 (lse's dtype), 512 bytes.
    values = 2 * B * (T // C) * K * D
    for rank, per_rank in enumerate(backward_results()):
        shards = [(op, size) for op, size, _, label in per_rank["zigzag", BF16][3] if label == "dkv"]
        assert shards == [("reduce_scatter", 4 * values)], \
            (f"rank {rank}, zigzag, bf16: your AllGatherKVAttention.backward's reduce-scatter (op, shard bytes) "
             f"{shards}; expected one of {4 * values} bytes: {values} values of 4 bytes, summed in lse's dtype "
             f"(float32), not the values' bf16")
    wrong = beyond_bf16_rounding(joined("zigzag", BF16, BACKWARD), inputs(), BACKWARD)
    assert not wrong, (f"c={C}, zigzag, bf16: your AllGatherKVAttention.backward's gradients (bf16) are farther from "
                       f"float64 autograd than one process's bf16 attention plus two bf16 roundings (2^-7 of the "
                       f"largest value): " + "; ".join(wrong))


@pytest.mark.exercises("AllGatherKVAttention.backward", "AllGatherKVAttention.forward",
                       "AllGatherKVAttention.gather_kv")
def test_one_gather_forward_and_a_gather_and_a_reduce_scatter_backward():
    # This rank's k and v stacked: 2 * B * T/c * K * D * 8 = 1,024 bytes; the gradients' shard the same
    # (float64). Forward: one all-gather; backward: the keys gathered again, the gradients reduce-scattered.
    shard = 2 * B * (T // C) * K * D * 8
    for passname, results, expected in (
            ("forward", forward_results(), [("all_gather", shard, "c", "kv")]),
            ("backward", backward_results(), [("all_gather", shard, "c", "kv"), ("reduce_scatter", shard, "c", "dkv")])):
        for rank, per_rank in enumerate(results):
            for kind in layout.LAYOUTS:
                log = per_rank[kind, f64][2 if passname == "forward" else 3]
                assert log == expected, \
                    (f"rank {rank}, {kind}: your AllGatherKVAttention.{passname} issued (op, payload, axis, label) "
                     f"{log}, expected {expected}")
