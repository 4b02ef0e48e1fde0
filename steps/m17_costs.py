# Generated from solutions/m17_costs.py by `python -m course.skeleton`: fill in the TODOs.
# Grade your work with `python main.py grade 17`. (skeleton 7beaed83bff5)
"""Module 17, part 5 - what FSDP costs across the pipeline's microbatches.

A stage gathers each of its blocks once per step and reduce-scatters each block's gradient once per
step (m17_stage), whatever the number of microbatches m. One block's tensor-parallel slice holds

    P_t = 2 M + (H/t) D M + 2 (K/t) D M + M (H/t) D + 3 (F/t) M       values (the norms whole, the rest 1/t)

laid out flat and padded to P_t', a multiple of the fsdp group's size n, so a rank keeps P_t'/n of
it (module 07's FlatLayout). What one rank sends in a step follows from the policy (m17_stage: how
many collectives a block a step, of what) and course/collectives.py's ring formulas; b is the bytes
of a weight, s those of a gradient accumulator (float32 at least).

Module 07's policy, a gather for each microbatch's forward and again for its backward and a
reduce-scatter of each microbatch's gradient, costs 2 m gathers and m reduce-scatters a block: with
m microbatches in flight in a pipeline the weights would travel 2 m times instead of once. The price
of gathering once: the stage's whole slices and their whole gradients live for the step (`buffers`),
P_t' (b + s) a block, where module 07 keeps two blocks at a time.

The weights outside the blocks (the embedding, the LM head and the final norm) are not sharded: every
rank of "dc" holds them whole and sums their gradients with one all-reduce a step (replicated_cost).
"""
from __future__ import annotations

import torch

from course.costs import StepCost
from .m06_llama_block import LlamaConfig
from .m12_tp_linear import grad_dtype
from .m12_vocab_parallel import padded_vocab_size


def slice_numel(cfg: LlamaConfig, t: int) -> int:
    """P_t: the values of one block's tensor-parallel slice (given)."""
    M, D = cfg.dim, cfg.head_dim
    return 2 * M + (cfg.n_heads // t) * D * M * 2 + 2 * (cfg.n_kv_heads // t) * D * M + 3 * (cfg.ffn_dim // t) * M


def fsdp_traffic(cfg: LlamaConfig, sizes: dict[str, int], dtype: torch.dtype, n_blocks: int) -> StepCost:
    """The FSDP collectives of one optimizer step on a rank that holds `n_blocks` blocks (its stages'),
    over the "dc" group of a mesh of `sizes`, weights in `dtype`: calls and bytes sent, by the module's policy."""
    # TODO(m17): the bytes FSDP sends in one step when it gathers and reduce-scatters once a step
    # Contract: a StepCost with sent[("dc", "all_gather")], sent[("dc", "reduce_scatter")] (bytes one rank sends in
    #   one step, every block of the rank counted) and calls[...] for both.
    # Pitfalls: the padded slice (a multiple of n = d c), not P_t itself; the gradients travel in grad_dtype(dtype)
    #   (float32 at least), the weights in dtype. The test compares with what the collectives log measured, with m
    #   = 2 microbatches: the number of microbatches appears nowhere in this policy.
    raise NotImplementedError('TODO(m17): the bytes FSDP sends in one step when it gathers and reduce-scatters once a step')


def fsdp_memory(cfg: LlamaConfig, sizes: dict[str, int], dtype: torch.dtype, n_blocks: int) -> StepCost:
    """What the blocks cost one rank to keep (given): their shards and gradient shards between steps, and during
    a step the whole slices and their whole gradients (`buffers`)."""
    n = sizes.get("d", 1) * sizes.get("c", 1)
    padded = -(-slice_numel(cfg, sizes.get("t", 1)) // n) * n
    b, s = dtype.itemsize, grad_dtype(dtype).itemsize
    return StepCost(memory={"parameters": n_blocks * padded // n * b, "gradients": n_blocks * padded // n * s,
                            "buffers": n_blocks * padded * (b + s)})


def replicated_cost(cfg: LlamaConfig, sizes: dict[str, int], dtype: torch.dtype) -> StepCost:
    """The weights every rank of "dc" holds whole (given): the embedding's and the LM head's V'/t vocabulary
    rows and the final norm, kept in b bytes with gradients in s bytes, and summed by one all-reduce over the
    n = d c ranks a step (m17_trainer's finish_gradients, "replicated grads": 2 (n - 1)/n of the gradients)."""
    n, t = sizes.get("d", 1) * sizes.get("c", 1), sizes.get("t", 1)
    values = 2 * padded_vocab_size(cfg.vocab_size, t) // t * cfg.dim + cfg.dim
    b, s = dtype.itemsize, grad_dtype(dtype).itemsize
    return StepCost({("dc", "all_reduce"): 2 * (n - 1) / n * values * s}, {("dc", "all_reduce"): 1},
                    {"parameters": values * b, "gradients": values * s})
