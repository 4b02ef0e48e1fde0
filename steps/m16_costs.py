# Generated from solutions/m16_costs.py by `python -m course.skeleton`: fill in the TODOs.
# Grade your work with `python main.py grade 16`. (skeleton 2dc404da41d3)
"""Module 16, part 6 - what one training step of the MoE Llama costs a rank: bytes sent, and bytes kept.

Notation: E experts of width F, top-k, on a mesh of d x c data ranks carved into expert groups of e
(and expert-data groups of d c / e); L blocks of width M, H query and K key/value heads of D, a
vocabulary V; b bytes a value (the weights' and activations' dtype). A rank's records say what its
routing did in each forward (m16_moe_layer.RoutingRecord): `sent` (E,), the rows it sent each expert
after the capacity, and `received` (e, E/e), the rows each member sent its own experts.

Bytes sent. The all-to-all of course/collectives.py logs the rows that leave this rank, so for one
forward of one layer, with i this rank's index in its expert group:

  counts    an all-to-all of E int64 counts: (e - 1) E / e 8 bytes
  rows      S_out = Σ sent - (what it sent its own experts), S_in = Σ received - received[i] (the rows
            from the others): the forward sends S_out rows out and S_in rows back, the backward the
            same again: 2 (S_out + S_in) M b
  calls     5 all-to-alls over "e" (counts; dispatch and combine; their two adjoints)

The routing decides S_out and S_in: evenly spread and dropless, S_out ≈ S_in ≈ k N (e - 1) / e for
N tokens a rank; a capacity bounds each source's rows to an expert by κ. Once per step (ring
all-reduces: 2 (n - 1) / n of the tensor over a group of n):

  dense gradients    Ψ_dense b over "dc", with Ψ_dense = 2 V M + M + L (2 H D M + 2 K D M + 2 M + E M
                     [+ 3 F M with a shared expert])
  expert gradients   L (E / e) 3 F M b over "ed"
  step statistics    3 + L E float64 values (loss, aux, dropped, loads) over "dc"

Bytes kept: the parameters (the dense weights, and the rank's L E/e experts: Ψ_dense + L (E/e) 3 F M
values), as many gradients, and AdamW's two moments of each; the biases (L E values) as buffers.
"""
from __future__ import annotations

import torch

from course.costs import StepCost
from .m06_llama_block import LlamaConfig
from .m16_router import MoEConfig

COUNT_BYTES = 8   # the counts are int64
STAT_BYTES = 8    # the step statistics are float64


def dense_values(cfg: LlamaConfig, moe: MoEConfig) -> int:
    """Ψ_dense: the values of every weight each rank holds a copy of (given)."""
    M, L = cfg.dim, cfg.n_layers
    attention = 2 * cfg.n_heads * cfg.head_dim * M + 2 * cfg.n_kv_heads * cfg.head_dim * M
    per_block = attention + 2 * M + moe.n_experts * M + (3 * moe.expert_dim * M if moe.shared_expert else 0)
    return 2 * cfg.vocab_size * M + M + L * per_block


def step_cost(cfg: LlamaConfig, moe: MoEConfig, sizes: dict[str, int], index: int, records, dtype=torch.float32
              ) -> StepCost:
    """What one rank sends in one training step of m16_moe_model: sizes {"d", "c", "e"} (absent: 1), index
    its place in its expert group, records its RoutingRecords of the step (one per layer and microbatch)."""
    b, M, L, E = dtype.itemsize, cfg.dim, cfg.n_layers, moe.n_experts
    e, dc = sizes.get("e", 1), sizes.get("d", 1) * sizes.get("c", 1)
    ed = dc // e
    # TODO(m16): the bytes and calls of one step, by axis and collective
    # Contract: return StepCost(sent, calls) with keys (axis, op): ("e", "all_to_all") for the exchanges,
    #   ("dc", "all_reduce") for the dense gradients and the step statistics, ("ed", "all_reduce") for the experts'
    #   gradients. Bytes as course/collectives.py counts them (the tests compare with the log of real steps on
    #   1, 2 and 4 ranks, to the byte), calls as the model issues them (a group of one still logs its calls).
    # Maths: the module docstring's table: per record, the counts' bytes and 2 (S_out + S_in) M b, 5 calls; per
    #   step, three all-reduces, 2 (n - 1) / n of what each sums.
    # Pitfalls: S_out leaves out the rows a rank sends its own experts, S_in the rows it receives from itself
    #   (rows that stay on the rank cross no wire); its own experts are those of index, E/e of them; the
    #   statistics are float64 whatever the model's dtype.
    raise NotImplementedError('TODO(m16): the bytes and calls of one step, by axis and collective')


def state_bytes(cfg: LlamaConfig, moe: MoEConfig, e: int, dtype=torch.float32) -> StepCost:
    """What one rank keeps between steps, as a StepCost's memory: parameters, gradients, optimizer (AdamW's
    two moments), buffers (the biases)."""
    b, L, E = dtype.itemsize, cfg.n_layers, moe.n_experts
    # TODO(m16): the bytes one expert-parallel rank keeps
    # Contract: return StepCost(memory={"parameters": ..., "gradients": ..., "optimizer": ..., "buffers": ...}),
    #   integers, in bytes: the tests compare with the tensors a rank of the model holds after a step, for e in
    #   1, 2 and 4.
    # Maths: the module docstring: the dense weights, whole, and E / e of each layer's experts; gradients like
    #   the parameters; AdamW keeps two moments of each; the biases, L E values.
    # Pitfalls: only the experts are split; each expert has three matrices of F M values.
    raise NotImplementedError('TODO(m16): the bytes one expert-parallel rank keeps')
