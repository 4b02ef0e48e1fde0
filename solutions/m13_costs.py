"""Module 13, part 4 - what the 2-D model costs, read off its equations: bytes sent and bytes kept.

Notation (docs/glossary.md): d x t ranks; L blocks; M the width, F the FFN width, K key/value heads,
H query heads, D the head dimension; V' the vocabulary padded to a multiple of t; b bytes a value
(the weights' and activations' dtype), s bytes a statistic (compute_dtype: float32 at least); a
global batch of B sequences of T tokens in m microbatches, so N = B T / (m d) tokens a rank sees in
a microbatch, and A = N M b bytes in one residual-stream activation. One block's matrices hold
P = 2 H D M + 2 K D M + 3 F M values.

Bytes sent. Every collective of the model is one arrow of its code, or one grouped collective
carrying several arrows over one mesh axis, and the log records each with its payload: for an
all-gather over n ranks this rank's block of the input (a grouped one: its blocks of all the
inputs), for a reduce-scatter this rank's block of the output, for an all-reduce the whole tensor.
With the ring algorithms (course/collectives.py's `sent_bytes`) one rank sends n - 1 payloads for an
all-gather or a reduce-scatter, and 2 (n - 1) / n of the tensor for an all-reduce; a two-axis arrow
is one call on each axis. A rank's block follows from the spec: a matrix split over both axes is
1/(d t) of it, the stream [B/d T M/t] is A / t. Grouping changes the calls, not the bytes: a grouped
collective sends what its arrows would have sent one by one. Every collective is called (and
logged) on an axis of size 1 too, sending nothing.

One term, worked on the stream over t: each half of a block gathers the stream [B/d T M/t] over t
before its norm, together with the norm weight, in one collective, and reduce-scatters its output
back; its backward does the same, conjugated. A rank's block of the stream is A / t, so each of
those collectives sends (t - 1) A / t for the stream, 2 L of them a pass in each direction for the
blocks' halves. The rest (the units' gathers and reduce-scatters over d, the embedding's and the
loss's collectives over t, the norms' share of the grouped ones, the loss's all-reduces) is read
off the model's code the same way, by axis and kind of collective, and a step repeats a
microbatch's m times.

Bytes kept. Between steps a rank keeps its block of every weight, as the weights' specs say (the
model's TOP_SPECS and BLOCK_SPECS), its block of every gradient (a gradient has its weight's spec),
and of every state tensor AdamW keeps per value (torch.optim.AdamW's `state` after a step shows them;
its scalar step counters aside). The activations a block keeps for its backward
are split over d (the rows), but only some over t: the gathered stream and the norms' outputs are
[B/d T M] on every rank of a t group (`block_activation_bytes`, given).

Every formula returns a course/costs.py `StepCost` and takes (cfg, sizes, [batch,] dtype, ...): the
model, the mesh's axis sizes ({"d": d, "t": t}; an axis left out has size 1), the global batch B
where the cost depends on it, and the dtype of the weights and activations.
"""
from __future__ import annotations

import torch

from course.costs import StepCost
from .m06_llama_block import LlamaConfig
from .m06_llama_ops import compute_dtype
from .m07_payload import block_matrix_params
from .m12_vocab_parallel import padded_vocab_size


def block_activation_bytes(cfg: LlamaConfig, sizes: dict[str, int], batch: int, dtype: torch.dtype = torch.float32,
                           n_microbatches: int = 1) -> StepCost:
    """What the L blocks keep for their backward on one rank, at the end of one microbatch's forward
    (given), as memory["activations"], by the specs of a block's store: xg, n1, hg, n2 [B/d T M];
    r1, r2 [B/d T] (statistics); q, o [B/d T K/t Q D]; k, v [B/d T K/t D]; lse [B/d K/t Q T]
    (statistics); g, u, s [B/d T F/t]."""
    d, t = sizes.get("d", 1), sizes.get("t", 1)
    b, s = dtype.itemsize, compute_dtype(dtype).itemsize
    N, kv_heads = batch // (n_microbatches * d) * cfg.max_seq_len, cfg.n_kv_heads // t
    q_per_kv = cfg.n_heads // cfg.n_kv_heads
    values = (4 * cfg.dim + 2 * kv_heads * q_per_kv * cfg.head_dim + 2 * kv_heads * cfg.head_dim
              + 3 * cfg.ffn_dim // t)
    return StepCost(memory={"activations": cfg.n_layers * N * (values * b + (2 + kv_heads * q_per_kv) * s)})


def step_traffic(cfg: LlamaConfig, sizes: dict[str, int], batch: int, dtype: torch.dtype = torch.float32,
                 n_microbatches: int = 1) -> StepCost:
    """What one rank sends in one optimizer step of m13_llama_2d on a d x t mesh: a global batch of
    `batch` sequences of cfg.max_seq_len tokens in n_microbatches, weights and activations in `dtype`."""
    d, t, m = sizes.get("d", 1), sizes.get("t", 1), n_microbatches
    b, s = dtype.itemsize, compute_dtype(dtype).itemsize
    L, M, P = cfg.n_layers, cfg.dim, block_matrix_params(cfg)
    V = padded_vocab_size(cfg.vocab_size, t)
    N = batch // (m * d) * cfg.max_seq_len  # tokens one rank sees in a microbatch
    A = N * M * b
    # >>> TODO(m13): the calls and the bytes one rank sends in a step, by axis and kind of collective
    # Contract: return StepCost(sent, calls): for each (axis, op) the model's code issues, calls[(axis, op)] the
    #   collectives issued in one step and sent[(axis, op)] the bytes this rank sends for them, exactly what
    #   course/costs.py's measured_cost reads off the model's log (the tests compare on the meshes 1x1, 1x4, 2x2
    #   and 4x1, to the byte and to the call). Axes "d" and "t"; ops "all_gather", "reduce_scatter", "all_reduce".
    # The question: for each collective the forward and the backward issue (m13_llama_2d, each grouped one
    #   counted once), which axis, how big is this rank's payload, and how many times does a microbatch issue it?
    # Maths: the module docstring's counting rule and its worked term; P, V', N, A, b and s as it defines them.
    # Pitfalls: a block of a matrix split over both axes is 1/(d t) of it, but which group does its unit gather
    #   over? How many calls is a two-axis arrow, or a grouped collective? Which values are in compute_dtype (s
    #   bytes)? What does an axis of size 1 send, and is the call made? (Floats are fine: the tests compare sums of
    #   (n - 1) / n terms.)
    # Hint 1: which units are there, how many times a step is each gathered and reduce-scattered over d, and how
    #         many collectives over t does each half issue in each pass?
    # Hint 2: a unit of u values sends (d - 1) u b / (d t) per gather or reduce-scatter over d; a block's unit
    #         holds P + 2M values, the top's 2 V' M + M; calls over d: 2L + 1 gathers, L + 1 reduce-scatters, 1
    #         all-reduce. Over t: the stream (t - 1) A / t per collective, 4L + 2 of them in each direction; a norm
    #         weight (t - 1) M b / t, gathered twice and reduce-scattered once; 4L + 3 gathers (the final norm is
    #         gathered alone in the loss's backward), 4L + 2 reduce-scatters, 3 all-reduces of N s.
    # Hint 3: unit_d = (d - 1) / (d t) b;  block, top = P + 2 M, 2 V' M + M
    #         norm_t = (t - 1) M / t b;  stream = (t - 1) / t A;  norms = 2 L + 1
    #         sent = {("d", "all_gather"): unit_d (2 L block + top), ("d", "reduce_scatter"): unit_d (L block + top),
    #                 ("t", "all_gather"): 2 norms norm_t + (4 L + 2) stream, ("t", "reduce_scatter"): norms norm_t
    #                 + (4 L + 2) stream, ("t", "all_reduce"): 3 * 2 (t - 1) / t N s, ("d", "all_reduce"): 2 (d - 1)
    #                 / d s}
    #         calls: ("d", ...): 2 L + 1, L + 1, 1;  ("t", ...): 4 L + 3, 4 L + 2, 3
    #         return StepCost of both, each entry times m
    unit_d = (d - 1) / (d * t) * b  # a unit's all-gather or reduce-scatter over d, per value of the unit
    block, top = P + 2 * M, 2 * V * M + M  # a block's values (its matrices and two norms), the top's
    norm_t = (t - 1) * M / t * b
    stream = (t - 1) / t * A
    norms = 2 * L + 1
    sent = {("d", "all_gather"): unit_d * (2 * L * block + top),
            ("t", "all_gather"): 2 * norms * norm_t + (4 * L + 2) * stream,
            ("d", "reduce_scatter"): unit_d * (L * block + top),
            ("t", "reduce_scatter"): norms * norm_t + (4 * L + 2) * stream,
            ("t", "all_reduce"): 3 * 2 * (t - 1) / t * N * s,
            ("d", "all_reduce"): 2 * (d - 1) / d * s}
    calls = {("d", "all_gather"): 2 * L + 1, ("t", "all_gather"): 4 * L + 3,
             ("d", "reduce_scatter"): L + 1, ("t", "reduce_scatter"): 4 * L + 2,
             ("t", "all_reduce"): 3, ("d", "all_reduce"): 1}
    return StepCost({key: m * value for key, value in sent.items()}, {key: m * n for key, n in calls.items()})
    # <<<


def state_bytes(cfg: LlamaConfig, sizes: dict[str, int], dtype: torch.dtype = torch.float32) -> StepCost:
    """What one rank keeps between steps: its blocks of the weights, of their gradients and of AdamW's
    state, as memory["parameters"], ["gradients"] and ["optimizer"]."""
    d, t = sizes.get("d", 1), sizes.get("t", 1)
    b, L, M = dtype.itemsize, cfg.n_layers, cfg.dim
    V = padded_vocab_size(cfg.vocab_size, t)
    # >>> TODO(m13): the bytes of parameters, gradients and optimizer state one rank keeps
    # Contract: return StepCost(memory={"parameters": ..., "gradients": ..., "optimizer": ...}) in bytes (integers): the
    #   tests compare them with the tensors a rank of the 2-D model really holds after a step (its weights' blocks, its
    #   gradients' blocks, the tensors in its AdamW's state), on four meshes.
    # The question: how many values of each a rank holds. The counting rule is the module docstring's (Bytes kept): each
    #   weight's spec says which block of it a rank keeps; docs/13-2d-sharding.md works out wq's term. Every weight of
    #   the model counts: the blocks', the embedding's, the final norm's, the LM head's.
    # Pitfalls: which vocabulary, V or V'? How many tensors does AdamW keep per value (its state after a step shows
    #   them)? Integer bytes: the mesh divides every size, so the blocks' sizes are exact.
    # Hint 1: what fraction of each weight does its spec leave a rank, and what does a gradient's spec, and AdamW's
    #         state, add to it? (docs/13, "What it costs, from the equations": wq's term, worked.)
    # Hint 2: every weight is split over both axes: values = (L (P + 2 M) + 2 V' M + M) / (d t); parameters values b,
    #         gradients values b, optimizer 2 values b (AdamW's two moments).
    # Hint 3: values = (cfg.n_layers * (block_matrix_params(cfg) + 2 * M) + 2 * V' * M + M) // (d * t)
    #         memory: parameters values * b, gradients values * b, optimizer 2 * values * b
    values = (L * (block_matrix_params(cfg) + 2 * M) + 2 * V * M + M) // (d * t)
    return StepCost(memory={"parameters": values * b, "gradients": values * b, "optimizer": 2 * values * b})
    # <<<
