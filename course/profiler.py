"""A pipeline profiler: what each rank did, when, and how much of the step it sat idle.

Given infrastructure (modules 05 onwards). A schedule is profiled without knowing it: wrap its
stage and comms once, and every call is timed.

    profiler = Profiler(rank)
    stage, comms = profiler.wrap_stage(stage), profiler.wrap_comms(comms)
    schedule = profiler.wrap_schedule(schedule)   # each call is one profiled step
    loss = schedule(stage, comms, x, y, n_microbatches)

Recorded spans, per rank, each with a microbatch id:
  forward / backward  compute of this rank's layers (backward: from the moment the gradient of
                      the stage output is known until the first layer's weight gradient is done);
  input / weight      module 11's halves of a backward: I (input gradient) and W (weight gradient);
  send                posting or sending a message;
  wait                blocked in a receive (or on a send handle): idle time, not "communication".
A receive is labelled with the microbatch of the compute that follows it, a send with the one
before it (a rank uses what it received next, and sends what it just computed).

Live activations are counted from autograd itself: every tensor the stage's forward saves for
backward is tagged with its microbatch, and a microbatch is alive until autograd has released all
of its saved tensors (which happens as its backward runs). No cooperation from the schedule.

Module 11's stages do their own backward (forward / backward_input / backward_weight / backward
methods, and a `saved` dict of what each microbatch keeps): `wrap_split_stage` times each call as
a span with its stage, and counts live activations from those stores, all stages of the rank
together. `wrap_stage_comms` does for module 11's StageComms what wrap_comms does for PipelineComms.

What a profile says is read elsewhere: course/bubble.py (idle fractions against theory),
course/trace.py (Chrome trace), course/plotting.py (timeline picture). course/emulated.py makes a
stage run like a device; course/simulate.py computes the timeline theory predicts.
"""
from __future__ import annotations

import contextlib
import functools
import time
import weakref
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

COMPUTE = ("forward", "backward", "input", "weight")
LETTERS = {"forward": "F", "backward": "B", "input": "I", "weight": "W"}  # the kinds of module 11's actions


@dataclass
class Span:
    rank: int
    kind: str  # forward | backward | send | wait
    microbatch: int | None
    start: float  # seconds, time.perf_counter (system-wide monotonic clock on Linux: comparable across ranks)
    end: float
    step: int
    stage: int | None = None  # module 11: which of the rank's stages computed (None: the rank's only one)


class Profiler:
    def __init__(self, rank: int):
        self.rank = rank
        self.spans: list[Span] = []
        self.steps: list[tuple[float, float]] = []  # (start, end) of each profiled step
        self.peak_live: list[int] = []  # peak live microbatches, per step
        self._live: dict[int, int] = {}  # microbatch -> saved tensors not yet released
        self._forwards = 0
        self._backward: tuple[int, float] | None = None  # microbatch and start of the running backward
        self._stores: list = []  # module 11's stages of this rank, whose `saved` dicts hold its activations

    # --- what the driver calls ---
    @contextlib.contextmanager
    def step(self):
        self._forwards, self._live, peak = 0, {}, [0]
        self._peak = peak
        start = time.perf_counter()
        yield
        self.steps.append((start, time.perf_counter()))
        self._label_messages(len(self.steps) - 1)
        self.peak_live.append(peak[0])

    def wrap_schedule(self, schedule):
        """The schedule, each call of it one profiled step. All ranks start the step together
        (a barrier), so the step time is the pipeline's, not a straggler's."""
        @functools.wraps(schedule)
        def profiled(*args, **kwargs):
            dist.barrier()
            with self.step():
                return schedule(*args, **kwargs)
        return profiled

    def wrap_stage(self, stage: nn.Module) -> "ProfiledStage":
        return ProfiledStage(stage, self)

    def wrap_comms(self, comms) -> "ProfiledComms":
        return ProfiledComms(comms, self)

    def wrap_split_stage(self, stage) -> "ProfiledSplitStage":
        self._stores.append(stage)
        return ProfiledSplitStage(stage, self)

    def wrap_stage_comms(self, comms) -> "ProfiledStageComms":
        return ProfiledStageComms(comms, self)

    def ops(self, step: int = -1) -> list[tuple[str, int]]:
        """The order of compute on this rank in one step: [("F", 0), ("F", 1), ("B", 0), ...]."""
        step = step % len(self.steps)
        return [(LETTERS[s.kind], s.microbatch) for s in self.spans if s.step == step and s.kind in COMPUTE]

    def actions(self, step: int = -1) -> list[tuple[int, str, int]]:
        """Module 11: the actions this rank ran in one step, as (stage, kind, microbatch)."""
        step = step % len(self.steps)
        return [(s.stage, LETTERS[s.kind], s.microbatch) for s in self.spans if s.step == step and s.kind in COMPUTE]

    # --- recording ---
    @contextlib.contextmanager
    def span(self, kind: str, microbatch: int | None = None, stage: int | None = None):
        start = time.perf_counter()
        try:
            yield
        finally:
            self._record(kind, microbatch, start, time.perf_counter(), stage)

    def _record(self, kind, microbatch, start, end, stage=None):
        self.spans.append(Span(self.rank, kind, microbatch, start, end, len(self.steps), stage))

    def _count_stores(self):
        """Module 11: the live (stage, microbatch) activations are the entries of the stages' stores."""
        self._peak[0] = max(self._peak[0], sum(len(stage.saved) for stage in self._stores))

    def _saved(self, microbatch: int):
        """saved_tensors_hooks that tag each tensor autograd saves with `microbatch`."""
        def pack(tensor):
            holder = _Saved(tensor)
            self._live[microbatch] = self._live.get(microbatch, 0) + 1
            self._peak[0] = max(self._peak[0], len(self._live))
            weakref.finalize(holder, self._release, microbatch)
            return holder

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda holder: holder.tensor)

    def _release(self, microbatch):
        self._live[microbatch] -= 1
        if self._live[microbatch] == 0:
            del self._live[microbatch]

    def _label_messages(self, step):
        compute = [s for s in self.spans if s.step == step and s.kind in COMPUTE]
        for span in self.spans:
            if span.step != step or span.kind in COMPUTE:
                continue
            if span.kind == "wait":  # what a rank receives, it uses in its next compute
                after = [c for c in compute if c.start >= span.end]
                span.microbatch = after[0].microbatch if after else None
            else:  # what it sends, it has just computed
                before = [c for c in compute if c.end <= span.start]
                span.microbatch = before[-1].microbatch if before else None


class _Saved:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor):
        self.tensor = tensor


class ProfiledStage:
    """Stands in for the stage: calls time its forward and, through autograd hooks, its backward."""

    def __init__(self, stage: nn.Module, profiler: Profiler):
        self._stage, self._profiler = stage, profiler
        first_weight = next(stage.parameters())
        # The first layer's weight gradient is the last thing a stage's backward produces.
        first_weight.register_post_accumulate_grad_hook(lambda _: self._backward_done())

    def __getattr__(self, name):  # everything else (hidden, loss, parameters, ...) is the stage's
        return getattr(self._stage, name)

    def forward(self, x):  # stage.forward(x) is profiled like stage(x)
        return self(x)

    def __call__(self, x):
        profiler = self._profiler
        microbatch = profiler._forwards
        profiler._forwards += 1
        with profiler.span("forward", microbatch), profiler._saved(microbatch):
            out = self._stage(x)
        if out.requires_grad:
            out.register_hook(lambda grad: self._backward_started(microbatch))
        return out

    def _backward_started(self, microbatch):
        self._profiler._backward = (microbatch, time.perf_counter())

    def _backward_done(self):
        if self._profiler._backward is not None:
            microbatch, start = self._profiler._backward
            self._profiler._record("backward", microbatch, start, time.perf_counter())
            self._profiler._backward = None


class ProfiledSplitStage:
    """Stands in for a module-11 stage: each forward / backward_input / backward_weight / backward is
    a span (forward / input / weight / backward) labelled with its stage and microbatch; after each,
    the rank's live activations are counted from its stages' stores."""

    def __init__(self, stage, profiler: Profiler):
        self._stage, self._profiler = stage, profiler

    def __getattr__(self, name):  # is_first, is_last, hidden, stage, saved, parameters, ...
        return getattr(self._stage, name)

    def _timed(self, kind, method, microbatch, *args):
        with self._profiler.span(kind, microbatch, self._stage.stage):
            result = method(microbatch, *args)
        self._profiler._count_stores()
        return result

    def forward(self, x, microbatch, *args, **kwargs):   # the stage's own signature, keywords too
        with self._profiler.span("forward", microbatch, self._stage.stage):
            out = self._stage.forward(x, microbatch, *args, **kwargs)
        self._profiler._count_stores()
        return out

    def backward_input(self, microbatch, grad_output=None):
        return self._timed("input", self._stage.backward_input, microbatch, grad_output)

    def backward_weight(self, microbatch):
        return self._timed("weight", self._stage.backward_weight, microbatch)

    def backward(self, microbatch, grad_output=None):
        return self._timed("backward", self._stage.backward, microbatch, grad_output)


class ProfiledStageComms:
    """Stands in for module 11's StageComms: sends are `send` spans, receives and handle waits `wait` spans."""

    def __init__(self, comms, profiler: Profiler):
        self._comms, self._profiler = comms, profiler

    def __getattr__(self, name):  # rank, placement, device, ...
        return getattr(self._comms, name)

    def send(self, tensor, message, stage, microbatch):
        with self._profiler.span("send", microbatch, stage):
            return _ProfiledHandle(self._comms.send(tensor, message, stage, microbatch), self._profiler)

    def recv(self, message, stage, microbatch, shape):
        with self._profiler.span("wait", microbatch, stage):
            return self._comms.recv(message, stage, microbatch, shape)


class ProfiledComms:
    """Stands in for PipelineComms: sends are `send` spans, receives and handle waits `wait` spans."""

    def __init__(self, comms, profiler: Profiler):
        self._comms, self._profiler = comms, profiler

    def __getattr__(self, name):  # rank, prev, next, device, ...
        return getattr(self._comms, name)

    def send_forward(self, tensor):
        with self._profiler.span("send"):
            self._comms.send_forward(tensor)

    def send_backward(self, tensor):
        with self._profiler.span("send"):
            self._comms.send_backward(tensor)

    def recv_forward(self, shape, dtype=None):
        with self._profiler.span("wait"):
            return self._comms.recv_forward(shape, dtype)

    def recv_backward(self, shape, dtype=None):
        with self._profiler.span("wait"):
            return self._comms.recv_backward(shape, dtype)

    def isend_forward(self, tensor):
        with self._profiler.span("send"):
            return _ProfiledHandle(self._comms.isend_forward(tensor), self._profiler)

    def isend_backward(self, tensor):
        with self._profiler.span("send"):
            return _ProfiledHandle(self._comms.isend_backward(tensor), self._profiler)


class _ProfiledHandle:
    def __init__(self, handle, profiler):
        self._handle, self._profiler = handle, profiler

    def wait(self):
        with self._profiler.span("wait"):
            return self._handle.wait()


def export(profiler: Profiler) -> dict:
    """Plain data (picklable, JSON-able) for gathering every rank's profile on one rank."""
    return {"rank": profiler.rank, "steps": profiler.steps, "peak_live": profiler.peak_live,
            "spans": [asdict(s) for s in profiler.spans]}
