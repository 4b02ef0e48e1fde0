# Generated from solutions/m15_costs.py by `python -m course.skeleton`: fill in the TODOs.
# Grade your work with `python main.py grade 15`. (skeleton 1e0c9d7d022e)
"""Module 15, part 6 - what context parallelism costs one rank: bytes sent, activations kept.

One microbatch on one rank: B / (d m) sequences of T/c tokens, N = B T / (d c m) tokens. Values are
b bytes, statistics (lse, delta, and the ring's gradient accumulators) s bytes. One key/value block
is KV = 2 N K D b bytes (k and v of this rank's tokens). The traffic of a variant is what its
attention objects send, message by message, as course/collectives.py logs them: a send counts its
payload; an all-gather or a reduce-scatter (c - 1) shards; an all-to-all the (c - 1)/c of its input
that goes to other ranks; a ring all-reduce 2 (n - 1)/n of its payload over a group of n. Each
block does the same in every microbatch; once a step the gradients (Ψ values, accumulated in s
bytes) and the loss (s bytes) are all-reduced over the d c ranks ("dc").

DeepSpeed-Ulysses (`adjoint=True`) keeps the head-sharded q, k, v, o and lse of its forward, sends
no lse, and leaves its backward to autograd, through all-to-alls whose backward is the reverse
all-to-all (chapter 15), where module 15's UlyssesAttention re-shards what its backward reads.

Activations. The block keeps module 06's fourteen tensors for this rank's N tokens: exactly one
process's store for a sequence c times shorter. The attention's transient buffers (not kept) are
two KV blocks for the ring (the one in hand, the one arriving), c of them for the all-gather, and
the head-sharded q, k, v, o (N (2H + 2K') D b) for Ulysses.
"""
from __future__ import annotations

import torch

from course.costs import StepCost
from .m06_llama_block import LlamaConfig
from .m06_llama_ops import compute_dtype
from .m15_ulysses import kv_copies


def parameter_count(cfg: LlamaConfig) -> int:
    """Ψ: embedding, L blocks, final norm, LM head (given)."""
    M, F, kv = cfg.dim, cfg.ffn_dim, cfg.n_kv_heads * cfg.head_dim
    block = 2 * M + M * M + 2 * kv * M + M * M + 3 * F * M
    return 2 * cfg.vocab_size * M + cfg.n_layers * block + M


def cp_traffic(cfg: LlamaConfig, batch: int, seq_len: int, dtype: torch.dtype, c: int, variant: str, d: int = 1,
               n_microbatches: int = 1, adjoint: bool = False) -> StepCost:
    """What one rank of a d x c mesh sends in one optimizer step of module 15's model (variant "ring",
    "zigzag", "allgather" or "ulysses"), on a global batch of (batch, seq_len) tokens in `dtype`, split
    into n_microbatches: StepCost.sent and .calls by (axis, collective), as course/costs.py reads them
    off the log ("c" for attention, "dc" for the gradients and the loss). adjoint: Ulysses as
    DeepSpeed runs it (the module docstring), not as module 15's UlyssesAttention does."""
    b, s = dtype.itemsize, compute_dtype(dtype).itemsize
    tokens = batch // (d * n_microbatches) * (seq_len // c)  # N, one rank's tokens in one microbatch
    H, K, D, L, m = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.n_layers, n_microbatches
    kv, dkv = 2 * tokens * K * D * b, 2 * tokens * K * D * s
    n = d * c  # the "dc" group
    dc_sent = 2 * (n - 1) / n * (parameter_count(cfg) + 1) * s  # the gradients, accumulated in s bytes, and the loss
    # TODO(m15): the bytes and calls of one step, per variant
    # Contract: a StepCost whose sent[(axis, op)] holds the bytes one rank sends in one step and
    #   whose calls[(axis, op)] the collectives it issues (receives are not counted), exactly as the log of a real step
    #   counts them (the tests compare with real steps of every variant on c = 2, and with hand counts for c = 4
    #   and c = 1, float32 and bf16): ("c", "send") for the ring and zigzag, ("c", "all_gather") and ("c",
    #   "reduce_scatter") for the all-gather, ("c", "all_to_all") for Ulysses (module 15's, or with adjoint
    #   DeepSpeed's), and always ("dc", "all_reduce"): 2 calls, dc_sent bytes (above). A group of one still logs
    #   its collectives (0 bytes each).
    # Maths: the module docstring's definitions (KV, N, b, s, what each collective sends); every block does the
    #   same in every microbatch.
    # Question: what do your own forward and backward of each variant send, message by message, in one block and
    #   microbatch, and in which dtype? And DeepSpeed's backward, knowing that autograd runs the adjoint of each of
    #   its forward's all-to-alls, an all-to-all of the same size the other way?
    # Pitfalls: how many hops does an accumulator make, and does a ring of one send anything? In which dtype do the
    #   ring's accumulators and the all-gather's gradients travel? Which of DeepSpeed's forward all-to-alls does its
    #   backward repeat, and does it send an lse?
    raise NotImplementedError('TODO(m15): the bytes and calls of one step, per variant')


def cp_activation_bytes(cfg: LlamaConfig, batch: int, seq_len: int, dtype: torch.dtype, c: int, d: int = 1) -> int:
    """Bytes the L blocks' stores keep on one rank after the forward of one microbatch of `batch`
    global sequences: module 06's fourteen tensors for its N = (batch/d)(seq_len/c) tokens (given)."""
    b, s = dtype.itemsize, compute_dtype(dtype).itemsize
    tokens = batch // d * (seq_len // c)
    M, H, K, D, F = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim
    # x n1 h n2 (M), q o (H D), k v (K D), g u s (F) values; r1 r2 and lse (H) statistics
    per_token = (4 * M + 2 * H * D + 2 * K * D + 3 * F) * b + (2 + H) * s
    return cfg.n_layers * tokens * per_token


def attention_buffer_bytes(cfg: LlamaConfig, batch: int, seq_len: int, dtype: torch.dtype, c: int, variant: str,
                           d: int = 1) -> int:
    """The largest transient buffer of one block's forward attention on one rank (given): two KV blocks
    for the ring, the gathered K and V (c blocks) for the all-gather, the head-sharded q, k, v, o for
    Ulysses. Not kept for the backward, so not in cp_activation_bytes."""
    b = dtype.itemsize
    tokens = batch // d * (seq_len // c)
    kv = 2 * tokens * cfg.n_kv_heads * cfg.head_dim * b
    if variant in ("ring", "zigzag"):
        return 2 * kv if c > 1 else kv
    if variant == "allgather":
        return c * kv
    copies = kv_copies(cfg.n_kv_heads, c)
    return tokens * (2 * cfg.n_heads + 2 * cfg.n_kv_heads * copies) * cfg.head_dim * b
