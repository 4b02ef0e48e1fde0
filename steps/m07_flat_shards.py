# Generated from solutions/m07_flat_shards.py by `python -m course.skeleton`: fill in the TODOs.
# Grade your work with `python main.py grade 07`. (skeleton 568618c4082a)
"""Module 07, part 1 - a group of weights as one flat buffer, cut into equal shards.

An all-gather moves one contiguous tensor, so FSDP lays all of a block's weights end to end in a
single flat buffer (ln1, wq, wk, wv, wo, ln2, w_gate, w_up, w_down, in BlockWeights order), padded
with zeros so that it cuts into world_size equal shards, one per rank in rank order: rank r keeps
only the r-th, and the shards of ranks 0, 1, ... laid end to end are the buffer again. After an
all-gather every rank holds the whole flat buffer again, and the block's weights are *views* into it
(no copy), exactly as FSDP's "flat parameter" does.

The weights outside the blocks, the embedding, the final norm and the LM head (OuterWeights), are
one more such group: FSDP2 shards the weights a root module holds itself the same way, as one group
gathered and reduce-scattered together. A FlatLayout takes either as its template.
"""
from dataclasses import dataclass, fields
from math import prod

import torch

from .m06_llama_block import BlockWeights

NAMES = [f.name for f in fields(BlockWeights)]


@dataclass
class OuterWeights:
    """The weights outside the blocks, in this order: the embedding (V, M), the final norm (M) and the
    LM head (V, M). A group laid out flat like a block (module 17's stages hold the ones they use, the
    others with no rows)."""
    embedding: torch.Tensor
    final_norm: torch.Tensor
    lm_head: torch.Tensor

    def tensors(self) -> list[torch.Tensor]:
        return [self.embedding, self.final_norm, self.lm_head]


class FlatLayout:
    """Where each tensor of a group (a block's BlockWeights, or OuterWeights) lives in the flat buffer,
    and how it is cut into `world_size` shards (FSDPLlama passes its data group's size, d = dp.size;
    module 08 passes 1). `template` gives the tensors' shapes and the group's class."""

    def __init__(self, template: BlockWeights | OuterWeights, world_size: int):
        self.kind, self.names = type(template), [f.name for f in fields(template)]
        self.shapes = [tuple(t.shape) for t in template.tensors()]
        self.numels = [prod(s) for s in self.shapes]
        self.numel = sum(self.numels)  # the group's parameters, without padding
        # TODO(m07): the shard size and the padded size: equal shards that cover every parameter
        # Set self.shard_numel and self.padded_numel (integers). The numel parameters are cut into world_size shards
        # of one size, the smallest size that lets them cover all numel; padded_numel is what the shards hold
        # together: numel plus fewer than world_size elements of zero padding.
        # Pitfall: the tests use 3 and 7 ranks, which do not divide the test block's numel; both sizes must be exact Python
        # integers, also for counts of billions (float arithmetic is not).
        raise NotImplementedError('TODO(m07): the shard size and the padded size: equal shards that cover every parameter')
        self.world_size = world_size

    def flatten(self, block: BlockWeights | OuterWeights) -> torch.Tensor:
        """A new padded flat buffer holding the group's tensors end to end (zeros in the padding)."""
        first = block.tensors()[0]
        flat = torch.zeros(self.padded_numel, dtype=first.dtype, device=first.device)
        # TODO(m07): lay the block's tensors end to end in the flat buffer
        # flat is a zeroed (padded_numel,) buffer. Write each of the group's tensors into it, flattened, in field
        # order (the order of block.tensors() and of self.numels), each right after the previous one;
        # the padding at the end stays zero. The test compares with the tensors concatenated in that order,
        # followed by zeros, for 1 to 7 ranks.
        # Pitfall: view(-1) fails on a tensor that is not contiguous; a reshape copies only when it must.
        raise NotImplementedError("TODO(m07): lay the block's tensors end to end in the flat buffer")
        return flat

    def views(self, flat: torch.Tensor) -> BlockWeights | OuterWeights:
        """The group's tensors as views into `flat` (writing through them writes the buffer)."""
        # TODO(m07): the block's tensors as views into the flat buffer, each in its shape
        # Return a group of the template's class (self.kind: BlockWeights for a block) whose fields (self.names, in
        # order) are views of flat's first numel elements, each in its shape (self.shapes). Views, not copies: writing through a field writes the buffer, and an all-gather into
        # the buffer changes what the fields show (that is how the gathered block reaches the loop). The padding
        # belongs to no field.
        # Pitfall: a copy (clone, cat, a reshape that had to copy) has the right values, but the test checks that
        # every field shares the buffer's storage.
        raise NotImplementedError("TODO(m07): the block's tensors as views into the flat buffer, each in its shape")

    def shard(self, flat: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank `rank`'s slice of a padded flat buffer (a view)."""
        # TODO(m07): the rank's shard: its slice of the padded buffer
        # Return rank `rank`'s shard of a padded flat buffer: a view of shard_numel consecutive elements. Rank r's is
        # the r-th of world_size equal consecutive pieces, so the shards of ranks 0 .. d - 1, in order, concatenate
        # to the whole buffer (the test checks this; docs/07-fsdp.md cuts 12 values over 3 ranks, and leaves 10
        # values over 4 ranks to you).
        # Pitfall: sizes computed from the unpadded numel leave a gap or an overlap when d does not divide it.
        raise NotImplementedError("TODO(m07): the rank's shard: its slice of the padded buffer")
