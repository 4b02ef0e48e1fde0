# Generated from solutions/m07_flat_shards.py by `python -m course.skeleton`: fill in the TODOs.
# Grade your work with `python main.py grade 07`. (skeleton 14e96a1a4d68)
"""Module 07, part 1 - one block's weights as one flat buffer, cut into equal shards.

An all-gather moves one contiguous tensor, so FSDP lays all of a block's weights end to end in a
single flat buffer (ln1, wq, wk, wv, wo, ln2, w_gate, w_up, w_down, in BlockWeights order), padded
with zeros to a multiple of the number of ranks. Rank r keeps only elements
[r * shard_numel, (r + 1) * shard_numel): its shard. After an all-gather every rank holds the whole
flat buffer again, and the block's weights are *views* into it (no copy), exactly as FSDP's
"flat parameter" does.
"""
from dataclasses import fields
from math import prod

import torch

from .m06_llama_block import BlockWeights

NAMES = [f.name for f in fields(BlockWeights)]


class FlatLayout:
    """Where each of a block's tensors lives in the flat buffer, and how it is cut into shards."""

    def __init__(self, template: BlockWeights, world_size: int):
        self.shapes = [tuple(t.shape) for t in template.tensors()]
        self.numels = [prod(s) for s in self.shapes]
        self.numel = sum(self.numels)  # the block's parameters, without padding
        # TODO(m07): pad the flat size up to a multiple of world_size; each rank holds one shard
        # Hint: all shards have the same size, the smallest that lets world_size of them cover numel (integer
        #       ceiling division, no floats); padded_numel is what the shards hold together.
        raise NotImplementedError('TODO(m07): pad the flat size up to a multiple of world_size; each rank holds one shard')
        self.world_size = world_size

    def flatten(self, block: BlockWeights) -> torch.Tensor:
        """A new padded flat buffer holding the block's tensors end to end (zeros in the padding)."""
        first = block.tensors()[0]
        flat = torch.zeros(self.padded_numel, dtype=first.dtype, device=first.device)
        # TODO(m07): copy each tensor, flattened, into its place
        # Hint: the tensors go in order, each right after the previous one; reshape(-1) flattens.
        raise NotImplementedError('TODO(m07): copy each tensor, flattened, into its place')
        return flat

    def views(self, flat: torch.Tensor) -> BlockWeights:
        """The block's tensors as views into `flat` (writing through them writes the buffer)."""
        # TODO(m07): split the flat buffer (without its padding) and view each piece in its shape
        # Hint: torch.split cuts a tensor into pieces of given lengths, as views; leave the padding out. Give
        #       each piece its shape with .view, which never copies: writing through it writes the buffer.
        raise NotImplementedError('TODO(m07): split the flat buffer (without its padding) and view each piece in its shape')

    def shard(self, flat: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank `rank`'s slice of a padded flat buffer (a view)."""
        # TODO(m07): the rank's contiguous slice of shard_numel elements
        raise NotImplementedError("TODO(m07): the rank's contiguous slice of shard_numel elements")
