# Generated from solutions/m14_costs.py by `python -m course.skeleton`: fill in the TODOs.
# Grade your work with `python main.py grade 14`. (skeleton 5433824b9c99)
"""Module 14, part 5 - what one step of data parallelism costs a rank: bytes sent, bytes kept.

Notation (docs/glossary.md): d ranks on the data axis, m micro-steps per optimizer step, b bytes a
value; the model's trainable parameters fall into G buckets of ψ_1 .. ψ_G values (Ψ = Σ ψ_g).
Under ZeRO each bucket is padded to a multiple of d: ψ'_g = d ceil(ψ_g / d), Ψ' = Σ ψ'_g (stage 0
does not pad: ψ'_g = ψ_g).

Bytes sent, with the ring algorithms of course/collectives.py: an all-reduce of S bytes sends
2 (d - 1) / d S per rank, an all-gather or a reduce-scatter of S bytes in all sends (d - 1) / d S. Which
collectives each stage issues, and how often, is chapter 14's table ("ZeRO-1 and ZeRO-2"); every stage
also issues the step's small all-reduces of one 8-byte value each (STATISTIC_BYTES): the global token
count (started at the step's start, waited for after the last backward), the loss (for the log), and
with clipping under ZeRO the squared norm's partial sums (DDP clips without sending: every rank holds
every gradient).

Bytes kept between steps (StepCost.memory): "parameters", "gradients" and "optimizer" (AdamW's
exp_avg and exp_avg_sq, in the parameters' dtype; its step counters are not counted), as the rank's
tensors hold them: chapter 14's table says which are whole and which are slices.
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
    # Question: which collectives does one step of each stage issue, how many times, on how many bytes each?
    # Maths: the ring costs (module docstring); G buckets, ψ'_g their padded sizes (padded_numels), Ψ' = Σ ψ'_g.
    # Pitfalls: which sizes does a collective send under ZeRO? Which of stage 2's collectives run on every micro-step,
    #   which once? An all-reduce is a reduce-scatter then an all-gather: what does it cost? Which statistics does a
    #   step send, and which only with clipping under ZeRO? A group of one sends nothing: are its calls logged?
    raise NotImplementedError('TODO(m14): bytes sent and collectives issued per step, for ZeRO stage 0, 1 or 2')


def state(bucket_numels: list[int], b: int, d: int, stage: int) -> StepCost:
    """Bytes one rank keeps between steps (StepCost.memory: parameters, gradients, optimizer)."""
    # TODO(m14): parameters, gradients and AdamW state one rank keeps, for ZeRO stage 0, 1 or 2
    # Contract: return StepCost(memory={"parameters": ..., "gradients": ..., "optimizer": ...}) in bytes (integers):
    #   the tests compare with the tensors a rank really holds after a step (its weights' buffers, its gradient
    #   buffers or shards, AdamW's exp_avg and exp_avg_sq) on 2 and 4 ranks, and with numbers written out by hand.
    # Question: how many values of each kind does a rank hold at each stage, whole or as its slices?
    # Maths: Ψ' = Σ ψ'_g (padded_numels: the unpadded sum at stage 0); a member's slice of bucket g is ψ'_g / d values.
    # Pitfalls: which layout does stage 0 keep, padded or not? Which buffers does every rank keep whole under ZeRO, and
    #   which only as its slices? How many tensors does AdamW keep per parameter?
    raise NotImplementedError('TODO(m14): parameters, gradients and AdamW state one rank keeps, for ZeRO stage 0, 1 or 2')
