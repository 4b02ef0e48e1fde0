# Generated from solutions/m07_sharded_weights.py by `python -m course.skeleton`: fill in the TODOs.
# Grade your work with `python main.py grade 07`. (skeleton ca4210eeb803)
"""Module 07, part 3 - a weight source that all-gathers each block from its shards, just in time.

It implements module 06's WeightSource protocol, so the model loop does not change:

    gather(l)   start the all-gather of block l (async) into one of two full-size buffers
    get(l)      wait for it; return the block's weights as views into that buffer
    release(l)  the loop is done with block l: its buffer may be overwritten by the next gather
    invalidate() the optimizer changed the shards: gathered copies are stale

Two buffers (double buffering): block l always goes to buffer l % 2, so while block l is computed
in one buffer, block l + 1 (forward) or l - 1 (backward) is gathered into the other.

Each buffer remembers which layer it holds and the weights' *version* when it was gathered. If
gather(l) finds layer l already there at the current version, nothing is sent: at the turn from
forward to backward the last two layers are still in the buffers, and at the turn from one
micro-step's backward to the next forward the first two are.

Misuse raises at once, with the same message on every rank (all ranks make the same calls), so a
mistake never leaves a peer waiting in a collective.
"""
from dataclasses import dataclass

import torch

from course.collectives import Collectives
from .m06_llama_block import BlockWeights
from .m07_flat_shards import FlatLayout

FREE, GATHERING, IN_USE = "free", "gathering", "in use"


# The protocol's misuse checks, shared with module 08's weight source: each buffer has a `layer`
# and a `state`, and a call in the wrong state fails at once with the fix, instead of hanging.
def check_gather(buf, layer: int):
    if buf.state != FREE:
        raise RuntimeError(f"gather({layer}): its buffer still holds layer {buf.layer} ({buf.state}); "
                           f"call release({buf.layer}) before gathering another layer into it")


def check_get(buf, layer: int):
    if buf.layer == layer and buf.state == FREE:
        raise RuntimeError(f"get({layer}): its buffer holds layer {layer} but is {FREE}; gather({layer}) must "
                           f"mark it {GATHERING}, also when the layer is still there")
    if buf.layer != layer or buf.state != GATHERING:
        raise RuntimeError(f"get({layer}) without a gather({layer}) before it "
                           f"(its buffer holds layer {buf.layer}, {buf.state})")


def check_release(buf, layer: int):
    if buf.layer != layer or buf.state != IN_USE:
        raise RuntimeError(f"release({layer}) but layer {layer} is not in use "
                           f"(its buffer holds layer {buf.layer}, {buf.state})")


@dataclass
class GatherBuffer:
    flat: torch.Tensor        # one padded block, all ranks' shards
    layer: int = -1           # the layer whose weights it holds (-1: none yet)
    version: int = -1         # the weights' version when they were gathered
    state: str = FREE
    pending: object = None    # the all-gather in flight (None: nothing to wait for)


class ShardedWeights:
    """Every block's shard on this rank, and two buffers to gather whole blocks into."""

    def __init__(self, layout: FlatLayout, shards: list[torch.Tensor], collectives: Collectives):
        self.layout, self.shards, self.collectives = layout, shards, collectives
        self.buffers = [GatherBuffer(torch.empty(layout.padded_numel, dtype=shards[0].dtype)) for _ in range(2)]
        self.version = 0

    def buffer_for(self, layer: int) -> GatherBuffer:
        return self.buffers[layer % 2]

    def gather(self, layer: int) -> None:
        buf = self.buffer_for(layer)
        check_gather(buf, layer)
        # TODO(m07): start gathering the layer into its buffer, unless it is there and current
        # After check_gather, buf (buffer layer % 2) is FREE. If it already holds this layer at the current version
        # (the weights have not changed since it was gathered), nothing is sent. Otherwise start an all-gather of
        # every rank's shard of this layer (self.shards[layer] is this rank's) into buf.flat, and record in buf the
        # layer and version it will hold. Either way: buf.pending is what get() must wait for (None if nothing), and
        # the buffer is now GATHERING.
        # Contract with the tests: gather() returns at once (a blocking all-gather fails them: the next block's
        # transfer must overlap this block's compute), and the collective is labelled "block <layer>" (the tests
        # read the layer number from the label).
        # Pitfalls: a hit needs the same layer *and* the current version: after invalidate() (an optimizer step) a
        # stale copy must be gathered again. The tests count the all-gathers of a step: exactly the turns' hits
        # are skipped. All ranks take the same branch; a rank that skipped a collective its peers ran would hang them.
        raise NotImplementedError('TODO(m07): start gathering the layer into its buffer, unless it is there and current')

    def get(self, layer: int) -> BlockWeights:
        buf = self.buffer_for(layer)
        check_get(buf, layer)
        # TODO(m07): hand out the gathered layer once its transfer has arrived
        # After check_get the buffer is GATHERING this layer. Return the block's weights as views into buf.flat
        # (your FlatLayout.views), but only once the all-gather in flight, if any, has completed: until then the
        # buffer holds the previous block or a partial one. Mark the buffer IN_USE; afterwards nothing is pending.
        # Pitfall: a hit (gather sent nothing) has nothing to wait for. Waiting in gather() instead would give the
        # same numbers, but gather(l + 1) comes before layer l computes: the transfer would no longer overlap it.
        raise NotImplementedError('TODO(m07): hand out the gathered layer once its transfer has arrived')

    def release(self, layer: int) -> None:
        buf = self.buffer_for(layer)
        check_release(buf, layer)
        # TODO(m07): free the buffer for the next gather (its contents stay valid for a hit)
        # After check_release the buffer holds this layer, IN_USE. The loop is done with it: mark it so the next
        # gather into this buffer may overwrite it. Keep the layer and version it remembers: if the same layer is
        # gathered again before the weights change (the turn from forward to backward), that gather is a hit.
        # Pitfall: resetting layer or version here turns every turn's hits into all-gathers (the tests count them).
        raise NotImplementedError('TODO(m07): free the buffer for the next gather (its contents stay valid for a hit)')

    def invalidate(self) -> None:
        self.version += 1
