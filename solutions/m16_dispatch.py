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
    # >>> TODO(m16): capacity, and the expert-major order of the rows to send
    # Contract: return DispatchPlan(slots, counts, kept, top_k). kept (N, k) marks the slots the capacity rule
    #   keeps (all of them when capacity is None). slots lists the kept slots (slot = token k + i) in
    #   expert-major order, and within one expert in slot order; counts (E,) the kept slots per expert.
    # Maths: the module docstring's rule: a slot is kept when fewer than κ earlier slots (in slot order) chose
    #   the same expert. Slot order is token order, then the token's choices in the router's order.
    # Pitfalls: the rule counts per expert, not per token; a stable sort keeps slot order within an expert (an
    #   unstable one may reorder equal keys, and the rows of one expert would not be in token order); empty
    #   experts still get a count of 0 (counts has E entries). The tests compare the dropped set with a loop
    #   over the slots, exactly, and the order of the rows.
    # Hint 1: flatten the choices to N k slots; a running count per expert gives each slot its position among
    #         its expert's slots; keep position < κ; sort the kept slots by expert, stably.
    # Hint 2: torch.nn.functional.one_hot(flat, E).cumsum(0) counts up to and including each slot;
    #         .gather(1, flat[:, None]); torch.nonzero(mask).squeeze(1) or torch.arange(N k)[mask];
    #         torch.argsort(keys, stable=True); torch.bincount(x, minlength=E).
    # Hint 3: flat = experts as (N k,)
    #         position = (one-hot of flat, cumulative sum down the slots, at each slot's own expert) - 1
    #         kept = position < κ (all True without a capacity)
    #         kept_slots = the indices of kept slots;  slots = kept_slots sorted stably by flat[kept_slots]
    #         counts = bincount of flat[slots] with E bins;  return DispatchPlan(slots, counts, kept as (N, k), k)
    flat = experts.reshape(-1)
    if capacity is None:
        kept = torch.ones_like(flat, dtype=torch.bool)
    else:
        position = torch.nn.functional.one_hot(flat, n_experts).cumsum(0).gather(1, flat.unsqueeze(1)).squeeze(1) - 1
        kept = position < capacity
    kept_slots = torch.arange(flat.numel(), device=flat.device)[kept]
    slots = kept_slots[torch.argsort(flat[kept_slots], stable=True)]
    counts = torch.bincount(flat[slots], minlength=n_experts)
    return DispatchPlan(slots, counts, kept.view(n_tokens, top_k), top_k)
    # <<<


def combine(h: torch.Tensor, rows: torch.Tensor, plan: DispatchPlan, weights: torch.Tensor) -> torch.Tensor:
    """y = h + Σ_i w_i expert_i(token) for each token: h (N, M) the residual stream, rows (R, M) the
    experts' outputs in the plan's order, weights (N, k) the router's."""
    # >>> TODO(m16): the combine: un-permute the experts' rows and add their weighted sum into the residual
    # Contract: return y (N, M) in h's dtype: h plus, for every token, the sum over its kept slots of the slot's
    #   weight times the slot's row (rows[r] belongs to slot plan.slots[r]). Dropped slots add nothing; h itself
    #   is not modified.
    # Maths: the module docstring: un-permuting is the inverse of the gather that made the rows, a scatter to the
    #   slots; then each token's k slots are weighted and summed.
    # Pitfalls: a token whose slots were all dropped must come out as h, unchanged (the residual carries it),
    #   not as zeros; rows[plan.slots] would apply the permutation a second time instead of undoing it (the
    #   tests use experts whose weights all differ, so a mixed-up row shows). The weights are in compute dtype:
    #   cast them to h's dtype.
    # Hint 1: a zero (N k, M) buffer of slot outputs, the rows written at their slots, a weighted sum over the
    #         k slots of each token, added to h.
    # Hint 2: buffer[plan.slots] = rows (a scatter); .view(N, k, M); weights.unsqueeze(-1); .sum(1).
    # Hint 3: per_slot = zeros (N k, M) in rows' dtype;  per_slot[slots] = rows
    #         return h + (weights as h's dtype, unsqueezed, times per_slot viewed (N, k, M)) summed over k
    n_tokens, top_k = weights.shape
    per_slot = rows.new_zeros(n_tokens * top_k, rows.shape[-1])
    per_slot[plan.slots] = rows
    return h + (weights.to(h.dtype).unsqueeze(-1) * per_slot.view(n_tokens, top_k, -1)).sum(1)
    # <<<


def combine_backward(dy: torch.Tensor, rows: torch.Tensor, plan: DispatchPlan, weights: torch.Tensor):
    """(d_rows, d_weights) for combine, given dy (N, M) = dL/dy: d_rows (R, M) in the plan's order,
    d_weights (N, k) in weights' dtype (zero at dropped slots). dL/dh is dy itself (the residual)."""
    # >>> TODO(m16): the combine's backward: the rows' gradient and the weights'
    # Contract: return (d_rows, d_weights): d_rows (R, M) in rows' dtype, row r the gradient of rows[r];
    #   d_weights (N, k) in weights' dtype, the gradient of each slot's weight (0 for a dropped slot).
    # Maths: y_t = h_t + Σ_i w_{t,i} row(t, i): the row of slot (t, i) gets w_{t,i} dy_t, and the weight gets
    #   the dot product of dy_t with that row.
    # Pitfalls: the rows are in the plan's order: the token of row r is plan.tokens[r], its weight
    #   weights.view(-1)[plan.slots[r]]; scatter the dot products back to their slots (the router's backward
    #   reads d_weights by token and choice). The tests compare both with autograd.
    # Hint 1: gather each row's token gradient and weight; one product gives d_rows, a row-wise dot product the
    #         weights' gradients, which go back to their slots.
    # Hint 2: dy[plan.tokens]; weights.reshape(-1)[plan.slots]; (a * b).sum(-1); zeros(N k).index_put_ or
    #         d[plan.slots] = values; .view(N, k).
    # Hint 3: dy_rows = dy at plan.tokens;  w_rows = flattened weights at plan.slots
    #         d_rows = dy_rows times w_rows (as a column, in dy's dtype)
    #         d_weights = zeros (N k) in weights' dtype;  at plan.slots: the row-wise sum of dy_rows * rows
    #         return d_rows, d_weights viewed (N, k)
    n_tokens, top_k = weights.shape
    dy_rows = dy[plan.tokens]
    d_rows = dy_rows * weights.reshape(-1)[plan.slots].to(dy.dtype).unsqueeze(-1)
    d_weights = weights.new_zeros(n_tokens * top_k)
    d_weights[plan.slots] = (dy_rows * rows).sum(-1).to(weights.dtype)
    return d_rows, d_weights.view(n_tokens, top_k)
    # <<<
