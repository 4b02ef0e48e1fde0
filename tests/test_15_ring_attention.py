"""Module 15 ring attention: the merge of partial results against one softmax over all the keys
(float32 scores large enough to overflow exp first, then float64); the ring on c = 4 ranks, both
layouts, the forward and the backward run and checked apart (the backward from a correct forward's o
and lse, so that each is graded on its own): first which queries and keys each call of module 06's
attention gets and which neighbours each rank exchanges blocks with, then the results against
torch.nn.functional.scaled_dot_product_attention on the whole sequence (output, and the q, k and v
gradients by autograd) and the lse against a float64 log-sum-exp of the masked scores; in bf16; the
messages each pass sends and their order, read off the group's log; and PyTorch's own (private) ring
attention.

Tolerances. float64: the ranks add the same terms in another order (blocks merged, gradients summed
over blocks and ranks): measured up to 1.1e-15 absolute on values of order 1 (torch 2.13 CPU); the
issue's bound is 1e-10. float32: the same reorderings at float32's unit roundoff 6e-8, through
exp/log merges: measured up to 7.4e-7 relative (c = 4); we allow 1e-5. A wrong offset, a merge without the
lse weights or a block from the wrong owner is off by O(1e-1).
bf16 (zig-zag): the lse is a float32 statistic, merged in float32: within 1e-5 (relative) of module 06's
lse on the whole sequence in one process from the same bf16 inputs (measured 1.1e-7; an lse rounded to
bf16 is off by ~1e-3). o, dq, dk, dv: bf16 keeps 8 significant bits, so one rounding moves a value by up
to 2^-8 of itself. Module 06's attention in one process, in bf16, is already several roundings from
float64 on the same rounded inputs (its scores and probabilities are bf16: measured up to 1.8e-2 of the
largest |dk|); the ring rounds each block's partial output and gradients to bf16 once more before
merging or summing them in float32, one rounding of each part (parts of both signs: their roundings
can add to more than one rounding of the sum), then casts the result once. We allow one process's error
(largest |error| / largest |value| against float64) plus 2^-7, two roundings: measured at most 1.0
rounding more than one process, over 8 seeds. The accumulators' messages are read off the log: float32,
4 bytes a value, whatever the values' dtype.
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

ring = load("m15_ring_attention")
layout = load("m15_layout")
trusted = reference("m15_ring_attention")   # a correct forward, to grade the backward alone

f64, BF16 = torch.float64, torch.bfloat16
B, T, H, K, D, C = 2, 16, 4, 2, 4, 4  # c = 4 ranks, 4 positions each: chunks of 2 with zig-zag
TIMEOUT_S = 30  # each pass of all five runs takes about a second on 2 cores


def inputs(dtype=f64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, T, heads, D, generator=g, dtype=f64).to(dtype) for heads in (H, K, K))
    return q, k, v, torch.randn(B, T, H * D, generator=g, dtype=f64).to(dtype)


# --- the merge --------------------------------------------------------------------------------

def partial(scores, values):
    """The attention of rows of scores (rows, keys) over values (keys, D), with its lse, in float64."""
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse.unsqueeze(-1)) @ values, lse


@pytest.mark.exercises("merge_partials")
@pytest.mark.parametrize("dtype, size, tolerance", [(torch.float32, 500.0, 1e-5), (f64, 1.0, 1e-12)],
                         ids=["float32-scores-of-500", "float64"])
def test_merging_two_partials_is_the_softmax_over_all_the_keys(dtype, size, tolerance):
    # Scores of several hundred first: exp(score) is inf in float32 (beyond ~88), so a merge that forms exp of
    # an lse returns inf or nan. Reference: one softmax in float64.
    g = torch.Generator().manual_seed(0)
    scores = size * torch.randn(2, 3, 5, 7, generator=g, dtype=f64)   # (..., rows, keys)
    values = torch.randn(2, 3, 7, 4, generator=g, dtype=f64)
    expected_o, expected_lse = partial(scores, values)
    o_a, lse_a = partial(scores[..., :3], values[..., :3, :])
    o_b, lse_b = partial(scores[..., 3:], values[..., 3:, :])
    o, lse = ring.merge_partials(o_a.to(dtype), lse_a.to(dtype), o_b.to(dtype), lse_b.to(dtype))
    assert o.dtype == dtype and lse.dtype == dtype, \
        f"your merge_partials returned {o.dtype}, {lse.dtype} for {dtype} partials: merge in the inputs' dtype"
    assert torch.isfinite(o).all() and torch.isfinite(lse).all(), \
        (f"your merge_partials returned inf or nan for {dtype} partials whose lse's reach "
         f"{max(lse_a.abs().max(), lse_b.abs().max()).item():.0f}: exp of such an lse is inf in float32 (beyond ~88)")
    o_error = ((o.double() - expected_o).abs().max() / expected_o.abs().max()).item()
    lse_error = ((lse.double() - expected_lse).abs().max() / expected_lse.abs().max()).item()
    assert lse_error <= tolerance, \
        (f"your merge_partials: the merged lse is {lse_error:.1e} (relative) from the log-sum-exp over both sets of "
         f"keys, allowed {tolerance:.0e}")
    assert o_error <= tolerance, \
        (f"your merge_partials: the merged o is {o_error:.1e} (relative) from the softmax over both sets of keys, "
         f"allowed {tolerance:.0e}: each partial is normalised over its own keys only; by how much does it count in "
         f"the softmax over both?")
    # A row that has seen no key yet (lse = -inf, o = 0) takes the block's result as it is.
    empty_o, empty_lse = torch.zeros_like(o_b), torch.full_like(lse_b, float("-inf"))
    o, lse = ring.merge_partials(empty_o.to(dtype), empty_lse.to(dtype), o_b.to(dtype), lse_b.to(dtype))
    assert torch.equal(o, o_b.to(dtype)) and torch.equal(lse, lse_b.to(dtype)), \
        ("your merge_partials of a row with no key yet (lse = -inf, o = 0) and a block must give the block's result "
         "unchanged, bit for bit")


# --- the ring on c = 4 ranks, forward and backward apart ----------------------------------------

RUNS = [(kind, dtype) for kind in layout.LAYOUTS for dtype in (f64, torch.float32)] + [("zigzag", BF16)]


def record_peers(group):
    """Wrap the group's isend and irecv in this rank: (op, peer, label) of every point-to-point message."""
    peers, collectives = [], group.collectives
    for op, inner in (("send", collectives.isend), ("recv", collectives.irecv)):
        def recording(tensor, peer, *args, _op=op, _inner=inner, **kwargs):
            peers.append((_op, int(peer), kwargs.get("label", args[0] if args else "")))
            return _inner(tensor, peer, *args, **kwargs)
        setattr(collectives, "isend" if op == "send" else "irecv", recording)
    return peers


def _ring(q, k, v, do, backward):
    """Each run's results on this rank: the forward (learner's), or the backward (learner's) after a correct
    forward; the pass's log, its point-to-point peers, and what is wrong with its calls of module 06's attention."""
    mesh = init_mesh({"c": dist.get_world_size()})
    group, results = mesh.group("c"), {}
    peers = record_peers(group)
    probe = AttentionProbe(ring, "attention_backward" if backward else "attention_forward")
    for kind, dtype in RUNS:
        split = layout.SequenceLayout(kind, q.shape[1], group.size)
        mine = [split.shard(t, group.index).to(dtype).contiguous() for t in (q, k, v, do)]
        probe.calls.clear()
        peers.clear()
        if backward:
            o, lse = trusted.RingAttention(group, kind, chunk=3).forward(*mine[:3])
        start = len(mesh.log)
        attention = ring.RingAttention(group, kind, chunk=3)
        out = attention.backward(mine[3], *mine[:3], o, lse) if backward else attention.forward(*mine[:3])
        log = [(c.op, c.label, c.payload_bytes, c.axis) for c in mesh.log[start:]]
        who = f"rank {group.index}, {kind}, {dtype}: your RingAttention.{'backward' if backward else 'forward'}"
        wrong = wrong_calls(probe.calls, q.to(dtype), k.to(dtype), split, group.index, range(group.size), who,
                            probe.name)
        if backward and not wrong:
            pieces = dict((start, rows) for start, rows in split.local_pieces(group.index))
            for q_offset, _, k_offset, _, got_lse in probe.calls:
                if q_offset in pieces and not torch.equal(got_lse, lse[..., pieces[q_offset]]):
                    wrong.append(f"{who} passed attention_backward an lse for queries {q_offset}.. that is not the "
                                 f"forward's merged lse of those rows (each block's share of the one softmax)")
                    break
        results[kind, dtype] = (*out, log, list(peers), wrong)
    probe.restore()
    return results


@functools.cache
def forward_results():
    return run_ranks(_ring, C, *inputs(), False, timeout=TIMEOUT_S)


@functools.cache
def backward_results():
    return run_ranks(_ring, C, *inputs(), True, timeout=TIMEOUT_S)


def joined(results, key, kind, which):
    """The ranks' results `which` of NAMES (o, lse forward; dq, dk, dv backward) put back in position order;
    lse as (B, H, T)."""
    split = layout.SequenceLayout(kind, T, C)
    parts = {}
    for j, i in enumerate(which):
        parts[i] = split.unshard([r[key][j] for r in results], dim=-1 if i == 1 else 1)
    if 1 in parts:
        parts[1] = parts[1].reshape(B, H, T)
    return parts


FORWARD, BACKWARD = (0, 1), (2, 3, 4)  # which of NAMES each pass computes
# float64: absolute; float32: relative to the largest |value| (see the module docstring)
TOLERANCES = {f64: (1e-10, False), torch.float32: (1e-5, True)}


def too_far(kind, dtype, which):
    """The results of the ring (`which` of NAMES) farther from SDPA and autograd than dtype's tolerance."""
    results = forward_results() if which == FORWARD else backward_results()
    got, expected = joined(results, (kind, dtype), kind, which), whole_attention(*inputs())
    tolerance, relative = TOLERANCES[dtype]
    wrong = []
    for i in which:
        error = (got[i].double() - expected[i]).abs().max() / (expected[i].abs().max() if relative else 1)
        if got[i].dtype != dtype or not error <= tolerance:
            wrong.append(f"{NAMES[i]}: {got[i].dtype}, {'relative ' if relative else ''}error {error.item():.1e}")
    return wrong


def neighbours_disagree(results, key, label, passname):
    """Where rank i's block messages go to a rank that does not receive them from i (or come from one that does
    not send them to i)."""
    sends = {rank: {p for op, p, lab in r[key][-2] if op == "send" and lab == label} for rank, r in enumerate(results)}
    recvs = {rank: {p for op, p, lab in r[key][-2] if op == "recv" and lab == label} for rank, r in enumerate(results)}
    for rank in sends:
        for to in sorted(sends[rank]):
            if rank not in recvs.get(to, set()):
                return (f"rank {rank} ({key[0]}): your RingAttention.{passname} sends its {label!r} messages to rank "
                        f"{to}, but rank {to} receives them from rank {sorted(recvs.get(to, set()))}: a ring receives "
                        f"from the neighbour that sends to it")
    return None


@pytest.mark.exercises("RingAttention.forward", "merge_partials")
@pytest.mark.parametrize("kind", ["contiguous", "zigzag"])
def test_ring_forward_scores_every_query_piece_against_the_right_keys(kind):
    results = forward_results()
    disagree = neighbours_disagree(results, (kind, f64), "kv", "forward")
    assert disagree is None, disagree
    for rank, per_rank in enumerate(results):
        wrong = per_rank[kind, f64][-1]
        assert not wrong, f"c={C}, float64: " + "; ".join(wrong)


@pytest.mark.exercises("RingAttention.forward", "merge_partials")
@pytest.mark.parametrize("dtype", [f64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("kind", ["contiguous", "zigzag"])
def test_ring_forward_equals_attention_on_the_whole_sequence(kind, dtype):
    wrong = too_far(kind, dtype, FORWARD)
    assert not wrong, (f"c={C}, {kind} layout, {dtype} in: your RingAttention.forward is above "
                       f"{TOLERANCES[dtype][0]:.0e} from SDPA and a float64 log-sum-exp on the whole sequence (o in "
                       f"{dtype}), with every block's keys at their positions (checked before): "
                       + "; ".join(wrong) + " (are the partials merged into the rows they belong to?)")


@pytest.mark.exercises("RingAttention.forward", "merge_partials")
def test_ring_forward_in_bf16_merges_in_float32():
    got = joined(forward_results(), ("zigzag", BF16), "zigzag", FORWARD)
    lse_alone = one_process_bf16(*inputs())[1]
    lse_error = ((got[1].double() - lse_alone).abs().max() / lse_alone.abs().max()).item()
    assert got[1].dtype == torch.float32 and lse_error <= 1e-5, \
        (f"c={C}, zigzag, bf16: your RingAttention.forward's lse is {got[1].dtype}, {lse_error:.1e} from one process's "
         f"float32 lse (relative); expected float32, within 1e-5: the lse's of the blocks are float32 statistics, "
         f"merged in float32")
    wrong = beyond_bf16_rounding(got, inputs(), (0,))
    assert not wrong, (f"c={C}, zigzag, bf16: your RingAttention.forward's o (bf16) is farther from float64 SDPA than "
                       f"one process's bf16 attention plus two bf16 roundings (2^-7 of the largest |o|): "
                       + "; ".join(wrong))


@pytest.mark.exercises("RingAttention.forward")
def test_the_forward_sends_every_block_but_the_last_once_receive_first():
    # One block is k and v of T/c = 4 positions: 2 * B * 4 * K * D * 8 = 1,024 bytes in float64. Every rank sends
    # c - 1 = 3 blocks (the last one it holds stays), receives 3, and at every step posts the receive of the next
    # block before the send of the one in hand (gloo moves a message only once its receive is posted).
    block = 2 * B * (T // C) * K * D * 8
    for rank, results in enumerate(forward_results()):
        for kind in layout.LAYOUTS:
            log = results[kind, f64][-3]
            sends = [(op, size, axis) for op, _, size, axis in log if op == "send"]
            assert sends == [("send", block, "c")] * 3 and len(log) == 6, \
                (f"rank {rank}, {kind}: your RingAttention.forward's messages (op, label, bytes, axis) {log}; expected "
                 f"3 sends of {block} and 3 receives")
            order = [op for op, label, _, _ in log if label == "kv"]
            assert order == ["recv", "send"] * (C - 1), \
                (f"rank {rank}, {kind}: your RingAttention.forward posted the blocks' messages in the order {order}; "
                 f"expected {C - 1} steps of recv then send: post each step's receive before its send")


@pytest.mark.exercises("RingAttention.backward")
@pytest.mark.parametrize("kind", ["contiguous", "zigzag"])
def test_ring_backward_scores_every_query_piece_against_the_right_keys(kind):
    results = backward_results()
    for label in ("kv", "dkv"):
        disagree = neighbours_disagree(results, (kind, f64), label, "backward")
        assert disagree is None, disagree
    for rank, per_rank in enumerate(results):
        wrong = per_rank[kind, f64][-1]
        assert not wrong, f"c={C}, float64: " + "; ".join(wrong)


@pytest.mark.exercises("RingAttention.backward")
@pytest.mark.parametrize("dtype", [f64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("kind", ["contiguous", "zigzag"])
def test_ring_backward_equals_autograd_on_the_whole_sequence(kind, dtype):
    wrong = too_far(kind, dtype, BACKWARD)
    assert not wrong, (f"c={C}, {kind} layout, {dtype} in, o and lse from a correct forward: your "
                       f"RingAttention.backward is above {TOLERANCES[dtype][0]:.0e} from autograd on the whole "
                       f"sequence (gradients in {dtype}): " + "; ".join(wrong)
                       + ("" if wrong[0].startswith("dq") else " (dq is right: do dk and dv end at their owners, "
                          "with every rank's contribution?)"))


@pytest.mark.exercises("RingAttention.backward")
def test_the_backward_sends_every_block_and_every_accumulator_home():
    # Backward: 3 blocks, and 4 gradient accumulators of the same size in float64 (each goes 3 hops with its
    # block, then one more, home), every receive of a block posted before the step's send.
    block = 2 * B * (T // C) * K * D * 8
    for rank, results in enumerate(backward_results()):
        for kind in layout.LAYOUTS:
            log = results[kind, f64][-3]
            sent = sorted(size for op, _, size, _ in log if op == "send")
            received = sorted(size for op, _, size, _ in log if op == "recv")
            accumulators = sum(op == "send" and label == "dkv" for op, label, _, _ in log)
            assert sent == [block] * 7 and received == [block] * 7, \
                (f"rank {rank}, {kind}: your RingAttention.backward sends {sent}, receives {received} "
                 f"({accumulators} accumulators); expected 7 of {block} bytes each: 3 blocks, and accumulators until "
                 f"each has reached its block's owner")
            order = [op for op, label, _, _ in log if label == "kv"]
            assert order == ["recv", "send"] * (C - 1), \
                (f"rank {rank}, {kind}: your RingAttention.backward posted the blocks' messages in the order {order}; "
                 f"expected {C - 1} steps of recv then send: post each step's receive before its send")


@pytest.mark.exercises("RingAttention.backward")
def test_ring_backward_in_bf16_sends_float32_accumulators():
    # Every dk, dv accumulator holds 2 * B * T/c * K * D = 128 values; in float32 (lse's dtype), 512 bytes.
    values = 2 * B * (T // C) * K * D
    for rank, results in enumerate(backward_results()):
        sizes = [size for op, label, size, _ in results["zigzag", BF16][-3] if label == "dkv"]
        assert sizes == [4 * values] * (2 * C), \
            (f"rank {rank}, zigzag, bf16: your RingAttention.backward's accumulator messages (sends and receives) are "
             f"{sizes} bytes; expected {2 * C} of {4 * values}: {values} values of 4 bytes, in lse's dtype (float32), "
             f"not the values' bf16")
    got = joined(backward_results(), ("zigzag", BF16), "zigzag", BACKWARD)
    wrong = beyond_bf16_rounding(got, inputs(), BACKWARD)
    assert not wrong, (f"c={C}, zigzag, bf16: your RingAttention.backward's gradients (bf16) are farther from float64 "
                       f"autograd than one process's bf16 attention plus two bf16 roundings (2^-7 of the largest "
                       f"value): " + "; ".join(wrong))


# --- against PyTorch's own ring attention (private API) -----------------------------------------

def torch_cp():
    """PyTorch's private context-parallel module: where 2.13 keeps it, or where earlier releases did."""
    try:
        from torch.distributed.tensor.experimental._context_parallel import _attention
    except ImportError:
        from torch.distributed.tensor.experimental import _attention
    return _attention


def _against_torch(q, k, v, do):
    cp = torch_cp()
    rank, c = dist.get_rank(), dist.get_world_size()
    cp._cp_options.enable_load_balance, cp._cp_options.convert_to_f32 = True, False
    cp._cp_options.rotate_method = cp._RotateMethod.ALL_TO_ALL  # blocks passed round a ring, as ours
    split = reference("m15_layout").SequenceLayout("zigzag", q.shape[1], c)  # = their head-tail split
    mine = [split.shard(t, rank).contiguous() for t in (q, k, v, do)]
    heads_first = [t.transpose(1, 2).contiguous() for t in mine[:3]]  # (B, H, T/c, D), equal head counts
    aten = torch.ops.aten
    theirs = cp._templated_ring_attention(dist.group.WORLD, 2, aten._scaled_dot_product_flash_attention_for_cpu,
                                          *heads_first, is_causal=True)
    o_theirs, lse_theirs = theirs[0], theirs[1]
    try:
        backward = cp._templated_ring_attention_backward(
            dist.group.WORLD, 2, aten._scaled_dot_product_flash_attention_for_cpu_backward,
            mine[3].view(*mine[3].shape[:2], -1, q.shape[-1]).transpose(1, 2).contiguous(), "grad_out", *heads_first,
            o_theirs, lse_theirs, is_causal=True, dropout_p=0.0, scale=None)
        grads_theirs = [g.transpose(1, 2) for g in backward[:3]]
    except Exception as error:  # noqa: BLE001 - reported by the test, which then skips the backward
        grads_theirs = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
    ours = reference("m15_ring_attention").RingAttention(init_mesh({"c": c}).group("c"), "zigzag", chunk=3)
    o, lse = ours.forward(*mine[:3])
    grads = ours.backward(mine[3], *mine[:3], o, lse)
    return o_theirs.transpose(1, 2).flatten(2), o, grads_theirs, grads


def torch_ring_or_skip():
    try:
        cp = torch_cp()
        missing = [name for name in ("_templated_ring_attention", "_templated_ring_attention_backward", "_cp_options",
                                     "_RotateMethod") if not hasattr(cp, name)]
    except ImportError:
        missing = ["torch.distributed.tensor.experimental._attention"]
    if not hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"):
        missing.append("aten._scaled_dot_product_flash_attention_for_cpu")
    if missing:
        pytest.skip(f"this torch lacks PyTorch's private ring attention on CPU ({', '.join(missing)}): skipped")


@functools.cache
def torch_results():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 8, 2, 4, generator=g, dtype=f64) for _ in range(3))  # equal head counts: their kernel
    return run_ranks(_against_torch, 2, q, k, v, torch.randn(1, 8, 8, generator=g, dtype=f64), timeout=60)


@pytest.mark.given
def test_our_ring_equals_pytorchs_private_ring_attention():
    # PyTorch's _templated_ring_attention (what context_parallel dispatches to), run on CPU ranks with the
    # CPU flash-attention op, head-tail load balancing and an all-to-all rotater, on the same zig-zag
    # shards as our ring (the reference solution). Measured on torch 2.13 CPU, float64: forward within
    # 4.4e-16, q/k/v gradients within 6.7e-16 of ours. We allow 1e-12.
    torch_ring_or_skip()
    for rank, (o_theirs, o_ours, grads_theirs, grads_ours) in enumerate(torch_results()):
        assert (o_theirs - o_ours).abs().max() <= 1e-12, f"rank {rank}: forward outputs differ"
        if isinstance(grads_theirs, str):
            pytest.skip(f"PyTorch's ring backward did not run on CPU ({grads_theirs}): forward compared only")
        for name, theirs, ours in zip(("dq", "dk", "dv"), grads_theirs, grads_ours, strict=True):
            assert (theirs - ours).abs().max() <= 1e-12, f"rank {rank}: {name} differs from PyTorch's ring"
