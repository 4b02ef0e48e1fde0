# Generated from solutions/m12_tp_model.py by `python -m course.skeleton`: fill in the TODOs.
# Grade your work with `python main.py grade 12`. (skeleton dec4c9ca1cb3)
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
"""
from __future__ import annotations

import torch

from course.dataset import load_text, random_batch
from .m06_llama_block import LlamaConfig
from .m06_llama_model import LlamaGrads, LlamaModel
from .m06_llama_ops import ATTENTION_CHUNK, rmsnorm_backward, rmsnorm_forward
from .m12_tp_block import TPBlock, check_tp_size, shard_block_weights, sum_norm_grads, zero_grads
from .m12_tp_linear import TPGroup, column_parallel_backward, column_parallel_forward, grad_dtype
from .m12_vocab_parallel import (embedding_backward, embedding_forward, padded_vocab_size, vocab_parallel_cross_entropy,
                                 vocab_rows)


# The module's model: module 06's defaults but 8 query and 4 key/value heads of 8, so that t = 4 ranks
# can split the key/value heads too (and t = 2, 4 the FFN's 176 units and the 64 positions).
CONFIG = LlamaConfig(dim=64, n_heads=8, n_kv_heads=4, head_dim=8, ffn_dim=176, n_layers=2, max_seq_len=64)


class TPLlama:
    """This rank's slices of module 06's Llama, their main_grad accumulators, and the block that runs them."""

    def __init__(self, cfg: LlamaConfig, tp: TPGroup, seed: int = 0, dtype=torch.float32, vocab_divisible_by: int = 1,
                 fused: bool = True, attention_chunk: int = ATTENTION_CHUNK):
        check_tp_size(cfg, tp.size)
        whole = LlamaModel(cfg, seed, dtype)  # every rank builds the same model, then keeps its slices
        self.cfg, self.tp = cfg, tp
        self.padded_vocab = padded_vocab_size(cfg.vocab_size, tp.size, vocab_divisible_by)
        self.embedding = vocab_rows(whole.embedding, self.padded_vocab, tp.rank, tp.size)
        self.blocks = [shard_block_weights(b, cfg, tp.rank, tp.size) for b in whole.blocks]
        self.final_norm = whole.final_norm.clone()
        self.lm_head = vocab_rows(whole.lm_head, self.padded_vocab, tp.rank, tp.size)
        self.block = TPBlock(cfg, tp, attention_chunk, fused)
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

    def forward_backward(self, tokens: torch.Tensor, targets: torch.Tensor, grad_scale: float = 1.0) -> torch.Tensor:
        """The loss of tokens (B, T) against targets (B, T) (the same on every rank); the gradient of
        grad_scale * loss is *added* into self.grads."""
        cfg, tp = self.cfg, self.tp
        cfg.check_seq_len(tokens.shape[1])
        if tp.sequence_parallel:
            check_tp_size(cfg, tp.size, tokens.shape[1])
        stores = [self.block.new_store() for _ in self.blocks]
        # TODO(m12): the forward and the loss: embedding, blocks, final norm, LM head, vocabulary-parallel loss
        # Contract: name the last block's output x, the final norm's (n, r), the LM head's local logits
        #   (B, T, V'/t) `logits`, and keep the loss and dlogits (the gradient of grad_scale * loss) from
        #   vocab_parallel_cross_entropy; the backward TODO reads them.
        # Pitfalls: the LM head is column-parallel (vocabulary rows): its input must be the whole sequence, which
        #   column_parallel_forward gathers with sequence parallelism; the loss takes (N, V'/t) and (N,).
        #   The real vocabulary is cfg.vocab_size, not the padded one.
        raise NotImplementedError('TODO(m12): the forward and the loss: embedding, blocks, final norm, LM head, vocabulary-parallel loss')
        # TODO(m12): the backward: LM head, final norm, blocks in reverse, embedding, into self.grads
        # Contract: every accumulator of self.grads grows by its gradient; each store is cleared after its block's
        #   backward; return the loss.
        # Pitfalls: the final norm's gradient is added into self.grads.final_norm (partial with sequence
        #   parallelism, summed once per step by train_step, not here).
        raise NotImplementedError('TODO(m12): the backward: LM head, final norm, blocks in reverse, embedding, into self.grads')

    def train_step(self, tokens: torch.Tensor, targets: torch.Tensor, n_microbatches: int, optimizer) -> float:
        """One optimizer step on the batch, split into n_microbatches; returns the mean of their losses."""
        # TODO(m12): zero the accumulators, accumulate the microbatches, sum the norm gradients, step
        # Contract: the step's gradient is that of the mean loss over the microbatches; the optimizer reads each
        #   parameter's .grad (self.grads.tensors() is in parameters()' order).
        # Pitfalls: the norm gradients are summed over the group once per step, after the last microbatch
        #   (sum_norm_grads with self.norm_grads()). A microbatch's loss gradient is scaled by 1 / n_microbatches.
        raise NotImplementedError('TODO(m12): zero the accumulators, accumulate the microbatches, sum the norm gradients, step')


def train(cfg: LlamaConfig, steps: int, tp: TPGroup, batch: int = 16, n_microbatches: int = 1, lr: float = 3e-3,
          seed: int = 0, dtype=torch.float32, vocab_divisible_by: int = 1, on_step=None):
    """Module 06's `train` on the ranks of `tp`: the same initial model, the same batches (every rank
    draws them all from the seed and uses them all). Returns (model, losses); every rank has the
    same losses. `on_step(step, loss)`, if given, is called after every step."""
    model = TPLlama(cfg, tp, seed, dtype, vocab_divisible_by)
    data, generator = load_text(), torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    for step in range(steps):
        tokens, targets = random_batch(data, batch, cfg.max_seq_len, generator)
        losses.append(model.train_step(tokens, targets, n_microbatches, optimizer))
        if on_step:
            on_step(step, losses[-1])
    return model, losses
