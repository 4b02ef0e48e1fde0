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

The weights outside the blocks (the embedding's and the LM head's V'/t vocabulary rows, the final
norm) are one more flat group of a stage (module 07's OuterWeights: the first stage's embedding, the
last stage's final norm and LM head), by the same policy: gathered once a step, reduce-scattered
once, whole during the step (replicated_cost, for a stage that holds all three unless told which).
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
    # >>> TODO(m17): the bytes FSDP sends in one step when it gathers and reduce-scatters once a step
    # Contract: a StepCost with sent[("dc", "all_gather")] and sent[("dc", "reduce_scatter")] (the bytes one rank sends
    #   in one step, every block of the rank counted) and calls[...] for both. The test compares it with what the
    #   collectives log measured in a step of m = 2 microbatches, and with module 07's layout of module 12's slice on a
    #   slice that needs padding, in float32 and bf16.
    # The question: what does the policy (m17_stage) send per block in a step, and what does one collective of that size
    #   cost one rank (course/collectives.py)?
    # Pitfalls: which buffer travels, the slice or its padded flat buffer? In which dtype does each collective move its
    #   values? Where would the number of microbatches enter?
    # Hint 1: how many collectives does a block make in a step under this policy, of which buffer and dtype, and what
    #         does a ring all-gather or reduce-scatter over n ranks send from each? (docs/17, "FSDP across the
    #         pipeline's microbatches"; the given replicated_cost below costs the outer group by the same policy.)
    # Hint 2: n = d c, P_t' = n ⌈P_t / n⌉ (P_t = slice_numel); per block and step one all-gather, (n - 1) P_t'/n b bytes
    #         sent, and one reduce-scatter, (n - 1) P_t'/n s, s = the bytes of grad_dtype(dtype); times n_blocks, and
    #         n_blocks calls of each.
    # Hint 3: n = sizes.get("d", 1) * sizes.get("c", 1);  shard = -(-slice_numel(cfg, sizes.get("t", 1)) // n)
    #         sent = {("dc", "all_gather"): n_blocks * (n - 1) * shard * dtype.itemsize,
    #                 ("dc", "reduce_scatter"): n_blocks * (n - 1) * shard * grad_dtype(dtype).itemsize}
    #         return StepCost(sent, {("dc", "all_gather"): n_blocks, ("dc", "reduce_scatter"): n_blocks})
    n = sizes.get("d", 1) * sizes.get("c", 1)
    P = slice_numel(cfg, sizes.get("t", 1))
    shard = -(-P // n)
    sent = {("dc", "all_gather"): n_blocks * (n - 1) * shard * dtype.itemsize,
            ("dc", "reduce_scatter"): n_blocks * (n - 1) * shard * grad_dtype(dtype).itemsize}
    return StepCost(sent, {("dc", "all_gather"): n_blocks, ("dc", "reduce_scatter"): n_blocks})
    # <<<


def fsdp_memory(cfg: LlamaConfig, sizes: dict[str, int], dtype: torch.dtype, n_blocks: int) -> StepCost:
    """What the blocks cost one rank to keep (given): their shards and gradient shards between steps, and during
    a step the whole slices and their whole gradients (`buffers`)."""
    n = sizes.get("d", 1) * sizes.get("c", 1)
    padded = -(-slice_numel(cfg, sizes.get("t", 1)) // n) * n
    b, s = dtype.itemsize, grad_dtype(dtype).itemsize
    return StepCost(memory={"parameters": n_blocks * padded // n * b, "gradients": n_blocks * padded // n * s,
                            "buffers": n_blocks * padded * (b + s)})


def replicated_cost(cfg: LlamaConfig, sizes: dict[str, int], dtype: torch.dtype, first: bool = True,
                    last: bool = True) -> StepCost:
    """The outer weights of one stage, sharded over the n = d c ranks of "dc" (given): the embedding's V'/t
    vocabulary rows on the `first` stage, the final norm and the LM head's V'/t rows on the `last` (one stage
    is both when S = 1; a rank holds one such group per stage of its, none on a stage in between). Its
    padded flat buffer is gathered (b bytes a value) and its gradient reduce-scattered (s bytes) once a
    step; a rank keeps its shard and its gradient's, and during the step both whole (`buffers`)."""
    n, t, M = sizes.get("d", 1) * sizes.get("c", 1), sizes.get("t", 1), cfg.dim
    rows = padded_vocab_size(cfg.vocab_size, t) // t
    values = (rows * M if first else 0) + ((M + rows * M) if last else 0)
    if values == 0:
        return StepCost()
    shard = -(-values // n)
    b, s = dtype.itemsize, grad_dtype(dtype).itemsize
    return StepCost({("dc", "all_gather"): (n - 1) * shard * b, ("dc", "reduce_scatter"): (n - 1) * shard * s},
                    {("dc", "all_gather"): 1, ("dc", "reduce_scatter"): 1},
                    {"parameters": shard * b, "gradients": shard * s, "buffers": n * shard * (b + s)})
