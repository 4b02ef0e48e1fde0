# Generated from solutions/m14_train_step.py by `python -m course.skeleton`: fill in the TODOs.
# Grade your work with `python main.py grade 14`. (skeleton a0e8421451a8)
"""Module 14, part 3 - one optimizer step of a data-parallel model: its rows of the global batch,
m micro-steps of gradient accumulation that send nothing until the last, and the step's loss, the
mean over the global batch's real tokens, with no collective waited for that DDP's loop does not
wait for.

Every rank draws the whole global batch of B rows from the seed (as module 06's loop does) and
keeps its B/d rows: member i of the data group keeps rows i B/d .. (i + 1) B/d - 1. It cuts them
into m microbatches. The loss of the step is the mean over every *real* token of the global batch;
a target of IGNORE_INDEX (-100, PyTorch's convention) marks padding, which is neither a term nor
counted. Its denominator, the global count of real tokens, is a sum over the ranks, which has to
travel like every other collective. A step that waited for it before its first backward would pay
that collective's whole latency, every step, with nothing to hide it behind; PyTorch's DDP loop (a mean per rank, averaged by DDP) has no such collective, and
gets the loss wrong as soon as ranks hold different numbers of real tokens. So the count is started
at the step's start and waited for only where it is needed, while the micro-steps compute; the
logged loss's sum over ranks travels while the optimizer steps. Which gradients the backwards can
compute before the count has arrived, and what is left to do once it has, is train_step's question
(docs/14-data-parallel.md works it on another loss).

Gradient accumulation: micro-steps 0 .. m - 2 run under `no_sync()` (gradients accumulate in the
buckets, nothing is sent), the last one sends. ZeRO-2 keeps only a shard of the gradients, so it
sends on every micro-step (`syncs_every_microstep`, m14_zero).

Two models: `train_step` drives an autograd model whose forward returns logits (module 00's MLP,
course/reference_llama.py's ModularLlama); `DataParallelLlama` is module 06's Llama, whose
hand-written backward hands each block's gradients to `ready` through `on_block_grads`. Module 06's
`forward_backward(tokens, targets, n_tokens)` divides a piece's summed token losses by the
`n_tokens` it is given, and its gradients are those of that quotient.
"""
from __future__ import annotations

import contextlib
from dataclasses import fields

import torch
import torch.nn as nn
import torch.nn.functional as F

from course.mesh import Group
from .m06_llama_block import BlockWeights, LlamaConfig
from .m06_llama_model import IGNORE_INDEX, LOSS_CHUNK, LlamaModel  # IGNORE_INDEX = -100: padding, not counted
from .m12_tp_linear import InFlight  # a collective started without waiting, and the tensor it fills
from .m14_data_parallel import DataParallel


def my_rows(batch: int, group: Group) -> slice:
    """The rows of a global batch of `batch` rows that this member of the data group trains on."""
    if batch % group.size:
        raise ValueError(f"a batch of {batch} rows does not split evenly over d={group.size} ranks")
    rows = batch // group.size
    return slice(group.index * rows, (group.index + 1) * rows)


def global_token_count(targets: torch.Tensor, group: Group) -> InFlight:
    """Start counting the real (not IGNORE_INDEX) targets of every member's `targets`, without waiting:
    the InFlight's wait() gives the count, a 0-d int64 tensor, the same on every member."""
    # Given, like global_loss_sum below: N_real is a sum over the ranks of each rank's own count, an int64 (a
    # float32 count is exact only up to 2^24 tokens); started without waiting, it travels while the micro-steps
    # compute, and train_step waits where it first needs the count.
    count = (targets != IGNORE_INDEX).sum()
    return InFlight(count, group.collectives.all_reduce(count, label="token count", async_op=True))


def global_loss_sum(loss_sum: torch.Tensor, group: Group) -> InFlight:
    """Start summing every rank's summed token losses over the group (float64), for the log, without waiting."""
    total = loss_sum.detach().to(torch.float64).reshape(1)
    return InFlight(total, group.collectives.all_reduce(total, label="loss", async_op=True))


def train_step(ddp: DataParallel, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
               n_microbatches: int, optimizer: torch.optim.Optimizer, max_norm: float | None = None) -> float:
    """One optimizer step of an autograd `model` (forward: inputs -> logits) replicated by `ddp`, on the
    global batch (inputs, targets): this rank's rows, in `n_microbatches` micro-steps; `max_norm` clips
    the gradients to that global norm. Returns the step's global mean loss."""
    mine = my_rows(inputs.shape[0], ddp.group)
    inputs, targets = inputs[mine], targets[mine]
    if inputs.shape[0] % n_microbatches:
        raise ValueError(f"{inputs.shape[0]} rows a rank do not split into {n_microbatches} equal microbatches")
    count = global_token_count(targets, ddp.group)  # in flight while the micro-steps compute
    # TODO(m14): the micro-steps: a loss normalised by the global count, sent on the last micro-step only
    # Contract: this rank's rows (inputs, targets) are cut into n_microbatches equal chunks, run in order: the forward
    #   (the model maps a chunk of inputs to logits (..., V)), the chunk's loss over its real tokens, its backward.
    #   Buckets leave during the last micro-step only (during every one when ddp.syncs_every_microstep), a backward
    #   inside ddp.no_sync() sends nothing, and every backward that sent is followed by DataParallel.finish. When the
    #   block ends: loss_sum is this rank's summed token losses over its micro-steps, a float64 0-d tensor whatever the
    #   model's dtype; n_tokens is the step's count of real tokens (an int); the gradients ddp keeps (ddp.gradients(),
    #   what ddp.step reads) are, on every rank, those of the step's loss, the mean over every real token of the
    #   global batch; and the count was waited for only after the last bucket left. The tests compare with one process
    #   on the whole batch for (d, m) = (1, 4), (2, 2), (4, 1), with microbatches holding 16, 11, 5 and 1 real tokens
    #   and collectives that deliver only at wait(); read from the log when buckets leave and when the count was
    #   waited for; and run a float32 model whose micro-steps' losses a float32 sum cannot add exactly.
    # Question: while the backwards run, the count has not arrived. What can each backward differentiate so that the
    #   buckets' sums are the step's gradient up to a factor, and what does that leave to do, and when?
    # Pitfalls: a microbatch's mean divided by m d weighs a token of a microbatch with 1 real token how many times one
    #   of a microbatch with 16? What does the count's tensor hold before its wait()? What does finish() do to buffers
    #   scaled before it lands the sums? What does the step wait for if the count is waited for before the first
    #   backward? If the first micro-step sends, who sums the later micro-steps' gradients over the ranks? What does
    #   finish() say after a backward that sent nothing? Up to what size are integers exact in float32?
    raise NotImplementedError('TODO(m14): the micro-steps: a loss normalised by the global count, sent on the last micro-step only')
    loss = global_loss_sum(loss_sum, ddp.group)  # travels while the optimizer steps
    ddp.step(optimizer, max_norm)
    ddp.zero_grad()
    return loss.wait().item() / n_tokens


class DataParallelLlama(LlamaModel):
    """Module 06's Llama replicated over `group`: its backward loop hands each block's gradients to the
    buckets (on_block_grads) as soon as they exist, so block l's bucket travels while block l - 1's
    backward computes. `train_step` has the contract of the course's training loop (`fit`)."""

    def __init__(self, cfg: LlamaConfig, group: Group, bucket_cap_bytes: int, seed: int = 0, dtype=torch.float32,
                 loss_chunk: int = LOSS_CHUNK):
        super().__init__(cfg, seed, dtype, loss_chunk=loss_chunk)
        self.ddp = DataParallel(self.ready_order()[::-1], group, bucket_cap_bytes)

    def ready_order(self) -> list[tuple[str, torch.Tensor]]:
        """(name, weight) in the order the backward hands their gradients over: blocks from the last, then
        the embedding, final norm and LM head (forward_backward returns theirs at the end). DDP can only
        guess that order from the order a module registers its parameters in (the forward's); here it is
        known, so DataParallel gets the parameters in the order a forward-ordered registration would
        list them: this one, back to front."""
        names = [f.name for f in fields(BlockWeights)]
        blocks = [(f"blocks.{l}.{name}", t) for l in reversed(range(self.cfg.n_layers))
                  for name, t in zip(names, self.blocks[l].tensors())]
        return blocks + [("embedding", self.embedding), ("final_norm", self.final_norm), ("lm_head", self.lm_head)]

    def on_block_grads(self, layer: int, grads: BlockWeights):
        """Module 06's backward calls this once block `layer`'s gradients are final: each goes to its bucket
        at once, while the earlier blocks' backwards still run."""
        for weight, grad in zip(self.blocks[layer].tensors(), grads.tensors(), strict=True):
            self.ddp.ready(weight, grad)

    def train_step(self, tokens: torch.Tensor, targets: torch.Tensor, n_microbatches: int, optimizer) -> float:
        """One optimizer step on the global batch (every rank passes all of it and keeps its rows), in
        `n_microbatches` micro-steps; returns the step's global mean loss. `optimizer` updates
        self.ddp.parameters(), whose .grad are the buckets' views."""
        group = self.ddp.group
        mine = my_rows(tokens.shape[0], group)
        tokens, targets = tokens[mine], targets[mine]
        count = global_token_count(targets, group)  # in flight while the micro-steps compute
        loss_sum = torch.zeros((), dtype=torch.float64)
        # TODO(m14): module 06's micro-steps: each microbatch's loss over the step's count, its gradients to the buckets
        # Contract: tokens, targets are this rank's rows, cut into n_microbatches equal chunks run in order, each through
        #   module 06's forward_backward(tok, tgt, n_tokens): its loss and gradients are the chunk's summed token losses
        #   divided by the n_tokens it is given, which it needs before it runs. During it the blocks' gradients reach the
        #   buckets through on_block_grads (above); it returns those of the embedding, the final norm and the LM head at
        #   the end, and the buckets need them too (self.ddp.ready). Buckets leave during the last micro-step only, and the
        #   DataParallel's finish follows it. When the block ends: loss_sum holds this rank's summed token losses (float64, 0-d),
        #   n_tokens the step's count (an int), and the buckets' gradients (self.ddp.gradients()) are those of the step's
        #   mean loss; the count was waited for only after the last bucket left. The tests train on 2 ranks x 2
        #   micro-steps and on the d axis of a d x t mesh against module 06's single-process train(), at 1e-12, with
        #   collectives that deliver only at wait().
        # Question: forward_backward wants its divisor before it runs, and the count is still in flight then. Which
        #   divisor makes the pieces add up to something you can still turn into the step's gradient?
        # Pitfalls: what does forward_backward divide by when it is given no n_tokens? What does waiting for the count
        #   before the first forward_backward cost? What does finish() report when three gradients never reach the
        #   buckets? What has forward_backward's loss already been divided by?
        raise NotImplementedError("TODO(m14): module 06's micro-steps: each microbatch's loss over the step's count, its gradients to the buckets")
        loss = global_loss_sum(loss_sum, group)  # travels while the optimizer steps
        self.ddp.step(optimizer)
        self.weights.invalidate()  # the weights changed: a weight source must not serve old copies
        self.ddp.zero_grad()
        return loss.wait().item() / n_tokens
