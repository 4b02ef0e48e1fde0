# Generated from solutions/m07_fsdp.py by `python -m course.skeleton`: fill in the TODOs.
# Grade your work with `python main.py grade 07`. (skeleton b2f2c3545c92)
"""Module 07 - FSDP: every rank keeps 1/N of each block; whole blocks exist only while in use.

Data parallel: each rank trains on its own rows of the global batch. Sharded: each rank keeps only
its shard of every block's flat buffer (m07_flat_shards), and its AdamW updates only that shard.
Module 06's loop asks a weight source for each block; ours (m07_sharded_weights) all-gathers the
block from the shards just in time, into one of two buffers.

    forward   gather(0); for l: gather(l + 1), get(l), block l, release(l)
    backward  for l from the last: gather(l - 1), get(l), block l's backward, release(l),
              reduce-scatter l's gradient (summed over ranks) to the shard owners, without
              waiting: it is finished (waited for, added to the shard's gradient) just before the
              next one starts, so it travels while block l - 1's backward computes

In the backward the next all-gather is issued *before* the current reduce-scatter (explicit
backward prefetch): with one communication queue, a reduce-scatter issued first would delay the
gather the next block's backward is waiting for.

The embedding, final norm and LM head are small here and stay replicated: every rank holds all of
them and their gradients are summed with one all-reduce per optimizer step (as plain data
parallelism does). Gradients are averaged over the global batch: each microbatch's contribution is
scaled by 1 / (n_microbatches * world_size).
"""
from dataclasses import dataclass

import torch
import torch.distributed as dist

from course.collectives import Collectives
from course.dataset import load_text, random_batch
from .m06_llama_block import LlamaConfig
from .m06_llama_model import LOSS_CHUNK, LlamaModel
from .m07_flat_shards import FlatLayout
from .m07_sharded_weights import ShardedWeights


@dataclass
class ReduceScatterInFlight:
    """A block's gradient reduce-scatter that has been started and not yet finished."""
    work: object              # what the collective returned: .wait() until it is done
    full: torch.Tensor        # the block's whole flat gradient, which the collective reads until then
    received: torch.Tensor    # this rank's slice of the sum over ranks, once it is done
    layer: int                # whose gradient shard it adds to


class FSDPLlama(LlamaModel):
    """Module 06's Llama with its blocks sharded over `world_size` ranks (those of `collectives`)."""

    def __init__(self, cfg: LlamaConfig, rank: int, world_size: int, collectives: Collectives, seed: int = 0,
                 dtype=torch.float32, loss_chunk: int = LOSS_CHUNK):
        # Every rank builds the same full model from the seed, then keeps only its shards, so the
        # sharded model starts exactly where a single process would.
        super().__init__(cfg, seed, dtype, loss_chunk=loss_chunk)
        self.rank, self.world_size, self.collectives = rank, world_size, collectives
        self.layout = FlatLayout(self.blocks[0], self.world_size)
        # TODO(m07): keep this rank's shard of every block, and nothing of the full blocks
        # self.blocks holds the full model's blocks (every rank built the same ones from the seed). Set self.shards:
        # one tensor per layer, this rank's shard of that block's padded flat buffer (self.layout, your FlatLayout).
        # The full blocks are dropped on the next line; afterwards a rank must hold only its shards, and the
        # optimizer updates each shard in place.
        # Pitfall: a shard is a view, and a view keeps its whole buffer alive: the test measures the memory behind
        # self.shards and fails if it is one full block per layer instead of one shard.
        raise NotImplementedError("TODO(m07): keep this rank's shard of every block, and nothing of the full blocks")
        self.blocks = []  # from here on, whole blocks exist only in the weight source's two buffers
        self.weights = ShardedWeights(self.layout, self.shards, collectives)
        self.replicated = [self.embedding, self.final_norm, self.lm_head]
        self.grad_shards = [torch.zeros_like(s) for s in self.shards]
        self.replicated_grads = [torch.zeros_like(p) for p in self.replicated]
        self.grad_scale = 1.0  # set per optimizer step: 1 / (n_microbatches * world_size)
        self.in_flight: ReduceScatterInFlight | None = None

    def parameters(self) -> list[torch.Tensor]:
        """What this rank's optimizer updates: its block shards and the replicated weights."""
        return [*self.shards, *self.replicated]

    def grads(self) -> list[torch.Tensor]:
        """The accumulated gradients, in the order of parameters()."""
        return [*self.grad_shards, *self.replicated_grads]

    def backward_blocks(self, dx: torch.Tensor, stores):
        """Module 06's backward loop, plus a reduce-scatter of each block's gradient as soon as it exists."""
        n_layers = self.cfg.n_layers
        # TODO(m07): the backward loop, each block's gradient reduce-scattered as soon as it exists
        # Module 06's backward loop (gather one layer ahead, get, the block's backward, clear the store, release),
        # plus: right after a layer's release, start the reduce-scatter of its gradient (reduce_scatter_grad); after
        # the loop, finish the last one still in flight, so that every layer's sum over ranks has landed in
        # self.grad_shards when this returns.
        # Returns (dx, this rank's gradient shards). dx, the gradient of the embedded input, is what forward_backward
        # needs (it becomes the embedding's gradient). The second item becomes LlamaGrads.blocks: in FSDP no whole
        # per-layer gradient may outlive the loop (L of them alive is what sharding avoids), so the blocks'
        # gradients exist only as the shards in self.grad_shards (LlamaGrads takes a flat shard per layer in place
        # of a BlockWeights). The optimizer reads them through grads(), in parameters()' order.
        # Pitfalls the grader catches: the order of calls (the test records gather, get, backward, release and the
        # collectives): the next layer's gather goes out *before* this layer's reduce-scatter (the module docstring:
        # one communication queue), and a layer is released only after its backward ran. A reduce-scatter never
        # waited for fails at the end of the step (its sum may not have arrived when the optimizer reads it).
        raise NotImplementedError("TODO(m07): the backward loop, each block's gradient reduce-scattered as soon as it exists")

    def reduce_scatter_grad(self, layer: int, grads):
        """Start summing the block's gradient over ranks, each rank receiving its own slice, without
        waiting: it travels while the next block's backward computes. The one started for the block
        before is finished first, so at most one is in flight (and at most two full gradients exist)."""
        # TODO(m07): finish the reduce-scatter in flight, then start this block's without waiting
        # grads is the block's full gradient on this rank (a BlockWeights, from this rank's rows of the batch). Start
        # summing it over ranks so that each rank receives its own shard_numel slice of the sum, in the layout of
        # the weights' shards, without waiting for it. Before that, finish the one started for the previous block:
        # at most one in flight, at most two whole gradients alive. Leave in self.in_flight (a
        # ReduceScatterInFlight) everything finish_reduce_scatter needs.
        # Contract with the tests: the collective is asynchronous and labelled "block <layer>"; starting one while
        # another is still in flight fails at once (each keeps a whole block's gradient alive until waited for).
        # Pitfalls: the collective reads the flat gradient until it completes, so self.in_flight keeps it alive.
        # Receive into a fresh tensor, not into grad_shards: the slice is added, scaled, when it is finished
        # (that is how microbatches accumulate).
        raise NotImplementedError("TODO(m07): finish the reduce-scatter in flight, then start this block's without waiting")

    def finish_reduce_scatter(self):
        """Wait for the reduce-scatter in flight, if any, and add its slice, scaled, to the shard's gradient."""
        if self.in_flight is None:
            return
        # TODO(m07): complete the reduce-scatter in flight; add its slice, scaled, to the gradient shard
        # self.in_flight (not None here) holds the work, the flat gradient it reads, the slice it receives and the
        # layer. Once the work has completed, add the received slice times self.grad_scale (1 / (n_microbatches *
        # world_size): the gradient of the mean loss over the global batch) into self.grad_shards[layer]. Afterwards
        # nothing is in flight.
        # Pitfalls: a missing scale moves the losses by only ~1e-7 (AdamW barely notices a constant factor), yet
        # that is 10^5 times the tests' tolerance against single-process training (their message names the scale).
        # Assigning instead of adding loses the earlier microbatches' gradients.
        raise NotImplementedError('TODO(m07): complete the reduce-scatter in flight; add its slice, scaled, to the gradient shard')

    def train_step(self, tokens: torch.Tensor, targets: torch.Tensor, n_microbatches: int, optimizer) -> float:
        """One optimizer step on this rank's rows (split into n_microbatches); returns their mean loss."""
        for g in self.grads():
            g.zero_()
        self.grad_scale = 1.0 / (n_microbatches * self.world_size)
        losses = [self.accumulate(tok, tgt) for tok, tgt in
                  zip(tokens.chunk(n_microbatches), targets.chunk(n_microbatches), strict=True)]
        self.reduce_and_step(optimizer)
        return sum(losses) / n_microbatches

    def accumulate(self, tokens: torch.Tensor, targets: torch.Tensor) -> float:
        """Forward and backward of one microbatch, its gradients added (times grad_scale) to this rank's
        accumulators: the blocks' by their reduce-scatters, the replicated weights' here. Returns its loss."""
        loss, grads = self.forward_backward(tokens, targets)  # block gradients land in grad_shards
        # TODO(m07): add this microbatch's replicated-weight gradients to their accumulators
        # grads is this microbatch's LlamaGrads on this rank. The blocks' gradients are already accumulated (by the
        # reduce-scatters). Add the embedding's, the final norm's and the LM head's gradients, each times
        # self.grad_scale, into self.replicated_grads (in the order of self.replicated). They are summed over ranks
        # once per step, later (reduce_and_step).
        # Pitfalls: assigning instead of adding loses the earlier microbatches; a missing scale is caught by the
        # 1e-12 tolerance against single-process training (2 to 4 ranks, 1 and 2 microbatches).
        raise NotImplementedError("TODO(m07): add this microbatch's replicated-weight gradients to their accumulators")
        return loss.item()

    def reduce_and_step(self, optimizer):
        """After the last microbatch: sum the replicated gradients over ranks, step, invalidate."""
        # TODO(m07): sum the replicated gradients over ranks in one collective; step; invalidate
        # After the last microbatch each rank holds its own scaled sum of the replicated gradients. Make every rank
        # hold the sum over ranks, with a single all-reduce for all three tensors (the tests count one per step).
        # Then give the optimizer the gradients (it reads each parameter's .grad; grads() is in parameters()'
        # order), step, and invalidate the weight source: the block shards changed, so gathered copies are stale.
        # Pitfalls: three all-reduces give the right numbers but fail the count; without invalidate() the next step
        # reuses stale blocks from the buffers (the losses drift from single-process training).
        raise NotImplementedError('TODO(m07): sum the replicated gradients over ranks in one collective; step; invalidate')


def global_mean(value: float) -> float:
    """The mean of a number over ranks (for the losses returned; not part of the training's traffic)."""
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def train_fsdp(cfg: LlamaConfig, steps: int, batch: int = 16, n_microbatches: int = 1, lr: float = 3e-3,
               seed: int = 0, dtype=torch.float32, collectives: Collectives | None = None, on_step=None):
    """Module 06's `train`, sharded over the ranks of the default group: the same initial model and
    the same global batches (every rank draws them all from the seed), each rank taking its
    batch // world_size rows. Returns (model, losses), the losses averaged over ranks.
    `on_step(step, loss)`, if given, is called after every step."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = FSDPLlama(cfg, rank, world_size, collectives or Collectives(), seed, dtype)
    data, generator = load_text(), torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    rows = batch // world_size
    losses = []
    for step in range(steps):
        tokens, targets = random_batch(data, batch, cfg.max_seq_len, generator)
        mine = slice(rank * rows, (rank + 1) * rows)
        losses.append(global_mean(model.train_step(tokens[mine], targets[mine], n_microbatches, optimizer)))
        if on_step:
            on_step(step, losses[-1])
    return model, losses
