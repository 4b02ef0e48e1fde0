# Generated from solutions/m07_flat_shards.py by `python -m course.skeleton`: fill in the TODOs.
# Grade your work with `python main.py grade 07`. (skeleton 3f73c0f31e9b)
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
        # Contract: set self.shard_numel and self.padded_numel, Python ints (exact for counts of billions): world_size
        #   shards of shard_numel values each, one per rank, which together hold all numel values and fewer than
        #   world_size values of zero padding; padded_numel is the shards' total. The tests use 3 and 7 ranks, which do
        #   not divide the test block's numel.
        # The question: how long must each of d equal shards be to cover numel values, for any numel and d?
        # Pitfall: what does float arithmetic give for a count of billions?
        raise NotImplementedError('TODO(m07): the shard size and the padded size: equal shards that cover every parameter')
        self.world_size = world_size

    def flatten(self, block: BlockWeights | OuterWeights) -> torch.Tensor:
        """A new padded flat buffer holding the group's tensors end to end (zeros in the padding)."""
        first = block.tensors()[0]
        flat = torch.zeros(self.padded_numel, dtype=first.dtype, device=first.device)
        # Given: each tensor right after the one before, in field order; the padding stays zero.
        offset = 0
        for tensor, n in zip(block.tensors(), self.numels):
            flat[offset:offset + n] = tensor.reshape(-1)
            offset += n
        return flat

    def views(self, flat: torch.Tensor) -> BlockWeights | OuterWeights:
        """The group's tensors as views into `flat` (writing through them writes the buffer)."""
        # TODO(m07): the block's tensors as views into the flat buffer, each in its shape
        # Contract: return a group of the template's class (self.kind) whose fields (self.names, in order) are views of
        #   flat's first numel values, each in its shape (self.shapes): writing through a field writes the buffer, and
        #   an all-gather into the buffer changes what the fields show (that is how the gathered block reaches the
        #   loop). The padding belongs to no field. The test checks that every field shares the buffer's storage.
        # The question: which piece of the buffer is each field, and how do you get it without a copy?
        # Pitfall: which of clone, cat and reshape may copy?
        raise NotImplementedError("TODO(m07): the block's tensors as views into the flat buffer, each in its shape")

    def shard(self, flat: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank `rank`'s slice of a padded flat buffer (a view)."""
        # Given: the pieces an all-gather lays end to end in rank order must be the buffer again.
        start = rank * self.shard_numel
        return flat[start:start + self.shard_numel]
