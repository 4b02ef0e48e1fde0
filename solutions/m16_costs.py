"""Module 16, part 6 - what one training step of the MoE Llama costs a rank: bytes sent, and bytes kept.

Notation: E experts of width F, top-k, on a mesh of d x c data ranks carved into expert groups of e
(and expert-data groups of d c / e); L blocks of width M, H query and K key/value heads of D, a
vocabulary V; b bytes a value (the weights' and activations' dtype). A rank's records say what its
routing did in each forward (m16_moe_layer.RoutingRecord): `sent` (E,), the rows it sent each expert
after the capacity, and `received` (e, E/e), the rows each member sent its own experts.

Bytes sent. course/collectives.py logs what leaves this rank: of an all-to-all, the blocks for the
other members (a block for itself crosses no wire); of a ring all-reduce over n ranks, 2 (n - 1) / n
of the tensor. With i this rank's index in its expert group, in one forward of one layer:

  S_out  the rows it sends to the other members' experts (`sent`, less what went to its own experts)
  S_in   the rows the other members send its experts (`received`, less its own row i)

The routing decides them: evenly spread and dropless, S_out ≈ S_in ≈ k N (e - 1) / e for N tokens a
rank; a capacity bounds each source's rows to an expert by κ. Which collectives a step runs, over
which group, and what each carries: the layer and the step you wrote. Ψ_dense (dense_values, given)
counts the weights every rank holds: 2 V M + M + L (2 H D M + 2 K D M + 2 M + E M [+ 3 F M with a
shared expert]).

Bytes kept: the parameters, their gradients, AdamW's two moments of each, and the biases as buffers.
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
    # >>> TODO(m16): the bytes and calls of one step, by axis and collective
    # Contract: return StepCost(sent, calls) with keys (axis, op): ("e", "all_to_all") for the exchanges, ("dc",
    #   "all_reduce") for the dense gradients and the step statistics, ("ed", "all_reduce") for the experts' gradients.
    #   Bytes as course/collectives.py counts them (what leaves this rank), calls as the model issues them (a group of
    #   one still logs its calls). The tests compare with the log of real steps on 1, 2 and 4 ranks, to the byte, and
    #   with a worked example.
    # Maths: the module docstring defines S_out and S_in and the ring all-reduce's bytes.
    # Question: which tensors cross which group in one step, how large is each, and how many times does one layer's
    #   forward and backward exchange rows?
    # Pitfalls: do the rows a rank sends its own experts cross a wire? Which experts are its own? What dtype are the
    #   counts and the statistics, whatever the model's dtype?
    # Hint 1: the chapter's "What a step costs" counts the bytes of one all-to-all of 3 members; count, from the layer
    #         and the step you wrote, every collective of one forward and backward of a layer, and of one step.
    # Hint 2: per record: (e - 1) E / e 8 bytes of counts + 2 (S_out + S_in) M b, in 5 all-to-alls; per step:
    #         2 (n - 1) / n of Ψ_dense b and of (3 + L E) 8 over dc, of L (E/e) 3 F M b over ed; 2 and 1 calls.
    # Hint 3: own = slice(index E/e, (index + 1) E/e)
    #         for record in records: S_out = record.sent.sum() - record.sent[own].sum();  S_in = record.received.sum() - record.received[index].sum()
    #             exchange += (e - 1) * E // e * 8 + 2 * (S_out + S_in) * M * b
    #         ring(n, values, nbytes) = 2 (n - 1) / n values nbytes
    #         sent = {("e", "all_to_all"): exchange, ("dc", "all_reduce"): ring(dc, dense_values(cfg, moe), b) + ring(dc, 3 + L E, 8),
    #                 ("ed", "all_reduce"): ring(ed, L E // e 3 F M, b)};  calls = {...: 5 per record, ...: 2, ...: 1}
    own = slice(index * E // e, (index + 1) * E // e)
    exchange = 0.0
    for record in records:
        rows_out = int(record.sent.sum() - record.sent[own].sum())
        rows_in = int(record.received.sum() - record.received[index].sum())
        exchange += (e - 1) * E // e * COUNT_BYTES + 2 * (rows_out + rows_in) * M * b

    def ring(n, values, nbytes):
        return 2 * (n - 1) / n * values * nbytes
    dense = ring(dc, dense_values(cfg, moe), b) + ring(dc, 3 + L * E, STAT_BYTES)
    experts = ring(ed, L * E // e * 3 * moe.expert_dim * M, b)
    return StepCost(sent={("e", "all_to_all"): exchange, ("dc", "all_reduce"): dense, ("ed", "all_reduce"): experts},
                    calls={("e", "all_to_all"): 5 * len(records), ("dc", "all_reduce"): 2, ("ed", "all_reduce"): 1})
    # <<<


def state_bytes(cfg: LlamaConfig, moe: MoEConfig, e: int, dtype=torch.float32) -> StepCost:
    """What one rank keeps between steps, as a StepCost's memory: parameters, gradients, optimizer (AdamW's
    two moments), buffers (the biases)."""
    b, L, E = dtype.itemsize, cfg.n_layers, moe.n_experts
    # >>> TODO(m16): the bytes one expert-parallel rank keeps
    # Contract: return StepCost(memory={"parameters": ..., "gradients": ..., "optimizer": ..., "buffers": ...}),
    #   integers, in bytes: the tests compare with the tensors a rank of the model holds after a step, for e in 1, 2
    #   and 4, and with a worked example.
    # Maths: dense_values (given) is Ψ_dense; an expert is a SwiGLU of width F.
    # Question: which of the model's weights does an expert-parallel rank hold whole, which only in part, and what does
    #   AdamW keep per value?
    # Pitfalls: how many matrices of how many values does one expert have? Which dtype are the biases in?
    # Hint 1: the chapter's "What a step costs" counts what a rank holds in words: write it as a count of values.
    # Hint 2: values = Ψ_dense + L (E/e) 3 F M; parameters and gradients values b each, AdamW 2 values b; buffers L E b.
    # Hint 3: values = dense_values(cfg, moe) + L * E // e * 3 * moe.expert_dim * cfg.dim
    #         return StepCost(memory={"parameters": values * b, "gradients": values * b, "optimizer": 2 * values * b,
    #                                 "buffers": L * E * b})
    values = dense_values(cfg, moe) + L * E // e * 3 * moe.expert_dim * cfg.dim
    return StepCost(memory={"parameters": values * b, "gradients": values * b, "optimizer": 2 * values * b,
                            "buffers": L * E * b})
    # <<<
