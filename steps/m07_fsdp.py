# Generated from solutions/m07_fsdp.py by `python -m course.skeleton`: fill in the TODOs.
# Grade your work with `python main.py grade 07`. (skeleton 3a40ab83577c)
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
parallelism does). Gradients are averaged over the global batch: each micro-step's contribution is
scaled by 1 / (micro_steps * world_size).
"""
import argparse
import time

import torch
import torch.distributed as dist

from course.collectives import Collectives
from .m02_comms import init_distributed
from .m06_llama_block import LlamaConfig
from .m06_llama_model import LOSS_CHUNK, LlamaModel, load_text, random_batch, train
from .m07_flat_shards import FlatLayout
from .m07_payload import fsdp_traffic
from .m07_sharded_weights import ShardedWeights

TITLE = "FSDP: sharded blocks, all-gathered just in time, gradients reduce-scattered"
NPROC = 2


class FSDPLlama(LlamaModel):
    """Module 06's Llama with its blocks sharded over the ranks of the default process group."""

    def __init__(self, cfg: LlamaConfig, comm: Collectives, seed: int = 0, dtype=torch.float32,
                 loss_chunk: int = LOSS_CHUNK):
        # Every rank builds the same full model from the seed, then keeps only its shards, so the
        # sharded model starts exactly where a single process would.
        super().__init__(cfg, seed, dtype, loss_chunk=loss_chunk)
        self.rank, self.world_size, self.comm = dist.get_rank(), dist.get_world_size(), comm
        self.layout = FlatLayout(self.blocks[0], self.world_size)
        # TODO(m07): keep this rank's shard of every block (a copy: the full blocks are dropped next)
        # Hint: your FlatLayout flattens a block and cuts out this rank's shard. A shard is a view, which
        #       keeps the whole flat buffer alive: keep a copy (.clone()) so the full buffer can be freed.
        raise NotImplementedError("TODO(m07): keep this rank's shard of every block (a copy: the full blocks are dropped next)")
        self.blocks = []  # from here on, whole blocks exist only in the weight source's two buffers
        self.weights = ShardedWeights(self.layout, self.shards, comm)
        self.replicated = [self.embedding, self.final_norm, self.lm_head]
        self.grad_shards = [torch.zeros_like(s) for s in self.shards]
        self.replicated_grads = [torch.zeros_like(p) for p in self.replicated]
        self.grad_scale = 1.0  # set per optimizer step: 1 / (micro_steps * world_size)
        self.in_flight = None  # (work, full gradient, slice received, layer) of a started reduce-scatter

    def parameters(self) -> list[torch.Tensor]:
        """What this rank's optimizer updates: its block shards and the replicated weights."""
        return [*self.shards, *self.replicated]

    def grads(self) -> list[torch.Tensor]:
        """The accumulated gradients, in the order of parameters()."""
        return [*self.grad_shards, *self.replicated_grads]

    def backward_blocks(self, dx: torch.Tensor, stores):
        """Module 06's backward loop, plus a reduce-scatter of each block's gradient as soon as it exists."""
        n_layers = self.cfg.n_layers
        # TODO(m07): the backward loop with explicit prefetch and a reduce-scatter per block
        # Hint: module 06's backward loop, plus reduce_scatter_grad(layer, grads) as soon as the layer's
        #       gradient exists, after its release. The next layer's gather thus goes out *before* this
        #       layer's reduce-scatter (see the module docstring); the tests check that order of calls.
        # Hint: the last reduce-scatter is still in flight after the loop: finish it before returning
        #       (dx, self.grad_shards).
        raise NotImplementedError('TODO(m07): the backward loop with explicit prefetch and a reduce-scatter per block')

    def reduce_scatter_grad(self, layer: int, grads):
        """Start summing the block's gradient over ranks, each rank receiving its own slice, without
        waiting: it travels while the next block's backward computes. The one started for the block
        before is finished first, so at most one is in flight (and at most two full gradients exist)."""
        # TODO(m07): finish the reduce-scatter in flight, then start this block's without waiting
        # Hint: comm.reduce_scatter(shard_out, full_flat, label=f"block {layer}", async_op=True) returns
        #       at once with a work to wait on; the sum over ranks lands in shard_out once it is done.
        # Hint: keep in self.in_flight what finish_reduce_scatter needs, and the flat gradient too: the
        #       collective reads it until it is done.
        raise NotImplementedError("TODO(m07): finish the reduce-scatter in flight, then start this block's without waiting")

    def finish_reduce_scatter(self):
        """Wait for the reduce-scatter in flight, if any, and add its slice, scaled, to the shard's gradient."""
        if self.in_flight is None:
            return
        # TODO(m07): wait for the reduce-scatter in flight and accumulate its slice into grad_shards
        # Hint: add with alpha=grad_scale; then nothing is in flight (None).
        raise NotImplementedError('TODO(m07): wait for the reduce-scatter in flight and accumulate its slice into grad_shards')

    def train_step(self, tokens: torch.Tensor, targets: torch.Tensor, micro_steps: int, optimizer) -> float:
        """One optimizer step on this rank's rows (split into micro_steps); returns their mean loss."""
        for g in self.grads():
            g.zero_()
        self.grad_scale = 1.0 / (micro_steps * self.world_size)
        total = 0.0
        for tok, tgt in zip(tokens.chunk(micro_steps), targets.chunk(micro_steps)):
            loss, grads = self.forward_backward(tok, tgt)  # block gradients land in grad_shards
            total += loss.item()
            # TODO(m07): accumulate the replicated weights' gradients (embedding, final norm, LM head)
            raise NotImplementedError("TODO(m07): accumulate the replicated weights' gradients (embedding, final norm, LM head)")
        # TODO(m07): sum the replicated gradients over ranks (one all-reduce), then step and invalidate
        # Hint: one collective for all three (the tests count one all-reduce per step): pack them into one
        #       flat buffer, all-reduce it (comm.all_reduce sums in place), and unpack the sums into them.
        # Hint: the optimizer reads each parameter's .grad (grads() is in parameters()' order); after its
        #       step, invalidate the weight source: the gathered copies of the blocks are now stale.
        raise NotImplementedError('TODO(m07): sum the replicated gradients over ranks (one all-reduce), then step and invalidate')
        return total / micro_steps


def global_mean(value: float) -> float:
    """The mean of a number over ranks (for logging; not part of the training's traffic)."""
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def train_fsdp(cfg: LlamaConfig, steps: int, batch: int = 16, micro_steps: int = 1, lr: float = 3e-3,
               seed: int = 0, dtype=torch.float32, comm: Collectives | None = None, log_every: int = 0):
    """Module 06's `train`, sharded: the same initial model and the same global batches (every rank
    draws them all from the seed), each rank taking its batch // world_size rows. Returns
    (model, losses), the losses averaged over ranks."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = FSDPLlama(cfg, comm or Collectives(), seed, dtype)
    data, generator = load_text(), torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    rows = batch // world_size
    losses = []
    for step in range(steps):
        tokens, targets = random_batch(data, batch, cfg.max_seq_len, generator)
        mine = slice(rank * rows, (rank + 1) * rows)
        losses.append(global_mean(model.train_step(tokens[mine], targets[mine], micro_steps, optimizer)))
        if log_every and rank == 0 and (step % log_every == 0 or step == steps - 1):
            print(f"  step {step:4d}  loss {losses[-1]:.4f}")
    return model, losses


def add_args(parser: argparse.ArgumentParser):
    parser.add_argument("--steps", type=int, default=30, help="training steps (default 30)")
    parser.add_argument("--batch", type=int, default=16, help="global batch, split over the ranks (default 16)")
    parser.add_argument("--micro-steps", type=int, default=1, help="gradient accumulation steps (default 1)")
    parser.add_argument("--layers", type=int, default=4, help="blocks (default 4)")


def check_args(args):
    if min(args.steps, args.batch, args.micro_steps, args.layers) < 1:
        raise ValueError(f"--steps, --batch, --micro-steps and --layers must be positive, got {args.steps}, "
                         f"{args.batch}, {args.micro_steps}, {args.layers}")
    if args.batch % (args.nproc * args.micro_steps):
        raise ValueError(f"--batch {args.batch} must be divisible by nproc * micro-steps = "
                         f"{args.nproc} * {args.micro_steps}: every rank and micro-step gets the same number of rows")


def demo(args):
    # This module's shards, buffers and collectives are CPU tensors: gloo, even on a machine with GPUs.
    rank, world_size, _ = init_distributed(backend="gloo")
    torch.set_num_threads(1)
    cfg, comm = LlamaConfig(n_layers=args.layers), Collectives()
    if rank == 0:
        print(f"FSDP over {world_size} ranks: {cfg.n_layers} blocks, global batch {args.batch} "
              f"({args.batch // world_size} rows per rank, {args.micro_steps} micro-step(s)), {args.steps} steps")
    began = time.perf_counter()
    model, losses = train_fsdp(cfg, args.steps, args.batch, args.micro_steps, comm=comm,
                               log_every=max(1, args.steps // 5))
    elapsed = time.perf_counter() - began
    traffic = fsdp_traffic(model.layout.numel, model.shards[0].element_size(), world_size, cfg.n_layers,
                           args.micro_steps, kept=min(2, cfg.n_layers))
    sent = {op: comm.counts(op) / args.steps for op in ("all_gather", "reduce_scatter")}
    payloads = {c.payload_bytes for c in comm.log if c.op != "all_reduce"}
    if rank != 0:
        return
    print(f"  {args.steps} steps in {elapsed:.1f} s")
    print(f"Per step: {sent['all_gather']:g} all-gathers + {sent['reduce_scatter']:g} reduce-scatters "
          f"(formula: {traffic.all_gathers} + {traffic.reduce_scatters}), payload {sorted(payloads)} bytes "
          f"(formula: {traffic.payload_bytes}); {traffic.full_buffer_bytes} bytes in the two full-block buffers")
    # The same training in one process, on the whole batch (rank 0 only).
    _, expected = train(cfg, args.steps, batch=args.batch)
    worst = max(abs(a - b) for a, b in zip(losses, expected))
    print(f"Single-process training of the same model on the same global batches: max |loss difference| "
          f"{worst:.2e} -> {'match' if worst < 1e-4 else 'MISMATCH'} (float32; the ranks sum the gradient "
          f"in a different order, so agreement is to rounding, not bit for bit)")
