# Generated from solutions/m15_ring_attention.py by `python -m course.skeleton`: fill in the TODOs.
# Grade your work with `python main.py grade 15`. (skeleton f75fec2d346c)
"""Module 15, part 2 - ring attention: keys and values travel round the context ranks.

Each of the c ranks of the context group holds its layout's share of q, k and v (T/c positions).
A query needs every key before it, and those are spread over the ranks. Ring attention passes the
key/value blocks round the ring instead of gathering them: at step s (0 .. c-1) rank i holds the
block of rank (i - s) mod c, computes its queries' attention against it with module 06's
attention_forward (at the blocks' positions, causal from them), and meanwhile sends that block on
to rank i + 1 and receives the next one from rank i - 1. After c steps every query has met every
key, having held at most two blocks (the one in hand and the one arriving) at a time.

Each block gives a *partial* result: the output over that block's keys alone, and the log-sum-exp
of those scores. Two partials of the same queries merge exactly (Milakov and Gimelshein's online
softmax, the merge of FlashAttention's tiles):

    lse = log(exp(lse_1) + exp(lse_2))        o = exp(lse_1 - lse) o_1 + exp(lse_2 - lse) o_2

written with the larger of lse_1, lse_2 subtracted first, so that no exp ever overflows.

Under the causal mask a block whose keys all come after the queries contributes nothing: it is
skipped (no scores computed, nothing merged). With the contiguous layout rank 0 skips every block
but its own, and the last rank skips none: the imbalance zig-zag removes (m15_layout).

The backward runs the same ring. Each rank computes its queries' dq against every block, and
contributions to the block's dk and dv, which belong to the block's owner: an accumulator travels
round the ring with the block, each rank adding its share, and comes home to its owner at the
end. Every block's backward uses the merged lse and delta = rowsum(do * o) of the whole attention
(module 06's attention_backward takes them), so that exp(s - lse) is the block's share of the one
softmax over all keys.

Every message goes through the group's logged collectives (`group.collectives.isend/irecv`, peers
by their index in the group), so the benchmark counts every byte against the formula (m15_costs).
"""
from __future__ import annotations

import torch

from course.mesh import Group
from .m06_llama_ops import ATTENTION_CHUNK, attention_backward, attention_delta, attention_forward, compute_dtype
from .m15_layout import SequenceLayout

KV_TAG, DKV_TAG = 0, 1  # two streams of messages between the same neighbours: blocks, and their gradients


def grouped_output(o: torch.Tensor, kv_heads: int, head_dim: int) -> torch.Tensor:
    """Module 06's output (B, T, heads * D) as (B, kv_heads, group, T, D), the layout of its lse (given)."""
    B, T = o.shape[:2]
    return o.view(B, T, kv_heads, -1, head_dim).permute(0, 2, 3, 1, 4)


def flat_output(og: torch.Tensor) -> torch.Tensor:
    """The inverse of grouped_output: (B, kv_heads, group, T, D) -> (B, T, heads * D) (given)."""
    B, K, Q, T, D = og.shape
    return og.permute(0, 3, 1, 2, 4).reshape(B, T, K * Q * D)


def merge_partials(o: torch.Tensor, lse: torch.Tensor, o_block: torch.Tensor, lse_block: torch.Tensor):
    """The attention of the same queries over two disjoint sets of keys, merged into one result.

    o and o_block are (..., rows, D), in a float dtype wide enough to merge in (float32 at least);
    lse and lse_block (..., rows) are the log-sum-exps of each query's scores over each set. An lse
    of -inf means no key yet (its o is 0). Returns (o, lse) of the attention over both sets."""
    # TODO(m15): merge two partial attention results by their log-sum-exps, without overflow
    # Contract: return (o, lse) with lse = log(exp(lse) + exp(lse_block)) and o the softmax-weighted average of the
    #   values over both sets of keys; shapes and dtypes of the inputs. A row whose lse is -inf (no key yet, o = 0)
    #   takes the other side's result unchanged. (Both -inf at once cannot happen in the ring: every block it
    #   merges has at least one key for each of its queries.)
    # Maths: each o is sum_j p_j v_j with p_j = exp(s_j - its lse): undo each normalisation and redo it with the
    #   joint one. The chapter's merge, and why it cannot overflow.
    # Pitfalls: summing or averaging the two outputs ignores how much weight each set of keys has (the lse's);
    #   exp(lse) itself overflows float32 once a score reaches ~88 (the tests use scores of several hundred).
    raise NotImplementedError('TODO(m15): merge two partial attention results by their log-sum-exps, without overflow')


class RingAttention:
    """Causal attention over the c ranks of `group`, each holding its share of the sequence in the
    layout `layout` ("contiguous" or "zigzag"), with module 06's attention contract on this rank's
    tokens: forward(q, k, v) -> (o, lse), backward(do, q, k, v, o, lse) -> (dq, dk, dv), shaped as
    module 06's (q (B, T/c, heads, D), k and v (B, T/c, kv_heads, D), o (B, T/c, heads * D), lse
    (B, kv_heads, group, T/c)). So module 06's block runs it: LlamaBlock(cfg, attention=RingAttention(...))."""

    def __init__(self, group: Group, layout: str = "contiguous", chunk: int = ATTENTION_CHUNK):
        self.group, self.layout_kind, self.chunk = group, layout, chunk

    def layout(self, local_len: int) -> SequenceLayout:
        return SequenceLayout(self.layout_kind, local_len * self.group.size, self.group.size)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        group, c, me = self.group, self.group.size, self.group.index
        B, n, heads, D = q.shape
        kv_heads = k.shape[2]
        layout = self.layout(n)
        dtype = compute_dtype(q.dtype)
        # The merged result so far, in the layout of module 06's lse: no key yet.
        o = torch.zeros(B, kv_heads, heads // kv_heads, n, D, dtype=dtype, device=q.device)
        lse = torch.full((B, kv_heads, heads // kv_heads, n), float("-inf"), dtype=dtype, device=q.device)
        kv = torch.stack((k, v))  # one message per step: (2, B, T/c, kv_heads, D)
        # TODO(m15): the ring's forward: c steps, the next block in flight while this one is computed
        # Contract: after the loop, o and lse (above) hold every query's attention over all the keys of the
        #   sequence. At step s this rank holds the block of rank (me - s) % c; unless it is the last step, it first
        #   posts the receive of the next block from rank me - 1 and the send of the block in hand to rank me + 1
        #   (group.collectives.irecv / isend, peers by group index, tag KV_TAG), then computes, then waits on both.
        #   For each of its pieces of queries and each piece of the block (layout.local_pieces: (first position,
        #   rows)), it skips the pair if every key comes after every query, else runs attention_forward at their
        #   positions and merges the partial into its rows of o and lse.
        # Pitfalls: gloo moves a message only once its receive is posted, so post the receive first. The block
        #   arriving from me - 1 is the block of rank (me - s - 1) % c: receiving from one side and sending to the
        #   other is what makes the owners line up. A buffer being sent must not be overwritten until its send is
        #   waited on (receive into a new tensor). attention_forward returns o as (B, rows, heads * D) in q's dtype:
        #   grouped_output(...).to(dtype) puts it in lse's layout for the merge.
        raise NotImplementedError("TODO(m15): the ring's forward: c steps, the next block in flight while this one is computed")
        return flat_output(o).to(q.dtype), lse

    def backward(self, do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                 lse: torch.Tensor):
        group, c, me = self.group, self.group.size, self.group.index
        B, n, heads, D = q.shape
        layout = self.layout(n)
        delta = attention_delta(do, o, heads, k.shape[2])  # from the merged output: once, for every block
        dq = torch.zeros(q.shape, dtype=lse.dtype, device=q.device)  # sums over the blocks in float32 at least
        kv = torch.stack((k, v))
        # TODO(m15): the ring's backward: blocks round the ring again, their gradient accumulators with them
        # Contract: return (dq, dk, dv) for this rank's tokens, in q's, k's and v's dtypes: dq sums this rank's
        #   queries' gradients over every block; dk and dv of this rank's block sum every rank's contributions.
        #   The blocks travel as in the forward (tag KV_TAG). Each block's accumulator (shaped like kv, in lse's
        #   dtype) travels one step behind it: at step s this rank adds its contributions to the block in hand into
        #   the accumulator that the previous holder sent (none at step 0: it is this rank's own block), and sends
        #   it on to me + 1 (tag DKV_TAG); after the last step the accumulator of this rank's own block arrives
        #   from me - 1, complete. With c = 1 nothing is sent at all.
        # Maths: attention_backward on each pair the forward computed (same skip, same positions), with this rank's
        #   rows of do, lse and delta (the merged ones: delta above) in place of o (pass None).
        # Pitfalls: every accumulator must end at its owner: c sends and c receives of accumulators per rank, the
        #   last receive being this rank's own block's. Post each receive before waiting on anything; keep every
        #   tensor being sent alive and unchanged until its send is waited on.
        raise NotImplementedError("TODO(m15): the ring's backward: blocks round the ring again, their gradient accumulators with them")
