"""Module 12, part 4 - module 06's Llama trained by t ranks in tensor (and sequence) parallel.

    tokens ─ embedding (vocabulary rows) ─ blocks (heads, FFN width) ─ final norm ─ LM head (vocabulary
    rows) ─ vocabulary-parallel cross-entropy, then the same backward in reverse

Every rank of the group sees the same batch (tensor parallelism splits the model, not the data) and
builds module 06's whole model from the seed, then keeps its slices: the sharded model starts
exactly where a single process does, and its losses follow the single-process curve up to the
rounding of sums taken in another order.

Gradients land in main_grad accumulators (module 06's LlamaGrads, in float32 at least), added
inside the weight-gradient GEMMs over the microbatches of a step. After the last microbatch, with
sequence parallelism, the norm weights' partial gradients are summed over the group, once per step.
AdamW is elementwise, so each rank updating its slices is the single process's update, sliced.
Module 06's `fit` trains it: `fit(TPLlama(cfg, tp, ...), steps)`.
"""
from __future__ import annotations

import torch

from course.mesh import Group
from course.splits import check_splits
from .m06_llama_block import LlamaConfig
from .m06_llama_model import LlamaGrads, LlamaModel, microbatches, real_tokens
from .m06_llama_ops import ATTENTION_CHUNK, rmsnorm_backward, rmsnorm_forward
from .m12_tp_block import TPBlock, shard_block_weights, sum_norm_grads, zero_grads
from .m12_tp_linear import column_parallel_backward, column_parallel_forward, grad_dtype
from .m12_vocab_parallel import (embedding_backward, embedding_forward, padded_vocab_size, vocab_parallel_cross_entropy,
                                 vocab_rows)


# The module's model: module 06's defaults but 8 query and 4 key/value heads of 8, so that t = 4 ranks
# can split the key/value heads too (and t = 2, 4 the FFN's 176 units and the 64 positions).
CONFIG = LlamaConfig(dim=64, n_heads=8, n_kv_heads=4, head_dim=8, ffn_dim=176, n_layers=2, max_seq_len=64)


class TPLlama:
    """This rank's slices of module 06's Llama, their main_grad accumulators, and the block that runs them."""

    def __init__(self, cfg: LlamaConfig, tp: Group, seed: int = 0, dtype=torch.float32, sequence_parallel: bool = False,
                 vocab_divisible_by: int = 1, fused: bool = True, attention_chunk: int = ATTENTION_CHUNK):
        check_splits(cfg, {"t": tp.size})
        whole = LlamaModel(cfg, seed, dtype)  # every rank builds the same model, then keeps its slices
        self.cfg, self.tp, self.sequence_parallel = cfg, tp, sequence_parallel
        self.padded_vocab = padded_vocab_size(cfg.vocab_size, tp.size, vocab_divisible_by)
        self.embedding = vocab_rows(whole.embedding, self.padded_vocab, tp)
        self.blocks = [shard_block_weights(b, cfg, tp) for b in whole.blocks]
        self.final_norm = whole.final_norm.clone()
        self.lm_head = vocab_rows(whole.lm_head, self.padded_vocab, tp)
        self.block = TPBlock(cfg, tp, sequence_parallel, attention_chunk, fused)
        accumulate_in = grad_dtype(dtype)
        self.grads = LlamaGrads(torch.zeros_like(self.embedding, dtype=accumulate_in),
                                [zero_grads(b, accumulate_in) for b in self.blocks],
                                torch.zeros_like(self.final_norm, dtype=accumulate_in),
                                torch.zeros_like(self.lm_head, dtype=accumulate_in))

    def parameters(self) -> list[torch.Tensor]:
        """This rank's slices, in the order of LlamaGrads.tensors()."""
        return [self.embedding, *(t for b in self.blocks for t in b.tensors()), self.final_norm, self.lm_head]

    def norm_grads(self) -> list[torch.Tensor]:
        """The accumulators of every norm weight: partial over the sequence with sequence parallelism."""
        return [*(t for b in self.grads.blocks for t in (b.ln1, b.ln2)), self.grads.final_norm]

    def forward_backward(self, tokens: torch.Tensor, targets: torch.Tensor,
                         n_tokens: int | None = None) -> torch.Tensor:
        """The loss of tokens (B, T) against targets (B, T) (the same on every rank), summed over the real
        targets and divided by n_tokens (module 06's convention; default: their count); its gradient is
        *added* into self.grads."""
        cfg, tp, sp = self.cfg, self.tp, self.sequence_parallel
        cfg.check_seq_len(tokens.shape[1])
        check_splits(cfg, {"t": tp.size}, seq_len=tokens.shape[1], sequence_parallel=sp)
        stores = [self.block.new_store() for _ in self.blocks]
        # >>> TODO(m12): the forward and the loss, every piece tensor-parallel
        # Contract: name the last block's output x, the final norm's (n, r), the LM head's local logits
        #   (B, T, V'/t) `logits`, and keep the loss and dlogits (the gradient of the loss, divided by n_tokens) from
        #   vocab_parallel_cross_entropy; the backward TODO reads them. n_tokens goes to the loss as it is.
        # The question: module 06's forward with each piece replaced by its tensor-parallel one: which, and with
        #   what shapes in and out?
        # Pitfalls: the LM head is column-parallel (vocabulary rows): is its input the stream's layout or the whole
        #   sequence? What shapes does the loss take? Is the vocabulary the real one or the padded one?
        # Hint 1: module 06's forward_backward, piece by piece: which module 12 function replaces each?
        # Hint 2: the embedding (vocabulary rows), each block's forward with its own store, the final RMSNorm on the
        #       stream's layout, the LM head as a column-parallel linear (whole sequence out), the loss on (N, V'/t)
        #       logits and (N,) targets with the real vocabulary cfg.vocab_size.
        # Hint 3: x = embedding_forward(tokens, self.embedding, tp, sp); x = self.block.forward(w, x, store) per block
        #       n, r = rmsnorm_forward(x, self.final_norm, cfg.norm_eps)
        #       (logits,) = column_parallel_forward(n, [self.lm_head], tp, sp, "lm head")
        #       loss, dlogits = vocab_parallel_cross_entropy(logits.reshape(-1, V'/t), targets.reshape(-1),
        #                                                    cfg.vocab_size, tp, n_tokens)
        x = embedding_forward(tokens, self.embedding, tp, sp)
        for w, store in zip(self.blocks, stores, strict=True):
            x = self.block.forward(w, x, store)
        n, r = rmsnorm_forward(x, self.final_norm, cfg.norm_eps)
        (logits,) = column_parallel_forward(n, [self.lm_head], tp, sp, "lm head")
        loss, dlogits = vocab_parallel_cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                                     cfg.vocab_size, tp, n_tokens)
        # <<<
        # >>> TODO(m12): the backward of the whole model, into self.grads
        # Contract: every accumulator of self.grads grows by its gradient; each store is cleared after its block's
        #   backward; return the loss.
        # The question: the forward in reverse: which backward for each piece, and into which accumulator?
        # Pitfalls: is the final norm's gradient added or assigned, and is it summed over the group here (it is
        #   partial with sequence parallelism; train_step sums it once per step)?
        # Hint 1: each forward call above has a backward in module 12 or module 06: in which order do they run?
        # Hint 2: the LM head's column-parallel backward (dlogits back in (B, T, V'/t), input n, into
        #       self.grads.lm_head), the final norm's backward (its gradient added), each block's backward from the
        #       last (its store cleared after), the embedding's backward.
        # Hint 3: dn = column_parallel_backward([dlogits.view_as(logits)], n, [self.lm_head], [self.grads.lm_head],
        #             tp, sp, "lm head", self.block.fused)
        #       dx, d_final = rmsnorm_backward(dn, x, r, self.final_norm); self.grads.final_norm.add_(d_final)
        #       for layer from the last: dx = self.block.backward(self.blocks[layer], dx, stores[layer],
        #             self.grads.blocks[layer]); stores[layer].clear()
        #       embedding_backward(dx, tokens, self.grads.embedding, tp, sp); return loss
        fused = self.block.fused
        dn = column_parallel_backward([dlogits.view_as(logits)], n, [self.lm_head], [self.grads.lm_head], tp, sp,
                                      "lm head", fused)
        dx, d_final_norm = rmsnorm_backward(dn, x, r, self.final_norm)
        self.grads.final_norm.add_(d_final_norm)
        for layer in reversed(range(len(self.blocks))):
            dx = self.block.backward(self.blocks[layer], dx, stores[layer], self.grads.blocks[layer])
            stores[layer].clear()
        embedding_backward(dx, tokens, self.grads.embedding, tp, sp)
        return loss
        # <<<

    def train_step(self, tokens: torch.Tensor, targets: torch.Tensor, n_microbatches: int, optimizer) -> float:
        """One optimizer step on the global batch (the same on every rank: tensor parallelism splits the
        model, not the data), in n_microbatches; returns the step's mean loss."""
        # >>> TODO(m12): one optimizer step over the microbatches
        # Contract: the step's gradient is that of the mean loss over the real tokens of the whole batch; the
        #   optimizer reads each parameter's .grad (self.grads.tensors() is in parameters()' order), which must
        #   have the parameter's dtype, while the accumulators are float32 at least (bf16 weights). Return the
        #   step's mean loss, a float.
        # The question: what does a step do to the accumulators before, between and after the microbatches, and
        #   what does each microbatch's loss divide by?
        # Pitfalls: how often are the norm gradients summed over the group (sum_norm_grads with self.norm_grads())?
        #   Does a microbatch divide by its own real tokens or by the whole batch's? What dtype must .grad have?
        # Hint 1: module 06's LlamaModel.train_step: which two things does tensor parallelism add to it?
        # Hint 2: n_tokens = the real tokens of the whole batch, counted once; accumulators zeroed; each
        #       microbatch's forward_backward with that n_tokens (their losses add up to the step's mean); the norm
        #       gradients summed once after the last; each .grad its accumulator cast to the parameter's dtype; step.
        # Hint 3: n_tokens = real_tokens(targets); for g in self.grads.tensors(): g.zero_()
        #       loss = sum(self.forward_backward(tok, tgt, n_tokens).item() for tok, tgt in microbatches(tokens,
        #              targets, n_microbatches))
        #       sum_norm_grads(self.norm_grads(), self.tp, self.sequence_parallel)
        #       for p, g in zip(self.parameters(), self.grads.tensors()): p.grad = g.to(p.dtype)
        #       optimizer.step(); return loss
        n_tokens = real_tokens(targets)
        for g in self.grads.tensors():
            g.zero_()
        loss = 0.0
        for tok, tgt in microbatches(tokens, targets, n_microbatches):
            loss += self.forward_backward(tok, tgt, n_tokens).item()
        sum_norm_grads(self.norm_grads(), self.tp, self.sequence_parallel)
        for p, g in zip(self.parameters(), self.grads.tensors(), strict=True):
            p.grad = g.to(p.dtype)
        optimizer.step()
        return loss
        # <<<
