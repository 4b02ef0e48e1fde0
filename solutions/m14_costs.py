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
    # >>> TODO(m14): bytes sent and collectives issued per step, for ZeRO stage 0, 1 or 2
    # Contract: return StepCost(sent={(axis, op): bytes}, calls={(axis, op): count}) with op among "all_reduce",
    #   "reduce_scatter", "all_gather": exactly what course/costs.py's measured_cost reads off the log of one step
    #   of train_step (the tests compare on 2 and 4 ranks, stages 0, 1 and 2, 1 and 2 micro-steps, with and
    #   without clipping, and with numbers written out by hand). Entries equal to zero may be left out.
    # Question: which collectives does one step of each stage issue, how many times, on how many bytes each?
    # Maths: the ring costs (module docstring); G buckets, ψ'_g their padded sizes (padded_numels), Ψ' = Σ ψ'_g.
    # Pitfalls: which sizes does a collective send under ZeRO? Which of stage 2's collectives run on every micro-step,
    #   which once? An all-reduce is a reduce-scatter then an all-gather: what does it cost? Which statistics does a
    #   step send, and which only with clipping under ZeRO? A group of one sends nothing: are its calls logged?
    # Hint 1: chapter 14's table ("ZeRO-1 and ZeRO-2"): for each kind of collective, in which stages does a step issue
    #         it, on what, and how often? Then price each call by its ring cost.
    # Hint 2: statistics: 2 all-reduces a step, 3 with clipping under ZeRO (stage 1 or 2), 2 (d-1)/d STATISTIC_BYTES each;
    #         all_reduce: stages 0 and 1 send 2 (d-1)/d Ψ' b in G calls; every stage adds its statistics;
    #         reduce_scatter (stage 2): m (d-1)/d Ψ' b in m G calls; all_gather (stages 1, 2): (d-1)/d Ψ' b in G calls.
    # Hint 3: n_buckets, values = len(bucket_numels), sum(padded_numels(bucket_numels, d, stage))
    #         statistics = 2 + (1 if clip and stage > 0 else 0);  ring = 2 (d - 1) / d
    #         all_reduce: bytes ring statistics STATISTIC_BYTES (+ ring values b, n_buckets more calls, if stage < 2)
    #         if stage == 2: reduce_scatter m (d - 1) / d values b, m n_buckets calls
    #         if stage > 0: all_gather (d - 1) / d values b, n_buckets calls
    n_buckets, values = len(bucket_numels), sum(padded_numels(bucket_numels, d, stage))
    statistics = 2 + (1 if clip and stage > 0 else 0)
    ring = 2 * (d - 1) / d
    sent = {(axis, "all_reduce"): ring * statistics * STATISTIC_BYTES}
    calls = {(axis, "all_reduce"): statistics}
    if stage < 2:
        sent[(axis, "all_reduce")] += ring * values * b
        calls[(axis, "all_reduce")] += n_buckets
    else:
        sent[(axis, "reduce_scatter")] = n_microbatches * (d - 1) / d * values * b
        calls[(axis, "reduce_scatter")] = n_microbatches * n_buckets
    if stage > 0:
        sent[(axis, "all_gather")] = (d - 1) / d * values * b
        calls[(axis, "all_gather")] = n_buckets
    return StepCost(sent, calls)
    # <<<


def state(bucket_numels: list[int], b: int, d: int, stage: int) -> StepCost:
    """Bytes one rank keeps between steps (StepCost.memory: parameters, gradients, optimizer)."""
    # >>> TODO(m14): parameters, gradients and AdamW state one rank keeps, for ZeRO stage 0, 1 or 2
    # Contract: return StepCost(memory={"parameters": ..., "gradients": ..., "optimizer": ...}) in bytes (integers):
    #   the tests compare with the tensors a rank really holds after a step (its weights' buffers, its gradient
    #   buffers or shards, AdamW's exp_avg and exp_avg_sq) on 2 and 4 ranks, and with numbers written out by hand.
    # Question: how many values of each kind does a rank hold at each stage, whole or as its slices?
    # Maths: Ψ' = Σ ψ'_g (padded_numels: the unpadded sum at stage 0); a member's slice of bucket g is ψ'_g / d values.
    # Pitfalls: which layout does stage 0 keep, padded or not? Which buffers does every rank keep whole under ZeRO, and
    #   which only as its slices? How many tensors does AdamW keep per parameter?
    # Hint 1: chapter 14's table ("ZeRO-1 and ZeRO-2"): which of the three does each stage keep whole, which sliced?
    # Hint 2: parameters Ψ' b at every stage; gradients Ψ' b (stages 0, 1) or Ψ' b / d (stage 2); optimizer 2 Ψ' b
    #         at stage 0, 2 Ψ' b / d under ZeRO.
    # Hint 3: values = sum(padded_numels(bucket_numels, d, stage));  shard = values // d
    #         return StepCost(memory={"parameters": values b, "gradients": shard b if stage == 2 else values b,
    #                                 "optimizer": 2 (values if stage == 0 else shard) b})
    values = sum(padded_numels(bucket_numels, d, stage))
    shard = values // d
    return StepCost(memory={"parameters": values * b, "gradients": (shard if stage == 2 else values) * b,
                            "optimizer": 2 * (values if stage == 0 else shard) * b})
    # <<<
