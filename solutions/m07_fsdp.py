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
        # >>> TODO(m07): keep this rank's shard of every block (a copy: the full blocks are dropped next)
        # Hint: your FlatLayout flattens a block and cuts out this rank's shard. A shard is a view, which
        #       keeps the whole flat buffer alive: keep a copy (.clone()) so the full buffer can be freed.
        self.shards = [self.layout.shard(self.layout.flatten(b), self.rank).clone() for b in self.blocks]
        # <<<
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
        # >>> TODO(m07): the backward loop with explicit prefetch and a reduce-scatter per block
        # Hint: module 06's backward loop, plus reduce_scatter_grad(layer, grads) as soon as the layer's
        #       gradient exists, after its release. The next layer's gather thus goes out *before* this
        #       layer's reduce-scatter (see the module docstring); the tests check that order of calls.
        # Hint: the last reduce-scatter is still in flight after the loop: finish it before returning
        #       (dx, self.grad_shards).
        self.weights.gather(n_layers - 1)
        for layer in reversed(range(n_layers)):
            if layer > 0:
                self.weights.gather(layer - 1)  # issued before this layer's reduce-scatter
            w = self.weights.get(layer)
            dx, grads = self.block.backward(w, dx, stores[layer])
            stores[layer].clear()
            self.weights.release(layer)
            self.reduce_scatter_grad(layer, grads)
        self.finish_reduce_scatter()
        return dx, self.grad_shards
        # <<<

    def reduce_scatter_grad(self, layer: int, grads):
        """Start summing the block's gradient over ranks, each rank receiving its own slice, without
        waiting: it travels while the next block's backward computes. The one started for the block
        before is finished first, so at most one is in flight (and at most two full gradients exist)."""
        # >>> TODO(m07): finish the reduce-scatter in flight, then start this block's without waiting
        # Hint: collectives.reduce_scatter(shard_out, full_flat, label=f"block {layer}", async_op=True)
        #       returns at once with a work to wait on; the sum over ranks lands in shard_out once it is done.
        # Hint: keep in self.in_flight (a ReduceScatterInFlight) what finish_reduce_scatter needs, the flat
        #       gradient included: the collective reads it until it is done.
        self.finish_reduce_scatter()
        full = self.layout.flatten(grads)
        received = torch.empty_like(self.grad_shards[layer])
        work = self.collectives.reduce_scatter(received, full, label=f"block {layer}", async_op=True)
        self.in_flight = ReduceScatterInFlight(work, full, received, layer)
        # <<<

    def finish_reduce_scatter(self):
        """Wait for the reduce-scatter in flight, if any, and add its slice, scaled, to the shard's gradient."""
        if self.in_flight is None:
            return
        # >>> TODO(m07): wait for the reduce-scatter in flight and accumulate its slice into grad_shards
        # Hint: add with alpha=grad_scale; then nothing is in flight (None).
        self.in_flight.work.wait()
        self.grad_shards[self.in_flight.layer].add_(self.in_flight.received, alpha=self.grad_scale)
        self.in_flight = None
        # <<<

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
        # >>> TODO(m07): accumulate the replicated weights' gradients (embedding, final norm, LM head)
        for acc, g in zip(self.replicated_grads, (grads.embedding, grads.final_norm, grads.lm_head), strict=True):
            acc.add_(g, alpha=self.grad_scale)
        # <<<
        return loss.item()

    def reduce_and_step(self, optimizer):
        """After the last microbatch: sum the replicated gradients over ranks, step, invalidate."""
        # >>> TODO(m07): sum the replicated gradients over ranks (one all-reduce), then step and invalidate
        # Hint: one collective for all three (the tests count one all-reduce per step): pack them into one
        #       flat buffer, all-reduce it (collectives.all_reduce sums in place), and unpack the sums into them.
        # Hint: the optimizer reads each parameter's .grad (grads() is in parameters()' order); after its
        #       step, invalidate the weight source: the gathered copies of the blocks are now stale.
        flat = torch.cat([g.reshape(-1) for g in self.replicated_grads])
        self.collectives.all_reduce(flat, label="replicated grads")
        for g, summed in zip(self.replicated_grads, flat.split([g.numel() for g in self.replicated_grads])):
            g.copy_(summed.view_as(g))
        for p, g in zip(self.parameters(), self.grads()):
            p.grad = g
        optimizer.step()
        self.weights.invalidate()
        # <<<


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
