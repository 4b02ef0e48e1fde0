# Generated from solutions/m12_tp_block.py by `python -m course.skeleton`: fill in the TODOs.
# Grade your work with `python main.py grade 12`. (skeleton b610ad4e6927)
"""Module 12, part 2 - module 06's block on t ranks: attention split by heads, the FFN by its width.

    residual x ─ RMSNorm ─ enter ─ q, k, v (column) ─ RoPE, attention ─ o (row) ─ leave ─ + ─ h
    h ─ RMSNorm ─ enter ─ gate, up (column) ─ SwiGLU ─ down (row) ─ leave ─ + ─ y

The rank at place i_t of the group (`tp.index`) computes H/t of the query heads and the key/value
heads those read (query head h reads key/value head h // (H / K)), so attention needs no
communication at all, and F/t of the FFN's hidden units: SwiGLU is elementwise. Each half of the
block is one enter/leave pair (m12_tp_linear), and its collectives are the pair's. The norms and
residual adds run on the whole stream, replicated, or with sequence parallelism on this rank's T/t
positions, which divides their activation memory by t.

The block is module 06's, op for op (its local ops are imported from m06_llama_ops), with the
weights sliced and the collectives at the seams; the attention and the rotary tables are a module-06
LlamaBlock's (`self.local`), run on this rank's heads.
Its backward adds every weight gradient into `grads`, the main_grad accumulators, instead of
returning new tensors, so microbatches accumulate inside the GEMMs. With sequence parallelism the
norm weights' gradients are partial (this rank's tokens only): `sum_norm_grads` sums them over the
group, once per optimizer step.
"""
from __future__ import annotations

import torch

from .m06_llama_block import ActivationStore, BlockWeights, LlamaBlock, LlamaConfig
from .m06_llama_ops import (ATTENTION_CHUNK, Matmul, residual_rmsnorm_backward, residual_rmsnorm_forward,
                            rmsnorm_backward, rmsnorm_forward, rope_backward, rope_forward, swiglu_backward,
                            swiglu_forward)
from course.mesh import Group
from course.splits import check_splits
from .m12_tp_linear import (column_parallel_backward, column_parallel_forward, row_parallel_backward,
                            row_parallel_forward)


def shard_block_weights(w: BlockWeights, cfg: LlamaConfig, tp: Group) -> BlockWeights:
    """This rank's pieces of a whole block's weights, the ones TPBlock computes with (copies, so the whole
    block can go)."""
    # TODO(m12): slice a block's weights for rank tp.index of tp.size
    # Contract: returns a BlockWeights of this rank's pieces. The t ranks' pieces of each weight, joined in rank order
    #   along the axis it is cut on, are exactly the block's weight, and each rank's are what its own heads and FFN
    #   units compute with: TPBlock on the t ranks equals module 06's block on the whole weights (the tests compare
    #   outputs and gradients). The norm weights are whole on every rank. Every tensor is a contiguous copy that
    #   shares no storage with w, so the whole block can be freed (the tests check both).
    # The question: for each of the nine weights, along which axis is it cut, and which piece is this rank's?
    # Pitfalls: with grouped-query attention K < H: is the key/value piece the size of the query piece? Which rows
    #   of wq hold one head (module 06 views q's features as heads)? Is a column block contiguous, and does a view
    #   of it free the whole weight?
    raise NotImplementedError("TODO(m12): slice a block's weights for rank tp.index of tp.size")


def zero_grads(w: BlockWeights, dtype: torch.dtype | None = None) -> BlockWeights:
    """main_grad accumulators for a block's weights: zeros of the same shapes, in `dtype` (given)."""
    return BlockWeights(*(torch.zeros(t.shape, dtype=dtype or t.dtype, device=t.device) for t in w.tensors()))


def sum_norm_grads(norm_grads: list[torch.Tensor], tp: Group, sequence_parallel: bool):
    """Make the norm weights' gradients (ln1, ln2, the final norm) whole on every rank, in place, before
    the optimizer step: module 06's gradients, whether or not each rank normed every position."""
    # TODO(m12): sum the norm weights' gradients over the group (sequence parallelism only)
    # Contract: afterwards every rank holds, in each tensor of norm_grads, the sum over the group of the ranks'
    #   tensors (with sequence parallelism), and they are untouched without it; one collective for all of them
    #   (they are tiny: one latency, not one per tensor), labelled "norm grads".
    # The question: which collective gives every rank the sum, and how do several tensors travel in one call?
    # Pitfalls: a sum over positions, or a mean? Without sequence parallelism, what would a sum do to gradients
    #   that are whole already?
    raise NotImplementedError("TODO(m12): sum the norm weights' gradients over the group (sequence parallelism only)")


class TPBlock:
    """Module 06's block computed by t ranks together; the weights are this rank's slices. Its seven linears
    take `matmul`, a module 09 policy (e.g. FP8Matmul), as module 06's block does; None is `@`."""

    def __init__(self, cfg: LlamaConfig, tp: Group, sequence_parallel: bool = False,
                 attention_chunk: int = ATTENTION_CHUNK, fused: bool = True, matmul: Matmul | None = None):
        check_splits(cfg, {"t": tp.size})
        self.cfg, self.tp, self.sequence_parallel, self.fused = cfg, tp, sequence_parallel, fused
        self.matmul = matmul  # module 09's seam: every linear's products (None: plain high precision)
        # Module 06's block, for what a rank computes alone: attention on its own heads, and the RoPE tables.
        self.local = LlamaBlock(cfg, attention_chunk=attention_chunk)

    def new_store(self) -> ActivationStore:
        return self.local.new_store()

    def forward(self, w: BlockWeights, x: torch.Tensor, store: ActivationStore) -> torch.Tensor:
        """y = block(x), x and y in the residual stream's layout: (B, T, dim), or (B, T / t, dim) with
        sequence parallelism. Saves module 06's activations under module 06's names."""
        cfg, tp, sp, mm = self.cfg, self.tp, self.sequence_parallel, self.matmul
        # TODO(m12): the attention half on t ranks: what this rank computes and saves
        # Contract: save in the store what the backward reads, under module 06's names: 'x', 'n1', 'r1', 'q', 'k',
        #   'v' (q and k after RoPE), 'o', 'lse'. q is (B, T, H/t, head_dim), k and v (B, T, K/t, head_dim), all
        #   T positions; x, n1 and r1 stay in the residual stream's layout (T/t positions with sequence parallelism).
        # The question: which of module 06's attention-half lines change on t ranks, and into what?
        # Pitfalls: 'n1' is the norm's output as this rank has it, not the gathered one: what would keeping the
        #   gathered input cost? How many heads does this rank have? Every linear, here and below, takes the block's
        #   policy mm as its last argument (module 09's seam).
        raise NotImplementedError('TODO(m12): the attention half on t ranks: what this rank computes and saves')
        # TODO(m12): the FFN half on t ranks: from the attention's partial output to the block's output
        # Contract: return y = h + down(SwiGLU(...)) in x's layout; save 'h', 'n2', 'r2', 'g', 'u', 's' (g, u, s:
        #   (B, T, F/t); h, n2, r2 in the residual stream's layout).
        # The question: which of module 06's FFN-half lines change on t ranks, and into what?
        # Pitfalls: the residual add needs the attention output summed over the ranks, in x's layout: which call
        #   gives it? What would adding a partial product do to h?
        raise NotImplementedError("TODO(m12): the FFN half on t ranks: from the attention's partial output to the block's output")

    def backward(self, w: BlockWeights, dy: torch.Tensor, store: ActivationStore, grads: BlockWeights) -> torch.Tensor:
        """dx given dy (both in the residual stream's layout), from what the forward saved. Every weight's
        gradient is *added* into `grads` (main_grad accumulators, e.g. from zero_grads); with sequence
        parallelism the norm weights' are this rank's partial sums until sum_norm_grads."""
        tp, sp, fused, mm = self.tp, self.sequence_parallel, self.fused, self.matmul
        # TODO(m12): backward of the FFN half on t ranks
        # Contract: add the gradients of w_down, w_gate, w_up and ln2 into grads; name the residual stream's
        #   gradient after the norm dh (the attention half's TODO uses it).
        # The question: module 06's FFN-half backward with each linear replaced by its parallel backward: which
        #   one, on which saved input, into which accumulator?
        # Pitfalls: labels: give each linear's backward the label of its forward, so the collectives log names them.
        #   Is ln2's gradient added into grads.ln2 or assigned (microbatches accumulate)?
        raise NotImplementedError('TODO(m12): backward of the FFN half on t ranks')
        # TODO(m12): backward of the attention half on t ranks
        # Contract: add the gradients of wo, wq, wk, wv and ln1 into grads; return dx = dh + the norm's input gradient.
        # The question: module 06's attention-half backward with each linear replaced by its parallel backward.
        # Pitfalls: attention's gradients have a head axis and may not be contiguous: view or reshape to (B, T, -1)?
        #   q, k and v share n1: how many column_parallel_backward calls?
        raise NotImplementedError('TODO(m12): backward of the attention half on t ranks')
