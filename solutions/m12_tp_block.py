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
    # >>> TODO(m12): slice a block's weights for rank tp.index of tp.size
    # Contract: returns a BlockWeights of this rank's pieces. The t ranks' pieces of each weight, joined in rank order
    #   along the axis it is cut on, are exactly the block's weight, and each rank's are what its own heads and FFN
    #   units compute with: TPBlock on the t ranks equals module 06's block on the whole weights (the tests compare
    #   outputs and gradients). The norm weights are whole on every rank. Every tensor is a contiguous copy that
    #   shares no storage with w, so the whole block can be freed (the tests check both).
    # The question: for each of the nine weights, along which axis is it cut, and which piece is this rank's?
    # Pitfalls: with grouped-query attention K < H: is the key/value piece the size of the query piece? Which rows
    #   of wq hold one head (module 06 views q's features as heads)? Is a column block contiguous, and does a view
    #   of it free the whole weight?
    # Hint 1: which weights are column-parallel and which row-parallel (docs/12, "Column and row"), which axis of W
    #       (out, in) holds the output features, and how does module 06 cut q's features into heads?
    # Hint 2: a head is head_dim consecutive rows of wq, wk, wv (columns of wo). Column-parallel (wq, wk, wv, w_gate,
    #       w_up): block i_t of t equal blocks of rows, i.e. query heads [i_t H/t, (i_t+1) H/t), key/value heads
    #       [i_t K/t, (i_t+1) K/t), units [i_t F/t, (i_t+1) F/t); row-parallel (wo, w_down): block i_t of t equal
    #       blocks of columns; the norms whole; every piece a contiguous copy. Shapes: wq (H/t D, dim), wk and wv
    #       (K/t D, dim), wo (dim, H/t D), w_gate and w_up (F/t, dim), w_down (dim, F/t).
    # Hint 3: block(weight, dim) = weight.chunk(tp.size, dim=dim)[tp.index].clone(memory_format=torch.contiguous_format)
    #       BlockWeights(ln1=a copy of w.ln1, wq=block(w.wq, 0), ..., wo=block(w.wo, 1), ..., w_down=block(w.w_down, 1))
    def block(weight, dim):
        return weight.chunk(tp.size, dim=dim)[tp.index].clone(memory_format=torch.contiguous_format)
    return BlockWeights(ln1=w.ln1.clone(), wq=block(w.wq, 0), wk=block(w.wk, 0), wv=block(w.wv, 0),
                        wo=block(w.wo, 1), ln2=w.ln2.clone(), w_gate=block(w.w_gate, 0), w_up=block(w.w_up, 0),
                        w_down=block(w.w_down, 1))
    # <<<


def zero_grads(w: BlockWeights, dtype: torch.dtype | None = None) -> BlockWeights:
    """main_grad accumulators for a block's weights: zeros of the same shapes, in `dtype` (given)."""
    return BlockWeights(*(torch.zeros(t.shape, dtype=dtype or t.dtype, device=t.device) for t in w.tensors()))


def sum_norm_grads(norm_grads: list[torch.Tensor], tp: Group, sequence_parallel: bool):
    """Make the norm weights' gradients (ln1, ln2, the final norm) whole on every rank, in place, before
    the optimizer step: module 06's gradients, whether or not each rank normed every position."""
    # >>> TODO(m12): sum the norm weights' gradients over the group (sequence parallelism only)
    # Contract: afterwards every rank holds, in each tensor of norm_grads, the sum over the group of the ranks'
    #   tensors (with sequence parallelism), and they are untouched without it; one collective for all of them
    #   (they are tiny: one latency, not one per tensor), labelled "norm grads".
    # The question: which collective gives every rank the sum, and how do several tensors travel in one call?
    # Pitfalls: a sum over positions, or a mean? Without sequence parallelism, what would a sum do to gradients
    #   that are whole already?
    # Hint 1: docs/12, "Sequence parallelism", says why these gradients are partial: over what is the missing sum?
    # Hint 2: one all-reduce (a sum) of all the tensors laid end to end in one flat buffer, then each tensor's
    #       piece copied back into it; nothing without sequence parallelism.
    # Hint 3: if not sequence_parallel: return
    #       flat = torch.cat([g.reshape(-1) for g in norm_grads]); tp.collectives.all_reduce(flat, label="norm grads")
    #       for g, piece in zip(norm_grads, flat.split([g.numel() for g in norm_grads])): g.copy_(piece.view_as(g))
    if not sequence_parallel or not norm_grads:
        return
    flat = torch.cat([g.reshape(-1) for g in norm_grads])
    tp.collectives.all_reduce(flat, label="norm grads")
    for g, summed in zip(norm_grads, flat.split([g.numel() for g in norm_grads]), strict=True):
        g.copy_(summed.view_as(g))
    # <<<


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
        # >>> TODO(m12): the attention half on t ranks: what this rank computes and saves
        # Contract: save in the store what the backward reads, under module 06's names: 'x', 'n1', 'r1', 'q', 'k',
        #   'v' (q and k after RoPE), 'o', 'lse'. q is (B, T, H/t, head_dim), k and v (B, T, K/t, head_dim), all
        #   T positions; x, n1 and r1 stay in the residual stream's layout (T/t positions with sequence parallelism).
        # The question: which of module 06's attention-half lines change on t ranks, and into what?
        # Pitfalls: 'n1' is the norm's output as this rank has it, not the gathered one: what would keeping the
        #   gathered input cost? How many heads does this rank have? Every linear, here and below, takes the block's
        #   policy mm as its last argument (module 09's seam).
        # Hint 1: module 06's attention half, line by line: which lines multiply by a weight (and so become
        #       column-parallel), and which run on this rank's heads alone?
        # Hint 2: n1, r1 = RMSNorm(x); q, k, v = the column-parallel linears of n1 (one call, they share n1); RoPE on
        #       q and k with tables for the whole sequence; attention on this rank's H/t query and K/t key/value heads.
        # Hint 3: n1, r1 = rmsnorm_forward(x, w.ln1, cfg.norm_eps)
        #       q, k, v = column_parallel_forward(n1, [w.wq, w.wk, w.wv], tp, sp, "attention in", mm)
        #       cos, sin = self.local.rope(T, x.dtype, x.device); q, k = rope_forward(view (B, T, -1, head_dim), cos, sin)
        #       v viewed likewise; o, lse = self.local.attention.forward(q, k, v); save the eight names
        n1, r1 = rmsnorm_forward(x, w.ln1, cfg.norm_eps)
        q, k, v = column_parallel_forward(n1, [w.wq, w.wk, w.wv], tp, sp, "attention in", mm)
        batch, seq_len, _ = q.shape
        cos, sin = self.local.rope(seq_len, x.dtype, x.device)
        q = rope_forward(q.view(batch, seq_len, -1, cfg.head_dim), cos, sin)
        k = rope_forward(k.view(batch, seq_len, -1, cfg.head_dim), cos, sin)
        v = v.view(batch, seq_len, -1, cfg.head_dim)
        o, lse = self.local.attention.forward(q, k, v)
        for name, tensor in (("x", x), ("n1", n1), ("r1", r1), ("q", q), ("k", k), ("v", v), ("o", o), ("lse", lse)):
            store.save(name, tensor)
        # <<<
        # >>> TODO(m12): the FFN half on t ranks: from the attention's partial output to the block's output
        # Contract: return y = h + down(SwiGLU(...)) in x's layout; save 'h', 'n2', 'r2', 'g', 'u', 's' (g, u, s:
        #   (B, T, F/t); h, n2, r2 in the residual stream's layout).
        # The question: which of module 06's FFN-half lines change on t ranks, and into what?
        # Pitfalls: the residual add needs the attention output summed over the ranks, in x's layout: which call
        #   gives it? What would adding a partial product do to h?
        # Hint 1: module 06's FFN half and the block's end: which linears are row-parallel, which column-parallel?
        # Hint 2: h, n2, r2 = residual + RMSNorm of (x, o's row-parallel output); g, u = the column-parallel linears
        #       of n2 (one call); s = SwiGLU(g, u); y = h + down's row-parallel output of s.
        # Hint 3: h, n2, r2 = residual_rmsnorm_forward(x, row_parallel_forward(o, w.wo, tp, sp, "attention out", mm),
        #       w.ln2, cfg.norm_eps); g, u = column_parallel_forward(n2, [w.w_gate, w.w_up], tp, sp, "ffn in", mm)
        #       s = swiglu_forward(g, u); save the six names; return h + row_parallel_forward(s, w.w_down, ..., "ffn out", mm)
        h, n2, r2 = residual_rmsnorm_forward(x, row_parallel_forward(o, w.wo, tp, sp, "attention out", mm), w.ln2,
                                             cfg.norm_eps)
        g, u = column_parallel_forward(n2, [w.w_gate, w.w_up], tp, sp, "ffn in", mm)
        s = swiglu_forward(g, u)
        for name, tensor in (("h", h), ("n2", n2), ("r2", r2), ("g", g), ("u", u), ("s", s)):
            store.save(name, tensor)
        return h + row_parallel_forward(s, w.w_down, tp, sp, "ffn out", mm)
        # <<<

    def backward(self, w: BlockWeights, dy: torch.Tensor, store: ActivationStore, grads: BlockWeights) -> torch.Tensor:
        """dx given dy (both in the residual stream's layout), from what the forward saved. Every weight's
        gradient is *added* into `grads` (main_grad accumulators, e.g. from zero_grads); with sequence
        parallelism the norm weights' are this rank's partial sums until sum_norm_grads."""
        tp, sp, fused, mm = self.tp, self.sequence_parallel, self.fused, self.matmul
        # >>> TODO(m12): backward of the FFN half on t ranks
        # Contract: add the gradients of w_down, w_gate, w_up and ln2 into grads; name the residual stream's
        #   gradient after the norm dh (the attention half's TODO uses it).
        # The question: module 06's FFN-half backward with each linear replaced by its parallel backward: which
        #   one, on which saved input, into which accumulator?
        # Pitfalls: labels: give each linear's backward the label of its forward, so the collectives log names them.
        #   Is ln2's gradient added into grads.ln2 or assigned (microbatches accumulate)?
        # Hint 1: the forward in reverse: which linear's backward comes first, and which two share one call?
        # Hint 2: ds = down's row-parallel backward of dy (input s); dg, du = SwiGLU's backward; dn2 = gate and up's
        #       column-parallel backward (input n2, one call); dh, d_ln2 = the residual norm's backward; grads.ln2 += d_ln2.
        # Hint 3: ds = row_parallel_backward(dy, store["s"], w.w_down, grads.w_down, tp, sp, "ffn out", fused, mm)  (s saved)
        #       dg, du = swiglu_backward(ds, store["g"], store["u"])
        #       dn2 = column_parallel_backward([dg, du], store["n2"], [w.w_gate, w.w_up], [grads.w_gate, grads.w_up],
        #             tp, sp, "ffn in", fused, mm)
        #       dh, d_ln2 = residual_rmsnorm_backward(dy, dn2, store["h"], store["r2"], w.ln2); grads.ln2.add_(d_ln2)
        ds = row_parallel_backward(dy, store["s"], w.w_down, grads.w_down, tp, sp, "ffn out", fused, mm)
        dg, du = swiglu_backward(ds, store["g"], store["u"])
        dn2 = column_parallel_backward([dg, du], store["n2"], [w.w_gate, w.w_up], [grads.w_gate, grads.w_up], tp,
                                       sp, "ffn in", fused, mm)
        dh, d_ln2 = residual_rmsnorm_backward(dy, dn2, store["h"], store["r2"], w.ln2)
        grads.ln2.add_(d_ln2)
        # <<<
        # >>> TODO(m12): backward of the attention half on t ranks
        # Contract: add the gradients of wo, wq, wk, wv and ln1 into grads; return dx = dh + the norm's input gradient.
        # The question: module 06's attention-half backward with each linear replaced by its parallel backward.
        # Pitfalls: attention's gradients have a head axis and may not be contiguous: view or reshape to (B, T, -1)?
        #   q, k and v share n1: how many column_parallel_backward calls?
        # Hint 1: the attention half's forward in reverse: o's backward first, then attention's, RoPE's, q/k/v's,
        #       the norm's; which of them communicate?
        # Hint 2: do = o's row-parallel backward of dh (input o); dq, dk, dv = attention's backward; RoPE's backward on
        #       dq and dk; dn1 = the column-parallel backward of the three (input n1, one call); dx_norm, d_ln1 = the
        #       norm's backward; grads.ln1 += d_ln1; dx = dh + dx_norm.
        # Hint 3: do = row_parallel_backward(dh, store["o"], w.wo, grads.wo, tp, sp, "attention out", fused, mm)
        #       dq, dk, dv = self.local.attention.backward(do, store["q"], store["k"], store["v"], store["o"], store["lse"])
        #       dq, dk = rope_backward(dq, cos, sin), rope_backward(dk, cos, sin)  (tables for dq.shape[1])
        #       dn1 = column_parallel_backward([d.reshape(B, T, -1) for d in (dq, dk, dv)], store["n1"],
        #             [w.wq, w.wk, w.wv], [grads.wq, grads.wk, grads.wv], tp, sp, "attention in", fused, mm)
        #       dx_norm, d_ln1 = rmsnorm_backward(dn1, store["x"], store["r1"], w.ln1); grads.ln1.add_(d_ln1)
        #       return dh + dx_norm
        do = row_parallel_backward(dh, store["o"], w.wo, grads.wo, tp, sp, "attention out", fused, mm)
        dq, dk, dv = self.local.attention.backward(do, store["q"], store["k"], store["v"], store["o"], store["lse"])
        batch, seq_len = dq.shape[:2]
        cos, sin = self.local.rope(seq_len, dy.dtype, dy.device)
        dq, dk = rope_backward(dq, cos, sin), rope_backward(dk, cos, sin)
        dn1 = column_parallel_backward([d.reshape(batch, seq_len, -1) for d in (dq, dk, dv)], store["n1"],
                                       [w.wq, w.wk, w.wv], [grads.wq, grads.wk, grads.wv], tp, sp,
                                       "attention in", fused, mm)
        dx_norm, d_ln1 = rmsnorm_backward(dn1, store["x"], store["r1"], w.ln1)
        grads.ln1.add_(d_ln1)
        return dh + dx_norm
        # <<<
