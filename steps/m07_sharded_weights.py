# Generated from solutions/m07_sharded_weights.py by `python -m course.skeleton`: fill in the TODOs.
# Grade your work with `python main.py grade 07`. (skeleton 55479d5d3d62)
"""Module 07, part 3 - a weight source that all-gathers each block from its shards, just in time.

It implements module 06's WeightSource protocol, so the model loop does not change:

    gather(l)   start the all-gather of block l (async) into one of two full-size buffers
    get(l)      wait for it; return the block's weights as views into that buffer
    release(l)  the loop is done with block l: its buffer may be overwritten by the next gather
    invalidate() the optimizer changed the shards: gathered copies are stale, and freed

Two buffers (double buffering): block l always goes to buffer l % 2, so while block l is computed
in one buffer, block l + 1 (forward) or l - 1 (backward) is gathered into the other.

A gather may find its block already in the buffer: at the turn from forward to backward the last
two layers are still there, and at the turn from one micro-step's backward to the next forward the
first two are. Then nothing need be sent, if those weights are still the current ones: the optimizer
changes the shards between steps, and invalidate() counts those changes as versions. Each buffer's
fields (GatherBuffer) say what it holds; the three methods keep them true.

Between steps nothing whole is kept: invalidate() frees both buffers (their copies are stale anyway),
and the step's first gather into each allocates it again. So a rank holds only its shards between
steps, as FSDP2's ranks do (it frees its gathered weights after the backward).

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
        raise RuntimeError(f"get({layer}): its buffer holds layer {layer} but is {FREE}; your gather({layer}) "
                           f"must mark it {GATHERING}, also when the layer is still there")
    if buf.layer != layer or buf.state != GATHERING:
        raise RuntimeError(f"get({layer}) without a gather({layer}) before it "
                           f"(its buffer holds layer {buf.layer}, {buf.state})")


def check_release(buf, layer: int):
    if buf.layer == layer and buf.state == GATHERING:
        raise RuntimeError(f"release({layer}): its buffer is still {GATHERING}; your get({layer}) must mark it "
                           f"{IN_USE} when it hands the block out")
    if buf.layer != layer or buf.state != IN_USE:
        raise RuntimeError(f"release({layer}) but layer {layer} is not in use "
                           f"(its buffer holds layer {buf.layer}, {buf.state})")


@dataclass
class GatherBuffer:
    """One of the two full-size buffers and what it knows of its contents. Between any two calls:
    `flat` holds block `layer` as it was at the weights' version `version`, or will once `pending`
    (the all-gather in flight into it) has completed, or is None, freed by invalidate() (whose new
    version that `version` is then older than); `state` is where the buffer is in the protocol's
    cycle, FREE -> gather -> GATHERING -> get -> IN_USE -> release -> FREE (the check_* functions
    above refuse a call in any other state)."""
    flat: torch.Tensor | None  # one padded block, all ranks' shards (None: freed between steps)
    layer: int = -1           # the layer whose weights it holds (-1: none yet)
    version: int = -1         # the weights' version when they were gathered
    state: str = FREE
    pending: object = None    # the all-gather in flight (None: nothing to wait for)


class ShardedWeights:
    """Every block's shard on this rank, and two buffers to gather whole blocks into (allocated by a
    step's first gathers, freed by invalidate())."""

    def __init__(self, layout: FlatLayout, shards: list[torch.Tensor], collectives: Collectives):
        self.layout, self.shards, self.collectives = layout, shards, collectives
        self.buffers = [GatherBuffer(None) for _ in range(2)]
        self.version = 0

    def buffer_for(self, layer: int) -> GatherBuffer:
        return self.buffers[layer % 2]

    def gather(self, layer: int) -> None:
        buf = self.buffer_for(layer)
        check_gather(buf, layer)
        if buf.flat is None:  # freed by invalidate(): the step's first gather into it allocates it again
            buf.flat = torch.empty(self.layout.padded_numel, dtype=self.shards[0].dtype)
        # TODO(m07): start gathering the layer into its buffer, unless it is there and current
        # Contract: after check_gather, buf (buffer layer % 2) is FREE. Leave it GATHERING, its fields true to
        #   GatherBuffer's docstring for this layer at the current weights (self.version), so that get(layer) can hand
        #   the block out; and send only what that needs. The tests count the all-gathers of a step: exactly the reuses
        #   at the turns are skipped, and a copy from before an optimizer step is not one. gather() returns at once,
        #   waiting for nothing (the next block's transfer must overlap this block's compute); this rank's shard of the
        #   layer is self.shards[layer]; the collective is labelled "block <layer>" (the tests read the layer number).
        # The question: which of the buffer's fields tell whether its contents can be handed out again as they are, and
        #   what must the fields say afterwards in either case?
        # Pitfall: all ranks take the same branch: what happens to the others if one rank skips a collective its peers
        #   run?
        raise NotImplementedError('TODO(m07): start gathering the layer into its buffer, unless it is there and current')

    def get(self, layer: int) -> BlockWeights:
        buf = self.buffer_for(layer)
        check_get(buf, layer)
        # TODO(m07): hand out the gathered layer once its transfer has arrived
        # Contract: after check_get the buffer is GATHERING this layer, and your gather() may have left a transfer in
        #   flight into it. Return the block as views into buf.flat (no copy) that hold this layer's current weights,
        #   and leave every field of buf true to GatherBuffer's docstring for a block the loop now holds. A collective's
        #   output holds NaN until its work is waited for (on a GPU the transfer may still be running).
        # The question: what must have completed before buf.flat holds the weights, and what do the fields say once it
        #   has?
        # Pitfall: completing the transfer in gather() gives the same numbers: what does it cost the overlap?
        raise NotImplementedError('TODO(m07): hand out the gathered layer once its transfer has arrived')

    def release(self, layer: int) -> None:
        """The loop is done with the layer (given)."""
        buf = self.buffer_for(layer)
        check_release(buf, layer)
        buf.state = FREE  # the buffer may be overwritten now; what it holds (layer, version) is still true

    def invalidate(self) -> None:
        """The optimizer changed the shards: a new version, and the stale copies freed (given)."""
        self.version += 1
        for buf in self.buffers:
            buf.flat = None
