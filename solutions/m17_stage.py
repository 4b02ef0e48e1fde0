"""Module 17, part 2 - one pipeline stage of the composed Llama, for module 11's executor.

Stage s of S = p v holds blocks [s L/S, (s+1) L/S) (the first also the embedding, the last the final
norm, the LM head and the loss). Every block is module 12's tensor-parallel block with sequence
parallelism over `groups.tp`, and the weights a rank computes with are also shared out, module 07's
way, over `groups.fsdp`: between steps a rank keeps only its shard of each of its stage's blocks and
of its stage's outer weights (module 07's OuterWeights: the embedding's vocabulary rows on the first
stage, the final norm and the LM head's rows on the last), how the two splits are taken being the
constructor's question.

The executor (m11_executor.run_schedule) calls, for each action of this rank's list,

    forward(x, microbatch, targets)   x: the microbatch's token rows on the first stage, else the
                                      previous stage's output (rows, hidden), as the message arrived
    backward(microbatch, grad)        grad: the gradient of this stage's output (None on the last)

and a message between stages is the residual stream as this rank holds it: the microbatch's rows,
its T/c positions (context), of those its T/(c t) (sequence parallelism), dim M: (rows, hidden)
with hidden = T M / (c t). Each rank exchanges its own piece with the rank at the same place of
the next stage: no gather before the pipeline's send.

FSDP across the pipeline's microbatches: the stage all-gathers its blocks once per step (before its
first forward) and keeps them until the step's last backward; the gradients of the m microbatches
add up in whole (unsharded) flat buffers, and each block's sum is reduce-scattered once, after the
schedule (m17_trainer). 2 collectives a block a step instead of 3 m (module 07 re-gathers for the
backward of every microbatch and reduce-scatters each one's gradient), for the memory of this
stage's whole slices and their gradients during the step: 1/(p t) of the model, not 1/(p t) of it
divided again by the fsdp group's size. The outer weights follow the same policy, as one more group:
gathered once a step with the blocks (gather_outer), their gradients added up in a whole buffer and
reduce-scattered once (reduce_scatter_outer).

Every piece of the loss is divided by `n_tokens`, the step's divisor, which the trainer sets before
the schedule runs (what it must be is the trainer's question); the executor's n_microbatches is not used.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .m06_llama_block import ActivationStore, LlamaBlock, LlamaConfig
from .m06_llama_ops import ATTENTION_CHUNK, rmsnorm_backward, rmsnorm_forward
from .m07_flat_shards import FlatLayout, OuterWeights
from .m12_tp_block import TPBlock, shard_block_weights
from .m12_tp_linear import column_parallel_backward, column_parallel_forward, grad_dtype
from .m12_vocab_parallel import (embedding_backward, embedding_forward, padded_vocab_size,
                                 vocab_parallel_cross_entropy, vocab_rows)
from .m15_cp_model import VARIANTS, CPBlock, context_attention
from .m15_layout import SequenceLayout
from .m17_composition import Groups


def stage_layers(cfg: LlamaConfig, stage: int, n_stages: int) -> range:
    """The blocks of stage `stage` of `n_stages`: L/S consecutive ones (given; check_composition has
    checked that S divides L)."""
    per_stage = cfg.n_layers // n_stages
    return range(stage * per_stage, (stage + 1) * per_stage)


def norm_positions(layout: FlatLayout, index: int) -> torch.Tensor:
    """Where the norm weights (a block's ln1 and ln2, the outer weights' final norm) lie in shard `index` of
    a group's flat buffer (given): their gradients are partial over t with sequence parallelism (each t
    rank normed T/t positions)."""
    is_norm = torch.zeros(layout.padded_numel, dtype=torch.bool)
    offset = 0
    for name, numel in zip(layout.names, layout.numels, strict=True):
        if name in ("ln1", "ln2", "final_norm"):
            is_norm[offset:offset + numel] = True
        offset += numel
    return layout.shard(is_norm, index).nonzero().squeeze(1)


@dataclass
class Saved:
    """What one microbatch's forward keeps on a stage until its backward."""
    stores: list[ActivationStore]          # one per block
    tokens: torch.Tensor | None = None     # first stage: this rank's positions of the token rows
    h: torch.Tensor | None = None          # last stage: the final norm's input, its output n, its r,
    n: torch.Tensor | None = None          # and the gradient of the loss share with respect to the
    r: torch.Tensor | None = None          # local logits (vocabulary-parallel cross-entropy)
    dlogits: torch.Tensor | None = None


class LlamaStage:
    """Stage `stage` of `n_stages` of module 06's Llama `whole`, on this rank of the mesh `groups`."""

    def __init__(self, cfg: LlamaConfig, groups: Groups, stage: int, n_stages: int, whole, variant: str = "zigzag",
                 attention_chunk: int = ATTENTION_CHUNK, recompute: bool = False, matmul=None):
        tp, cp, fsdp = groups.tp, groups.cp, groups.fsdp
        self.matmul = matmul  # module 09's policy for the blocks' linears (FP8Matmul), or None: high precision
        self.cfg, self.groups, self.stage, self.variant = cfg, groups, stage, variant
        self.recompute = recompute  # module 10's "block" option: keep each block's input only
        self.is_first, self.is_last = stage == 0, stage == n_stages - 1
        self.layers = stage_layers(cfg, stage, n_stages)
        self.dtype, self.grad_dtype = whole.embedding.dtype, grad_dtype(whole.embedding.dtype)
        self.stream_len = cfg.max_seq_len // (cp.size * tp.size)  # positions of the residual stream a rank holds
        self.hidden = self.stream_len * cfg.dim                  # a message's width (module 11's stage.hidden)
        self.block = self.make_block(attention_chunk)
        self.padded_vocab = padded_vocab_size(cfg.vocab_size, tp.size)
        # >>> TODO(m17): hold the stage's blocks as FSDP x TP shards, and its vocabulary rows
        # Contract: set self.layout (the FlatLayout of one block's piece, cut over the fsdp group) and self.shards (one
        #   per block of self.layers, in order: this rank's shard of that block, a tensor of its own, not a view of a
        #   whole block); self.outer_layout and self.outer_shard, the same for the stage's outer weights: an
        #   OuterWeights of what this rank's ends compute with (the embedding's vocabulary rows on the first stage, the
        #   final norm and the LM head's rows on the last, padded as module 12 pads them), each weight the stage does
        #   not use with no rows (whole.embedding[:0], ...). Every rank reads its weights from `whole` (module 06's
        #   model, the same everywhere).
        # The question: in which order are the two splits taken, and what does each cut? gather() must give back, on
        #   every rank, exactly the weights its block and its ends compute with, and nothing else.
        # Pitfalls: what shape does a shard have if the layout is of other tensors, or of another group's size? Which
        #   ranks keep the same shard index?
        # Hint 1: what does module 12's block multiply with on t rank i_t, and what can an all-gather over the fsdp
        #         group rebuild from the shards? (docs/17, "A stage: FSDP x TP blocks": one linear split over t and
        #         stored over d.)
        # Hint 2: first over t, the way the block computes, then the slice is laid out flat: rank (i_fsdp, i_t) keeps
        #         shard i_fsdp of the padded flat buffer of module 12's slice i_t of each block, n = the fsdp group's
        #         size; the outer group likewise, from this t rank's V'/t rows of the embedding and the LM head and the
        #         final norm.
        # Hint 3: slices = [shard_block_weights(whole.blocks[layer], cfg, tp) for layer in self.layers]
        #         self.layout = FlatLayout(slices[0], fsdp.size)
        #         self.shards = [self.layout.shard(self.layout.flatten(s), fsdp.index).clone() for s in slices]
        #         outer = OuterWeights(vocab_rows(whole.embedding, self.padded_vocab, tp) if first
        #                              else whole.embedding[:0], whole.final_norm if last else whole.final_norm[:0],
        #                              vocab_rows(whole.lm_head, self.padded_vocab, tp) if last else whole.lm_head[:0])
        #         outer_layout and outer_shard from outer, as for a slice
        slices = [shard_block_weights(whole.blocks[layer], cfg, tp) for layer in self.layers]
        self.layout = FlatLayout(slices[0], fsdp.size)
        self.shards = [self.layout.shard(self.layout.flatten(s), fsdp.index).clone() for s in slices]
        outer = OuterWeights(vocab_rows(whole.embedding, self.padded_vocab, tp) if self.is_first else whole.embedding[:0],
                             whole.final_norm if self.is_last else whole.final_norm[:0],
                             vocab_rows(whole.lm_head, self.padded_vocab, tp) if self.is_last else whole.lm_head[:0])
        self.outer_layout = FlatLayout(outer, fsdp.size)
        self.outer_shard = self.outer_layout.shard(self.outer_layout.flatten(outer), fsdp.index).clone()
        # <<<
        # The weights every rank of groups.replicas holds the same copy of (a MoE stage's routers), by name, and
        # their accumulators.
        self.replicated, self.replicated_grads = {}, {}
        self.grad_shards = [torch.zeros_like(s, dtype=self.grad_dtype) for s in self.shards]
        self.outer_grad = torch.zeros_like(self.outer_shard, dtype=self.grad_dtype)
        self.experts, self.expert_grads = [], []  # a MoE stage's experts (m17_moe_stage)
        self.norms = norm_positions(self.layout, fsdp.index)
        self.outer_norms = norm_positions(self.outer_layout, fsdp.index)
        self.weights = self.block_grads = None  # the whole slices and their gradients, during a step
        self.full = self.full_grads = None
        # The outer weights whole (views of outer_full) and their gradients (views of outer_full_grad), during a step.
        self.embedding = self.final_norm = self.lm_head = self.outer_grads = None
        self.outer_full = self.outer_full_grad = None
        self.saved: dict[int, Saved] = {}
        self.n_tokens, self.training = None, True

    def make_block(self, attention_chunk: int):
        """Module 12's block on groups.tp with sequence parallelism, its linears through self.matmul; with c > 1 its attention is module 15's
        over groups.cp and its RoPE rotates each token by its position in the whole sequence (given)."""
        block = TPBlock(self.cfg, self.groups.tp, sequence_parallel=True, attention_chunk=attention_chunk,
                        matmul=self.matmul)
        if self.groups.cp.size > 1:  # module 12's block runs its heads' attention and RoPE through `local`
            block.local = CPBlock(self.cfg, self.groups.cp, VARIANTS[self.variant][1],
                                  context_attention(self.variant, self.groups.cp, attention_chunk))
        return block

    def layout_of_sequence(self) -> SequenceLayout:
        return SequenceLayout(VARIANTS[self.variant][1], self.cfg.max_seq_len, self.groups.cp.size)

    def positions(self, rows: torch.Tensor) -> torch.Tensor:
        """This rank's positions of token (or target) rows (rows, T): (rows, T/c), in the layout's order (given)."""
        return self.layout_of_sequence().shard(rows, self.groups.cp.index)

    def parameters(self) -> list[torch.Tensor]:
        """What this rank's optimizer updates for this stage, in the order of grads()."""
        return [*self.shards, self.outer_shard, *self.replicated.values(), *self.experts]

    def grads(self) -> list[torch.Tensor]:
        return [*self.grad_shards, self.outer_grad, *self.replicated_grads.values(), *self.expert_grads]

    def begin_step(self, n_tokens: int, n_sequences: int):
        """Before the schedule: the step's real tokens (every piece of the loss divides by them), zeroed
        accumulators (given). n_sequences, the global batch's B, is for the MoE stage's auxiliary loss."""
        self.n_tokens = n_tokens
        for g in self.grads():
            g.zero_()

    # --- FSDP across the step's microbatches ---
    def gather(self):
        """Every block of the stage whole (its t slice), for the whole step: views into flat buffers."""
        fsdp = self.groups.fsdp
        # >>> TODO(m17): gather the stage's blocks once per step, and the whole gradient buffers they add into
        # Contract: set self.full (one whole padded flat buffer per block, every fsdp rank's shard in it), self.weights
        #   (a BlockWeights of views of each, what the block computes with), self.full_grads (one zeroed flat buffer per
        #   block, in self.grad_dtype) and self.block_grads (BlockWeights of views of each: the main_grad accumulators
        #   that module 12's block adds into). One all-gather per block over fsdp, labelled "block <layer>"; the m
        #   microbatches of the step all use these copies.
        # The question: how do the shards come back whole once for the whole step, and what must be true of a block's
        #   gradient buffer before the step's first backward adds into it?
        # Pitfalls: must the first block's transfer wait for the last one's to start? What is in a new buffer's memory?
        # Hint 1: how many blocks' transfers may be in flight at once, and which must have arrived before the stage's
        #         first forward reads a weight? (docs/17, "FSDP across the pipeline's microbatches";
        #         course/collectives.py's all_gather, as module 07 calls it.)
        # Hint 2: full_l = shard_0 ‖ shard_1 ‖ ... ‖ shard_(n-1) over the fsdp ranks in order; the accumulator starts at
        #         G_l = 0 and ends the step at Σ_(i < m) ∂L_i/∂W_l, in the accumulators' dtype (float32 at least).
        # Hint 3: self.full = [torch.empty(self.layout.padded_numel, dtype=self.dtype) for _ in self.shards]
        #         works = [fsdp.collectives.all_gather(full, shard, label=f"block {layer}", async_op=True)
        #                  for full, shard, layer in zip(self.full, self.shards, self.layers)]
        #         wait for each work;  self.weights = [self.layout.views(full) for full in self.full]
        #         self.full_grads = [torch.zeros(self.layout.padded_numel, dtype=self.grad_dtype) for each shard]
        #         self.block_grads = views of each
        self.full = [torch.empty(self.layout.padded_numel, dtype=self.dtype) for _ in self.shards]
        works = [fsdp.collectives.all_gather(full, shard, label=f"block {layer}", async_op=True)
                 for full, shard, layer in zip(self.full, self.shards, self.layers, strict=True)]
        for work in works:
            work.wait()
        self.weights = [self.layout.views(full) for full in self.full]
        self.full_grads = [torch.zeros(self.layout.padded_numel, dtype=self.grad_dtype) for _ in self.shards]
        self.block_grads = [self.layout.views(g) for g in self.full_grads]
        # <<<
        self.gather_outer()

    def gather_outer(self):
        """The stage's outer weights whole for the step, and the whole gradient buffer they add into."""
        if self.outer_layout.numel == 0:
            return  # a stage between the first and the last: none (every rank of fsdp holds the same stage)
        # >>> TODO(m17): the stage's embedding, final norm and LM head whole for the step, and their gradient buffer
        # Contract: set self.outer_full (the outer group's whole padded flat buffer, every fsdp rank's shard in it),
        #   self.embedding, self.final_norm and self.lm_head (views of it: what forward() reads), self.outer_full_grad
        #   (a zeroed whole buffer in self.grad_dtype) and self.outer_grads (an OuterWeights of views of it: the
        #   accumulators backward() adds into). One all-gather over fsdp, labelled "outer".
        # The question: the blocks' policy (gather()) applied to one more group: what changes?
        # Pitfall: module 07 gathers these for each microbatch; how long do they stay whole here?
        # Hint 1: which of gather()'s steps carry over to a single group, and which views does forward() read? (docs/17,
        #         "FSDP across the pipeline's microbatches", the outer weights' paragraph.)
        # Hint 2: outer_full = shard_0 ‖ ... ‖ shard_(n-1) over the fsdp ranks; G_outer = 0 before the step's first
        #         backward, in the accumulators' dtype.
        # Hint 3: self.outer_full = torch.empty(self.outer_layout.padded_numel, dtype=self.dtype)
        #         self.groups.fsdp.collectives.all_gather(self.outer_full, self.outer_shard, label="outer")
        #         self.embedding, self.final_norm, self.lm_head = self.outer_layout.views(self.outer_full).tensors()
        #         self.outer_full_grad = torch.zeros(self.outer_layout.padded_numel, dtype=self.grad_dtype)
        #         self.outer_grads = self.outer_layout.views(self.outer_full_grad)
        self.outer_full = torch.empty(self.outer_layout.padded_numel, dtype=self.dtype)
        self.groups.fsdp.collectives.all_gather(self.outer_full, self.outer_shard, label="outer")
        self.embedding, self.final_norm, self.lm_head = self.outer_layout.views(self.outer_full).tensors()
        self.outer_full_grad = torch.zeros(self.outer_layout.padded_numel, dtype=self.grad_dtype)
        self.outer_grads = self.outer_layout.views(self.outer_full_grad)
        # <<<

    def reduce_scatter(self):
        """After the schedule: each block's gradient, summed over the step's microbatches, summed over fsdp
        into this rank's shard; the whole copies are dropped. The outer weights' too (reduce_scatter_outer)."""
        self.reduce_scatter_outer()
        fsdp = self.groups.fsdp
        # >>> TODO(m17): reduce-scatter each block's whole gradient once per step; drop the whole copies
        # Contract: afterwards self.grad_shards[i] holds this rank's slice (its fsdp shard, where self.shards[i] lies)
        #   of the sum over the fsdp group of block i's whole gradient (self.full_grads[i]); one reduce-scatter per
        #   block, labelled "block <layer>"; then self.full, self.weights, self.full_grads and self.block_grads are None
        #   again (the next step gathers anew: the optimizer changes the shards). A stage that ran no forward this step
        #   has nothing to send.
        # The question: which collective leaves each rank with only its own slice of a sum, and into which tensor?
        # Pitfalls: where must the slice land so that the optimizer pairs it with its weight? Which ranks' buffers
        #   belong in the sum (do the t ranks, or the pipeline's other places, hold the same weights)?
        # Hint 1: what does one reduce-scatter over n ranks leave on each of them, and how is that the sum an all-reduce
        #         would give, cut as the shards are cut? (docs/17, "FSDP across the pipeline's microbatches".)
        # Hint 2: grad_shard_l = slice i_fsdp of Σ_(fsdp ranks) G_l (the same layout as the weights' shards).
        # Hint 3: if self.full_grads is None: return
        #         works = [fsdp.collectives.reduce_scatter(shard, full, label=f"block {layer}", async_op=True)
        #                  for shard, full, layer in zip(self.grad_shards, self.full_grads, self.layers)]
        #         wait for each work;  set full, weights, full_grads, block_grads to None
        if self.full_grads is None:
            return
        works = [fsdp.collectives.reduce_scatter(shard, full, label=f"block {layer}", async_op=True)
                 for shard, full, layer in zip(self.grad_shards, self.full_grads, self.layers, strict=True)]
        for work in works:
            work.wait()
        self.full = self.weights = self.full_grads = self.block_grads = None
        # <<<

    def reduce_scatter_outer(self):
        """After the schedule: the outer weights' gradient, summed over the step's microbatches in its whole
        buffer, summed over fsdp into this rank's shard; their whole copies dropped."""
        if self.outer_full_grad is None:
            return  # a stage without outer weights, or one that ran no forward this step
        # >>> TODO(m17): reduce-scatter the outer weights' whole gradient once per step; drop their whole copies
        # Contract: afterwards self.outer_grad holds this rank's slice (its fsdp shard, where self.outer_shard lies) of
        #   the sum over the fsdp group of self.outer_full_grad; one collective over fsdp, labelled "outer"; then
        #   self.outer_full, self.outer_full_grad, self.outer_grads and the three weights' views are None again.
        # The question: reduce_scatter() for one more group: what carries over?
        # Pitfall: does an all-reduce followed by keeping one's slice send the same bytes?
        # Hint 1: which collective sums over the fsdp ranks and leaves each with its own slice only? (docs/17, the outer
        #         weights' paragraph.)
        # Hint 2: outer_grad = slice i_fsdp of Σ_(fsdp ranks) G_outer.
        # Hint 3: self.groups.fsdp.collectives.reduce_scatter(self.outer_grad, self.outer_full_grad, label="outer")
        #         set outer_full, outer_full_grad, outer_grads, embedding, final_norm, lm_head to None
        self.groups.fsdp.collectives.reduce_scatter(self.outer_grad, self.outer_full_grad, label="outer")
        self.outer_full = self.outer_full_grad = self.outer_grads = None
        self.embedding = self.final_norm = self.lm_head = None
        # <<<

    def release(self):
        """Drop the whole copies without a gradient (after an evaluation's forwards; given)."""
        self.full = self.weights = self.full_grads = self.block_grads = None
        self.outer_full = self.outer_full_grad = self.outer_grads = None
        self.embedding = self.final_norm = self.lm_head = None

    # --- what the executor calls ---
    def block_forward(self, i: int, x: torch.Tensor, store: ActivationStore) -> torch.Tensor:
        """Block i of the stage (given; the MoE stage runs its own)."""
        return self.block.forward(self.weights[i], x, store)

    def block_backward(self, i: int, dy: torch.Tensor, store: ActivationStore) -> torch.Tensor:
        """Block i's backward, its weights' gradients added into self.block_grads[i] (given). With recompute,
        the block's forward runs again first, from its kept input, into a store that keeps everything."""
        if self.recompute:
            store, kept = self.block.new_store(), store
            self.block_forward(i, kept["x"], store)
        return self.block.backward(self.weights[i], dy, store, self.block_grads[i])

    def new_store(self) -> ActivationStore:
        """A store for one block's forward (given): nothing kept when evaluating; with recompute (module 10's
        "block" option) only the block's input x, which the backward runs the block's forward from again: the
        same ops on the same values, so the same gradients bit for bit, for a second forward's work and its
        tensor-parallel collectives (Megatron's full recompute)."""
        if not self.training:
            return ActivationStore(keep=frozenset())
        return ActivationStore(keep=frozenset({"x"})) if self.recompute else self.block.new_store()

    @torch.no_grad()
    def forward(self, x: torch.Tensor, microbatch: int, targets: torch.Tensor | None = None, n_microbatches: int = 1):
        """The stage's output (rows, hidden), or on the last stage this rank's share of the step's loss."""
        if self.weights is None:
            self.gather()
        cfg, tp = self.cfg, self.groups.tp
        rows = x.shape[0]
        stores = [self.new_store() for _ in self.layers]
        # >>> TODO(m17): the stage's forward on this rank's piece of the microbatch
        # Contract: x is the microbatch's token rows (rows, T) on the first stage, else the previous stage's message
        #   (rows, self.hidden). Not the last stage: return this rank's residual stream after the stage's blocks, as
        #   (rows, self.hidden). Last stage: return this rank's share of the step's loss (a 0-d tensor): the summed
        #   cross-entropy of its positions divided by self.n_tokens (the trainer sets it), so that the shares of every
        #   rank and microbatch add up to the step's loss. While self.training, keep in self.saved[microbatch] a Saved
        #   of what backward() reads (the blocks' stores; the tokens on the first stage; h, n, r and dlogits on the
        #   last).
        # The question: which part of module 12's forward does a stage run, and on which of the microbatch's positions?
        # Pitfalls: is the executor's n_microbatches the loss's divisor? Which positions of the targets go with this
        #   rank's positions of the tokens?
        # Hint 1: where does module 12's TPLlama forward start and stop on a first, a middle and a last stage, and which
        #         of the T positions does a rank hold after module 15's layout and sequence parallelism? (docs/17, "A
        #         stage: FSDP x TP blocks", the message between stages.)
        # Hint 2: first stage: h = E[tokens] at this rank's T/c positions (vocabulary-parallel, sequence-parallel:
        #         (rows, T/(c t), M)); else h = the message as (rows, T/(c t), M). h <- block_l(h) for each of the
        #         stage's blocks. Last stage: n = rmsnorm(h) with the final norm, z = n W_head^T on this t rank's V'/t
        #         rows, share = Σ_j ℓ_j / self.n_tokens over this rank's positions j (module 12's vocabulary-parallel
        #         cross-entropy).
        # Hint 3: tokens = self.positions(x) on the first stage
        #         h = embedding_forward(tokens, self.embedding, tp, True) on the first stage,
        #             else x.view(rows, self.stream_len, cfg.dim)
        #         h = self.block_forward(i, h, stores[i]) for each block i
        #         not last: keep Saved(stores, tokens) while training; return h.reshape(rows, self.hidden)
        #         last: n, r = rmsnorm_forward(h, self.final_norm, cfg.norm_eps)
        #               (logits,) = column_parallel_forward(n, [self.lm_head], tp, True, "lm head")
        #               loss, dlogits = vocab_parallel_cross_entropy(logits as (N, V'/t), self.positions(targets)
        #                                                            as (N,), cfg.vocab_size, tp, self.n_tokens)
        #               keep Saved(stores, tokens, h, n, r, dlogits.view_as(logits)) while training; return loss
        tokens = self.positions(x) if self.is_first else None
        h = embedding_forward(tokens, self.embedding, tp, True) if self.is_first else \
            x.view(rows, self.stream_len, cfg.dim)
        for i, store in enumerate(stores):
            h = self.block_forward(i, h, store)
        if not self.is_last:
            if self.training:
                self.saved[microbatch] = Saved(stores, tokens)
            return h.reshape(rows, self.hidden)
        n, r = rmsnorm_forward(h, self.final_norm, cfg.norm_eps)
        (logits,) = column_parallel_forward(n, [self.lm_head], tp, True, "lm head")
        loss, dlogits = vocab_parallel_cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                     self.positions(targets).reshape(-1), cfg.vocab_size, tp,
                                                     self.n_tokens)
        if self.training:
            self.saved[microbatch] = Saved(stores, tokens, h, n, r, dlogits.view_as(logits))
        return loss
        # <<<

    @torch.no_grad()
    def backward(self, microbatch: int, grad_output: torch.Tensor | None = None):
        """The gradient of the stage's input (rows, hidden), None on the first stage; every weight's
        gradient added into its accumulator (the blocks' whole buffers, the outer weights' one)."""
        saved = self.saved.pop(microbatch)
        tp = self.groups.tp
        # >>> TODO(m17): the stage's backward: loss, head and final norm (last stage), blocks, embedding (first)
        # Contract: the forward in reverse, from what forward() saved. Every weight's gradient of this microbatch's
        #   share is added into its accumulator: the blocks' through block_backward (into self.block_grads), the LM
        #   head's, the final norm's and the embedding's into self.outer_grads (views of the whole buffer gather_outer()
        #   made). Return the gradient of the stage's input as (rows, self.hidden), or None on the first stage; each
        #   block's store is empty afterwards.
        # The question: which backward undoes each step of the forward, on a first, a middle and a last stage?
        # Pitfalls: do the m microbatches of the step add up, or does each replace the one before? Where does the last
        #   stage's gradient start, and what does grad_output hold elsewhere?
        # Hint 1: module 12's TPLlama backward, on a stage's piece: which weights does each stage end own, and in which
        #         order do their backwards run? (docs/17, "A stage: FSDP x TP blocks".)
        # Hint 2: last stage: from dlogits through the LM head (dn, and ∂W_head += dlogits^T n over the gathered
        #         positions), then the final norm (dh, and ∂g += its gradient); else dh = grad_output as (rows, T/(c t),
        #         M). dh <- block_l's backward for l from the stage's last block to its first. First stage: ∂E[token] +=
        #         dh at each of this rank's positions (module 12's vocabulary-parallel embedding backward).
        # Hint 3: acc = self.outer_grads
        #         last: dn = column_parallel_backward([saved.dlogits], saved.n, [self.lm_head], [acc.lm_head], tp, True,
        #                                             "lm head")
        #               dh, d_final = rmsnorm_backward(dn, saved.h, saved.r, self.final_norm)
        #               acc.final_norm.add_(d_final)
        #         else: dh = grad_output.view(rows, self.stream_len, cfg.dim)
        #         for i from the last block to the first: dh = self.block_backward(i, dh, saved.stores[i]); clear it
        #         first: embedding_backward(dh, saved.tokens, acc.embedding, tp, True); return None
        #         else: return dh.reshape(rows, self.hidden)
        accumulators = self.outer_grads
        if self.is_last:
            dn = column_parallel_backward([saved.dlogits], saved.n, [self.lm_head], [accumulators.lm_head], tp,
                                          True, "lm head")
            dh, d_final = rmsnorm_backward(dn, saved.h, saved.r, self.final_norm)
            accumulators.final_norm.add_(d_final)
        else:
            dh = grad_output.view(grad_output.shape[0], self.stream_len, self.cfg.dim)
        for i in reversed(range(len(self.layers))):
            dh = self.block_backward(i, dh, saved.stores[i])
            saved.stores[i].clear()
        if self.is_first:
            embedding_backward(dh, saved.tokens, accumulators.embedding, tp, True)
            return None
        return dh.reshape(dh.shape[0], self.hidden)
        # <<<


class EvalMode:
    """`with EvalMode(stages):` the stages' forwards keep nothing and need no backward (given)."""

    def __init__(self, stages):
        self.stages = list(stages)

    def __enter__(self):
        for stage in self.stages:
            stage.training = False

    def __exit__(self, *exc):
        for stage in self.stages:
            stage.training = True
            stage.release()
