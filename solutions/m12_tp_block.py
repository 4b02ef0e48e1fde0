"""Module 12, part 2 - module 06's block on t ranks: attention split by heads, the FFN by its width.

    residual x ─ RMSNorm ─ enter ─ q, k, v (column) ─ RoPE, attention ─ o (row) ─ leave ─ + ─ h
    h ─ RMSNorm ─ enter ─ gate, up (column) ─ SwiGLU ─ down (row) ─ leave ─ + ─ y

The rank at place i_t of the group (`tp.index`) keeps query heads [i_t H/t, (i_t+1) H/t) and
key/value heads [i_t K/t, (i_t+1) K/t): exactly the key/value heads its query heads read (query
head h reads key/value head h // (H / K)), so attention needs no communication at all. The FFN
keeps hidden units [i_t F/t, (i_t+1) F/t): SwiGLU is elementwise. Each half of the block is one
enter/leave pair (m12_tp_linear), and its collectives are the pair's. The norms and residual adds
run on the whole stream, replicated, or with sequence parallelism on this rank's T/t positions,
which divides their activation memory by t.

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
    """This rank's slices of a whole block's weights (copies, contiguous, so the whole block can go).

    Column-parallel wq, wk, wv, w_gate, w_up: rank i_t's contiguous block of rows (output features);
    row-parallel wo, w_down: its contiguous block of columns (input features). The norm weights are
    whole on every rank.
    """
    # >>> TODO(m12): slice a block's weights for rank tp.index of tp.size
    # Contract: rank i_t = tp.index holds query heads [i_t H/t, (i_t+1) H/t), key/value heads [i_t K/t,
    #   (i_t+1) K/t) and FFN units [i_t F/t, (i_t+1) F/t); a head is head_dim consecutive rows of wq/wk/wv (columns of wo). Shapes:
    #   wq (H/t D, dim), wk and wv (K/t D, dim), wo (dim, H/t D), w_gate and w_up (F/t, dim), w_down (dim, F/t).
    # Pitfalls: the key/value slice is not the query slice: with grouped-query attention K < H, and the
    #   key/value heads a rank needs are the ones its query heads read. A column slice is not contiguous.
    # Hint 1: each weight is cut into t equal blocks along one axis; rank i_t takes block i_t.
    # Hint 2: rows for the column-parallel weights (chunk(t, dim=0)), columns for the row-parallel ones (dim=1).
    # Hint 3: BlockWeights(ln1=..., wq=rows of wq, ..., wo=columns of wo, ...), each .clone(memory_format=
    #       torch.contiguous_format).
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
    """With sequence parallelism each rank normed only its T/t positions, so its norm weights'
    gradients are partial sums: add them up over the group, in place, in one all-reduce. Without
    it, every rank normed every position and its gradients are already whole: nothing to do."""
    # >>> TODO(m12): sum the norm weights' gradients over the group (sequence parallelism only)
    # Contract: afterwards every rank holds, in each tensor of norm_grads, the sum over the group of the ranks'
    #   tensors; one collective for all of them (they are tiny: one latency, not one per tensor).
    # Pitfalls: it is a sum over positions, not a mean: no 1/t. Without sequence parallelism a sum would make
    #   them t times too big.
    # Hint 1: pack them into one flat tensor (torch.cat of the flattened tensors), all-reduce it, copy back.
    # Hint 2: tp.collectives.all_reduce sums a tensor in place (label it "norm grads"); splitting the flat sum by
    #       the tensors' sizes gives their pieces back, to copy into them.
    # Hint 3: return at once without sequence parallelism; else flat = cat of the flattened gradients; all-reduce;
    #       for each gradient and its piece of flat: copy the piece (viewed in the gradient's shape) into it.
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
        # >>> TODO(m12): the attention half: norm, column-parallel q/k/v, RoPE, attention on this rank's heads
        # Contract: save in the store what the backward reads, under module 06's names: 'x', 'n1', 'r1', 'q', 'k',
        #   'v' (q and k after RoPE), 'o', 'lse'. q is (B, T, H/t, head_dim), k and v (B, T, K/t, head_dim), all
        #   T positions; x, n1 and r1 stay in the residual stream's layout (T/t positions with sequence parallelism).
        # Pitfalls: 'n1' is the norm's output as this rank has it, not the gathered one: keeping the gathered
        #   input would cost t times the memory (the backward gathers it again). The head count is H/t, not H.
        #   Every linear, here and below, takes the block's policy mm as its last argument (module 09's seam).
        # Hint 1: module 06's attention_half, with column_parallel_forward(n1, [wq, wk, wv], tp, sp, label, mm)
        #       where it multiplied; the attention and RoPE ops are module 06's, the tables from self.local.rope(T, ...).
        # Hint 2: view the projections as (B, T, -1, head_dim): the -1 is this rank's head count.
        # Hint 3: n1, r1 = the norm of x; q, k, v = the column-parallel forward of n1; T = q's second size; RoPE on q
        #       and k (tables for T); o, lse = self.local.attention.forward(q, k, v); save the eight names.
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
        # >>> TODO(m12): the FFN half: row-parallel o, residual + norm, column-parallel gate/up, SwiGLU, row-parallel down
        # Contract: return y = h + down(SwiGLU(...)) in x's layout; save 'h', 'n2', 'r2', 'g', 'u', 's' (g, u, s:
        #   (B, T, F/t); h, n2, r2 in the residual stream's layout).
        # Pitfalls: the residual add needs the *summed* attention output in x's layout: that is what the row-
        #   parallel linear's leave gives; adding a partial product gives a wrong h on every rank.
        # Hint 1: module 06's ffn_half and forward, with row_parallel_forward for o and down and
        #       column_parallel_forward(n2, [w_gate, w_up], ...) for gate and up.
        # Hint 2: residual_rmsnorm_forward(x, the o projection's output, ln2, eps) gives h, n2, r2 in x's layout;
        #       swiglu_forward(g, u) gives s.
        # Hint 3: h, n2, r2 from the residual norm; g, u column-parallel from n2; s = SwiGLU; save the six names;
        #       return h + the row-parallel down projection of s.
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
        # >>> TODO(m12): backward of the FFN half: down (row), SwiGLU, gate/up (column), residual + norm
        # Contract: add the gradients of w_down, w_gate, w_up and ln2 into grads; name the residual stream's
        #   gradient after the norm dh (the attention half's TODO uses it).
        # Pitfalls: labels: give each linear's backward the label of its forward, so the collectives log names them.
        #   ln2's gradient is added into grads.ln2, not assigned: microbatches accumulate.
        # Hint 1: module 06's backward, with row_parallel_backward for down, column_parallel_backward for
        #       [gate, up] (one call: they share n2), and residual_rmsnorm_backward as before.
        # Hint 2: the linears' backwards take the main_grad accumulators (grads.w_down, ...), fused and mm last;
        #       swiglu_backward(ds, g, u) gives dg, du.
        # Hint 3: ds = row-parallel backward of dy through down (input s); dg, du; dn2 = column-parallel backward of
        #       [dg, du] (input n2); dh, d_ln2 = residual_rmsnorm_backward(dy, dn2, h, r2, ln2); add d_ln2.
        ds = row_parallel_backward(dy, store["s"], w.w_down, grads.w_down, tp, sp, "ffn out", fused, mm)
        dg, du = swiglu_backward(ds, store["g"], store["u"])
        dn2 = column_parallel_backward([dg, du], store["n2"], [w.w_gate, w.w_up], [grads.w_gate, grads.w_up], tp,
                                       sp, "ffn in", fused, mm)
        dh, d_ln2 = residual_rmsnorm_backward(dy, dn2, store["h"], store["r2"], w.ln2)
        grads.ln2.add_(d_ln2)
        # <<<
        # >>> TODO(m12): backward of the attention half: o (row), attention, RoPE, q/k/v (column), norm
        # Contract: add the gradients of wo, wq, wk, wv and ln1 into grads; return dx = dh + the norm's input gradient.
        # Pitfalls: attention's gradients have a head axis and may not be contiguous: reshape (not view) them to
        #   (B, T, -1) for the projections. q, k and v share n1: one column_parallel_backward for the three.
        # Hint 1: module 06's backward again: row_parallel_backward for o, self.local.attention.backward, rope_backward
        #       for dq and dk, column_parallel_backward([dq, dk, dv], n1, [wq, wk, wv], ...), rmsnorm_backward.
        # Hint 2: attention's backward takes (do, q, k, v, o, lse) from the store; the rope tables are for the whole
        #       sequence (dq's second size), as in the forward.
        # Hint 3: do = row-parallel backward of dh through o; dq, dk, dv; un-rotate dq, dk; dn1 = column-parallel
        #       backward of the three, reshaped to (B, T, -1); dx_norm, d_ln1 = rmsnorm_backward; add d_ln1;
        #       return dh + dx_norm.
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
