# Generated from solutions/m08_host_weights.py by `python -m course.skeleton`: fill in the TODOs.
# Grade your work with `python main.py grade 08`. (skeleton 40eb35baab94)
"""Module 08 - weights streamed from host memory on a side stream, overlapping compute.

The same gather/get/release protocol as module 07, but a "gather" is a copy of the block from
page-locked (pinned) host memory into one of two device buffers, on a *side stream*, so it runs
while the compute stream works on the previous block (llm.q's "gather from CPU" path). One GPU is
enough to see communication overlap compute.

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
        # TODO(m08): pinned host copies of the blocks, a side stream, two device buffers with two events each
        # Hint: three attributes, by these names (the tests and the given code use them): self.host, every
        #       block flattened by self.layout, in pinned memory; self.copy_stream, a side stream;
        #       self.buffers, two DeviceBuffers, each room for one padded block on the device, with its own
        #       two events. The runtime makes all of these (course/streams.py lists its calls).
        raise NotImplementedError('TODO(m08): pinned host copies of the blocks, a side stream, two device buffers with two events each')

    def gather(self, layer: int) -> None:
        buf = self.buffers[layer % 2]
        check_gather(buf, layer)
        if buf.layer != layer or buf.version != self.version:  # else: still there, nothing to copy
            # TODO(m08): once the buffer is released, copy the block in on the side stream; mark it ready
            # Hint: all on the copy stream, and the host waits for none of it: first the stream waits for the
            #       buffer's released event (compute may still be reading the old block), then the copy runs
            #       there (rt.stream is a context manager; rt.copy(dst, src)), then the ready event records it
            #       for get() to wait on.
            raise NotImplementedError('TODO(m08): once the buffer is released, copy the block in on the side stream; mark it ready')
            buf.layer, buf.version = layer, self.version
            self.copies += 1
        buf.state = GATHERING

    def get(self, layer: int) -> BlockWeights:
        buf = self.buffers[layer % 2]
        check_get(buf, layer)
        # TODO(m08): make the compute stream wait for the copy; mark the buffer IN_USE; return the block as views
        raise NotImplementedError('TODO(m08): make the compute stream wait for the copy; mark the buffer IN_USE; return the block as views')

    def release(self, layer: int) -> None:
        buf = self.buffers[layer % 2]
        check_release(buf, layer)
        # TODO(m08): record that the compute queued so far is the last to read this buffer; mark it FREE
        raise NotImplementedError('TODO(m08): record that the compute queued so far is the last to read this buffer; mark it FREE')

    def invalidate(self) -> None:
        """The host weights are about to change (or have): no copy may still be reading them."""
        # TODO(m08): wait (on the host) for the copies in flight, then bump the version
        raise NotImplementedError('TODO(m08): wait (on the host) for the copies in flight, then bump the version')


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

