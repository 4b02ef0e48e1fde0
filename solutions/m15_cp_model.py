"""Module 15, part 5 - module 06's Llama over a d x c mesh: batch rows over d, positions over c.

    rank (i_d, i_c) holds rows [i_d B/d, (i_d + 1) B/d) of the global batch and, of each of those
    sequences, the positions its layout gives context rank i_c

Everything in the model but attention works token by token, so a context rank runs module 06's
model unchanged on its own tokens: module 06's LlamaModel, whose block is module 06's LlamaBlock
with two things swapped in. Attention is one of this module's (ring, all-gather KV, Ulysses): the
block already calls it through its `attention` object. RoPE rotates by the tokens' positions in the
whole sequence, which on a zig-zag rank are two runs far apart: CPBlock overrides the block's
`rope` tables with those of the rank's own positions.

The loss is the mean over the step's *real* tokens (module 06's `real_tokens` of the global
targets: padding, IGNORE_INDEX, is no token), on all d c ranks together: each rank adds its tokens'
losses and divides by that one global count, and the gradients are summed over the d c ranks (the
"dc" group), never averaged. Dividing by a rank's own token count instead and summing gives a loss
and gradients d c times too large; averaging the ranks' means hides the mistake only while every
rank has the same number of real tokens. The sum over "dc" is one all-reduce here,
`sum_over_data_and_context`; module 14's data parallelism replaces it with its bucketed, overlapped
version. Module 06's `fit` trains the model: `fit(CPLlama(cfg, mesh, variant), steps)`.
"""
from __future__ import annotations

import torch

from course.mesh import Group, Mesh
from .m06_llama_block import LlamaBlock, LlamaConfig
from .m06_llama_model import LOSS_CHUNK, LlamaModel, microbatches, real_tokens
from .m06_llama_ops import ATTENTION_CHUNK, compute_dtype, rope_tables_at
from .m15_allgather_kv import AllGatherKVAttention
from .m15_layout import SequenceLayout, check_layout
from .m15_ring_attention import RingAttention
from .m15_ulysses import UlyssesAttention, check_ulysses

# The module's model: 4 query and 2 key/value heads (Ulysses: c up to 4), a sequence of 32 (zig-zag: c up to 16).
CONFIG = LlamaConfig(dim=32, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=64, n_layers=2, max_seq_len=32)

# variant -> (attention, layout): what `python main.py run 15 --variant` picks.
VARIANTS = {"ring": (RingAttention, "contiguous"), "zigzag": (RingAttention, "zigzag"),
            "allgather": (AllGatherKVAttention, "zigzag"), "ulysses": (UlyssesAttention, "contiguous")}


def check_cp(cfg: LlamaConfig, variant: str, c: int, seq_len: int, d: int = 1, batch: int | None = None):
    """One line for a variant, mesh or shape this model cannot run (given)."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}: one of {', '.join(VARIANTS)}")
    check_layout(VARIANTS[variant][1], seq_len, c)
    if variant == "ulysses":
        check_ulysses(cfg.n_heads, cfg.n_kv_heads, c)
    if batch is not None and batch % d:
        raise ValueError(f"the batch of {batch} sequences is not divisible by d={d}: every data rank takes B/d of them")


def context_attention(variant: str, group: Group, chunk: int = ATTENTION_CHUNK):
    """The attention object of `variant` over the context group."""
    attention, layout = VARIANTS[variant]
    return attention(group, layout, chunk)


class CPBlock(LlamaBlock):
    """Module 06's block on one context rank: this module's attention, RoPE at the rank's positions."""

    def __init__(self, cfg: LlamaConfig, group: Group, layout: str, attention):
        super().__init__(cfg, attention=attention)
        self.group, self.layout_kind = group, layout

    def rope(self, seq_len: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for this rank's seq_len tokens, rotating each by its position in the whole
        sequence (c seq_len positions, cut by the layout); built once per length, dtype and device."""
        key = (seq_len, dtype, str(device))
        if key not in self._rope:
            # >>> TODO(m15): the RoPE tables of this rank's positions
            # Contract: store in self._rope[key] what module 06's LlamaBlock.rope would return for a sequence whose
            #   positions are this rank's (the block calls self.rope with its local length, seq_len = T/c): cos and
            #   sin, each (seq_len, 1, head_dim // 2), row j for the position of local token j.
            # Pitfall: positions 0 .. T/c - 1 are right on context rank 0 of the contiguous layout only; on a zig-zag
            #   rank the positions are two runs far apart. The tests train every variant against one process.
            # Hint 1: the layout of the whole sequence says where this rank's tokens sit; module 06 has tables for
            #         given positions.
            # Hint 2: SequenceLayout(self.layout_kind, seq_len * self.group.size, self.group.size).positions(
            #         self.group.index); rope_tables_at(positions, head_dim, rope_theta, dtype, device).
            # Hint 3: positions = the layout's positions of this rank
            #         self._rope[key] = rope_tables_at(positions, cfg.head_dim, cfg.rope_theta, dtype, device)
            layout = SequenceLayout(self.layout_kind, seq_len * self.group.size, self.group.size)
            self._rope[key] = rope_tables_at(layout.positions(self.group.index), self.cfg.head_dim,
                                             self.cfg.rope_theta, dtype, device)
            # <<<
        return self._rope[key]


def sum_over_data_and_context(tensors: list[torch.Tensor], group: Group, label: str = "gradients"):
    """Sum each tensor over the ranks of `group` (the d x c ranks), in place, in one all-reduce of one
    flat buffer (given; module 14 replaces it with buckets that overlap the backward)."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    group.collectives.all_reduce(flat, label=label)
    for t, summed in zip(tensors, flat.split([t.numel() for t in tensors]), strict=True):
        t.copy_(summed.view_as(t))


class CPLlama(LlamaModel):
    """Module 06's Llama on one rank of a d x c mesh: the whole model's weights (every rank builds the
    same from the seed), this rank's rows and positions of every batch."""

    def __init__(self, cfg: LlamaConfig, mesh: Mesh, variant: str, seed: int = 0, dtype=torch.float32,
                 chunk: int = ATTENTION_CHUNK, loss_chunk: int = LOSS_CHUNK):
        check_cp(cfg, variant, mesh.sizes.get("c", 1), cfg.max_seq_len)
        group = mesh.group("c")
        block = CPBlock(cfg, group, VARIANTS[variant][1], context_attention(variant, group, chunk))
        super().__init__(cfg, seed, dtype, block=block, loss_chunk=loss_chunk)
        self.mesh, self.variant = mesh, variant

    def layout(self, seq_len: int) -> SequenceLayout:
        c = self.mesh.group("c").size
        return SequenceLayout(VARIANTS[self.variant][1], seq_len, c)

    def share(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's part of a global batch x (B, T): its B/d rows, and of those its positions (given)."""
        d = self.mesh.group("d")
        rows = x.shape[0] // d.size
        return self.layout(x.shape[1]).shard(x[d.index * rows:(d.index + 1) * rows], self.mesh.group("c").index)

    def train_step(self, tokens: torch.Tensor, targets: torch.Tensor, n_microbatches: int, optimizer) -> float:
        """One optimizer step on the global batch tokens, targets (B, T), the same on every rank; returns
        the step's mean loss over its real tokens (the same on every rank). What module 06's `fit` calls."""
        # >>> TODO(m15): one step: this rank's share, every piece divided by the step's real tokens, the sum over d x c
        # Contract: the gradient handed to the optimizer (each parameter's .grad, in its dtype) is that of the step's
        #   mean loss: the sum of the losses of the global batch's real tokens (targets != IGNORE_INDEX) divided by
        #   their count; the returned float is that loss. This rank runs self.forward_backward on each of
        #   n_microbatches slices of its share (self.share of the batch, cut along the rows); then the gradients
        #   and the loss are summed over the d x c ranks (self.mesh.group("d", "c")): the gradients with
        #   sum_over_data_and_context, the loss in an all-reduce of its own (label "loss"). Then the optimizer steps.
        # Maths: module 06's forward_backward(tokens, targets, n_tokens) divides the summed loss of the tokens it is
        #   given (and so its gradients) by n_tokens, by default their own real count. Which count makes the pieces'
        #   losses and gradients, summed over the microbatches and the d c ranks, the step's mean and its gradient?
        # Pitfalls: a piece's own mean, summed over d c ranks, is d c times too large; averaging the pieces' means
        #   (1 / (m d c) each) is right only while every piece holds as many real tokens as the others, which
        #   padding breaks: the tests pad the batch unevenly and compare with one process on the whole batch.
        #   Accumulate in the gradients' compute dtype (compute_dtype), not in place in the LlamaGrads.
        # Hint 1: count the real tokens of the whole batch once; take this rank's share; for each microbatch,
        #         forward_backward with that count and add its loss and gradients up; one sum over "dc" for the
        #         gradients and one for the loss; .grad; step.
        # Hint 2: real_tokens(targets), before self.share; microbatches(tok, tgt, n_microbatches) cuts the rows;
        #         grads.tensors() is in parameters()'s order; self.mesh.group("d", "c").collectives.all_reduce(loss,
        #         label="loss").
        # Hint 3: n_tokens = real_tokens(targets);  tok, tgt = self.share(tokens), self.share(targets)
        #         acc = zeros like each parameter, in compute_dtype;  loss = zero scalar (compute dtype)
        #         for each microbatch: part, grads = forward_backward(tok_m, tgt_m, n_tokens)
        #             loss += part;  each acc += its gradient
        #         sum acc over "dc"; all-reduce loss over "dc"; p.grad = acc in p's dtype; step; return loss.item()
        dc = self.mesh.group("d", "c")
        n_tokens = real_tokens(targets)  # of the whole global batch: every piece divides by the same count
        tok, tgt = self.share(tokens), self.share(targets)
        params = self.parameters()
        acc = [torch.zeros(p.shape, dtype=compute_dtype(p.dtype), device=p.device) for p in params]
        loss = torch.zeros((), dtype=compute_dtype(self.embedding.dtype))
        for tok_m, tgt_m in microbatches(tok, tgt, n_microbatches):
            part, grads = self.forward_backward(tok_m, tgt_m, n_tokens)
            loss += part
            for a, g in zip(acc, grads.tensors(), strict=True):
                a.add_(g)
        sum_over_data_and_context(acc, dc)
        dc.collectives.all_reduce(loss, label="loss")
        for p, a in zip(params, acc, strict=True):
            p.grad = a.to(p.dtype)
        optimizer.step()
        return loss.item()
        # <<<
