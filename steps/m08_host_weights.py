# Generated from solutions/m08_host_weights.py by `python -m course.skeleton`: fill in the TODOs.
# Grade your work with `python main.py grade 08`. (skeleton 63e23109c884)
"""Module 08 - weights streamed from host memory on a side stream, overlapping compute.

The same gather/get/release protocol as module 07, but a "gather" is a copy of the block from
page-locked (pinned) host memory into one of two device buffers, on a *side stream*, so it runs
while the compute stream works on the previous block (the "gather from CPU" path of llm.q, a
CUDA/C++ LLM trainer). One GPU is enough to see communication overlap compute.

Streams run their work in order; work on different streams may run at the same time. Events say
what must wait for what:

    gather(l)   the copy stream waits for buffer l % 2's *released* event (the compute that read
                its old contents is done), copies block l in without blocking the host, and
                records the buffer's *ready* event after the copy
    get(l)      the compute stream waits for the ready event: block l's kernels start after the copy
    release(l)  record the released event on the compute stream, after the kernels that read it

The host never waits in gather/get/release: it only queues work and dependencies. (PyTorch's
`record_stream` would instead tie the buffer's memory to the compute stream through the caching
allocator; an explicit event says exactly when the buffer may be overwritten.)

The stream calls go through a runtime (course/streams.py): torch.cuda on a GPU, or a recorder on
CPU whose event graph the tests check for read-before-copy and overwrite-before-release hazards.
"""
from dataclasses import dataclass

import torch

from .m06_llama_block import BlockWeights
from .m07_flat_shards import FlatLayout
from .m07_sharded_weights import FREE, GATHERING, IN_USE, check_gather, check_get, check_release


@dataclass
class DeviceBuffer:
    flat: torch.Tensor   # one block, on the device
    ready: object        # event: the copy into `flat` has finished
    released: object     # event: the compute that read `flat` has finished
    layer: int = -1
    version: int = -1
    state: str = FREE


class HostWeights:
    """Every block in pinned host memory; two device buffers filled on a side stream."""

    def __init__(self, blocks: list[BlockWeights], runtime):
        self.rt, self.layout, self.version = runtime, FlatLayout(blocks[0], world_size=1), 0
        self.compute_stream = runtime.current_stream()
        dtype = blocks[0].wq.dtype
        self.copies = 0  # block copies issued (the benchmark's transfer count)
        # TODO(m08): pinned host blocks, a side stream, two device buffers with their events
        # Set three attributes, by these names (the tests and the given code read them):
        #   self.host         every block, flattened by self.layout, in pinned (page-locked) host memory
        #   self.copy_stream  a new side stream for the copies
        #   self.buffers      two DeviceBuffers, each with room for one padded block on the device (in dtype) and
        #                     its own two events, ready and released
        # Everything comes from the runtime (course/streams.py lists its calls), never from torch.cuda directly: on
        # CPU the tests hand you a recorder, and its event graph is what the hazard checker reads.
        # Why pinned: only from page-locked memory does a host-to-device copy run without the host waiting for it.
        # Pitfall: events shared between the buffers make a copy wait for more than
        # the buffer it overwrites: the prefetch test then finds the step longer than compute plus the first copy.
        raise NotImplementedError('TODO(m08): pinned host blocks, a side stream, two device buffers with their events')

    def gather(self, layer: int) -> None:
        buf = self.buffers[layer % 2]
        check_gather(buf, layer)
        if buf.layer != layer or buf.version != self.version:  # else: still there, nothing to copy
            # TODO(m08): on the side stream, once the buffer is released: copy the block in, mark it ready
            # Reached when buffer layer % 2 does not hold this layer, current. Queue on the copy stream, in this order:
            # a wait for the buffer's released event (compute may still be reading the block it holds), the copy of
            # self.host[layer] into buf.flat, and a record of buf.ready after the copy, for get() to wait on.
            # The host waits for none of it: gather only queues work and dependencies (a host wait inside a step fails
            # the tests).
            # Invariants the event-graph hazard checker enforces: no copy overwrites a buffer that compute still reads,
            # and the copies run on the side stream, never on the compute stream.
            # Pitfalls: the copy must be *issued on* the copy stream, not only ordered after a wait there: a copy
            # queued on the current (compute) stream serializes with compute and fails the side-stream test. ready is
            # recorded on the stream the copy went to, after the copy: recorded before it, it says nothing about it.
            raise NotImplementedError('TODO(m08): on the side stream, once the buffer is released: copy the block in, mark it ready')
            buf.layer, buf.version = layer, self.version
            self.copies += 1
        buf.state = GATHERING

    def get(self, layer: int) -> BlockWeights:
        buf = self.buffers[layer % 2]
        check_get(buf, layer)
        # TODO(m08): make compute wait for the block's copy, and hand the block out
        # After check_get, buffer layer % 2 is GATHERING this layer. Make the compute stream's later work (this
        # block's kernels) wait for the copy into the buffer, without the host waiting. Then mark the buffer
        # IN_USE and return the block as views into buf.flat (your FlatLayout's views).
        # Pitfalls: a host-side wait (synchronize) gives the right numbers but no overlap, and a host wait inside a
        # step fails the tests. A missing wait is the hazard "compute may read a buffer before the copy into it
        # has finished" (on a GPU: old weights, or the NaN the GPU test poisons buffers with).
        # A hit (gather copied nothing) may wait anyway: the event then refers to the last copy, long done.
        raise NotImplementedError("TODO(m08): make compute wait for the block's copy, and hand the block out")

    def release(self, layer: int) -> None:
        buf = self.buffers[layer % 2]
        check_release(buf, layer)
        # TODO(m08): mark the point after which the buffer may be overwritten, and free it
        # After check_release the buffer is IN_USE with this layer, and the compute that reads it has been queued
        # (not necessarily run: the host runs ahead of the GPU). Record the event a later gather into this buffer
        # will wait for, at this point of the compute stream; then mark the buffer FREE (keeping its layer and
        # version, for a later hit).
        # Pitfall: recording it on the copy stream, or not at all, lets the next copy overwrite the buffer while
        # compute still reads it: the hazard checker names the pair ("a copy may overwrite a buffer that compute
        # still reads").
        raise NotImplementedError('TODO(m08): mark the point after which the buffer may be overwritten, and free it')

    def invalidate(self) -> None:
        """The host weights are about to change (or have): no copy may still be reading them."""
        # TODO(m08): make host weights safe to write, and forget every copy on the device
        # The optimizer changes the host weights around this call, and copies still in flight read them: the host
        # must wait until the copy stream's work is done (the one host wait, between steps). Then every block in a
        # device buffer is stale: bump the version, so the next gather of any layer copies it again.
        # Pitfalls: without the wait, the hazard checker reports that "the host may write weights that a copy is
        # still reading"; without the bump, the next step reuses old blocks (the test counts the copies of two
        # steps).
        raise NotImplementedError('TODO(m08): make host weights safe to write, and forget every copy on the device')


class NoPrefetch:
    """Wraps a HostWeights so each block is copied only when needed and only after all compute queued
    before it, as if the copy ran on the compute stream: no overlap (the benchmark's baseline).

    Merely issuing the copy late would not do: the host runs ahead of the GPU, so a copy issued after
    block l's kernels still overlaps them unless the copy stream is told to wait for them."""

    def __init__(self, source: HostWeights):
        self.source = source
        self.compute_done = source.rt.new_event()

    def gather(self, layer: int) -> None:
        pass

    def get(self, layer: int) -> BlockWeights:
        self.compute_done.record(self.source.compute_stream)
        self.source.copy_stream.wait_event(self.compute_done)
        self.source.gather(layer)
        return self.source.get(layer)

    def release(self, layer: int) -> None:
        self.source.release(layer)

    def invalidate(self) -> None:
        self.source.invalidate()

