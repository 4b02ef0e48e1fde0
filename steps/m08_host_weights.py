# Generated from solutions/m08_host_weights.py by `python -m course.skeleton`: fill in the TODOs.
# Grade your work with `python main.py grade 08`. (skeleton f4ffeb6cca7f)
"""Module 08 - weights streamed from host memory on a side stream, overlapping compute.

The same gather/get/release protocol as module 07, but a "gather" is a copy of the block from
page-locked (pinned) host memory into one of two device buffers, on a *side stream*, so it can run
while the compute stream works on the previous block (the "gather from CPU" path of llm.q, a
CUDA/C++ LLM trainer). One GPU is enough to see communication overlap compute.

Streams run their work in order; work on different streams may run at the same time. Each device
buffer has two events: `ready` completes when the copy into the buffer has finished, `released`
when the compute that read the buffer has finished. Who records each, on which stream, and who
waits for it, is what gather, get and release decide. The host never waits in them: it only queues
work and dependencies. (PyTorch's `record_stream` would instead tie the buffer's memory to the
compute stream through the caching allocator; an explicit event says exactly when the buffer may
be overwritten.)

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
        # Contract: afterwards three attributes exist, by these names (the tests and the given code read them):
        #   self.host (one entry per block, in self.layout's flat form), self.copy_stream (the stream gather issues
        #   its copies on) and self.buffers (the two DeviceBuffers that layer % 2 picks from). The first test checks,
        #   from outside: a copy from each self.host entry to the device can run while the host goes on; the copy
        #   stream is not the compute stream; each buffer's flat tensor is on the device, in the blocks' dtype, with
        #   room for one padded block; and the four events are four distinct objects. Everything comes from the
        #   runtime (course/streams.py lists its calls), never from torch.cuda directly: on CPU the tests hand you a
        #   recorder, and its event graph is what they check.
        # Question: what must exist before the first gather for a copy to overlap compute, and what must each buffer
        #   own alone?
        # Pitfalls: from which memory can a host-to-device copy run without the host waiting for it? Could copies
        #   issued on the compute stream overlap the compute queued before them? If two buffers shared an event, what
        #   would a copy into one of them end up waiting for?
        raise NotImplementedError('TODO(m08): pinned host blocks, a side stream, two device buffers with their events')

    def gather(self, layer: int) -> None:
        buf = self.buffers[layer % 2]
        check_gather(buf, layer)
        if buf.layer != layer or buf.version != self.version:  # else: still there, nothing to copy
            # TODO(m08): bring the block into its device buffer, in order with the compute, without the host waiting
            # Contract: reached when buffer layer % 2 does not hold this layer at the current version. Queue the copy of
            #   self.host[layer] into buf.flat (self.rt.copy), issued on the copy stream, such that afterwards, in the
            #   event graph: the copy is ordered after every compute that read the buffer's old block (up to its
            #   release), and buf.ready completes only once the copy has. The host waits for none of it.
            # Question: which event must the copy stream wait for, and where must ready be recorded to mean "copied"?
            # Pitfalls: is a copy queued while the compute stream is current on the side stream, whatever it waited
            #   for? Does an event recorded before the copy say anything about the copy?
            raise NotImplementedError('TODO(m08): bring the block into its device buffer, in order with the compute, without the host waiting')
            buf.layer, buf.version = layer, self.version
            self.copies += 1
        buf.state = GATHERING

    def get(self, layer: int) -> BlockWeights:
        buf = self.buffers[layer % 2]
        check_get(buf, layer)
        # TODO(m08): hand the block out for compute to read
        # Contract: after check_get, buffer layer % 2 is GATHERING this layer. Afterwards the compute stream's later
        #   work (this block's kernels) is ordered after the copy into the buffer, the host has not waited, the buffer
        #   is IN_USE, and the block is returned as views into buf.flat (the layout's, as in module 07).
        # Question: how does the compute stream come to wait for a copy queued on another stream, without the host
        #   waiting for anything?
        # Pitfalls: a host-side wait gives the right numbers: what does it do to the overlap? What may a kernel read
        #   if nothing orders it after the copy (on a GPU: old weights, or the NaN the GPU test fills buffers with)?
        #   When gather found the block still there and copied nothing, what does waiting cost?
        raise NotImplementedError('TODO(m08): hand the block out for compute to read')

    def release(self, layer: int) -> None:
        buf = self.buffers[layer % 2]
        check_release(buf, layer)
        # TODO(m08): give the buffer back once the compute that reads it has been queued
        # Contract: after check_release the buffer is IN_USE with this layer, and the compute that reads it has been
        #   queued (not necessarily run: the host runs ahead of the GPU). Afterwards buf.released is what the next copy
        #   into this buffer can be ordered by, so that it never overwrites the block while a kernel queued so far may
        #   still read it (the host waits for nothing); the buffer is FREE, still knowing its layer and version (a
        #   later gather of the same layer is a hit).
        # Question: the next copy into this buffer must wait for the compute that reads it: what can it wait for, and
        #   what decides when that completes?
        # Pitfalls: recorded on the copy stream, or not at all, what would the next copy into this buffer wait for?
        raise NotImplementedError('TODO(m08): give the buffer back once the compute that reads it has been queued')

    def invalidate(self) -> None:
        """The host weights are about to change (or have): no copy may still be reading them."""
        # TODO(m08): make host weights safe to write, and forget every copy on the device
        # Contract: the optimizer writes the host weights right after this call. Afterwards no copy may still be
        #   reading them (the hazard checker orders the host's writes after every copy issued), and no buffer counts
        #   as holding a current block: the next gather of any layer copies it again (the test counts the copies of
        #   two steps). This is the one place the host may wait, between steps.
        # Question: what must the host wait for before a write, and how does the next gather learn that every buffer
        #   is stale?
        # Pitfalls: which stream's work reads the host weights? What does gather compare to decide that a buffer
        #   still holds the current block?
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

