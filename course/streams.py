"""Streams and events behind one small interface, for real (CUDA) or recorded (CPU) - given code.

Module 08's weight source talks to a *runtime* instead of torch.cuda directly:

    rt.current_stream()      the stream compute runs on           torch.cuda.current_stream()
    rt.new_stream()          a side stream                        torch.cuda.Stream()
    rt.new_event()           an event                             torch.cuda.Event()
    rt.stream(s)             `with` block: work goes to stream s  torch.cuda.stream(s)
    rt.copy(dst, src)        asynchronous copy on the current stream   dst.copy_(src, non_blocking=True)
    rt.pin(t)                a copy of t in page-locked host memory    t.pin_memory()
    rt.empty(n, dtype)       an uninitialised buffer on the device
    stream.wait_event(e)     later work on the stream waits for the work e captured
    e.record(stream)         e captures all work issued to the stream so far
    stream.synchronize()     the host waits for all of the stream's work

`CudaRuntime` passes these straight to torch.cuda. `FakeRuntime` runs every copy at once on CPU
tensors (so the numbers are real) and records an *event graph*: one node per operation, with an
edge from each operation to the ones that must finish first (same stream: the previous one; a
wait: the work the event captured). `find_hazards` then lists every pair of operations that touch
the same memory, at least one writing, that the graph does not order: on a GPU they could run in
either order.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch


class CudaRuntime:
    """The real thing: torch.cuda's streams and events (touches CUDA only when constructed)."""

    def __init__(self, device="cuda"):
        self.device = torch.device(device)

    def current_stream(self):
        return torch.cuda.current_stream(self.device)

    def new_stream(self):
        return torch.cuda.Stream(self.device)

    def new_event(self):
        return torch.cuda.Event()

    def stream(self, stream):
        return torch.cuda.stream(stream)

    def copy(self, dst: torch.Tensor, src: torch.Tensor):
        dst.copy_(src, non_blocking=True)

    def pin(self, t: torch.Tensor) -> torch.Tensor:
        return t.pin_memory()

    def empty(self, n: int, dtype) -> torch.Tensor:
        return torch.empty(n, dtype=dtype, device=self.device)


# --- the recorder ------------------------------------------------------------------------------

@dataclass
class Node:
    index: int
    stream: str
    label: str
    reads: frozenset   # storage addresses
    writes: frozenset
    preds: tuple = ()  # the nodes this one waits for directly
    before: int = 0    # bit i set: node i must finish before this one (transitively)


@dataclass
class FakeStream:
    runtime: "FakeRuntime"
    name: str
    last: Node | None = None
    waits: list = field(default_factory=list)  # nodes the next operation must wait for

    def wait_event(self, event: "FakeEvent"):
        if event.node is not None:  # waiting on an event never recorded waits for nothing (as in CUDA)
            self.waits.append(event.node)

    def synchronize(self):
        self.runtime.host.wait_for(self.last)

    def add(self, label, reads=(), writes=()) -> Node:
        # Anything the host did before issuing this (e.g. writing weights) has already happened.
        host = self.runtime.host.last if self is not self.runtime.host else None
        preds = tuple(n for n in [self.last, host, *self.waits] if n is not None)
        before = 0
        for node in preds:
            before |= node.before | (1 << node.index)
        node = Node(len(self.runtime.nodes), self.name, label, frozenset(reads), frozenset(writes), preds, before)
        self.runtime.nodes.append(node)
        self.last, self.waits = node, []
        return node


@dataclass
class FakeEvent:
    runtime: "FakeRuntime"
    node: Node | None = None

    def record(self, stream: FakeStream | None = None):
        stream = stream or self.runtime.current_stream()
        self.node = stream.add("record event")  # captures the stream's work, and what it waited for

    def synchronize(self):
        self.runtime.host.wait_for(self.node)


class HostTimeline(FakeStream):
    """The CPU's own operations (e.g. the optimizer writing host weights), ordered by synchronize()."""

    def wait_for(self, node: Node | None):
        if node is not None:
            self.waits.append(node)


def address(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class FakeRuntime:
    """Streams and events that run copies at once on CPU tensors and record the event graph."""

    def __init__(self):
        self.nodes: list[Node] = []
        self.compute = FakeStream(self, "compute")
        self.host = HostTimeline(self, "host")
        self._current = self.compute
        self.streams = 0
        self.pinned: set[int] = set()  # addresses of the host memory pin() returned

    def current_stream(self) -> FakeStream:
        return self._current

    def new_stream(self) -> FakeStream:
        self.streams += 1
        return FakeStream(self, f"side {self.streams}")

    def new_event(self) -> FakeEvent:
        return FakeEvent(self)

    @contextlib.contextmanager
    def stream(self, stream: FakeStream):
        previous, self._current = self._current, stream
        try:
            yield stream
        finally:
            self._current = previous

    def copy(self, dst: torch.Tensor, src: torch.Tensor):
        if address(src) not in self.pinned:  # a GPU would make the host wait: no overlap
            raise RuntimeError("copy from host memory that is not pinned: the copy would block the host "
                               "instead of running beside compute; keep the host copies made by rt.pin()")
        self._current.add("copy", reads=[address(src)], writes=[address(dst)])
        dst.copy_(src)

    def pin(self, t: torch.Tensor) -> torch.Tensor:
        pinned = t.clone()  # no page-locked memory without a GPU; the graph is what we check
        self.pinned.add(address(pinned))
        return pinned

    def empty(self, n: int, dtype) -> torch.Tensor:
        return torch.empty(n, dtype=dtype)

    # What the tests add around the weight source: the compute that reads a block, host writes.
    def compute_reads(self, t: torch.Tensor, label: str = "compute"):
        self._current.add(label, reads=[address(t)])

    def host_writes(self, tensors, label: str = "host write"):
        self.host.add(label, writes=[address(t) for t in tensors])


def find_hazards(nodes: list[Node]) -> list[tuple[Node, Node]]:
    """Pairs (a, b), a issued before b, touching the same memory (one writing) and not ordered."""
    hazards = []
    for b in nodes:
        for a in nodes[:b.index]:
            conflict = (a.writes & (b.reads | b.writes)) or (a.reads & b.writes)
            if conflict and not (b.before >> a.index) & 1:
                hazards.append((a, b))
    return hazards


def record_compute(model, runtime: FakeRuntime):
    """Wrap `model`'s block so that each forward and each backward adds a node reading the block's
    weights on the current stream ("block forward" / "block backward"): the block's kernels, booked
    where the model loop issues them. A loop that releases a block before computing it then shows a
    hazard: the next copy into that buffer waits only for work recorded before the release."""
    block = model.block
    for name in ("forward", "backward"):
        run = getattr(block, name)

        def issued(w, *args, run=run, name=name):
            runtime.compute_reads(w.wq, f"block {name}")
            return run(w, *args)
        setattr(block, name, issued)
    return model


def schedule(nodes: list[Node], seconds) -> list[tuple[Node, float, float]]:
    """(node, start, end) if every node starts as soon as the nodes it waits for have finished and
    lasts seconds(node): the timeline a GPU would follow, given the durations."""
    end, out = {}, []
    for node in nodes:
        start = max((end[p.index] for p in node.preds), default=0.0)
        end[node.index] = start + seconds(node)
        out.append((node, start, end[node.index]))
    return out
