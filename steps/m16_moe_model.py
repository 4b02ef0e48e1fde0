# Generated from solutions/m16_moe_model.py by `python -m course.skeleton`: fill in the TODOs.
# Grade your work with `python main.py grade 16`. (skeleton 1dca1858b6b5)
"""Module 16, part 5 - module 06's Llama with MoE blocks, trained with experts over e ranks that are
also data-parallel (torchtitan's folding of the expert axis into the data axis).

Every rank builds the whole model from the seed and keeps its E/e experts of every layer; it draws
the whole global batch and keeps its share: the d c ranks of the "dc" group split the B sequences,
each then cuts its share into m microbatches. A microbatch's forward sends each token to the member
of the rank's expert group ("e") that holds its expert, so the e members of a group compute on
each other's tokens, and every rank's loss is its own tokens' loss.

Which ranks sum which gradients:

  dense weights (embedding, attention, norms, router, shared expert, LM head)  every rank has a copy and
      its own tokens' gradient: summed over every data rank, mesh.group("d", "c")
  experts (gate, up, down of each local expert)  the members of the expert-data group "ed" hold the same
      experts; each copy's gradient already holds every token its expert group routed to it: summed
      over "ed" only (d c / e ranks)

The loss of a step is the mean cross-entropy of the global batch's tokens plus, with the auxiliary
loss, (1/B) Σ over its sequences of Σ over the layers of L_seq: each microbatch's cross-entropy
gradient is scaled by 1 / (d c m) (its share of the mean), each sequence's auxiliary loss by 1 / B.
With the auxiliary-loss-free bias, the step's loads (summed over every data rank) move the biases
after the optimizer's step. Dropless, the losses follow one process's on the whole batch; with a
capacity they follow one process that drops by the same groups: d c m microbatches, one per source.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from course.collectives import Collectives
from course.dataset import load_text, random_batch
from course.mesh import Group, Mesh
from .m06_llama_block import LlamaConfig
from .m06_llama_model import LOSS_CHUNK, LlamaModel, ResidentWeights, chunked_cross_entropy
from .m06_llama_ops import rmsnorm_backward, rmsnorm_forward
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
    loss: float            # mean cross-entropy
    aux: float             # the auxiliary loss: (1/B) Σ over sequences and layers of L_seq (0 without it)
    dropped: int           # slots the capacity dropped, over all layers and ranks
    loads: torch.Tensor    # (L, E) int64: slots the router sent each expert of each layer (before the capacity)


def sum_gradients(dense: list[torch.Tensor], experts: list[torch.Tensor], mesh: Mesh):
    """Sum the gradients of a step in place over the ranks that hold the same weights: `dense`, those
    of the weights every rank holds, `experts`, those of this rank's experts. (Module 14 replaces this
    with its bucketed, overlapped version.)"""
    # TODO(m16): sum the dense gradients over every data rank, the experts' over the expert-data group
    # Contract: afterwards every tensor of `dense` holds its sum over mesh.group("d", "c"), and every tensor of
    #   `experts` its sum over mesh.group("ed"). One all-reduce for each list (flatten it into one buffer, sum,
    #   copy back), labelled "dense gradients" and "expert gradients": the cost formula counts two.
    # Maths: the module docstring's table: a gradient is summed over the ranks that hold the same weight and saw
    #   different tokens.
    # Pitfalls: the experts are *not* on every data rank: summing them over "d", "c" adds different experts'
    #   gradients together, summing them over "e" too; the dense weights over "ed" or "e" miss ranks. On one
    #   rank every group has one member (the collectives then copy nothing and send nothing).
    raise NotImplementedError("TODO(m16): sum the dense gradients over every data rank, the experts' over the expert-data group")


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

    def forward_backward(self, tokens: torch.Tensor, targets: torch.Tensor, grad_scale: float = 1.0,
                         aux_weight: float = 1.0):
        """Module 06's forward_backward with MoE blocks, given: returns (loss, dense grads, expert grads), in
        the order of dense_parameters() and expert_parameters(); the cross-entropy's gradient is scaled by
        grad_scale, each sequence's auxiliary loss weighted by aux_weight."""
        self.cfg.check_seq_len(tokens.shape[1])
        self.layer.aux_weight = aux_weight
        stores = [self.block.new_store() for _ in range(self.cfg.n_layers)]
        x = self.forward_blocks(self.embedding[tokens], stores)
        n, r = rmsnorm_forward(x, self.final_norm, self.cfg.norm_eps)
        loss, dn, d_head = chunked_cross_entropy(n, self.lm_head, targets, self.loss_chunk)
        dx, d_final = rmsnorm_backward(dn * grad_scale, x, r, self.final_norm)
        dx, grads = self.backward_blocks(dx, stores)
        d_embedding = torch.zeros_like(self.embedding).index_add_(0, tokens.reshape(-1), dx.reshape(-1, self.cfg.dim))
        blocks = [t for g in grads for t in (g.dense.ln1, g.dense.wq, g.dense.wk, g.dense.wv, g.dense.wo, g.dense.ln2,
                                             *g.moe.dense_tensors())]
        dense = [d_embedding, *blocks, d_final, d_head * grad_scale]
        return loss, dense, [t for g in grads for t in g.moe.experts.tensors()]

    def train_step(self, tokens: torch.Tensor, targets: torch.Tensor, n_microbatches: int, optimizer) -> float:
        """One optimizer step on the global batch tokens, targets (B, T) (the same on every rank): this rank
        takes its share, in n_microbatches microbatches. Returns the step's mean cross-entropy over the whole
        batch (the same on every rank); self.last_step holds the step's statistics (StepStats) afterwards."""
        data, n_layers, n_experts = self.mesh.group("d", "c"), self.cfg.n_layers, self.moe.n_experts
        n_sequences = tokens.shape[0]
        if n_sequences % (data.size * n_microbatches):
            raise ValueError(f"a batch of {n_sequences} sequences cannot be split over {data.size} data ranks x "
                             f"{n_microbatches} microbatches")
        self.layer.records.clear()
        # TODO(m16): one training step: this rank's share in microbatches, the gradient sums, the step, the biases
        # Contract: take rows data.index * B/(d c) .. of tokens and targets (B = tokens.shape[0], d c = data.size),
        #   cut them into n_microbatches, run forward_backward on each, add up the gradients, sum them with
        #   sum_gradients, hand them to the optimizer (p.grad, in parameters()' order: dense, then experts), step.
        #   Then leave in `stats` the step's statistics summed over the whole global batch, float64: [cross-entropy
        #   sum of the microbatches' mean losses, auxiliary loss sum (the records' aux), dropped slots, then the loads
        #   (L, E) flattened], and with self.moe.balance == "bias" update the biases with those loads.
        # Maths: the module docstring: the cross-entropy of a microbatch counts 1 / (d c m) in the step's mean,
        #   each sequence's auxiliary loss 1 / B. self.layer.records holds one RoutingRecord per layer and
        #   microbatch, in call order (microbatch by microbatch, layer by layer).
        # Pitfalls: every statistic the step's loss or the biases read is summed over every data rank ("d", "c"),
        #   in one all-reduce labelled "step statistics". The loads are the router's choices before the capacity,
        #   summed over the microbatches per layer. The tests train on 2 and 4 ranks, with experts over 2 and 4 of
        #   them, with and without microbatches, the auxiliary loss and the biases, against one process.
        raise NotImplementedError("TODO(m16): one training step: this rank's share in microbatches, the gradient sums, the step, the biases")
        self.last_step = StepStats(stats[0].item() / (data.size * n_microbatches), stats[1].item() / n_sequences,
                                   int(stats[2].item()), stats[3:].view(n_layers, n_experts).long())
        return self.last_step.loss


def train(cfg: LlamaConfig, moe: MoEConfig, steps: int, mesh: Mesh, batch: int = 8, n_microbatches: int = 1,
          lr: float = 3e-3, seed: int = 0, dtype=torch.float32, on_step=None):
    """Module 06's `train` for the MoE Llama on the ranks of `mesh` (one_rank_mesh() for one process):
    the same initial model and batches on every rank. Returns (model, losses); `on_step(step, loss)`
    is called after every step (the model's layer.records then hold the step's routing)."""
    model = MoELlama(cfg, moe, mesh, seed, dtype)
    data, generator = load_text(), torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    for step in range(steps):
        tokens, targets = random_batch(data, batch, cfg.max_seq_len, generator)
        losses.append(model.train_step(tokens, targets, n_microbatches, optimizer))
        if on_step:
            on_step(step, losses[-1])
    return model, losses
