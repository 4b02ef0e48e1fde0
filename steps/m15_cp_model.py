# Generated from solutions/m15_cp_model.py by `python -m course.skeleton`: fill in the TODOs.
# Grade your work with `python main.py grade 15`. (skeleton 980bece385a2)
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
targets: padding, IGNORE_INDEX, is no token), as one process computes it on the whole batch, and the
gradients are those of that loss. Context ranks hold different tokens of the same sequences, so
their weight gradients are partial sums like the data ranks': every gradient is summed over the d c
ranks (the "dc" group), in one all-reduce here, `sum_over_data_and_context`; module 14's data
parallelism replaces it with its bucketed, overlapped version. Module 06's `fit` trains the model:
`fit(CPLlama(cfg, mesh, variant), steps)`.
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
        sequence (c seq_len positions, cut by the layout); built once per length, dtype and device (given)."""
        key = (seq_len, dtype, str(device))
        if key not in self._rope:
            # The rank's positions in the whole sequence: on a zig-zag rank two runs far apart.
            layout = SequenceLayout(self.layout_kind, seq_len * self.group.size, self.group.size)
            self._rope[key] = rope_tables_at(layout.positions(self.group.index), self.cfg.head_dim,
                                             self.cfg.rope_theta, dtype, device)
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
        # TODO(m15): one step: this rank's share of the batch, the step's mean loss and its gradient over d x c
        # Contract: the gradient handed to the optimizer (each parameter's .grad, in its dtype) is that of the step's
        #   mean loss: the sum of the cross-entropies of the global batch's real tokens (targets != IGNORE_INDEX)
        #   divided by their count, as one process computes it on the whole batch; the returned float is that loss,
        #   the same on every rank. This rank runs self.forward_backward on each of n_microbatches slices (module
        #   06's microbatches) of its share (self.share of tokens and targets); the gradients are added up in their
        #   compute dtype (compute_dtype: float32 at least, also for a bf16 model) and summed over the d x c ranks
        #   (self.mesh.group("d", "c")) with sum_over_data_and_context, the loss in an all-reduce of its own (label
        #   "loss"); then the optimizer steps. The tests pad the batch unevenly (every rank's microbatches hold
        #   different numbers of real tokens) and compare with one process on the whole batch, and read the dtype
        #   of the sums off the log in a bf16 step.
        # Maths: module 06's forward_backward(tokens, targets, n_tokens) returns the summed loss of the tokens it is
        #   given divided by n_tokens, and that loss's gradients; by default n_tokens is their own real count. The
        #   step's mean loss is Σ ℓ_j / N_real over the whole batch's real tokens.
        # Question: which n_tokens makes the pieces' losses and gradients, added over the microbatches and the d c
        #   ranks, exactly the step's mean and its gradient?
        # Pitfalls: what does a piece's own mean, summed over d c ranks and m microbatches, amount to? Would an
        #   average of the pieces' means still be right when the pieces hold different numbers of real tokens? In
        #   which dtype does a bf16 model's gradient sum run?
        raise NotImplementedError("TODO(m15): one step: this rank's share of the batch, the step's mean loss and its gradient over d x c")
