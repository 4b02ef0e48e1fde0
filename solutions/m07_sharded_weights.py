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
        # >>> TODO(m07): start the all-gather of this layer's shards into the buffer, unless it is already there
        # Hint: a hit needs the same layer *and* the current version (the optimizer has not changed it since).
        # Hint: otherwise all-gather every rank's shard of this layer into buf.flat (collectives.all_gather, see
        #       course/collectives.py) without waiting: async_op=True, so gather() returns at once and the
        #       transfer overlaps compute. Label it f"block {layer}" (the log and the tests read the layer
        #       from it). get() must wait for the transfer: keep the work all_gather returns in buf.pending,
        #       and record the layer and version the buffer now holds. Either way the buffer is now GATHERING.
        if buf.layer == layer and buf.version == self.version:
            buf.pending = None  # still resident and current: nothing to send
        else:
            buf.pending = self.collectives.all_gather(buf.flat, self.shards[layer], label=f"block {layer}", async_op=True)
            buf.layer, buf.version = layer, self.version
        buf.state = GATHERING
        # <<<

    def get(self, layer: int) -> BlockWeights:
        buf = self.buffer_for(layer)
        check_get(buf, layer)
        # >>> TODO(m07): wait for the gather if one is in flight; mark the buffer in use; return views
        if buf.pending is not None:
            buf.pending.wait()
            buf.pending = None
        buf.state = IN_USE
        return self.layout.views(buf.flat)
        # <<<

    def release(self, layer: int) -> None:
        buf = self.buffer_for(layer)
        check_release(buf, layer)
        # >>> TODO(m07): the buffer may now be overwritten (its contents stay valid for a later hit)
        buf.state = FREE
        # <<<

    def invalidate(self) -> None:
        self.version += 1
