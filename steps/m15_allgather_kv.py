# Generated from solutions/m15_allgather_kv.py by `python -m course.skeleton`: fill in the TODOs.
# Grade your work with `python main.py grade 15`. (skeleton c034a862ad8b)
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

The backward needs the whole sequence's keys and values again (the store keeps only this rank's k
and v: the activation memory stays T/c), and each rank's queries contribute to the gradients of
every rank's keys: those contributions must be summed over the ranks and end at the keys' owners.
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
        # TODO(m15): the whole sequence's keys and values, gathered, in position order
        # Contract: return (2, B, T, kv_heads, D), k and v of the whole sequence stacked, element t of the time axis
        #   holding position t, whatever the layout. One all-gather of this rank's k and v stacked (2, B, T/c,
        #   kv_heads, D) along their time axis, through self.group.collectives.all_gather (label "kv").
        # Question: in which order does the all-gather join the ranks' tokens, and what puts them in position order?
        # Pitfalls: are the two orders the same for the contiguous layout? For zig-zag? The tests run both.
        raise NotImplementedError("TODO(m15): the whole sequence's keys and values, gathered, in position order")

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        me, layout = self.group.index, self.layout(q.shape[1])
        # TODO(m15): attend once per piece of this rank's queries, against the whole sequence's keys
        # Contract: return (o, lse) for this rank's tokens in its local order, as module 06's attention_forward
        #   returns them: o (B, T/c, heads * D) in q's dtype, lse (B, kv_heads, group, T/c); causal over the whole
        #   sequence. The keys and values come from self.gather_kv (one all-gather a forward).
        # Maths: layout.local_pieces(me) lists this rank's runs of positions as (first position, its rows);
        #   attention_forward(q, k, v, chunk, q_offset, k_offset) puts query i at q_offset + i and key j at k_offset + j.
        # Question: at which offsets does a piece of queries, scored against all T keys, see exactly the keys up to
        #   each query's position?
        # Pitfalls: is a piece's first position the same as its first row for a zig-zag rank's second piece? Along
        #   which axis do the pieces' o and lse join?
        raise NotImplementedError("TODO(m15): attend once per piece of this rank's queries, against the whole sequence's keys")

    def backward(self, do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                 lse: torch.Tensor):
        me, layout = self.group.index, self.layout(q.shape[1])
        delta = attention_delta(do, o, q.shape[2], k.shape[2])  # from the output: once, for every piece
        # TODO(m15): the backward: every rank's keys' gradients, summed over the ranks, home to their owners
        # Contract: return (dq, dk, dv) for this rank's tokens, in q's, k's and v's dtypes: dq of this rank's queries;
        #   dk and dv of this rank's keys summed over every rank's queries, the sum in lse's dtype (float32 at least:
        #   bf16 inputs too). Collectives: one all-gather (self.gather_kv: the store kept only this rank's k and v)
        #   and one reduce-scatter of dk and dv stacked (2, B, T, kv_heads, D), through
        #   self.group.collectives.reduce_scatter(out, full, label="dkv", dim=2), which hands rank j block j of
        #   full's time axis, summed over the ranks. The tests compare with autograd on the whole sequence (c = 4,
        #   both layouts, float64 and bf16, o and lse from a correct forward) and read the collectives off the log.
        # Maths: attention_backward(do, q, k, v, None, lse, chunk, q_offset, k_offset, delta) on a piece of queries
        #   against all T keys returns its dq and its contributions to every key's dk and dv, given this rank's rows
        #   of lse and delta (above); the pieces are scored as in the forward.
        # Question: in which order must the time axis of the gradients be laid out so that block j of it holds
        #   exactly rank j's positions?
        # Pitfalls: is that position order, for zig-zag? In which dtype are the pieces' contributions added and
        #   reduce-scattered?
        raise NotImplementedError("TODO(m15): the backward: every rank's keys' gradients, summed over the ranks, home to their owners")
