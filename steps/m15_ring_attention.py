# Generated from solutions/m15_ring_attention.py by `python -m course.skeleton`: fill in the TODOs.
# Grade your work with `python main.py grade 15`. (skeleton 3be257e58324)
"""Module 15, part 2 - ring attention: keys and values travel round the context ranks.

Each of the c ranks of the context group holds its layout's share of q, k and v (T/c positions).
A query needs every key before it, and those are spread over the ranks. Ring attention passes the
key/value blocks round the ring instead of gathering them: at every step each rank computes its
queries' attention against the block in hand with module 06's attention_forward (at the blocks'
positions, causal from them) while that block moves on to one neighbour and the next arrives from
the other. After c steps every query has met every key, and no rank has held more than two blocks
(the one in hand and the one arriving).

Each block gives a *partial* result: the output over that block's keys alone, and the log-sum-exp
of those scores. Two partials of the same queries merge exactly into the result over both sets of
keys (Milakov and Gimelshein's online softmax, the merge of FlashAttention's tiles): merge_partials.

Under the causal mask a block whose keys all come after the queries contributes nothing: it is
skipped (no scores computed, nothing merged). With the contiguous layout rank 0 skips every block
but its own, and the last rank skips none: the imbalance zig-zag removes (m15_layout).

The backward runs the same ring. Each rank computes its queries' dq against every block, and
contributions to the block's dk and dv, which belong to the block's owner: they travel round the
ring in accumulators, each rank adding its share, until they reach the owner. Every block's
backward uses the merged lse and delta = rowsum(do * o) of the whole attention (module 06's
attention_backward takes them), so that exp(s - lse) is the block's share of the one softmax over
all keys.

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
    # Contract: return (o, lse) of the attention over both sets of keys: lse each query's log-sum-exp of its scores
    #   over both sets, o the softmax over both sets weighting their values; shapes and dtypes of the inputs. A row
    #   whose lse is -inf (no key yet, o = 0) takes the other side's result unchanged. Finite for any finite lse's:
    #   the tests merge float32 partials of scores of several hundred, where exp(score) is inf. (Both -inf at once
    #   cannot happen in the ring: every block it merges has at least one key for each of its queries.)
    # Maths: a partial over a set A of keys is o_A = Σ_{j∈A} exp(s_j - lse_A) v_j with lse_A = log Σ_{j∈A} exp(s_j):
    #   each set's own softmax, normalised over its own keys.
    # Question: by which factor must each partial output be re-weighted to become its share of the softmax over
    #   both sets, and how do you compute those factors without ever forming exp(lse)?
    # Pitfalls: what does a plain sum, or an average, of o and o_block assume about the two sets of keys? What is
    #   exp(500) in float32?
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
        # Contract: afterwards o and lse (above) hold every query's causal attention over all the keys of the
        #   sequence, at the layout's positions, as one process computes it. Messages: in c steps a rank sends c - 1
        #   blocks and receives c - 1 (kv as stacked above), through group.collectives.irecv / isend (peers by their
        #   index in the group, label "kv", tag KV_TAG); at each step that moves a block the receive is posted before
        #   the send, both before the step's attention, and both are waited on after it. A rank holds at most two
        #   blocks at a time, and computes no scores for a (query piece, key piece) pair that the mask hides
        #   entirely. The tests compare with SDPA on the whole sequence (c = 4, both layouts, float64, float32 and
        #   bf16), check which keys each call of attention_forward gets, and read the messages off the log.
        # Maths: layout.local_pieces(i) lists rank i's runs of positions as (first position, its rows); module 06's
        #   attention_forward(q, k, v, chunk, q_offset, k_offset) puts query i at q_offset + i and key j at
        #   k_offset + j; merge_partials merges a partial into o and lse (grouped_output(...).to(dtype) puts
        #   attention_forward's o in lse's layout).
        # Question: whose block does this rank hold at step s, and from which neighbour must the next one come, so
        #   that in c steps it meets every rank's block exactly once?
        # Pitfalls: can the buffer a block arrives in be the one whose send is still in flight? Once a block has
        #   arrived, which block is in hand? Can a query piece see part of a key piece that starts after its first
        #   query?
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
        #   queries' gradients over every block; dk and dv of this rank's block sum every rank's contributions, added
        #   in lse's dtype (float32 at least: bf16 inputs too). Messages: the blocks travel as in the forward (label
        #   "kv", tag KV_TAG); the contributions to a block's dk and dv travel in accumulators shaped like kv, in lse's
        #   dtype, through group.collectives.isend / irecv (label "dkv", tag DKV_TAG); every accumulator ends at its
        #   block's owner, and each rank receives as many as it sends; with c = 1 nothing is sent. Every receive is
        #   posted before anything waits on it. The tests compare with autograd on the whole
        #   sequence (c = 4, both layouts, float64, float32 and bf16, o and lse from a correct forward), check the
        #   keys each call of attention_backward gets, and read the messages and their sizes off the log.
        # Maths: attention_backward(do, q, k, v, None, lse, chunk, q_offset, k_offset, delta) returns one pair's
        #   exact shares of dq, dk and dv when given this rank's rows of the merged lse and of delta (above); the
        #   pairs are the ones the forward computed.
        # Question: where must the contributions to rank j's block end, how many hops does that take, and when
        #   can each rank add its own share on the way?
        # Pitfalls: when the loop ends, which accumulator has arrived, and whose block is it? Can a tensor whose
        #   send is in flight be added to or freed? A rank that waits for a receive nobody posted a send for: what
        #   does it wait for?
        raise NotImplementedError("TODO(m15): the ring's backward: blocks round the ring again, their gradient accumulators with them")
