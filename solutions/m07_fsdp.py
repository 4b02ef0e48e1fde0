"""Module 07 - FSDP: every rank keeps 1/d of each weight; whole blocks exist only while in use.

The d ranks of one data-parallel group (`dp`, a course.mesh `Group`: `dp.index`, `dp.size` = d,
`dp.collectives`) train one model. Data parallel: every rank draws the same global batch and trains
on its own rows of it. Sharded: each rank keeps only its shard of every block's flat buffer
(m07_flat_shards) and of the outer weights' (below), and its AdamW updates only those shards.
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

The embedding, final norm and LM head (OuterWeights) are sharded too, as one more flat group, the
way FSDP2 shards the weights of its root module: each microbatch gathers them whole before its
forward (the embedding is its first op, the LM head its last and its backward's first) and keeps
them to the end of its backward, then reduce-scatters their gradients and drops the whole copies.

    microbatch  gather the outer weights; forward; backward; reduce-scatter their gradients

Gradients are those of the mean loss over the global batch: every rank divides each microbatch's
loss by the real tokens of the whole global batch (module 06's `real_tokens`), so the sums over
microbatches and over ranks need no further scale. Module 06's `fit` trains it:
`fit(FSDPLlama(cfg, dp), steps)`.
"""
from dataclasses import dataclass

import torch
import torch.distributed as dist

from course.mesh import Group
from .m06_llama_block import LlamaConfig
from .m06_llama_model import LOSS_CHUNK, LlamaGrads, LlamaModel, microbatches, real_tokens
from .m07_flat_shards import FlatLayout, OuterWeights
from .m07_sharded_weights import ShardedWeights


@dataclass
class ReduceScatterInFlight:
    """A block's gradient reduce-scatter that has been started and not yet finished."""
    work: object              # what the collective returned: .wait() until it is done
    full: torch.Tensor        # the block's whole flat gradient, which the collective reads until then
    received: torch.Tensor    # this rank's slice of the sum over ranks, once it is done
    layer: int                # whose gradient shard it adds to


class FSDPLlama(LlamaModel):
    """Module 06's Llama with its blocks sharded over the d = dp.size ranks of the data group `dp`."""

    def __init__(self, cfg: LlamaConfig, dp: Group, seed: int = 0, dtype=torch.float32, loss_chunk: int = LOSS_CHUNK):
        # Every rank builds the same full model from the seed, then keeps only its shards, so the
        # sharded model starts exactly where a single process would.
        super().__init__(cfg, seed, dtype, loss_chunk=loss_chunk)
        self.dp = dp
        self.layout = FlatLayout(self.blocks[0], dp.size)
        outer = OuterWeights(self.embedding, self.final_norm, self.lm_head)
        self.outer_layout = FlatLayout(outer, dp.size)
        # >>> TODO(m07): keep this rank's shard of every block, and nothing of the full blocks
        # self.blocks holds the full model's blocks and `outer` its embedding, final norm and LM head (every rank
        # built the same ones from the seed). Set self.shards: one tensor per layer, this rank's shard of that block's
        # padded flat buffer (self.layout, your FlatLayout); and self.outer_shard: this rank's shard of the outer
        # weights' padded flat buffer (self.outer_layout). The whole weights are dropped on the next lines;
        # afterwards a rank must hold only its shards, and the optimizer updates each shard in place.
        # Pitfall: a shard is a view, and a view keeps its whole buffer alive: the test measures the memory behind
        # self.shards and self.outer_shard and fails if it is a whole group instead of one shard.
        # Hint 1: flatten each group, take this rank's slice, and make the slice own its memory.
        # Hint 2: self.layout.flatten(block), self.layout.shard(flat, self.dp.index), .clone(); the same with
        #         self.outer_layout and outer.
        # Hint 3: shards = for each block: a clone of this rank's shard of the flattened block
        #         outer_shard = a clone of this rank's shard of the flattened outer weights
        self.shards = [self.layout.shard(self.layout.flatten(b), self.dp.index).clone() for b in self.blocks]
        self.outer_shard = self.outer_layout.shard(self.outer_layout.flatten(outer), self.dp.index).clone()
        # <<<
        self.blocks = []  # from here on, whole blocks exist only in the weight source's two buffers
        self.embedding = self.final_norm = self.lm_head = None  # and the outer weights only during a microbatch
        self.weights = ShardedWeights(self.layout, self.shards, dp.collectives)
        self.grad_shards = [torch.zeros_like(s) for s in self.shards]
        self.outer_grad = torch.zeros_like(self.outer_shard)
        self.in_flight: ReduceScatterInFlight | None = None

    def parameters(self) -> list[torch.Tensor]:
        """What this rank's optimizer updates: its block shards and its shard of the outer weights."""
        return [*self.shards, self.outer_shard]

    def grads(self) -> list[torch.Tensor]:
        """The accumulated gradients, in the order of parameters()."""
        return [*self.grad_shards, self.outer_grad]

    def backward_blocks(self, dx: torch.Tensor, stores):
        """Module 06's backward loop, plus a reduce-scatter of each block's gradient as soon as it exists."""
        n_layers = self.cfg.n_layers
        # >>> TODO(m07): the backward loop, each block's gradient reduce-scattered as soon as it exists
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
        # Hint 1: your module 06 backward loop, plus one call right after each release and one call after the loop.
        # Hint 2: the two methods below do the work (reduce_scatter_grad starts one, finish_reduce_scatter
        #         completes the one in flight); the loop only calls them at the right moments.
        # Hint 3: gather the last layer
        #         for each layer from the last: gather the one before it (if any); w = get(layer)
        #             dx, grads = block backward;  clear the layer's store;  release it;  reduce-scatter its grads
        #         finish the reduce-scatter in flight;  return dx and the gradient shards
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
        # grads is the block's full gradient on this rank (a BlockWeights, from this rank's rows of the batch). Start
        # summing it over ranks so that each rank receives its own shard_numel slice of the sum, in the layout of
        # the weights' shards, without waiting for it. Before that, finish the one started for the previous block:
        # at most one in flight, at most two whole gradients alive. Leave in self.in_flight (a
        # ReduceScatterInFlight) everything finish_reduce_scatter needs.
        # Contract with the tests: the collective is asynchronous and labelled "block <layer>"; starting one while
        # another is still in flight fails at once (each keeps a whole block's gradient alive until waited for).
        # Pitfalls: the collective reads the flat gradient until it completes, so self.in_flight keeps it alive.
        # Receive into a fresh tensor, not into grad_shards: the slice is added as it is when it is finished
        # (that is how microbatches accumulate; each loss is already divided by the global batch's tokens, so
        # nothing is left to scale).
        # Hint 1: flatten the gradient exactly as the weights were flattened: then slice r of the sum is the gradient
        #         of rank r's shard.
        # Hint 2: self.layout.flatten(grads); torch.empty_like(a gradient shard); self.dp.collectives.reduce_scatter(
        #         output_slice, full_flat, label=..., async_op=True) returns a work; ReduceScatterInFlight(work, full,
        #         received, layer).
        # Hint 3: finish the one in flight
        #         full = the flattened gradient;  received = an empty tensor shaped like this layer's shard
        #         work = async reduce-scatter of full into received, labelled with the layer
        #         in_flight = a ReduceScatterInFlight of work, full, received and the layer
        self.finish_reduce_scatter()
        full = self.layout.flatten(grads)
        received = torch.empty_like(self.grad_shards[layer])
        work = self.dp.collectives.reduce_scatter(received, full, label=f"block {layer}", async_op=True)
        self.in_flight = ReduceScatterInFlight(work, full, received, layer)
        # <<<

    def finish_reduce_scatter(self):
        """Wait for the reduce-scatter in flight, if any, and add its slice to the shard's gradient."""
        if self.in_flight is None:
            return
        # >>> TODO(m07): complete the reduce-scatter in flight; add its slice to the gradient shard
        # self.in_flight (not None here) holds the work, the flat gradient it reads, the slice it receives and the
        # layer. Once the work has completed, add the received slice (the sum over ranks of this microbatch's
        # gradients of this rank's shard) into self.grad_shards[layer]. Afterwards nothing is in flight.
        # Pitfalls: reading the slice before the work has completed reads whatever the buffer held (the tests
        # deliver it only on wait()). Assigning instead of adding loses the earlier microbatches' gradients.
        # Hint 1: wait first, then accumulate, then forget it.
        # Hint 2: work.wait(); tensor.add_(other) adds in place.
        # Hint 3: wait for the work in flight
        #         grad_shards[its layer] += its received slice
        #         in_flight = None
        self.in_flight.work.wait()
        self.grad_shards[self.in_flight.layer].add_(self.in_flight.received)
        self.in_flight = None
        # <<<

    def train_step(self, tokens: torch.Tensor, targets: torch.Tensor, n_microbatches: int, optimizer) -> float:
        """One optimizer step on the global batch tokens, targets (B, T), the same on every rank: this rank
        trains on its rows, in n_microbatches; returns the step's mean loss over the global batch."""
        # >>> TODO(m07): this rank's rows, every microbatch divided by the global batch's tokens, one step
        # Contract: this rank (self.dp.index = i_d of d = self.dp.size) takes rows [i_d B/d, (i_d + 1) B/d) of the
        #   global batch, zeroes its accumulators (grads()), accumulates its rows in n_microbatches (accumulate) and
        #   steps (optimizer_step). Returns the mean loss over the global batch, the same on every rank:
        #   summed_over(this rank's part, self.dp), given below.
        # Maths: the step's gradient is that of the mean loss over the real tokens of the *whole global batch*.
        #   Each microbatch's loss is divided by that count (module 06's real_tokens of the global targets): then
        #   the sums over microbatches (in the accumulators) and over ranks (the reduce-scatters) are that gradient as they are, with no scale left to apply.
        # Pitfalls: dividing by this rank's tokens, or by a microbatch's, gives gradients d or m d times too big:
        #   AdamW barely notices a constant factor, so the losses move by only ~1e-7, yet that is 10^5 times the
        #   tests' tolerance against single-process training (their message names the scale). Count the real
        #   tokens of the whole batch, before taking this rank's rows.
        # Hint 1: count, slice, zero, accumulate each microbatch, step, sum the losses over the group.
        # Hint 2: real_tokens(targets); rows = B // self.dp.size; microbatches(tokens, targets, n_microbatches) cuts
        #         this rank's rows; self.accumulate(tok, tgt, n_tokens) returns a microbatch's part of the loss.
        # Hint 3: n_tokens = real tokens of the whole targets;  rows = B / d;  mine = rows i_d rows .. (i_d + 1) rows
        #         zero every tensor of grads()
        #         loss = sum of accumulate(tok, tgt, n_tokens) over the microbatches of this rank's rows
        #         optimizer_step(optimizer);  return summed_over(loss, self.dp)
        n_tokens = real_tokens(targets)
        rows = tokens.shape[0] // self.dp.size
        mine = slice(self.dp.index * rows, (self.dp.index + 1) * rows)
        for g in self.grads():
            g.zero_()
        loss = sum(self.accumulate(tok, tgt, n_tokens) for tok, tgt in
                   microbatches(tokens[mine], targets[mine], n_microbatches))
        self.optimizer_step(optimizer)
        return summed_over(loss, self.dp)
        # <<<

    def accumulate(self, tokens: torch.Tensor, targets: torch.Tensor, n_tokens: int) -> float:
        """Forward and backward of one microbatch, its loss divided by n_tokens (the global batch's real
        tokens), its gradients added to this rank's shards of them (given): the blocks' by their
        reduce-scatters during the backward, the outer weights' by theirs after it. The outer weights are
        whole only for the microbatch, as FSDP2 keeps its root's. Returns its part of the step's loss."""
        self.gather_outer()
        loss, grads = self.forward_backward(tokens, targets, n_tokens)  # block gradients land in grad_shards
        self.reduce_scatter_outer(grads)
        self.embedding = self.final_norm = self.lm_head = None  # the whole copies dropped: shards only again
        return loss.item()

    def gather_outer(self):
        """Before a microbatch: the embedding, final norm and LM head whole, from every rank's shard, for
        module 06's forward_backward (which reads self.embedding, self.final_norm and self.lm_head)."""
        # >>> TODO(m07): the embedding, final norm and LM head whole for one microbatch
        # Contract: afterwards self.embedding, self.final_norm and self.lm_head are the whole current weights in their
        #   shapes (the tests compare them with the single process's, bit for bit), views into one whole buffer of the
        #   outer group, so that dropping the three names frees it; one all-gather over the data group, labelled
        #   "outer".
        # The question: this is a block's gather and get at once, for a group needed at once (the embedding is the
        #   microbatch's first op). What does this rank contribute, and where does each weight lie in what arrives?
        # Pitfall: a buffer of the unpadded size cannot receive every rank's padded shard.
        # Hint 1: one buffer, one collective, then views.
        # Hint 2: torch.empty(self.outer_layout.padded_numel, dtype=self.outer_shard.dtype);
        #         self.dp.collectives.all_gather(output, shard, label="outer"); self.outer_layout.views(flat) is an
        #         OuterWeights, .tensors() its three tensors in order.
        # Hint 3: whole = an empty buffer of the outer layout's padded size
        #         all-gather self.outer_shard into whole, labelled "outer"
        #         embedding, final_norm, lm_head = the outer layout's views of whole, in order
        whole = torch.empty(self.outer_layout.padded_numel, dtype=self.outer_shard.dtype)
        self.dp.collectives.all_gather(whole, self.outer_shard, label="outer")
        self.embedding, self.final_norm, self.lm_head = self.outer_layout.views(whole).tensors()
        # <<<

    def reduce_scatter_outer(self, grads: LlamaGrads):
        """After a microbatch: its gradients of the embedding, final norm and LM head (in grads, module 06's
        LlamaGrads: whole, from this rank's rows) summed over ranks into this rank's shard of them."""
        # >>> TODO(m07): the outer weights' gradients summed over ranks into this rank's gradient shard
        # Contract: afterwards self.outer_grad has grown by this rank's slice (the slice self.outer_shard is of the
        #   weights) of the sum over the data group of the microbatch's three gradients; one collective over the
        #   data group, labelled "outer".
        # The question: how must the three gradients be laid out for slice r of their sum to be the gradient of rank
        #   r's shard?
        # Pitfalls: summing the whole gradients over ranks and keeping a slice gives the same numbers for twice the
        #   bytes (the tests count the step's collectives). Assigning instead of adding loses the earlier
        #   microbatches' gradients (the tests run 2 microbatches).
        # Hint 1: lay the gradients out as the weights were laid out, reduce-scatter, add.
        # Hint 2: self.outer_layout.flatten(OuterWeights(grads.embedding, grads.final_norm, grads.lm_head));
        #         torch.empty_like(self.outer_grad); self.dp.collectives.reduce_scatter(output, full, label="outer").
        # Hint 3: full = the three gradients, flattened by the outer layout
        #         received = an empty tensor like outer_grad;  reduce-scatter full into received, labelled "outer"
        #         outer_grad += received
        full = self.outer_layout.flatten(OuterWeights(grads.embedding, grads.final_norm, grads.lm_head))
        received = torch.empty_like(self.outer_grad)
        self.dp.collectives.reduce_scatter(received, full, label="outer")
        self.outer_grad.add_(received)
        # <<<

    def optimizer_step(self, optimizer):
        """After the last microbatch every gradient this rank holds is its slice of the sum over ranks:
        step, and invalidate the weight source."""
        # >>> TODO(m07): step on the gradient shards; invalidate the gathered copies
        # Contract: the optimizer updates every shard (it reads each parameter's .grad; grads() is in parameters()'
        #   order); afterwards the weight source hands out no block gathered before this step.
        # Pitfall: without invalidate() the next step reuses stale blocks from the buffers (the losses drift from
        #   single-process training).
        # Hint 1: .grad, step, invalidate.
        # Hint 2: zip(self.parameters(), self.grads()); optimizer.step(); self.weights.invalidate().
        # Hint 3: each parameter's .grad = its gradient;  optimizer step;  invalidate the weight source
        for p, g in zip(self.parameters(), self.grads(), strict=True):
            p.grad = g
        optimizer.step()
        self.weights.invalidate()
        # <<<


def summed_over(value: float, group: Group) -> float:
    """The sum of a number over the ranks of `group` (given): each rank's part of the step's loss adds
    up to the global mean. Not part of the training's traffic, so not logged."""
    if group.size == 1:
        return value
    total = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(total, group=group.collectives.group)
    return total.item()
