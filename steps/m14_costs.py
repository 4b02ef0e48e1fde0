# Generated from solutions/m14_costs.py by `python -m course.skeleton`: fill in the TODOs.
# Grade your work with `python main.py grade 14`. (skeleton 1074d1ab42bc)
"""Module 14, part 5 - what one step of data parallelism costs a rank: bytes sent, bytes kept.

Notation (docs/glossary.md): d ranks on the data axis, m micro-steps per optimizer step, b bytes a
value; the model's trainable parameters fall into G buckets of ψ_1 .. ψ_G values (Ψ = Σ ψ_g).
Under ZeRO each bucket is padded to a multiple of d: ψ'_g = d ceil(ψ_g / d), Ψ' = Σ ψ'_g (stage 0
does not pad: ψ'_g = ψ_g).

Bytes sent, with the ring algorithms of course/collectives.py (an all-reduce of S bytes sends
2 (d - 1) / d S; an all-gather or a reduce-scatter of S bytes in all sends (d - 1) / d S):

    stage 0 (DDP)  one all-reduce per bucket, on the last micro-step only     2 (d-1)/d Ψ b,    G calls
    stage 1        the same all-reduces, then one all-gather of the updated
                   weights per bucket                                       + (d-1)/d Ψ' b,    G calls
    stage 2        one reduce-scatter per bucket *every micro-step*           m (d-1)/d Ψ' b,  m G calls
                   (and stage 1's all-gathers)

and, every stage, the step's small all-reduces of one 8-byte value each (STATISTIC_BYTES): the
global token count (before the first backward), the loss (for the log), and with clipping under
ZeRO the squared norm's partial sums (DDP clips without sending: every rank holds every gradient).

Bytes kept between steps (StepCost.memory): "parameters", "gradients" and "optimizer" (AdamW's
exp_avg and exp_avg_sq, in the parameters' dtype; its step counters are not counted):

    stage 0   Ψ b      Ψ b         2 Ψ b          = 4 Ψ b
    stage 1   Ψ' b     Ψ' b        2 Ψ' b / d     ~ (2 + 2/d) Ψ b
    stage 2   Ψ' b     Ψ' b / d    2 Ψ' b / d     ~ (1 + 3/d) Ψ b

(Stage 3 - module 07 - shards the parameters too: ~ 4 Ψ b / d plus the gathered blocks.)
"""
from __future__ import annotations

from course.costs import StepCost

STATISTIC_BYTES = 8  # one int64 token count, one float64 loss, one float64 squared norm


def padded_numels(bucket_numels: list[int], d: int, stage: int) -> list[int]:
    """ψ'_g: each bucket's values as laid out (padded to a multiple of d under ZeRO)."""
    return list(bucket_numels) if stage == 0 else [-(-n // d) * d for n in bucket_numels]


def traffic(bucket_numels: list[int], b: int, d: int, stage: int, n_microbatches: int = 1, clip: bool = False,
            axis: str = "d") -> StepCost:
    """The collectives one rank issues in one optimizer step, by kind, over the data axis `axis`: a
    StepCost with `sent` (bytes) and `calls` (see the module docstring). `bucket_numels` are the ψ_g."""
    # TODO(m14): bytes sent and collectives issued per step, for ZeRO stage 0, 1 or 2
    # Contract: return StepCost(sent={(axis, op): bytes}, calls={(axis, op): count}) with op among "all_reduce",
    #   "reduce_scatter", "all_gather": exactly what course/costs.py's measured_cost reads off the log of one step
    #   of train_step (the tests compare on 2 and 4 ranks, stages 0, 1 and 2, 1 and 2 micro-steps, with and
    #   without clipping, and with numbers written out by hand). Entries equal to zero may be left out.
    # Maths: the module docstring's table; the statistics' all-reduces send 2 (d - 1) / d STATISTIC_BYTES each:
    #   2 per step, 3 with clipping under ZeRO (stage 1 or 2).
    # Pitfalls: the padded sizes under ZeRO (padded_numels); ZeRO-2's reduce-scatters on every micro-step but its
    #   all-gathers once; (d - 1) / d for an all-reduce (it is a reduce-scatter and an all-gather: twice that);
    #   a group of one sends nothing, but its calls are still issued (and logged).
    raise NotImplementedError('TODO(m14): bytes sent and collectives issued per step, for ZeRO stage 0, 1 or 2')


def state(bucket_numels: list[int], b: int, d: int, stage: int) -> StepCost:
    """Bytes one rank keeps between steps (StepCost.memory: parameters, gradients, optimizer)."""
    # TODO(m14): parameters, gradients and AdamW state one rank keeps, for ZeRO stage 0, 1 or 2
    # Contract: return StepCost(memory={"parameters": ..., "gradients": ..., "optimizer": ...}) in bytes (integers):
    #   the tests compare with the tensors a rank really holds after a step (its weights' buffers, its gradient
    #   buffers or shards, AdamW's exp_avg and exp_avg_sq) on 2 and 4 ranks, and with numbers written out by hand.
    # Maths: the module docstring's second table; a shard is ψ'_g / d values of bucket g.
    # Pitfalls: stage 0 lays the parameters out unpadded; ZeRO's parameters and ZeRO-1's gradients are the padded
    #   flat buffers (every rank keeps all of them); AdamW keeps two moments.
    raise NotImplementedError('TODO(m14): parameters, gradients and AdamW state one rank keeps, for ZeRO stage 0, 1 or 2')
