"""Module 15, part 4 - Ulysses: trade the sequence split for a head split around attention.

DeepSpeed-Ulysses (Jacobs et al. 2023) does not split attention's work by positions at all. Around
attention it re-shards q, k and v with one all-to-all each: every rank sends rank j the heads j is
to own, for all of its own positions, and receives its own heads for every position. Then each rank
runs ordinary causal attention on the whole sequence for H/c query heads (module 06's
attention_forward, unchanged: attention heads are independent), and an all-to-all of the output
goes back the other way, to the positions this rank holds.

    sequence-sharded (B, T/c, heads, D)  --all-to-all-->  head-sharded (B, T, heads/c, D)

Every rank computes a full causal attention of H/c heads: the same work on every rank, whatever the
layout, with no merge and no skipped blocks. The price: four all-to-alls forward (each sends
(c - 1)/c of its input, whose size does not shrink as c grows), and c is limited by the heads.

Grouped-query attention: rank j's query heads [j H/c, (j+1) H/c) read the key/value heads
h // (H/K). If c divides K, rank j takes key/value heads [j K/c, (j+1) K/c), exactly those. If c is
a multiple of K, each key/value head is copied c/K times before the all-to-all, so that every rank
receives the one head its query heads read (and in the backward the copies' gradients are added
back up). Any other c is refused, in one line, by check_ulysses.
"""
from __future__ import annotations

import torch

from course.mesh import Group
from .m06_llama_ops import ATTENTION_CHUNK, attention_backward, attention_delta, attention_forward
from .m15_layout import SequenceLayout


def check_ulysses(n_heads: int, n_kv_heads: int, c: int):
    """One line unless Ulysses can split these heads over c ranks (given)."""
    if n_heads % c:
        raise ValueError(f"Ulysses: c={c} must divide the query heads H={n_heads} (each rank attends with H/c heads)")
    if n_kv_heads % c and c % n_kv_heads:
        raise ValueError(f"Ulysses: c={c} must divide the key/value heads K={n_kv_heads} (K/c a rank) or be a "
                         f"multiple of K (each head copied c/K times); {c} is neither")


def kv_copies(n_kv_heads: int, c: int) -> int:
    """How many copies of each key/value head the all-to-all sends: 1 if c divides K, else c/K (given)."""
    return 1 if n_kv_heads % c == 0 else c // n_kv_heads


def sequence_to_heads(x: torch.Tensor, group: Group, label: str = "") -> torch.Tensor:
    """(B, T/c, h, D) this rank's positions of every head -> (B, T, h/c, D) every rank's positions of
    this rank's heads, time in the ranks' order (rank 0's positions, then rank 1's, ...)."""
    # >>> TODO(m15): the all-to-all from sequence-sharded to head-sharded
    # Contract: rank j of c receives heads [j h/c, (j+1) h/c) of every rank's positions; the time axis of the result
    #   is the ranks' positions one rank after the other. One group.collectives.all_to_all (label `label`), which
    #   cuts its input along dim 0 into c equal blocks (block j goes to rank j) and fills its output's dim 0 with
    #   the block from each rank, in rank order.
    # Pitfalls: the block for rank j is cut along the *heads*; what arrives is laid side by side along *time*.
    #   Cutting and joining along the same axis, or the two swapped, runs without error and mixes heads and
    #   positions: the tests compare every variant with the whole attention. all_to_all wants contiguous tensors.
    # Hint 1: view the heads as (c, h/c), move that c axis to the front, exchange, then move the arriving c axis
    #         next to time and merge the two.
    # Hint 2: x.reshape(B, n, c, h // c, D).permute(2, 0, 1, 3, 4).contiguous(); an output of the same shape;
    #         then .permute(1, 0, 2, 3, 4).reshape(B, c n, h // c, D).
    # Hint 3: blocks = x as (c, B, n, h/c, D), contiguous;  received = empty like blocks
    #         group.collectives.all_to_all(received, blocks, label=label)
    #         return received with its c axis after B, merged with n
    B, n, h, D = x.shape
    c = group.size
    blocks = x.reshape(B, n, c, h // c, D).permute(2, 0, 1, 3, 4).contiguous()
    received = torch.empty_like(blocks)
    group.collectives.all_to_all(received, blocks, label=label)
    return received.permute(1, 0, 2, 3, 4).reshape(B, c * n, h // c, D)
    # <<<


def heads_to_sequence(x: torch.Tensor, group: Group, label: str = "") -> torch.Tensor:
    """The inverse of sequence_to_heads: (B, T, h/c, D), time in the ranks' order -> (B, T/c, h, D)."""
    # >>> TODO(m15): the all-to-all back, from head-sharded to sequence-sharded
    # Contract: rank j receives its own positions (block j of the time axis) of every rank's heads, laid side by side
    #   along the heads in rank order: sequence_to_heads followed by heads_to_sequence gives x back. One all_to_all.
    # Pitfall: the mirror image of sequence_to_heads: cut along time, join along the heads.
    # Hint 1: view time as (c, T/c), move that c to the front, exchange, move the arriving c axis before the heads.
    # Hint 2: x.reshape(B, c, n, hc, D).permute(1, 0, 2, 3, 4).contiguous(); then .permute(1, 2, 0, 3, 4).reshape(
    #         B, n, c hc, D).
    # Hint 3: blocks = x as (c, B, n, hc, D), contiguous;  received = empty like blocks;  all_to_all
    #         return received as (B, n, c, hc, D), merged to (B, n, c hc, D)
    B, T, hc, D = x.shape
    c = group.size
    blocks = x.reshape(B, c, T // c, hc, D).permute(1, 0, 2, 3, 4).contiguous()
    received = torch.empty_like(blocks)
    group.collectives.all_to_all(received, blocks, label=label)
    return received.permute(1, 2, 0, 3, 4).reshape(B, T // c, c * hc, D)
    # <<<


class UlyssesAttention:
    """Causal attention over the c ranks of `group` by a head split: module 06's attention contract
    on this rank's tokens, as RingAttention (default layout: contiguous; any layout works)."""

    def __init__(self, group: Group, layout: str = "contiguous", chunk: int = ATTENTION_CHUNK):
        self.group, self.layout_kind, self.chunk = group, layout, chunk

    def layout(self, local_len: int) -> SequenceLayout:
        return SequenceLayout(self.layout_kind, local_len * self.group.size, self.group.size)

    def to_heads(self, x: torch.Tensor, order: torch.Tensor, label: str) -> torch.Tensor:
        """This rank's heads of the whole sequence, time in position order (given)."""
        return sequence_to_heads(x, self.group, label)[:, order.argsort()]

    def to_sequence(self, x: torch.Tensor, order: torch.Tensor, label: str) -> torch.Tensor:
        """Every head of this rank's positions, from this rank's heads in position order (given)."""
        return heads_to_sequence(x[:, order], self.group, label)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        c = self.group.size
        B, n, heads, D = q.shape
        kv_heads = k.shape[2]
        check_ulysses(heads, kv_heads, c)
        order = self.layout(n).order()
        copies = kv_copies(kv_heads, c)
        # >>> TODO(m15): Ulysses' forward: to heads, attend on the whole sequence, back to the sequence
        # Contract: return (o, lse) for this rank's tokens as module 06's attention_forward returns them (o (B, T/c,
        #   heads * D) in q's dtype, lse (B, kv_heads, heads // kv_heads, T/c)). Five all-to-alls, labelled "q",
        #   "k", "v" (this rank's heads, with self.to_heads), then "o" and "lse" (back, with self.to_sequence).
        #   Key/value heads are first copied `copies` times each (repeat_interleave on the head axis).
        # Maths: attention_forward on the head-sharded q, k, v (the whole sequence, position 0 first) is ordinary
        #   causal attention of this rank's heads. Its lse is (B, k_heads, q_heads, T) for this rank's heads: flatten
        #   them to one head axis (their global order), send them back like an output with D = 1, and regroup as
        #   (B, kv_heads, heads // kv_heads, T/c).
        # Pitfalls: the head axis of o and lse must come back in the global head order (head h = kv head h // group,
        #   then its place in the group), which is what the all-to-alls' rank order gives if nothing is permuted.
        # Hint 1: copy the key/value heads, re-shard q, k, v, attend, re-shard o (as (B, T, heads/c, D)) and lse.
        # Hint 2: the lse's head axis after attention: lse_h.reshape(B, heads // c, T).transpose(1, 2).unsqueeze(-1)
        #         is (B, T, heads/c, 1); back on this rank's positions: (B, n, heads, 1) -> squeeze, transpose,
        #         reshape to (B, kv_heads, heads // kv_heads, n).
        # Hint 3: qh = to_heads(q, order, "q"); kh, vh = to_heads(k, v each repeat_interleave(copies, dim=2), ...)
        #         o_h, lse_h = attention_forward(qh, kh, vh, self.chunk)
        #         o = to_sequence(o_h viewed (B, c n, heads // c, D), order, "o")
        #         lse = to_sequence(lse_h as in Hint 2, order, "lse"), regrouped;  return o as (B, n, heads D), lse
        qh = self.to_heads(q, order, "q")
        kh = self.to_heads(k.repeat_interleave(copies, dim=2), order, "k")
        vh = self.to_heads(v.repeat_interleave(copies, dim=2), order, "v")
        o_h, lse_h = attention_forward(qh, kh, vh, self.chunk)
        T = qh.shape[1]
        o = self.to_sequence(o_h.view(B, T, heads // c, D), order, "o")
        lse = self.to_sequence(lse_h.reshape(B, heads // c, T).transpose(1, 2).unsqueeze(-1), order, "lse")
        return o.reshape(B, n, heads * D), lse.squeeze(-1).transpose(1, 2).reshape(B, kv_heads, -1, n)
        # <<<

    def backward(self, do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                 lse: torch.Tensor):
        c = self.group.size
        B, n, heads, D = q.shape
        kv_heads = k.shape[2]
        order = self.layout(n).order()
        copies = kv_copies(kv_heads, c)
        delta = attention_delta(do, o, heads, kv_heads)  # this rank's positions, every head: no need to send o
        # >>> TODO(m15): Ulysses' backward: everything to heads, module 06's backward, the gradients back
        # Contract: return (dq, dk, dv) for this rank's tokens, in q's, k's and v's dtypes. All-to-alls labelled
        #   "lse, delta" (the two statistics stacked on a last axis of 2, like the forward's lse), "q", "k", "v", "do"
        #   to heads, then "dq", "dk", "dv" back. attention_backward takes the head-sharded lse and delta in its own
        #   grouping (B, k_heads, q_heads, T) of this rank's heads, and o=None.
        # Maths: dk and dv come back for every copy of each key/value head: the copies of a head add up.
        # Pitfalls: lse and delta travel per (position, head) like the output did, in the global head order.
        # Hint 1: the forward's re-sharding, for the statistics, q, k, v and do; attention_backward on the whole
        #         sequence; three re-shardings back; add up the copies.
        # Hint 2: stats = torch.stack((lse, delta), -1).reshape(B, heads, n, 2).transpose(1, 2) is (B, n, heads, 2);
        #         after to_heads, stats_h[..., i].transpose(1, 2).reshape(B, kh.shape[2], -1, T) regroups one.
        #         dk back is (B, n, kv_heads copies, D): .view(B, n, kv_heads, copies, D).sum(3).
        # Hint 3: stats_h = to_heads(stats, order, "lse, delta");  qh, kh, vh as in the forward;  doh = to_heads(do
        #         viewed (B, n, heads, D), order, "do");  lse_h, delta_h from stats_h
        #         dqh, dkh, dvh = attention_backward(doh as (B, T, -1), qh, kh, vh, None, lse_h, self.chunk,
        #                                            delta=delta_h)
        #         dq = to_sequence(dqh, order, "dq"); dk, dv likewise, copies summed; return them in their dtypes
        stats = torch.stack((lse, delta), dim=-1).reshape(B, heads, n, 2).transpose(1, 2)
        stats_h = self.to_heads(stats, order, "lse, delta")
        qh = self.to_heads(q, order, "q")
        kh = self.to_heads(k.repeat_interleave(copies, dim=2), order, "k")
        vh = self.to_heads(v.repeat_interleave(copies, dim=2), order, "v")
        doh = self.to_heads(do.view(B, n, heads, D), order, "do")
        T, k_heads = qh.shape[1], kh.shape[2]
        lse_h, delta_h = (stats_h[..., i].transpose(1, 2).reshape(B, k_heads, -1, T) for i in range(2))
        dqh, dkh, dvh = attention_backward(doh.reshape(B, T, -1), qh, kh, vh, None, lse_h, self.chunk,
                                           delta=delta_h)
        dq = self.to_sequence(dqh, order, "dq")
        dk = self.to_sequence(dkh, order, "dk").view(B, n, kv_heads, copies, D).sum(3)
        dv = self.to_sequence(dvh, order, "dv").view(B, n, kv_heads, copies, D).sum(3)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
        # <<<
