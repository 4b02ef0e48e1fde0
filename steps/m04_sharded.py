# Generated from solutions/m04_sharded.py by `python -m course.skeleton`: fill in the TODOs.
# Grade your work with `python main.py grade 04`. (skeleton 98fa46064f8a)
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
    # TODO(m04): return the contiguous block of layer indices owned by `rank`
    raise NotImplementedError('TODO(m04): return the contiguous block of layer indices owned by `rank`')


class ShardedMLP(nn.Module):
    """This rank's layers of the monolith; the last rank also holds the head."""

    def __init__(self, cfg: MLPConfig, rank: int, world_size: int):
        super().__init__()
        self.rank, self.world_size, self.hidden = rank, world_size, cfg.hidden
        # Where this stage sits in the pipeline: the first takes the batch, the last computes the loss.
        self.is_first, self.is_last = rank == 0, rank == world_size - 1
        mine = layer_range(cfg, rank, world_size)
        # TODO(m04): build self.layers (an nn.ModuleList of this rank's layers) and self.head
        # Hint: torch.manual_seed(cfg.seed), then create all cfg.layers Linear(hidden, hidden)
        #       layers in order, keeping those whose index is in `mine`: the random stream then
        #       matches the monolith's. The last rank then creates the head (others: self.head = None).
        raise NotImplementedError("TODO(m04): build self.layers (an nn.ModuleList of this rank's layers) and self.head")

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

    Every rank passes the same batch: the first rank feeds it in, the others only use its batch
    size to allocate their receive buffer, shape (batch, hidden).
    """
    # TODO(m04): receive the input (unless first rank), run this rank's layers, send (unless last)
    # Hint: model.is_first and model.is_last say where this rank's stage sits.
    # Hint: the receive buffer's shape is (x.shape[0], model.hidden).
    raise NotImplementedError("TODO(m04): receive the input (unless first rank), run this rank's layers, send (unless last)")

