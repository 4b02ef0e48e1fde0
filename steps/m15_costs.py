# Generated from solutions/m15_costs.py by `python -m course.skeleton`: fill in the TODOs.
# Grade your work with `python main.py grade 15`. (skeleton 2c9bb2a68c89)
"""Module 15, part 6 - what context parallelism costs one rank: bytes sent, activations kept.

One microbatch on one rank: B / (d m) sequences of T/c tokens, N = B T / (d c m) tokens. Values are
b bytes, statistics (lse, delta, and the ring's gradient accumulators) s bytes. One key/value block
is KV = 2 N K D b bytes (k and v of this rank's tokens). Per block and microbatch:

  ring        forward: c - 1 sends of KV (every block but the last moves on)
              backward: c - 1 sends of KV, and c sends of an accumulator 2 N K D s (each travels c - 1
              hops with its block, then one more home); nothing at all with c = 1
  all-gather  forward: one all-gather of KV; backward: another, and a reduce-scatter of the
              accumulated gradients (this rank's shard: 2 N K D s); each sends (c - 1) shards
  Ulysses     forward: all-to-alls of q (N H D b), k and v (N K' D b each, K' = K copies: K, or c
              when c is a multiple of K), o (N H D b) and lse (N H s); backward, the course's
              (module 15's UlyssesAttention): lse and delta (2 N H s), q, k, v, do, and dq, dk, dv
              back: 5 forward, 8 backward; each sends the (c - 1)/c of its input that goes to other
              ranks. DeepSpeed-Ulysses (`adjoint=True`) keeps the head-sharded q, k, v, o and lse of
              its forward, sends no lse, and leaves its backward to autograd, through all-to-alls
              whose backward is the reverse all-to-all (chapter 15)

and once a step, over the d c ranks ("dc"): one all-reduce of every gradient (Ψ values, accumulated
in s bytes) and one of the loss (s bytes), each sending 2 (dc - 1)/(dc) of its payload.

Forward, the ring and the all-gather send the same (c - 1) KV = 2 (c - 1) N K D b: about the keys
and values of the rank's whole sequences (c N tokens), whatever c. The ring spreads it over c - 1 messages that hide
behind block attention; the all-gather spends one latency and does not overlap here. Ulysses sends
(c - 1)/c of N (2H + 2K') D b (and the lse), and N shrinks as 1/c: in the forward the ratio
Ulysses / ring is about (H + K') / (K c). With many key/value heads (K = H: 2/c) Ulysses sends less
for any c > 2; with grouped-query attention the ring's blocks are small and it sends less until c
exceeds (H + K') / K (Llama 3 8B: H = 32, K = 8: c > 5), and c cannot exceed H for Ulysses at all.
Over a whole step the backward decides, and the two Ulysses backwards differ (chapter 15 works it
out for Llama 3 8B at 128K tokens).

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
    # Contract: return a StepCost of two dicts, sent[(axis, op)] the bytes one rank sends per step and
    #   calls[(axis, op)] the collectives it issues per step (receives are not counted), for the ops of the
    #   module docstring: ("c", "send") for the ring, ("c", "all_gather") and ("c", "reduce_scatter") for the
    #   all-gather, ("c", "all_to_all") for Ulysses (the course's, or with adjoint DeepSpeed's), and always ("dc",
    #   "all_reduce"): 2 calls (gradients, loss), dc_sent bytes (given above). Per microbatch and block, times m L.
    # Question: autograd's backward of an all-to-all is an all-to-all of the gradient the other way, the same size;
    #   what then does DeepSpeed's backward send, knowing which of its forward's all-to-alls it runs backwards?
    # Pitfalls: a group of one still logs its collectives (0 bytes), but the ring sends nothing with c = 1. The
    #   ring's accumulators are in the statistics' dtype (s bytes), not the values'. An all-gather or reduce-scatter
    #   sends c - 1 times its shard; an all-to-all (c - 1)/c of its input. "zigzag" is the ring's traffic. The
    #   adjoint re-sends none of its forward's inputs.
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
