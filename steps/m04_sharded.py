# Generated from solutions/m04_sharded.py by `python -m course.skeleton`: fill in the TODOs.
# Grade your work with `python main.py grade 04`. (skeleton cce5c0bbf85a)
"""Module 04 - the sharded model.

The model is cut into stages of consecutive layers, one per rank of the pipeline (the last stage
also holds the head and computes the loss), so the parameter memory per rank is divided by the
number of pipeline ranks, p. A forward pass becomes a relay: the first stage feeds the batch in,
every stage runs its layers and sends the result on, and the last stage produces the logits.

The pipeline's ranks are a group (course/mesh.py's `Group`): every rank of the job by default, or
one axis of a bigger mesh. A stage's place in the pipeline is its index in that group.

For the split to be an exact copy of the monolith, every rank must start from the monolith's
weights for its layers, which the monolith draws from one seeded random stream, layer after layer.
Approximating the random stream instead (say, seeding each rank differently) gives a different
model, and the loss curves no longer agree.
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
    # Contract: a range of layer indices. Over stages 0 .. n_stages - 1 (S stages), in order, the
    # ranges are consecutive blocks of equal length that together cover 0 .. L - 1 (L =
    # cfg.layers) exactly once and in order: each stage's block starts where the previous
    # stage's ends. check_stages (given, above) has already refused an S that does not divide L.
    # The grader lists the ranges it got for S = 1, 2, 4, 8, 16 (16 layers) and S = 3, 6 (12).
    # The question: where does stage s's block start, and where does it stop?
    # Pitfalls: is a range's stop included? Do layers dealt out in turn (s, s + S, ...) form
    # consecutive blocks?
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
        # order), each hidden to hidden, with exactly the initial weights of the monolith's layers
        # of the same indices; self.head is the monolith's head (hidden to classes) on the last
        # stage and None on every other. What the process drew from the random stream before this
        # constructor must not matter: the grader draws with another seed before each shard, on
        # pipelines of 1 to 16 ranks. Memory: never hold the whole model, only this rank's layers
        # and at most a layer or two more at any moment.
        # The question: the monolith's layer i is initialised by draws that come after every draw
        # of layers 0 .. i - 1. How does rank r end up with the weights of the layers it owns,
        # and with no others kept?
        # Pitfalls: does rank 0 holding the right weights say anything about rank 1? Where in the
        # stream are the head's draws, and which ranks hold a head? Are layers kept in a plain
        # list parameters?
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
    # Contract: runs on every rank at once, with the same batch x (batch, features); every rank
    # but the first may be handed only x's rows (x[:, :1]), to read the batch size from. Returns
    # this rank's output, its stage applied to its input: activations (batch, model.hidden), or
    # logits (batch, classes) on the last rank, equal to the monolith's bit for bit (torch.equal
    # on 1, 2 and 4 ranks, and a 12-layer model 8 wide on 3). Messages go through comms (module
    # 02's verbs); activations travel in float32, the comms' default.
    # The question: where does each rank's input come from, and where must its output go, so that
    # every receive has a matching send?
    # Pitfalls: which ranks have no one to receive from, or to send to? How wide is the activation
    # a rank receives? What does the next rank do if this one never sends?
    raise NotImplementedError("TODO(m04): pass the batch through this rank's stage of the relay and return its output")

