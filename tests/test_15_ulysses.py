"""Module 15 Ulysses: the two all-to-alls move exactly the blocks the chapter says (values that encode
their position and head, read back on every rank), and attention by heads on c = 4 ranks equals
torch.nn.functional.scaled_dot_product_attention on the whole sequence (output, q/k/v gradients by
autograd, lse against a float64 log-sum-exp; the forward and the backward checked apart), when c
divides the key/value heads (one a rank, and two a rank: the order of a rank's (key/value head,
group) pairs shows only then) and when they are copied (K = 2 < c = 4); the all-to-alls counted by the
group's log; unsupported heads refused in one line.

Tolerance, float64: measured up to 1.3e-15 absolute (torch 2.13 CPU) against the bound 1e-10. An
all-to-all cut along the wrong axis mixes heads and positions: off by O(1).
"""
import functools

import pytest
import torch
import torch.distributed as dist

from course.impl import load
from course.launch import run_ranks
from course.mesh import init_mesh
from course.reference_attention import whole_attention  # float64 SDPA, logsumexp and autograd

ulysses = load("m15_ulysses")
layout = load("m15_layout")

f64 = torch.float64
B, T, D, C = 2, 16, 4, 4
# (H, K): c = 4 divides K = 4 (one key/value head a rank); K = 2 is copied twice; K = 8: two key/value heads a
# rank, each shared by two query heads, so the order of a rank's (key/value head, group) pairs matters.
HEADS = {"K divides": (8, 4), "K copied": (4, 2), "2 kv heads a rank": (16, 8)}


def inputs(H, K, seed=2):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, T, heads, D, generator=g, dtype=f64) for heads in (H, K, K))
    return q, k, v, torch.randn(B, T, H * D, generator=g, dtype=f64)


def labelled(n, heads, rank, c):
    """(1, n, heads, 2): each value says (its position, its head), this rank's positions of the contiguous layout."""
    positions = torch.arange(rank * n, (rank + 1) * n, dtype=f64)
    return torch.stack(torch.broadcast_tensors(positions[:, None], torch.arange(heads, dtype=f64)), -1).unsqueeze(0)


def _ulysses(cases):
    mesh = init_mesh({"c": dist.get_world_size()})
    group, results = mesh.group("c"), {}
    x = labelled(T // group.size, 8, group.index, group.size)
    to_heads = ulysses.sequence_to_heads(x, group, "test")
    results["all-to-all"] = (to_heads, ulysses.heads_to_sequence(to_heads, group, "test"))
    for name, (q, k, v, do) in cases.items():
        split = layout.SequenceLayout("contiguous", T, group.size)
        mine = [split.shard(t, group.index).contiguous() for t in (q, k, v, do)]
        attention = ulysses.UlyssesAttention(group, "contiguous", chunk=3)
        start = len(mesh.log)
        o, lse = attention.forward(*mine[:3])
        grads = attention.backward(mine[3], *mine[:3], o, lse)
        results[name] = (o, lse, *grads, [(c.op, c.label, c.payload_bytes) for c in mesh.log[start:]])
    return results


@functools.cache
def results():
    return run_ranks(_ulysses, C, {name: inputs(H, K) for name, (H, K) in HEADS.items()}, timeout=60)


@pytest.mark.exercises("sequence_to_heads", "heads_to_sequence")
def test_the_all_to_alls_move_heads_and_positions_where_they_belong():
    # Rank j of c = 4 must receive heads [2j, 2j + 2) of 8 for every position 0..15, in position order
    # (the contiguous layout's rank order), and the way back must give each rank its own tokens again.
    n = T // C
    for rank, per_rank in enumerate(results()):
        to_heads, back = per_rank["all-to-all"]
        positions, heads = to_heads[0, :, :, 0], to_heads[0, :, :, 1]
        expected_heads = torch.arange(2 * rank, 2 * rank + 2, dtype=f64).expand(T, 2)
        expected_positions = torch.arange(T, dtype=f64)[:, None].expand(T, 2)
        assert to_heads.shape == (1, T, 2, 2) and torch.equal(positions, expected_positions) \
            and torch.equal(heads, expected_heads), \
            (f"rank {rank}: sequence_to_heads gave (position, head) pairs {to_heads[0, :, :, :].tolist()[:3]}...; "
             f"expected positions 0..{T - 1} of heads {2 * rank} and {2 * rank + 1}: cut the heads, join along time")
        assert torch.equal(back, labelled(n, 8, rank, C)), \
            f"rank {rank}: heads_to_sequence(sequence_to_heads(x)) is not x: cut along time, join along the heads"


NAMES = ("o", "lse", "dq", "dk", "dv")


def too_far(case, which):
    """The results (`which` of NAMES) of case farther than 1e-10 from SDPA and autograd on the whole sequence."""
    H, K = HEADS[case]
    split = layout.SequenceLayout("contiguous", T, C)
    got = [split.unshard([r[case][i] for r in results()], dim=-1 if i == 1 else 1) for i in range(5)]
    got[1] = got[1].reshape(B, H, T)
    expected = whole_attention(*inputs(H, K))
    return [f"{NAMES[i]}: {(got[i] - expected[i]).abs().max().item():.1e}" for i in which
            if not (got[i] - expected[i]).abs().max() <= 1e-10]


@pytest.mark.exercises("UlyssesAttention.forward", "sequence_to_heads", "heads_to_sequence")
@pytest.mark.parametrize("case", list(HEADS))
def test_ulysses_forward_equals_attention_on_the_whole_sequence(case):
    H, K = HEADS[case]
    wrong = too_far(case, (0, 1))
    assert not wrong, (f"c={C}, H={H}, K={K} ({case}), float64: forward above 1e-10 from SDPA and a float64 "
                       f"log-sum-exp on the whole sequence (lse's heads in module 06's order: key/value head, then "
                       f"its group): " + "; ".join(wrong))


@pytest.mark.exercises("UlyssesAttention.backward", "UlyssesAttention.forward", "sequence_to_heads",
                       "heads_to_sequence")
@pytest.mark.parametrize("case", list(HEADS))
def test_ulysses_backward_equals_autograd_on_the_whole_sequence(case):
    H, K = HEADS[case]
    wrong = too_far(case, (2, 3, 4))
    assert not wrong, (f"c={C}, H={H}, K={K} ({case}), float64: backward above 1e-10 from autograd on the whole "
                       f"sequence, first in the order computed: " + "; ".join(wrong))


@pytest.mark.exercises("UlyssesAttention.forward", "UlyssesAttention.backward")
def test_five_all_to_alls_forward_and_eight_backward():
    # H = 8, K = 4, float64, this rank's T/c = 4 positions: q, o, do, dq move 2 * 4 * 8 * 4 * 8 = 2,048
    # bytes; k, v, dk, dv 1,024; the lse 2 * 4 * 8 * 8 = 512; lse and delta together 1,024.
    q, kv, lse = B * (T // C) * 8 * D * 8, B * (T // C) * 4 * D * 8, B * (T // C) * 8 * 8
    expected = [("all_to_all", "q", q), ("all_to_all", "k", kv), ("all_to_all", "v", kv), ("all_to_all", "o", q),
                ("all_to_all", "lse", lse), ("all_to_all", "lse, delta", 2 * lse), ("all_to_all", "q", q),
                ("all_to_all", "k", kv), ("all_to_all", "v", kv), ("all_to_all", "do", q), ("all_to_all", "dq", q),
                ("all_to_all", "dk", kv), ("all_to_all", "dv", kv)]
    for rank, per_rank in enumerate(results()):
        log = per_rank["K divides"][5]
        assert log == expected, f"rank {rank}: all-to-alls (op, label, payload) {log}, expected {expected}"


@pytest.mark.given
@pytest.mark.parametrize("heads, kv_heads, c, message", [
    (4, 2, 3, "c=3 must divide the query heads H=4"),
    (12, 4, 6, "c=6 must divide the key/value heads K=4 .* or be a multiple of K"),
])
def test_heads_ulysses_cannot_split_are_refused_in_one_line(heads, kv_heads, c, message):
    with pytest.raises(ValueError, match=message) as refused:
        ulysses.check_ulysses(heads, kv_heads, c)
    assert "\n" not in str(refused.value)
    ulysses.check_ulysses(8, 2, 4)  # c a multiple of K: each key/value head copied twice
    assert ulysses.kv_copies(2, 4) == 2 and ulysses.kv_copies(4, 4) == 1
