"""Module 15, part 3 - all-gather KV: the whole sequence's keys and values gathered at once (Llama 3).

The ring passes c - 1 blocks round, one per step, so that a rank never holds more than two of them.
Llama 3's context parallelism (Dubey et al. 2024, section 3.3.2) does the opposite: each rank
all-gathers the keys and values of the whole sequence in one collective, then computes its own
queries' attention against them in one call, with the zig-zag layout so the work is even. It sends
the same bytes as the ring's forward ((c - 1) blocks a rank) in one latency instead of c - 1, and
holds the whole K and V for a moment: with grouped-query attention those are K/H of the queries'
size (Llama 3 8B: 8 key/value heads for 32 query heads), small beside the activations the block
keeps anyway. It does not overlap the gather with compute, and needs no merge: the lse comes out of
one attention over all keys.

The backward gathers the keys and values again (the store keeps only this rank's k and v: the
activation memory stays T/c), computes dq, and dk and dv for the *whole* sequence (this rank's
queries' contributions to every key), and a reduce-scatter sums those over the ranks and hands each
rank the sum for its own positions.

The gathered keys come in the order the ranks hold them (rank 0's, then rank 1's, ...: the layout's
`order()`); attention wants them in position order, and the reduce-scatter wants the gradients back
in the ranks' order.
"""
from __future__ import annotations

import torch

from course.mesh import Group
from .m06_llama_ops import ATTENTION_CHUNK, attention_backward, attention_delta, attention_forward
from .m15_layout import SequenceLayout


class AllGatherKVAttention:
    """Causal attention over the c ranks of `group`, keys and values all-gathered: module 06's
    attention contract on this rank's tokens, as RingAttention (default layout: zig-zag, as Llama 3)."""

    def __init__(self, group: Group, layout: str = "zigzag", chunk: int = ATTENTION_CHUNK):
        self.group, self.layout_kind, self.chunk = group, layout, chunk

    def layout(self, local_len: int) -> SequenceLayout:
        return SequenceLayout(self.layout_kind, local_len * self.group.size, self.group.size)

    def gather_kv(self, k: torch.Tensor, v: torch.Tensor, layout: SequenceLayout) -> torch.Tensor:
        """Every rank's keys and values, (2, B, T, kv_heads, D), in position order."""
        # >>> TODO(m15): the whole sequence's keys and values, gathered, in position order
        # Contract: one all-gather (label "kv") through self.group.collectives of k and v stacked, (2, B, T/c,
        #   kv_heads, D), along the time axis; return (2, B, T, kv_heads, D) with time in position order.
        # Pitfall: the gathered time axis is in the ranks' order, layout.order() (rank 0's positions, then rank 1's,
        #   ...), not in position order: the two are the same only for the contiguous layout.
        # Hint 1: stack, gather along the time axis of the stack, reorder the time axis.
        # Hint 2: torch.stack((k, v)); all_gather(out, shard, label="kv", dim=2) with out (2, B, T, kv_heads, D); the
        #         gathered index j holds position layout.order()[j]: index_select with its argsort.
        # Hint 3: local = stack of k and v; gathered = empty (2, B, layout.seq_len, kv_heads, D) like k
        #         all-gather local into gathered (label "kv", dim=2)
        #         return gathered.index_select(2, layout.order().argsort())
        local = torch.stack((k, v))
        gathered = torch.empty((2, k.shape[0], layout.seq_len, *k.shape[2:]), dtype=k.dtype, device=k.device)
        self.group.collectives.all_gather(gathered, local, label="kv", dim=2)
        return gathered.index_select(2, layout.order().argsort().to(k.device))
        # <<<

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        me, layout = self.group.index, self.layout(q.shape[1])
        # >>> TODO(m15): attend once per piece of this rank's queries, against the whole sequence's keys
        # Contract: return (o, lse) for this rank's tokens in its local order: o (B, T/c, heads * D) in q's dtype, lse
        #   (B, kv_heads, group, T/c), as module 06's attention_forward returns them; the keys and values of the
        #   whole sequence come from self.gather_kv (one all-gather).
        # Maths: each piece of queries (layout.local_pieces(me): first position, rows) against all T keys, the first
        #   at position 0: attention_forward at offsets (q_start, 0) sees exactly the keys before each query.
        # Pitfalls: the pieces' outputs and lse's go back side by side along the time axis (dim 1 for o, the last
        #   for lse), in the local order.
        # Hint 1: gather, attend piece by piece, concatenate.
        # Hint 2: attention_forward(q[:, rows], kv[0], kv[1], self.chunk, q_start, 0).
        # Hint 3: kv = self.gather_kv(k, v, layout)
        #         for q_start, rows in layout.local_pieces(me): o_p, lse_p = attention_forward(...)
        #         return the o_p concatenated on dim 1, the lse_p on the last dim
        kv = self.gather_kv(k, v, layout)
        outputs, lses = [], []
        for q_start, rows in layout.local_pieces(me):
            o, lse = attention_forward(q[:, rows], kv[0], kv[1], self.chunk, q_start, 0)
            outputs.append(o)
            lses.append(lse)
        return torch.cat(outputs, dim=1), torch.cat(lses, dim=-1)
        # <<<

    def backward(self, do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                 lse: torch.Tensor):
        me, layout = self.group.index, self.layout(q.shape[1])
        delta = attention_delta(do, o, q.shape[2], k.shape[2])  # from the output: once, for every piece
        # >>> TODO(m15): the backward: gather again, this rank's share of every key's gradient, reduce-scatter
        # Contract: return (dq, dk, dv) for this rank's tokens, in q's, k's and v's dtypes. Gather k and v again (the
        #   store kept only this rank's), run attention_backward per piece at the forward's positions with this
        #   rank's rows of do, lse and delta (o not read: pass None), sum every piece's dk and dv over the whole
        #   sequence (lse's dtype), and reduce-scatter them (label "dkv") so that each rank receives the sum over
        #   the ranks for its own positions.
        # Pitfalls: the reduce-scatter hands rank j block j of the time axis: lay the gradients out in the ranks'
        #   order (layout.order()) first, not in position order. Its output is (2, B, T/c, kv_heads, D).
        # Hint 1: the forward's loop with attention_backward, then one reduce-scatter of dk and dv stacked.
        # Hint 2: attention_backward(do[:, rows], q[:, rows], kv[0], kv[1], None, lse[..., rows], self.chunk, q_start,
        #         0, delta[..., rows]) -> dq_p (B, rows, heads, D), dk_p and dv_p (B, T, kv_heads, D);
        #         group.collectives.reduce_scatter(mine, full.index_select(2, layout.order()), label="dkv", dim=2).
        # Hint 3: kv = gather_kv again;  dkv = zeros (2, B, T, kv_heads, D) in lse's dtype;  dqs = []
        #         for each piece: dq_p, dk_p, dv_p = ...; dqs.append(dq_p); dkv[0] += dk_p; dkv[1] += dv_p
        #         mine = empty (2, *k.shape) in lse's dtype; reduce-scatter dkv in the ranks' order into it
        #         return cat(dqs, dim=1), mine[0], mine[1], each in its tensor's dtype
        kv = self.gather_kv(k, v, layout)
        dkv = torch.zeros(kv.shape, dtype=lse.dtype, device=kv.device)
        dqs = []
        for q_start, rows in layout.local_pieces(me):
            dq, dk, dv = attention_backward(do[:, rows], q[:, rows], kv[0], kv[1], None, lse[..., rows], self.chunk,
                                            q_start, 0, delta[..., rows])
            dqs.append(dq)
            dkv[0] += dk
            dkv[1] += dv
        mine = torch.empty((2, *k.shape), dtype=lse.dtype, device=k.device)
        in_ranks_order = dkv.index_select(2, layout.order().to(k.device))
        self.group.collectives.reduce_scatter(mine, in_ranks_order, label="dkv", dim=2)
        return torch.cat(dqs, dim=1).to(q.dtype), mine[0].to(k.dtype), mine[1].to(v.dtype)
        # <<<
