"""Module 12, part 5 - what tensor and sequence parallelism cost: bytes sent and activations kept.

Traffic. A global batch of B sequences of T tokens in m microbatches: one microbatch holds
N = B T / m tokens (every rank of the group sees all of them), and a residual-stream activation
(N, M) of b bytes a value is A = N M b bytes. Every collective of a step is one of:

  the operators   each f and each g, forward and backward, issues what m12_tp_linear makes it issue
                  (nothing, or one collective of a stream activation), wherever the model calls one:
                  the blocks' two pairs, the embedding's g, the LM head's f
  the loss        the vocabulary-parallel cross-entropy's all-reduces of N statistics, s bytes each
  the norms       with sequence parallelism, sum_norm_grads' one all-reduce of the (2L + 1) norm
                  weights' gradients, M values each, in the accumulators' dtype (s bytes), per step

With the ring algorithms one rank sends (t - 1)/t A for an all-gather or a reduce-scatter of A and
2 (t - 1)/t A for an all-reduce (course/collectives.py's `sent_bytes`). One term, worked: without
sequence parallelism the forward of a microbatch leaves each block's two pairs through g (after o
and after down) and the embedding through g, 2L + 1 all-reduces of A, each sending 2 (t - 1)/t A.
The backward, sequence parallelism, the loss and the norms are yours to count (each operator sends
what your m12_tp_linear makes it send). `tp_traffic` returns them as a course/costs.py `StepCost` over the axis
t: the calls and the bytes of each kind of collective in one optimizer step.

Activations. One block keeps module 06's fourteen tensors (the names of its store). On t ranks,
the ones after the column-parallel split are 1/t of module 06's (q, k, v, o, lse: this rank's
heads; g, u, s: its FFN units); the ones in the residual stream's layout (x, n1, r1, h, n2, r2) are
whole on every rank, or 1/t of it with sequence parallelism.

Every formula takes (cfg, sizes, batch, dtype, ...): the model, the mesh's axis sizes (here only
t = sizes["t"] matters; an axis left out has size 1), the global batch B (sequences of
cfg.max_seq_len = T tokens) and the dtype of the weights and activations.
"""
from __future__ import annotations

import torch

from course.costs import StepCost
from .m06_llama_block import LlamaConfig
from .m06_llama_ops import compute_dtype
from .m12_tp_linear import grad_dtype

STREAM_NAMES = ("x", "n1", "r1", "h", "n2", "r2")  # kept in the residual stream's layout


def tp_traffic(cfg: LlamaConfig, sizes: dict[str, int], batch: int, dtype: torch.dtype, n_microbatches: int = 1,
               sequence_parallel: bool = False) -> StepCost:
    """The collectives of one optimizer step of module 12's model over the t ranks of sizes["t"], and
    the bytes one rank sends for them: a global batch of `batch` sequences of cfg.max_seq_len tokens
    in n_microbatches, weights and activations in `dtype`."""
    t, m, L = sizes.get("t", 1), n_microbatches, cfg.n_layers
    N = batch // m * cfg.max_seq_len                   # tokens in one microbatch
    A = N * cfg.dim * dtype.itemsize                   # one residual-stream activation
    statistics = N * compute_dtype(dtype).itemsize     # one loss all-reduce
    norm_grads = (2 * L + 1) * cfg.dim * grad_dtype(dtype).itemsize
    # >>> TODO(m12): count the collectives of one step and the bytes one rank sends for them
    # Contract: a StepCost(sent, calls) over the axis "t": calls[("t", op)] the number of collectives of each kind
    #   (op "all_reduce", "all_gather", "reduce_scatter") in one step, sent[("t", op)] the bytes one rank sends for
    #   them, counted as the module docstring says, times m where they are per microbatch. The tests compare it
    #   with a hand count and with the log of a real step (course/costs.py's measured_cost), to the byte and to
    #   the call.
    # The question: for each collective the model's code issues in one microbatch (each f and g, forward and
    #   backward, the loss's reductions) and once per step (the norms), which kind is it and how many bytes does
    #   this rank send for it?
    # Maths: the module docstring's counting rule and its worked term (the forward's all-reduces without sequence
    #   parallelism); N, A, s as it defines them.
    # Pitfalls: how often does the norm gradients' all-reduce run, and in which case? What does a rank send for an
    #   all-gather: its shard, or (t - 1) shards? On t = 1, is a collective still called (and logged)? What kind
    #   are the loss's reductions?
    # Hint 1: walk one microbatch through the model: where is f called (forward and backward) and where g, and
    #       what does each issue in each layout (your enter_tp_*; leave_tp_* runs them)? Where does the backward
    #       call f's forward again (docs/12, "Sequence parallelism")?
    # Hint 2: per microbatch, without sequence parallelism: 4L + 2 all-reduces of A (2L + 1 in the forward, 2L + 1
    #       in the backward); with it: 6L + 3 all-gathers and 4L + 2 reduce-scatters of A; always 3 loss all-reduces
    #       of N s. Per step: m times those, plus with sequence parallelism 1 all-reduce of the norms. A rank sends
    #       2 (t-1)/t of an all-reduce's payload and (t-1)/t A for an all-gather or a reduce-scatter.
    # Hint 3: stream = 0 if sequence_parallel else 4 L + 2; gathers, scatters = (6 L + 3, 4 L + 2) or (0, 0)
    #       norms = 1 if sequence_parallel else 0; share = (t - 1) / t
    #       calls = {("t", "all_reduce"): m (stream + 3) + norms, ("t", "all_gather"): m gathers,
    #                ("t", "reduce_scatter"): m scatters}
    #       sent = {("t", "all_reduce"): m (stream 2 share A + 3 * 2 share statistics) + norms 2 share norm_grads,
    #               ("t", "all_gather"): m gathers share A, ("t", "reduce_scatter"): m scatters share A}
    #       return StepCost(sent, calls)
    stream = 0 if sequence_parallel else 4 * L + 2
    gathers, scatters = (6 * L + 3, 4 * L + 2) if sequence_parallel else (0, 0)
    norms = 1 if sequence_parallel else 0
    share = (t - 1) / t
    calls = {("t", "all_reduce"): m * (stream + 3) + norms, ("t", "all_gather"): m * gathers,
             ("t", "reduce_scatter"): m * scatters}
    sent = {("t", "all_reduce"): (m * (stream * 2 * share * A + 3 * 2 * share * statistics)
                                  + norms * 2 * share * norm_grads),
            ("t", "all_gather"): m * gathers * share * A, ("t", "reduce_scatter"): m * scatters * share * A}
    return StepCost(sent, calls)
    # <<<


def tp_activations_by_name(cfg: LlamaConfig, sizes: dict[str, int], batch: int, dtype: torch.dtype,
                           n_microbatches: int = 1, sequence_parallel: bool = False) -> dict[str, int]:
    """Bytes of each activation one block keeps on one rank for one microbatch (batch / n_microbatches
    sequences of cfg.max_seq_len tokens), by name (module 06's store names). r1, r2 and lse are kept
    in compute_dtype(dtype)."""
    act, stat = dtype.itemsize, compute_dtype(dtype).itemsize
    tokens, t = batch // n_microbatches * cfg.max_seq_len, sizes.get("t", 1)
    # >>> TODO(m12): the bytes of each of the fourteen activations on one rank
    # Contract: a dict from each store name (x n1 r1 q k v o lse h n2 r2 g u s) to bytes; the tests compare it, name
    #   by name, with what TPBlock's store really holds.
    # The question: per token, how many values (or statistics) does each name hold on this rank, and for how many
    #   tokens is it kept?
    # Pitfalls: which names scale with this rank's query heads, which with its key/value heads, which with its
    #   FFN units? Which shrink with sequence parallelism? Head counts, or dim / t?
    # Hint 1: the shapes TPBlock.forward saves (its contract lists them): which are in the stream's layout?
    # Hint 2: per token: x, n1, h, n2 M values; r1, r2 one statistic; q, o (H/t) D values; k, v (K/t) D; lse H/t
    #       statistics; g, u, s F/t values. Values are b bytes, statistics s; STREAM_NAMES kept for N/t tokens with
    #       sequence parallelism, the rest for all N.
    # Hint 3: heads, kv_heads, ffn = H // t, K // t, F // t
    #       per_token = {"x": M act, "n1": M act, "r1": stat, "q": heads D act, "k": kv_heads D act, ..., "s": ffn act}
    #       stream_tokens = tokens // t if sequence_parallel else tokens
    #       return {name: (stream_tokens if name in STREAM_NAMES else tokens) per_token[name] for each name}
    heads, kv_heads, ffn = cfg.n_heads // t, cfg.n_kv_heads // t, cfg.ffn_dim // t
    per_token = {"x": cfg.dim * act, "n1": cfg.dim * act, "r1": stat, "q": heads * cfg.head_dim * act,
                 "k": kv_heads * cfg.head_dim * act, "v": kv_heads * cfg.head_dim * act,
                 "o": heads * cfg.head_dim * act, "lse": heads * stat, "h": cfg.dim * act, "n2": cfg.dim * act,
                 "r2": stat, "g": ffn * act, "u": ffn * act, "s": ffn * act}
    stream_tokens = tokens // t if sequence_parallel else tokens
    return {name: (stream_tokens if name in STREAM_NAMES else tokens) * size for name, size in per_token.items()}
    # <<<


def tp_activation_bytes(cfg: LlamaConfig, sizes: dict[str, int], batch: int, dtype: torch.dtype,
                        n_microbatches: int = 1, sequence_parallel: bool = False) -> StepCost:
    """What the L blocks keep for the backward on one rank, at the end of one microbatch's forward, as a
    StepCost's memory["activations"] (given): L times the sum of tp_activations_by_name."""
    per_block = tp_activations_by_name(cfg, sizes, batch, dtype, n_microbatches, sequence_parallel)
    return StepCost(memory={"activations": cfg.n_layers * sum(per_block.values())})
