# Generated from solutions/m12_tp_costs.py by `python -m course.skeleton`: fill in the TODOs.
# Grade your work with `python main.py grade 12`. (skeleton 5597a5b13cf4)
"""Module 12, part 5 - what tensor and sequence parallelism cost: bytes sent and activations kept.

Traffic. One microbatch of N = B T tokens; a residual-stream activation (N, dim) of b bytes a value
is A = N dim b bytes. Per microbatch, for L blocks:

  without sequence parallelism   all-reduces of A: 2 per block forward (o, down), 2 per block
                                 backward (q/k/v, gate/up), 1 for the embedding, 1 for the LM head's
                                 input gradient: 4L + 2
  with sequence parallelism      each of those becomes a reduce-scatter or an all-gather of A, and
                                 the backward gathers each column-parallel input again:
                                 all-gathers 6L + 3, reduce-scatters 4L + 2
  either way                     3 all-reduces of N statistics for the loss (max, sum, target logit)
  per optimizer step, with sequence parallelism: 1 all-reduce of the (2L + 1) norm weights' gradients

With the ring algorithms one rank sends (t - 1)/t A for an all-gather or a reduce-scatter of A and
2 (t - 1)/t A for an all-reduce (course/collectives.py's `sent_bytes`). So the forward costs the
same with sequence parallelism or without; the backward's extra all-gathers are the price of
keeping 1/t of the norms' activations.

Activations. One block keeps module 06's fourteen tensors (the names of its store). On t ranks,
the ones after the column-parallel split are 1/t of module 06's (q, k, v, o, lse: this rank's
heads; g, u, s: its FFN units); the ones in the residual stream's layout (x, n1, r1, h, n2, r2) are
whole on every rank, or 1/t of it with sequence parallelism.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .m06_llama_block import LlamaConfig
from .m06_llama_ops import compute_dtype
from .m12_tp_linear import grad_dtype

STREAM_NAMES = ("x", "n1", "r1", "h", "n2", "r2")  # kept in the residual stream's layout


@dataclass(frozen=True)
class TPTraffic:
    """The collectives of one optimizer step, and what one rank sends for them."""
    stream_all_reduces: int       # all-reduces of a (N, dim) activation, per step
    stream_all_gathers: int       # all-gathers of a (N, dim) activation (its shard: N/t tokens), per step
    stream_reduce_scatters: int   # reduce-scatters of a (N, dim) activation, per step
    loss_all_reduces: int         # all-reduces of N loss statistics, per step
    norm_all_reduces: int         # all-reduces of the norm weights' gradients, per step
    sent_bytes: float             # bytes one rank sends per step, ring algorithms, all of the above


def tp_traffic(cfg: LlamaConfig, batch: int, seq_len: int, dtype: torch.dtype, tp_size: int,
               sequence_parallel: bool, n_microbatches: int = 1) -> TPTraffic:
    """The collectives and bytes of one optimizer step of module 12's model: a batch of (batch, seq_len)
    tokens split into n_microbatches, weights and activations in `dtype`, on tp_size ranks."""
    tokens = batch // n_microbatches * seq_len           # N, one microbatch
    stream = tokens * cfg.dim * dtype.itemsize           # A
    statistics = tokens * compute_dtype(dtype).itemsize  # one loss all-reduce
    norm_grads = (2 * cfg.n_layers + 1) * cfg.dim * grad_dtype(dtype).itemsize
    L, t, M = cfg.n_layers, tp_size, n_microbatches
    # TODO(m12): count the collectives of one step and the bytes one rank sends for them
    # Contract: the counts of the module docstring, times n_microbatches where they are per microbatch; sent_bytes
    #   adds (t - 1)/t of the payload for each all-gather or reduce-scatter and 2 (t - 1)/t for each all-reduce.
    # Pitfalls: the norm gradients' all-reduce is once per step, and only with sequence parallelism. An all-gather's
    #   payload is its shard, but what a rank sends is (t - 1) shards: (t - 1)/t of the whole A.
    raise NotImplementedError('TODO(m12): count the collectives of one step and the bytes one rank sends for them')


def tp_activation_bytes(cfg: LlamaConfig, batch: int, seq_len: int, dtype: torch.dtype, tp_size: int,
                        sequence_parallel: bool) -> dict[str, int]:
    """Bytes of each activation one block keeps on one rank, by name (module 06's store names), for a
    (batch, seq_len) input of `dtype`. r1, r2 and lse are kept in compute_dtype(dtype)."""
    act, stat = dtype.itemsize, compute_dtype(dtype).itemsize
    tokens, t = batch * seq_len, tp_size
    # TODO(m12): the bytes of each of the fourteen activations on one rank
    # Contract: a dict from each store name (x n1 r1 q k v o lse h n2 r2 g u s) to bytes; the tests compare it, name
    #   by name, with what TPBlock's store really holds.
    # Pitfalls: q, o and lse scale with this rank's query heads H/t, k and v with its key/value heads K/t, g u s
    #   with F/t; only the STREAM_NAMES shrink with sequence parallelism (T/t tokens). Head counts, not dim / t.
    raise NotImplementedError('TODO(m12): the bytes of each of the fourteen activations on one rank')
