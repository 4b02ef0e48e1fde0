# Generated from solutions/m07_fsdp.py by `python -m course.skeleton`: fill in the TODOs.
# Grade your work with `python main.py grade 07`. (skeleton 77a1efda8c7f)
"""Module 07 - FSDP: every rank keeps 1/d of each weight; whole blocks exist only while in use.

The d ranks of one data-parallel group (`dp`, a course.mesh `Group`: `dp.index`, `dp.size` = d,
`dp.collectives`) train one model. Data parallel: every rank draws the same global batch and trains
on its own rows of it. Sharded: each rank keeps only its shard of every block's flat buffer
(m07_flat_shards) and of the outer weights' (below), and its AdamW updates only those shards.
Module 06's loop asks a weight source for each block; ours (m07_sharded_weights) all-gathers the
block from the shards just in time, into one of two buffers.

    forward   module 06's loop, unchanged: gather(0); for l: gather(l + 1), get(l), block l, release(l)
    backward  module 06's loop, and each block's gradient summed over ranks into the shard owners'
              gradient shards by a reduce-scatter that travels while the next block's backward
              computes (backward_blocks: where each call goes is its question)

With one communication queue, the order in which the backward issues its all-gathers and
reduce-scatters decides which of them waits for the other (docs/07, "Implicit and explicit
prefetch").

The embedding, final norm and LM head (OuterWeights) are sharded too, as one more flat group, the
way FSDP2 shards the weights of its root module: each microbatch gathers them whole before its
forward (the embedding is its first op, the LM head its last and its backward's first) and keeps
them to the end of its backward, then reduce-scatters their gradients and drops the whole copies.

    microbatch  gather the outer weights; forward; backward; reduce-scatter their gradients

Gradients are those of the mean loss over the global batch's real tokens, summed plainly over the
microbatches (in the accumulators) and over the ranks (by the reduce-scatters): what each
microbatch's loss must be divided by for that is train_step's question. Module 06's `fit` trains it:
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
        # TODO(m07): keep this rank's shard of every block, and nothing of the full blocks
        # Contract: self.blocks holds the full model's blocks and `outer` its embedding, final norm and LM head (every
        #   rank built the same ones from the seed). Set self.shards (one tensor per layer: this rank's shard of that
        #   block's padded flat buffer, self.layout) and self.outer_shard (the same of the outer weights,
        #   self.outer_layout). The whole weights are dropped on the next lines: afterwards a rank holds only its
        #   shards, each owning its memory, and the optimizer updates each in place. The test measures the memory behind
        #   self.shards and self.outer_shard.
        # The question: what does a rank keep of each group, and what memory does it keep alive with it?
        # Pitfall: what does a slice keep alive of the tensor it was taken from?
        raise NotImplementedError("TODO(m07): keep this rank's shard of every block, and nothing of the full blocks")
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
        # TODO(m07): the backward loop, each block's gradient reduce-scattered as soon as it exists
        # Contract: module 06's backward loop over the weight source (your m06 backward_blocks), plus: every layer's
        #   gradient is reduce-scattered (reduce_scatter_grad) as soon as its backward has run, and when this returns
        #   every layer's sum over ranks has landed in self.grad_shards. Returns (dx, self.grad_shards): dx is the
        #   gradient of the embedded input; the second item becomes LlamaGrads.blocks, this rank's flat gradient shard
        #   per layer (no whole per-layer gradient outlives the loop: L of them alive is what sharding avoids). The test
        #   records the calls (gather, get, backward, release, the collectives) and checks their order.
        # The question: where in the loop does each reduce-scatter go, relative to the next layer's gather and to the
        #   release, and what is left to do once the loop ends?
        # Pitfalls: with one communication queue, what does a reduce-scatter issued before the next layer's gather
        #   delay? What happens to a reduce-scatter that nobody waits for before the optimizer reads its sum?
        raise NotImplementedError("TODO(m07): the backward loop, each block's gradient reduce-scattered as soon as it exists")

    def reduce_scatter_grad(self, layer: int, grads):
        """Start summing the block's gradient over ranks, each rank receiving its own slice, without
        waiting: it travels while the next block's backward computes. The one started for the block
        before is finished first, so at most one is in flight (and at most two full gradients exist)."""
        # TODO(m07): finish the reduce-scatter in flight, then start this block's without waiting
        # Contract: grads is the block's full gradient on this rank (a BlockWeights, from its rows of the batch). Start
        #   summing it over ranks so that each rank receives its own shard_numel slice of the sum, in the layout of the
        #   weights' shards, without waiting for it; before that, the one started for the previous block is finished (at
        #   most one in flight, at most two whole gradients alive). Leave in self.in_flight (a ReduceScatterInFlight)
        #   everything finish_reduce_scatter needs. The collective is asynchronous and labelled "block <layer>";
        #   starting one while another is in flight fails at once in the tests.
        # The question: how must the gradient be laid out so that slice r of its sum over ranks is the gradient of rank
        #   r's shard, and what must stay alive until the sum has arrived?
        # Pitfalls: what does the collective read from until it completes? Why receive into a fresh tensor rather than
        #   into grad_shards, which earlier microbatches have added to?
        raise NotImplementedError("TODO(m07): finish the reduce-scatter in flight, then start this block's without waiting")

    def finish_reduce_scatter(self):
        """Settle the reduce-scatter in flight, if any, into its block's gradient shard."""
        if self.in_flight is None:
            return
        # TODO(m07): settle the reduce-scatter in flight into the block's gradient shard
        # Contract: self.in_flight (not None here) is the reduce-scatter reduce_scatter_grad started. Afterwards
        #   self.in_flight is None, and once the step's last microbatch is through, self.grad_shards[l] is this rank's
        #   slice of block l's gradient summed over the ranks and over every microbatch of the step (the tests compare
        #   it with the single process's after 2 microbatches, with collectives that deliver their result only when
        #   their work is waited for).
        # The question: at what moment does the received slice become the sum, and what must become of it so that
        #   no microbatch's part is lost?
        # Pitfall: what did this rank's received tensor hold the instant the collective was started?
        raise NotImplementedError("TODO(m07): settle the reduce-scatter in flight into the block's gradient shard")

    def train_step(self, tokens: torch.Tensor, targets: torch.Tensor, n_microbatches: int, optimizer) -> float:
        """One optimizer step on the global batch tokens, targets (B, T), the same on every rank: this rank
        trains on its rows, in n_microbatches; returns the step's mean loss over the global batch."""
        # TODO(m07): this rank's rows, the loss's divisor, one step
        # Contract: one optimizer step on the global batch (module 06's `fit` contract): this rank (self.dp.index = i_d
        #   of d = self.dp.size) trains on rows [i_d B/d, (i_d + 1) B/d) of it, in n_microbatches (accumulate, given,
        #   returns a microbatch's part of the loss), from zeroed accumulators (grads()), then steps (optimizer_step).
        #   Returns the step's mean loss over the global batch, the same on every rank (summed_over(this rank's part,
        #   self.dp), given).
        # The question: accumulate divides each microbatch's loss by the n_tokens it is given. The gradients are then
        #   summed plainly, over the microbatches in the accumulators and over the ranks by the reduce-scatters: which
        #   count must n_tokens be, counted where, for those plain sums to be the gradient of the mean loss over the
        #   global batch's real tokens (module 06's IGNORE_INDEX marks the others)?
        # Pitfalls: a divisor off by a constant factor scales every gradient: AdamW barely notices, so the losses move
        #   by only ~1e-7, yet that is 10^5 times the tests' tolerance against single-process training (their message
        #   names the scale). Which rows of the global batch are this rank's?
        raise NotImplementedError("TODO(m07): this rank's rows, the loss's divisor, one step")

    def accumulate(self, tokens: torch.Tensor, targets: torch.Tensor, n_tokens: int) -> float:
        """Forward and backward of one microbatch, its loss divided by n_tokens (train_step's divisor), its
        gradients added to this rank's shards of them (given): the blocks' by their
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
        # TODO(m07): the embedding, final norm and LM head whole for one microbatch
        # Contract: afterwards self.embedding, self.final_norm and self.lm_head are the whole current weights in their
        #   shapes (the tests compare them with the single process's, bit for bit), views into one whole buffer of the
        #   outer group, so that dropping the three names frees it; one all-gather over the data group, labelled
        #   "outer".
        # The question: this is a block's gather and get at once, for a group needed at once (the embedding is the
        #   microbatch's first op). What does this rank contribute, and where does each weight lie in what arrives?
        # Pitfall: can a buffer of the unpadded size receive every rank's padded shard?
        raise NotImplementedError('TODO(m07): the embedding, final norm and LM head whole for one microbatch')

    def reduce_scatter_outer(self, grads: LlamaGrads):
        """After a microbatch: its gradients of the embedding, final norm and LM head (in grads, module 06's
        LlamaGrads: whole, from this rank's rows) summed over ranks into this rank's shard of them."""
        # TODO(m07): the outer weights' gradients summed over ranks into this rank's gradient shard
        # Contract: afterwards self.outer_grad has grown by this rank's slice (the slice self.outer_shard is of the
        #   weights) of the sum over the data group of the microbatch's three gradients; one collective over the data
        #   group, labelled "outer". The tests count the step's collectives and run 2 microbatches.
        # The question: how must the three gradients be laid out for slice r of their sum to be the gradient of rank r's
        #   shard?
        # Pitfalls: summing the whole gradients over ranks and keeping a slice gives the same numbers: for how many
        #   bytes? What happens to the earlier microbatches' part if the slice is assigned?
        raise NotImplementedError("TODO(m07): the outer weights' gradients summed over ranks into this rank's gradient shard")

    def optimizer_step(self, optimizer):
        """After the last microbatch every gradient this rank holds is its slice of the sum over ranks:
        step, and invalidate the weight source."""
        # Given (module 06's step on this rank's shards): your ShardedWeights.gather must then tell a copy gathered
        # before the step (an older version) from a current one.
        for p, g in zip(self.parameters(), self.grads(), strict=True):
            p.grad = g
        optimizer.step()
        self.weights.invalidate()


def summed_over(value: float, group: Group) -> float:
    """The sum of a number over the ranks of `group` (given): each rank's part of the step's loss adds
    up to the global mean. Not part of the training's traffic, so not logged."""
    if group.size == 1:
        return value
    total = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(total, group=group.collectives.group)
    return total.item()
