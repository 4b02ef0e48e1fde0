# Generated from solutions/m16_dispatch.py by `python -m course.skeleton`: fill in the TODOs.
# Grade your work with `python main.py grade 16`. (skeleton c0fc06d81022)
"""Module 16, part 2 - from tokens to expert rows and back, on one rank: capacity, the expert-major
permutation, and the weighted combine.

The router gives each of the N tokens k (expert, weight) pairs: N k *slots*, numbered token-major
(slot = token k + i for the token's i-th choice). The experts want their rows side by side, so
the slots are permuted into **expert-major** order: every slot of expert 0 (in slot order), then
every slot of expert 1, ... The rows sent are the tokens of those slots, one row per slot (a token
chosen by two experts is sent twice). `counts[j]` says how many rows expert j gets.

Capacity. Experts run as fixed-size GEMMs in production, so a source may send expert j at most
κ = ceil(f k N / E) rows (MoEConfig.capacity; f is the capacity factor, N this source's tokens).
The rule here is deterministic and needs no communication: for each expert, the first κ of its
slots in slot order (earlier tokens first) are kept, the rest dropped (GShard's and Switch's
position rule; Megatron-LM also offers keeping the highest scores). A dropped slot adds nothing to
its token's output, so a token whose every slot is dropped leaves the layer unchanged: the
residual stream carries it past. Because the rule runs per source (a rank's microbatch), which
tokens are dropped depends on how the batch is grouped: only dropless routing (capacity None)
equals one process on the whole batch.

Combine. Back from the experts, row r is expert e(r)'s output for the token of its slot; the layer
adds Σ_i w_i expert_i(token) to the residual stream h. Un-permuting is scattering each row back to
its slot: the inverse of the gather that built the rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DispatchPlan:
    """Which slots are sent, in which order, and how many to each expert."""
    slots: torch.Tensor    # (R,) int64: the kept slots (token k + i), in expert-major order: row r is slot slots[r]
    counts: torch.Tensor   # (E,) int64: rows per expert (they sum to R)
    kept: torch.Tensor     # (N, k) bool: False where the capacity dropped a slot
    top_k: int

    @property
    def tokens(self) -> torch.Tensor:
        """(R,): the token each row carries."""
        return self.slots // self.top_k


def plan_dispatch(experts: torch.Tensor, n_experts: int, capacity: int | None) -> DispatchPlan:
    """The dispatch plan of one source's routing: experts (N, k) int64 from the router; capacity κ
    (None: dropless)."""
    n_tokens, top_k = experts.shape
    # TODO(m16): capacity, and the expert-major order of the rows to send
    # Contract: return DispatchPlan(slots, counts, kept, top_k). kept (N, k) marks the slots the capacity rule keeps
    #   (all of them when capacity is None); slots lists the kept slots (slot = token k + i) expert after expert and,
    #   within one expert, in slot order; counts (E,) the kept slots per expert (0 for an expert with none). The
    #   tests compare the dropped set and the order with a loop over the slots, exactly.
    # Maths: the module docstring's rule: a slot is kept when fewer than κ earlier slots (in slot order) chose the same
    #   expert. Slot order is token order, then the token's choices in the router's order.
    # Question: how does each slot learn how many earlier slots chose its expert, without a loop over the slots, and
    #   how do you list the kept slots expert by expert without disturbing their order within an expert?
    # Pitfalls: does the rule count per expert or per token? Does your way of ordering keep equal experts in slot order
    #   (some do not, on more than a few rows)? How many entries does counts need when an expert gets nothing?
    raise NotImplementedError('TODO(m16): capacity, and the expert-major order of the rows to send')


def combine(h: torch.Tensor, rows: torch.Tensor, plan: DispatchPlan, weights: torch.Tensor) -> torch.Tensor:
    """y = h + Σ_i w_i expert_i(token) for each token: h (N, M) the residual stream, rows (R, M) the
    experts' outputs in the plan's order, weights (N, k) the router's."""
    # TODO(m16): the combine: un-permute the experts' rows and add their weighted sum into the residual
    # Contract: return y (N, M) in h's dtype: h plus, for every token, the sum over its kept slots of the slot's weight
    #   times the slot's row (rows[r] belongs to slot plan.slots[r]). Dropped slots add nothing; h itself is not
    #   modified. The tests compare with the sum written row by row, with experts whose rows all differ.
    # Maths: the rows were gathered from the tokens in the plan's order (row r carries token plan.tokens[r]).
    # Question: where does row r go back to, and how do a token's k slots become one vector?
    # Pitfalls: what must a token whose every slot was dropped come out as? Does indexing rows by plan.slots put them
    #   back, or move them once more? Which dtype are the weights in?
    raise NotImplementedError("TODO(m16): the combine: un-permute the experts' rows and add their weighted sum into the residual")


def combine_backward(dy: torch.Tensor, rows: torch.Tensor, plan: DispatchPlan, weights: torch.Tensor):
    """(d_rows, d_weights) for combine, given dy (N, M) = dL/dy: d_rows (R, M) in the plan's order,
    d_weights (N, k) in weights' dtype (zero at dropped slots). dL/dh is dy itself (the residual)."""
    # TODO(m16): the combine's backward: the rows' gradient and the weights'
    # Contract: return (d_rows, d_weights): d_rows (R, M) in rows' dtype, row r the gradient of rows[r]; d_weights (N, k)
    #   in weights' dtype, the gradient of each slot's weight (0 for a dropped slot). The tests compare both with
    #   autograd.
    # Maths: y_t = h_t + Σ_i w_{t,i} row(t, i), row(t, i) the row of slot t k + i.
    # Question: which part of dy does each row's gradient read, and which product gives each weight's?
    # Pitfalls: which token and which weight belong to row r? The router's backward reads d_weights by token and
    #   choice: where does row r's value go?
    raise NotImplementedError("TODO(m16): the combine's backward: the rows' gradient and the weights'")
