"""Module 04 - the sharded model.

Each rank holds only its own slice of the 16 layers (the last rank also holds the head and
computes the loss), so the parameter memory per rank is divided by the number of ranks. A forward
pass becomes a relay: rank 0 feeds the batch in, every rank runs its layers and sends the result
on, and the last rank produces the logits.

For the split to be an exact copy of the monolith, every rank must start from the monolith's
weights for its layers. We get them by replaying the monolith's construction from the same seed:
every rank creates every layer in order (one at a time, so at most two extra layers are alive) and
keeps only its own. Approximating the random stream instead (say, seeding each rank differently)
gives a different model, and the loss curves no longer agree.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from .m00_monolith import MLPConfig
from .m02_comms import PipelineComms


def check_world_size(cfg: MLPConfig, world_size: int):
    if world_size < 1 or cfg.layers % world_size != 0:
        raise ValueError(f"{cfg.layers} layers cannot be split evenly over {world_size} ranks; "
                         f"use a world size that divides {cfg.layers}")


def layer_range(cfg: MLPConfig, rank: int, world_size: int) -> range:
    """The indices of the layers that `rank` holds."""
    check_world_size(cfg, world_size)
    # >>> TODO(m04): return the block of consecutive layer indices a rank owns
    # Contract: a range of layer indices. Over ranks 0 .. world_size - 1, in order, the ranges are
    # consecutive blocks of equal length L/P (L = cfg.layers, P = world_size) that together
    # cover 0 .. L - 1 exactly once and in order: rank r's block starts where rank r - 1's ends.
    # check_world_size (given, above) has already refused a P that does not divide L.
    # Pitfalls: a range's stop is excluded, so an off-by-one drops or repeats a layer at every
    # boundary; dealing the layers out in turn (r, r + P, ...) covers every layer but not in
    # blocks, and a pipeline needs each rank's layers to be consecutive. The grader lists the
    # ranges it got for P = 1, 2, 4, 8 and 16.
    # Hint 1: Every rank gets the same number of layers; rank r's block comes after r such blocks.
    # Hint 2: per_rank = L // P (an int); rank r's first index is r * per_rank; range(start, stop)
    #         stops before stop.
    # Hint 3: per_rank <- layers divided by world_size (integer division)
    #         return the range from rank's first index up to the next rank's first index
    per_rank = cfg.layers // world_size
    return range(rank * per_rank, (rank + 1) * per_rank)
    # <<<


class ShardedMLP(nn.Module):
    """This rank's layers of the monolith; the last rank also holds the head."""

    def __init__(self, cfg: MLPConfig, rank: int, world_size: int):
        super().__init__()
        self.rank, self.world_size, self.hidden = rank, world_size, cfg.hidden
        # Where this stage sits in the pipeline: the first takes the batch, the last computes the loss.
        self.is_first, self.is_last = rank == 0, rank == world_size - 1
        mine = layer_range(cfg, rank, world_size)
        # >>> TODO(m04): build this rank's layers, and the head on the last rank, with the monolith's initial weights
        # Contract: self.layers is an nn.ModuleList of this rank's layers (the indices in `mine`, in
        # order), each hidden to hidden, with exactly the initial weights of the monolith's layers of
        # the same indices; self.head is the monolith's head (hidden to classes) on the last rank
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
        # names the world size, rank and layer. The head before the layers, or on every rank:
        # the grader compares the head and demands None elsewhere. Layers in a plain Python list
        # are not parameters: the grader counts the parameters the shards hold together.
        # Hint 1: Replay the monolith's construction from its seed on every rank, keeping only this
        #         rank's layers and letting the others go as soon as they are made; then, on the
        #         last rank only, the head (the last draws).
        # Hint 2: torch.manual_seed(the config's seed); nn.Linear(cfg.hidden, cfg.hidden) for
        #         every index in range(cfg.layers), kept when the index is in `mine`;
        #         nn.ModuleList(kept layers); nn.Linear(cfg.hidden, cfg.classes); self.is_last.
        # Hint 3: seed with cfg.seed
        #         for each layer index, in order: make a hidden-to-hidden Linear; keep it if the
        #             index is this rank's
        #         self.layers <- ModuleList of the kept ones
        #         self.head <- a hidden-to-classes Linear on the last rank, else None
        torch.manual_seed(cfg.seed)
        kept = []
        for index in range(cfg.layers):
            layer = nn.Linear(cfg.hidden, cfg.hidden)  # every rank draws every layer's weights
            if index in mine:
                kept.append(layer)
        self.layers = nn.ModuleList(kept)
        self.head = nn.Linear(cfg.hidden, cfg.classes) if self.is_last else None
        # <<<

    def forward(self, x):
        """This rank's part of the forward pass: hidden activations, or logits on the last rank."""
        for layer in self.layers:
            x = F.relu(layer(x))
        return self.head(x) if self.is_last else x

    def loss(self, logits, targets):
        if not self.is_last:
            raise RuntimeError(f"rank {self.rank} has no head: only the last rank computes the loss")
        return F.cross_entropy(logits, targets)


def sharded_forward(model: ShardedMLP, comms: PipelineComms, x: torch.Tensor) -> torch.Tensor:
    """Relay the batch `x` through all ranks; return this rank's output (logits on the last rank).

    The first rank feeds the batch in; the others only read its number of rows from `x` (to size
    their receive buffer, (rows, hidden)), so they may be handed just those rows.
    """
    # >>> TODO(m04): pass the batch through this rank's stage of the relay and return its output
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
    # Hint 1: Three steps, two of them depending on where this stage sits: where its input comes
    #         from, computing, where its output goes.
    # Hint 2: model.is_first and model.is_last; comms.recv_forward(shape) with shape
    #         (x.shape[0], model.hidden); model(input); comms.send_forward(output).
    # Hint 3: if not the first stage: x <- receive forward, (batch rows, hidden columns)
    #         out <- this rank's model of x
    #         if not the last stage: send out forward
    #         return out
    if not model.is_first:
        x = comms.recv_forward((x.shape[0], model.hidden))
    out = model(x)
    if not model.is_last:
        comms.send_forward(out)
    return out
    # <<<

