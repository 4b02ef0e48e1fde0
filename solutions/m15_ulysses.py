"""Module 15, part 4 - Ulysses: trade the sequence split for a head split around attention.

DeepSpeed-Ulysses (Jacobs et al. 2023) does not split attention's work by positions at all. Around
attention it re-shards q, k and v with one all-to-all each: every rank sends rank j the heads j is
to own, for all of its own positions, and receives its own heads for every position. Then each rank
runs ordinary causal attention on the whole sequence for H/c query heads (module 06's
attention_forward, unchanged: attention heads are independent), and an all-to-all of the output
goes back the other way, to the positions this rank holds.

    sequence-sharded (B, T/c, heads, D)  --all-to-all-->  head-sharded (B, T, heads/c, D)

Every rank computes a full causal attention of H/c heads: the same work on every rank, whatever the
layout, with no merge and no skipped blocks. The price: all-to-alls of whole activations around
every attention, and c is limited by the heads.

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
    #   is the ranks' positions one rank after the other. One group.collectives.all_to_all(output, input,
    #   label=label), which cuts its input along dim 0 into c equal blocks (block j goes to rank j) and fills its
    #   output's dim 0 with the block from each rank, in rank order; it wants contiguous tensors. The tests send
    #   values that encode their (position, head) and read them back on every rank.
    # Question: along which axis must x be cut into the c blocks, and along which must the arriving blocks be
    #   joined?
    # Pitfalls: cutting and joining along the same axis, or the two swapped, runs without an error: what does each
    #   arriving block hold, and where does it belong in the result?
    # Hint 1: the chapter's "Ulysses" draws the re-shard: what does rank j need from this rank, and what does the
    #         block from rank s hold once it arrives?
    # Hint 2: cut the heads: view h as (c, h/c) and bring that c axis to the front, so block j is heads
    #         [j h/c, (j+1) h/c) of this rank's n positions. The block from rank s holds rank s's n positions of
    #         this rank's heads: put the arriving axis just before n and merge the two into c n.
    # Hint 3: blocks = x.reshape(B, n, c, h // c, D).permute(2, 0, 1, 3, 4).contiguous()
    #         received = torch.empty_like(blocks);  group.collectives.all_to_all(received, blocks, label=label)
    #         return received.permute(1, 0, 2, 3, 4), reshaped to (B, c * n, h // c, D)
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
    # Question: which axis is cut this time, and which joined?
    # Pitfalls: rank s's heads are heads [s h/c, (s+1) h/c): do they come back one block after another, or
    #   interleaved?
    # Hint 1: the mirror image of sequence_to_heads: what does the block for rank j hold now, and where does the
    #         block from rank s go?
    # Hint 2: cut time: view T as (c, T/c), that c axis to the front (block j: rank j's positions); the block from
    #         rank s is heads [s hc, (s+1) hc): put the arriving axis just before the heads and merge them.
    # Hint 3: blocks = x.reshape(B, c, T // c, hc, D).permute(1, 0, 2, 3, 4).contiguous()
    #         received = torch.empty_like(blocks);  group.collectives.all_to_all(received, blocks, label=label)
    #         return received.permute(1, 2, 0, 3, 4), reshaped to (B, T // c, c * hc, D)
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
        #   heads * D) in q's dtype, lse (B, kv_heads, heads // kv_heads, T/c) in its float dtype). Five all-to-alls,
        #   labelled "q", "k", "v" (to this rank's heads, with self.to_heads), then "o" and "lse" (back, with
        #   self.to_sequence). When c is a multiple of K, each key/value head goes out as `copies` copies, so that
        #   every rank receives the key/value head its query heads read. The tests compare with SDPA on the whole
        #   sequence for c dividing K, K copied, and two key/value heads a rank.
        # Maths: query head h reads key/value head h // (heads // kv_heads); module 06's lse is grouped (B, kv_heads,
        #   group, T): its head order is key/value head first, then the place in the group. attention_forward on the
        #   head-sharded q, k, v (the whole sequence, position 0 first) is ordinary causal attention of this rank's
        #   heads.
        # Question: how does this rank's lse, grouped by its own key/value heads, travel back as a per-position,
        #   per-head tensor, and come out in the global head order?
        # Pitfalls: which copying puts on rank j the key/value head its query heads read, each head's copies side by
        #   side or the whole set repeated? With two key/value heads a rank, does your lse keep (key/value head,
        #   group) in that order?
        # Hint 1: the chapter's "Ulysses": which tensors cross before and after attention, and which of them is
        #         not laid out like q, k, v and o: how can it cross by the same exchange?
        # Hint 2: the head-sharded lse (B, K_r, Q, T) lists this rank's heads as K_r Q in the global order: flatten
        #         them to one axis, put time first and add a last axis of 1, (B, T, heads/c, 1); back on this rank's
        #         positions it is (B, n, heads, 1): drop the last axis, time last, and regroup as (B, kv_heads,
        #         heads // kv_heads, n). Copies of a key/value head sit next to each other (each head repeated in
        #         place).
        # Hint 3: qh = self.to_heads(q, order, "q")
        #         kh = self.to_heads(k.repeat_interleave(copies, dim=2), order, "k");  vh likewise with "v"
        #         o_h, lse_h = attention_forward(qh, kh, vh, self.chunk);  T = qh.shape[1]
        #         o = self.to_sequence(o_h.view(B, T, heads // c, D), order, "o")
        #         lse = self.to_sequence(lse_h reshaped (B, heads // c, T), .transpose(1, 2).unsqueeze(-1), order, "lse")
        #         return o.reshape(B, n, heads * D), lse.squeeze(-1).transpose(1, 2).reshape(B, kv_heads, -1, n)
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
        # Contract: return (dq, dk, dv) for this rank's tokens, in q's, k's and v's dtypes. Eight all-to-alls,
        #   labelled "lse, delta" (the two statistics stacked on a last axis of 2), "q", "k", "v", "do" to this rank's
        #   heads, then "dq", "dk", "dv" back. attention_backward takes this rank's heads' lse and delta in its own
        #   grouping (B, k_heads, q_heads, T), and o=None. The tests compare with autograd on the whole sequence.
        # Maths: the forward's re-sharding, for every tensor the attention's backward reads; dk and dv come back for
        #   every copy of a key/value head.
        # Question: how do the statistics travel per (position, head), and what does the backward do with the
        #   gradients of a head's copies?
        # Pitfalls: what is the gradient of a tensor that was copied before use? Do lse and delta come back in the
        #   grouping attention_backward reads, (key/value head, group)?
        # Hint 1: the chapter's "Ulysses": the forward's lse went back as a per-head output; what is the way out for
        #         a statistic, and which all-to-alls does attention's backward need?
        # Hint 2: lse and delta stacked on a last axis, per (position, head): (B, n, heads, 2), to heads (B, T,
        #         heads/c, 2); each regrouped as (B, k_heads, heads/c / k_heads, T). The copies of a key/value head
        #         sum: dk back is (B, n, kv_heads copies, D), summed over the copies.
        # Hint 3: stats = torch.stack((lse, delta), -1).reshape(B, heads, n, 2).transpose(1, 2)
        #         stats_h = self.to_heads(stats, order, "lse, delta");  qh, kh, vh as in the forward
        #         doh = self.to_heads(do.view(B, n, heads, D), order, "do");  T, k_heads = qh.shape[1], kh.shape[2]
        #         lse_h, delta_h = stats_h[..., 0] and [..., 1], each .transpose(1, 2) reshaped (B, k_heads, -1, T)
        #         dqh, dkh, dvh = attention_backward(doh.reshape(B, T, -1), qh, kh, vh, None, lse_h, self.chunk,
        #                                            delta=delta_h)
        #         dq = self.to_sequence(dqh, order, "dq")
        #         dk = self.to_sequence(dkh, order, "dk").view(B, n, kv_heads, copies, D).sum(3);  dv likewise
        #         return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
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
