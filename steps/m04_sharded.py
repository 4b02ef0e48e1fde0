# Generated from solutions/m04_sharded.py by `python -m course.skeleton`: fill in the TODOs.
# Grade your work with `python main.py grade 04`. (skeleton 1e76429bad73)
"""Module 04 - the sharded model.

The model is cut into stages of consecutive layers, one per rank of the pipeline (the last stage
also holds the head and computes the loss), so the parameter memory per rank is divided by the
number of pipeline ranks, p. A forward pass becomes a relay: the first stage feeds the batch in,
every stage runs its layers and sends the result on, and the last stage produces the logits.

The pipeline's ranks are a group (course/mesh.py's `Group`): every rank of the job by default, or
one axis of a bigger mesh. A stage's place in the pipeline is its index in that group.

For the split to be an exact copy of the monolith, every rank must start from the monolith's
weights for its layers. We get them by replaying the monolith's construction from the same seed:
every rank creates every layer in order (one at a time, so at most two extra layers are alive) and
keeps only its own. Approximating the random stream instead (say, seeding each rank differently)
gives a different model, and the loss curves no longer agree.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from course.mesh import Group
from .m00_monolith import MLPConfig
from .m02_comms import PipelineComms


def check_stages(cfg: MLPConfig, n_stages: int):
    """Refuse a cut of the model into stages of unequal length (here one stage per pipeline rank;
    module 11 cuts it into p v stages)."""
    if n_stages < 1 or cfg.layers % n_stages != 0:
        raise ValueError(f"{cfg.layers} layers cannot be split evenly into {n_stages} stages; "
                         f"use a number of stages that divides {cfg.layers}")


def layer_range(cfg: MLPConfig, stage: int, n_stages: int) -> range:
    """The indices of the layers that stage `stage` of `n_stages` holds."""
    check_stages(cfg, n_stages)
    # TODO(m04): return the block of consecutive layer indices a stage owns
    # Contract: a range of layer indices. Over stages 0 .. n_stages - 1, in order, the ranges are
    # consecutive blocks of equal length L/S (L = cfg.layers, S = n_stages; here one stage per
    # pipeline rank, S = p) that together cover 0 .. L - 1 exactly once and in order: stage s's
    # block starts where stage s - 1's ends. check_stages (given, above) has already refused an S
    # that does not divide L.
    # Pitfalls: a range's stop is excluded, so an off-by-one drops or repeats a layer at every
    # boundary; dealing the layers out in turn (s, s + S, ...) covers every layer but not in
    # blocks, and a pipeline needs each stage's layers to be consecutive. The grader lists the
    # ranges it got for S = 1, 2, 4, 8 and 16.
    raise NotImplementedError('TODO(m04): return the block of consecutive layer indices a stage owns')


class ShardedMLP(nn.Module):
    """This rank's stage of the monolith: its layers, and the head on the last stage.

    `pp` is the pipeline's group: this rank holds stage pp.index of pp.size."""

    def __init__(self, cfg: MLPConfig, pp: Group):
        super().__init__()
        self.pp, self.hidden = pp, cfg.hidden
        # Where this stage sits in the pipeline: the first takes the batch, the last computes the loss.
        self.is_first, self.is_last = pp.index == 0, pp.index == pp.size - 1
        mine = layer_range(cfg, pp.index, pp.size)
        # TODO(m04): build this rank's layers, and the head on the last rank, with the monolith's initial weights
        # Contract: self.layers is an nn.ModuleList of this rank's layers (the indices in `mine`, in
        # order), each hidden to hidden, with exactly the initial weights of the monolith's layers of
        # the same indices; self.head is the monolith's head (hidden to classes) on the last stage
        # and None on every other. What the process drew from the random stream before this
        # constructor must not matter.
        # The invariant: the monolith's weights come from one stream seeded with cfg.seed, drawn
        # layer by layer in index order and the head last; a layer's weights depend on every draw
        # before it, and there is no cheap way to skip ahead (docs/04-sharded.md). Memory: keep only
        # this rank's layers, and let every other layer go once the next one exists: never hold
        # the whole model.
        # Pitfalls: not seeding here makes the shard depend on what the caller drew (the grader
        # draws with another seed before building each shard). Creating only this rank's layers
        # after seeding gives rank 0 the right weights and every other rank wrong ones: the grader
        # names the world size, rank and layer. The head before the layers, or on every stage:
        # the grader compares the head and demands None elsewhere. Layers in a plain Python list
        # are not parameters: the grader counts the parameters the shards hold together.
        raise NotImplementedError("TODO(m04): build this rank's layers, and the head on the last rank, with the monolith's initial weights")

    def forward(self, x):
        """This stage's part of the forward pass: hidden activations, or logits on the last stage."""
        for layer in self.layers:
            x = F.relu(layer(x))
        return self.head(x) if self.is_last else x

    def loss(self, logits, targets):
        if not self.is_last:
            raise RuntimeError(f"stage {self.pp.index} of {self.pp.size} has no head: only the last stage computes "
                               "the loss")
        return F.cross_entropy(logits, targets)


def sharded_forward(model: ShardedMLP, comms: PipelineComms, x: torch.Tensor) -> torch.Tensor:
    """Relay the batch `x` through the pipeline; return this rank's output (logits on the last stage).

    The first stage feeds the batch in; the others only read its number of rows from `x` (to size
    their receive buffer, (rows, hidden)), so they may be handed just those rows.
    """
    # TODO(m04): pass the batch through this rank's stage of the relay and return its output
    # Contract: runs on every rank at once, with the same batch x (batch, features). The first
    # rank computes from x; every other rank computes from the activation the previous rank sends
    # (batch rows, model.hidden columns, float32), and x only tells it the batch size. Every rank
    # but the last hands its output on to the next rank. Returns this rank's output: activations
    # (batch, hidden), or the logits (batch, classes) on the last rank.
    # The invariant: a message copies bytes and does no arithmetic, so the last rank's logits are
    # the monolith's bit for bit (the grader compares with torch.equal on 2 and 4 ranks).
    # Pitfalls: receiving on the first rank or sending from the last: the comms raise their clear
    # "rank r is the first/last stage" error. A rank that never sends leaves the next one
    # waiting in its receive: the grader stops the ranks at its timeout and names the line each
    # is stuck on. The buffer's width is the model's, not x's: the grader hands the other ranks
    # only the batch's rows (x[:, :1]), so a buffer sized from x.shape fails.
    raise NotImplementedError("TODO(m04): pass the batch through this rank's stage of the relay and return its output")

