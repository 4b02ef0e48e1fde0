# Generated from solutions/m16_moe_model.py by `python -m course.skeleton`: fill in the TODOs.
# Grade your work with `python main.py grade 16`. (skeleton 1560ec9eb07f)
"""Module 16, part 5 - module 06's Llama with MoE blocks, trained with experts over e ranks that are
also data-parallel (torchtitan's folding of the expert axis into the data axis).

Every rank builds the whole model from the seed and keeps its E/e experts of every layer; it draws
the whole global batch and keeps its share: the d c ranks of the "dc" group split the B sequences,
each then cuts its share into m microbatches. A microbatch's forward sends each token to the member
of the rank's expert group ("e") that holds its expert, so the e members of a group compute on
each other's tokens, and every rank's loss is its own tokens' loss.

Which rank holds what:

  dense weights (embedding, attention, norms, router, shared expert, LM head)  a copy on every rank
  experts (gate, up, down)  member i of an expert group holds experts i E/e .. (i + 1) E/e - 1 of
      every layer; a copy's gradient holds every token its expert group routed to those experts

The loss of a step is the mean cross-entropy over the global batch's real tokens (module 06's
`real_tokens`: IGNORE_INDEX marks padding) plus, with the auxiliary loss, (1/B) Σ over its sequences
of Σ over the layers of L_seq. With the auxiliary-loss-free bias, the step's loads (over the whole
global batch) move the biases after the optimizer's step. Dropless, the losses
follow one process's on the whole batch; with a capacity they follow one process that drops by the
same groups: d c m microbatches, one per source. Module 06's `fit` trains it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from course.collectives import Collectives
from course.mesh import Group, Mesh
from .m06_llama_block import LlamaConfig
from .m06_llama_model import LOSS_CHUNK, LlamaModel, ResidentWeights, fit, microbatches, real_tokens
from .m16_moe_layer import MoEBlock, MoEBlockWeights, init_moe_weights, zero_ffn
from .m16_router import MoEConfig, update_biases

# The module's model: module 06's Llama, small (dim 32, 2 blocks, sequences of 16); its dense FFN is replaced
# by E = 8 experts of width F = 32, top-2, so e can be 1, 2, 4 or 8.
CONFIG = LlamaConfig(dim=32, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=32, n_layers=2, max_seq_len=16)
MOE = MoEConfig(n_experts=8, top_k=2, expert_dim=32)


def one_rank_mesh() -> Mesh:
    """The mesh of a single process: every group (d, c, dc, e, ed) a group of one, logging into
    mesh.log (given)."""
    log = []
    groups = {axis: Group(axis, 0, (0,), Collectives(None, axis, (0,), log)) for axis in ("d", "c", "dc", "e", "ed")}
    return Mesh({}, {}, groups, log)


@dataclass
class StepStats:
    """One training step, over the whole global batch (the same on every rank)."""
    loss: float            # mean cross-entropy over the real tokens
    aux: float             # the auxiliary loss: (1/B) Σ over sequences and layers of L_seq (0 without it)
    dropped: int           # slots the capacity dropped, over all layers and ranks
    loads: torch.Tensor    # (L, E) int64: slots the router sent each expert of each layer (before the capacity)


def sum_gradients(dense: list[torch.Tensor], experts: list[torch.Tensor], mesh: Mesh):
    """Sum the gradients of a step in place over the ranks that hold the same weights: `dense`, those
    of the weights every rank holds, `experts`, those of this rank's experts. (Module 14 replaces this
    with its bucketed, overlapped version.)"""
    # TODO(m16): sum each gradient over the ranks that hold a copy of its weight
    # Contract: afterwards every tensor of `dense` and of `experts` holds the sum of that gradient over every rank that
    #   holds a copy of its weight (the ranks that saw other tokens). One all-reduce for each list, each flattened into
    #   one buffer, labelled "dense gradients" and "expert gradients" (the cost formula counts two). The test gives
    #   each rank its own values and reads which ranks' values each list holds afterwards.
    # Maths: the module docstring says which ranks hold which weights.
    # Question: for a dense weight, and for one expert's weight, which of the mesh's groups is exactly the set of its
    #   copies?
    # Pitfalls: are the experts on every data rank? Does the expert group hold copies of one expert, or different
    #   experts? On one rank every group has one member: what must the sums then be?
    raise NotImplementedError('TODO(m16): sum each gradient over the ranks that hold a copy of its weight')


class MoELlama(LlamaModel):
    """This rank's part of module 06's Llama with MoE blocks: every dense weight, and its E/e experts
    of each layer. Module 06's loops run the blocks (forward_blocks, backward_blocks)."""

    def __init__(self, cfg: LlamaConfig, moe: MoEConfig, mesh: Mesh, seed: int = 0, dtype=torch.float32,
                 loss_chunk: int = LOSS_CHUNK):
        if mesh.sizes.get("c", 1) > 1:
            raise ValueError(f"c={mesh.sizes['c']}: this model splits whole sequences over its data ranks (context "
                             f"parallelism, which splits one sequence, is module 15's)")
        block = MoEBlock(cfg, moe, mesh.group("e"))
        super().__init__(cfg, seed, dtype, block=block, loss_chunk=loss_chunk)   # the dense model, from the seed
        generator = torch.Generator().manual_seed(seed + 1)   # then every layer's E experts; this rank keeps its own
        self.blocks = [MoEBlockWeights(zero_ffn(b), init_moe_weights(moe, cfg.dim, generator, block.moe_layer.local,
                                                                        dtype)) for b in self.blocks]
        self.weights = ResidentWeights(self.blocks)
        self.moe, self.mesh, self.layer = moe, mesh, block.moe_layer

    def dense_parameters(self) -> list[torch.Tensor]:
        """Every weight each rank holds a copy of (the zero FFN left out: it is not trained)."""
        blocks = [t for b in self.blocks for t in (b.dense.ln1, b.dense.wq, b.dense.wk, b.dense.wv, b.dense.wo,
                                                   b.dense.ln2, *b.moe.dense_tensors())]
        return [self.embedding, *blocks, self.final_norm, self.lm_head]

    def expert_parameters(self) -> list[torch.Tensor]:
        return [t for b in self.blocks for t in b.moe.experts.tensors()]

    def parameters(self) -> list[torch.Tensor]:
        return self.dense_parameters() + self.expert_parameters()

    def biases(self) -> list[torch.Tensor]:
        return [b.moe.bias for b in self.blocks]

    def forward_backward(self, tokens: torch.Tensor, targets: torch.Tensor, n_tokens: int | None = None,
                         aux_weight: float = 1.0):
        """Module 06's forward_backward with MoE blocks, given: returns (loss, dense grads, expert grads), in
        the order of dense_parameters() and expert_parameters(); the cross-entropy summed over the real
        targets is divided by n_tokens (module 06's convention), each sequence's auxiliary loss weighted by
        aux_weight."""
        self.layer.aux_weight = aux_weight
        loss, grads = super().forward_backward(tokens, targets, n_tokens)
        blocks = [t for g in grads.blocks for t in (g.dense.ln1, g.dense.wq, g.dense.wk, g.dense.wv, g.dense.wo,
                                                    g.dense.ln2, *g.moe.dense_tensors())]
        dense = [grads.embedding, *blocks, grads.final_norm, grads.lm_head]
        return loss, dense, [t for g in grads.blocks for t in g.moe.experts.tensors()]

    def train_step(self, tokens: torch.Tensor, targets: torch.Tensor, n_microbatches: int, optimizer) -> float:
        """One optimizer step on the global batch tokens, targets (B, T) (the same on every rank): this rank
        takes its share, in n_microbatches microbatches. Returns the step's mean cross-entropy over the whole
        batch's real tokens (the same on every rank); self.last_step holds the step's statistics (StepStats)
        afterwards."""
        data, n_layers, n_experts = self.mesh.group("d", "c"), self.cfg.n_layers, self.moe.n_experts
        n_sequences = tokens.shape[0]
        if n_sequences % (data.size * n_microbatches):
            raise ValueError(f"a batch of {n_sequences} sequences cannot be split over {data.size} data ranks x "
                             f"{n_microbatches} microbatches")
        self.layer.records.clear()
        # TODO(m16): one training step: this rank's share in microbatches, the gradient sums, the step, the biases
        # Contract: afterwards every parameter has had one optimizer step, with p.grad (set for parameters() in order:
        #   dense, then experts) the gradient of the step's loss (the mean cross-entropy over the whole global batch's real
        #   tokens, plus each sequence's L_seq weighted 1 / B) summed over its copies; this rank computed rows
        #   data.index B/(d c) .. (data.index + 1) B/(d c) - 1 of tokens and targets, in n_microbatches microbatches, with
        #   forward_backward; `stats` holds, float64 and the same on every rank, [the cross-entropy (the microbatches'
        #   losses added up), the aux losses' sum (the records'), the dropped slots, then the loads (L, E) flattened], over
        #   the whole global batch, from one all-reduce labelled "step statistics"; with self.moe.balance == "bias" the
        #   biases have moved by those loads. The tests train on 4 ranks (experts over 2 and 4, with microbatches, the
        #   auxiliary loss, the bias, a capacity, targets padded unevenly) against one process.
        # Maths: the module docstring defines the step's loss. self.layer.records holds one RoutingRecord per layer and
        #   forward, in call order.
        # Question: what must each microbatch's cross-entropy be divided by, and each sequence's auxiliary loss weighted by,
        #   so that the pieces added over the microbatches and the ranks are the step's loss and its gradient?
        # Pitfalls: what if the padding falls unevenly over the ranks and the microbatches? In which order do the records
        #   come when m > 1? Are the loads counted before or after the capacity? Over which group must every statistic the
        #   loss or the biases read be summed?
        raise NotImplementedError("TODO(m16): one training step: this rank's share in microbatches, the gradient sums, the step, the biases")
        self.last_step = StepStats(stats[0].item(), stats[1].item() / n_sequences, int(stats[2].item()),
                                   stats[3:].view(n_layers, n_experts).long())
        return self.last_step.loss


def train(cfg: LlamaConfig, moe: MoEConfig, steps: int, mesh: Mesh, batch: int = 8, n_microbatches: int = 1,
          lr: float = 3e-3, seed: int = 0, dtype=torch.float32, on_step=None):
    """The MoE Llama on the ranks of `mesh` (one_rank_mesh() for one process), trained by module 06's `fit`:
    the same initial model and batches on every rank. Returns (model, losses); `on_step(step, loss)` is
    called after every step (the model's last_step and layer.records then hold the step's statistics and
    routing)."""
    return fit(MoELlama(cfg, moe, mesh, seed, dtype), steps, batch, lr, seed, n_microbatches, on_step)
