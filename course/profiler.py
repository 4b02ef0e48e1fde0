"""A pipeline profiler: what each rank did, when, and how much of the step it sat idle.

Given infrastructure (modules 05 onwards). A schedule is profiled without knowing it: wrap its
stage and comms once, and every call is timed.

    profiler = Profiler(rank)
    stage, comms = profiler.wrap_stage(stage), profiler.wrap_comms(comms)
    with profiler.step():
        loss = schedule(stage, comms, x, y, chunks)

Recorded spans, per rank, each with a microbatch id:
  forward / backward  compute of this rank's layers (backward: from the moment the gradient of
                      the stage output is known until the first layer's weight gradient is done);
  send                posting or sending a message;
  wait                blocked in a receive (or on a send handle): idle time, not "communication".
A receive is labelled with the microbatch of the compute that follows it, a send with the one
before it (a rank uses what it received next, and sends what it just computed).

Live activations are counted from autograd itself: every tensor the stage's forward saves for
backward is tagged with its microbatch, and a microbatch is alive until autograd has released all
of its saved tensors (which happens as its backward runs). No cooperation from the schedule.

`EmulatedStage` makes each layer's forward/backward take a fixed extra time (time.sleep), an
*emulated device*: sleeping ranks do not compete for the CPU, so 4 ranks on 2 cores show the
bubble a real pipeline of 4 devices would have. `simulate` computes a schedule's exact timeline
with unit costs (F = 1, B = 2): the textbook numbers, with no noise at all.
"""
from __future__ import annotations

import contextlib
import json
import time
import weakref
from dataclasses import asdict, dataclass
from fractions import Fraction

import torch
import torch.nn as nn

COMPUTE = ("forward", "backward")


@dataclass
class Span:
    rank: int
    kind: str  # forward | backward | send | wait
    microbatch: int | None
    start: float  # seconds, time.perf_counter (system-wide monotonic clock on Linux: comparable across ranks)
    end: float
    step: int


class Profiler:
    def __init__(self, rank: int):
        self.rank = rank
        self.spans: list[Span] = []
        self.steps: list[tuple[float, float]] = []  # (start, end) of each profiled step
        self.peak_live: list[int] = []  # peak live microbatches, per step
        self._live: dict[int, int] = {}  # microbatch -> saved tensors not yet released
        self._forwards = 0
        self._backward: tuple[int, float] | None = None  # microbatch and start of the running backward

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

    def wrap_stage(self, stage: nn.Module) -> "ProfiledStage":
        return ProfiledStage(stage, self)

    def wrap_comms(self, comms) -> "ProfiledComms":
        return ProfiledComms(comms, self)

    def ops(self, step: int = -1) -> list[tuple[str, int]]:
        """The order of compute on this rank in one step: [("F", 0), ("F", 1), ("B", 0), ...]."""
        step = step % len(self.steps)
        return [(s.kind[0].upper(), s.microbatch) for s in self.spans if s.step == step and s.kind in COMPUTE]

    # --- recording ---
    @contextlib.contextmanager
    def span(self, kind: str, microbatch: int | None = None):
        start = time.perf_counter()
        try:
            yield
        finally:
            self._record(kind, microbatch, start, time.perf_counter())

    def _record(self, kind, microbatch, start, end):
        self.spans.append(Span(self.rank, kind, microbatch, start, end, len(self.steps)))

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


# --- emulated device ---------------------------------------------------------------------------

class _SleepInBackward(torch.autograd.Function):
    """Identity whose backward first sleeps: the emulated cost of the stage's backward."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None


class EmulatedStage(nn.Module):
    """A stage whose layers each take `ms_per_layer` more in forward and twice that in backward.

    Emulation, not measurement of a device: the sleep stands for the compute a real device would
    do, so that the schedule's shape (not CPU contention between ranks) decides the step time.
    """

    def __init__(self, stage: nn.Module, ms_per_layer: float):
        super().__init__()
        self.stage = stage
        self.hidden, self.is_last = stage.hidden, stage.is_last
        self.seconds = ms_per_layer * len(stage.layers) / 1000

    def forward(self, x):
        out = self.stage(x)
        time.sleep(self.seconds)
        return _SleepInBackward.apply(out, 2 * self.seconds)

    def loss(self, logits, targets):
        return self.stage.loss(logits, targets)


# --- summaries -----------------------------------------------------------------------------------

def theoretical_bubble(world_size: int, chunks: int) -> float:
    """Idle fraction of a GPipe or 1F1B step with equal stages and free messages: (P-1)/(M+P-1)."""
    return (world_size - 1) / (chunks + world_size - 1)


def summarize(profilers: list[dict], skip_first: bool = True) -> dict:
    """Per-rank and overall step time, compute and idle fraction, averaged over the steps.

    `profilers` are the ranks' `export()` dicts. A step lasts from the first rank's start to the
    last rank's end; a rank's idle fraction is 1 - its compute / that step time.
    """
    n_steps = len(profilers[0]["steps"])
    steps = range(1 if skip_first and n_steps > 1 else 0, n_steps)  # the first pays for warm-up
    ranks = []
    step_times = [max(p["steps"][s][1] for p in profilers) - min(p["steps"][s][0] for p in profilers)
                  for s in steps]
    step_time = sum(step_times) / len(step_times)
    for p in profilers:
        compute = sum(s["end"] - s["start"] for s in p["spans"] if s["kind"] in COMPUTE
                      and s["step"] in steps) / len(steps)
        ranks.append({"rank": p["rank"], "step_s": step_time, "compute_s": compute,
                      "idle": 1 - compute / step_time, "peak_live": max(p["peak_live"])})
    return {"step_s": step_time, "ranks": ranks,
            "idle": sum(r["idle"] for r in ranks) / len(ranks)}


def export(profiler: Profiler) -> dict:
    """Plain data (picklable, JSON-able) for gathering every rank's profile on one rank."""
    return {"rank": profiler.rank, "steps": profiler.steps, "peak_live": profiler.peak_live,
            "spans": [asdict(s) for s in profiler.spans]}


def format_report(profilers: list[dict], chunks: int) -> str:
    summary = summarize(profilers)
    world_size = len(profilers)
    lines = [f"{'rank':>4}  {'step ms':>8}  {'compute ms':>10}  {'idle':>6}  {'peak live microbatches':>22}"]
    for r in summary["ranks"]:
        lines.append(f"{r['rank']:>4}  {r['step_s'] * 1e3:8.2f}  {r['compute_s'] * 1e3:10.2f}  "
                     f"{r['idle']:6.1%}  {r['peak_live']:>22}")
    lines.append(f" all  {summary['step_s'] * 1e3:8.2f}  {'':>10}  {summary['idle']:6.1%}  "
                 f"(theory (P-1)/(M+P-1) = {theoretical_bubble(world_size, chunks):.1%})")
    return "\n".join(lines)


def chrome_trace(profilers: list[dict], path) -> None:
    """One Chrome-trace JSON for all ranks (open in https://ui.perfetto.dev or chrome://tracing)."""
    origin = min(p["steps"][0][0] for p in profilers)
    events = []
    for p in profilers:
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": p["rank"],
                       "args": {"name": f"rank {p['rank']}"}})
        for s in p["spans"]:
            label = s["kind"] if s["microbatch"] is None else f"{s['kind']} {s['microbatch']}"
            events.append({"name": label, "cat": s["kind"], "ph": "X", "pid": 0, "tid": p["rank"],
                           "ts": (s["start"] - origin) * 1e6, "dur": (s["end"] - s["start"]) * 1e6,
                           "args": {"microbatch": s["microbatch"], "step": s["step"]}})
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)


# --- the unit-cost simulator ---------------------------------------------------------------------

def simulate(orders: list[list[tuple[str, int]]], forward=Fraction(1), backward=Fraction(2)) -> dict:
    """Exact timeline of a schedule: `orders[r]` is rank r's compute in order, ("F", m) / ("B", m).

    F(r, m) starts when rank r is free and F(r-1, m) has finished; B(r, m) when rank r is free and
    B(r+1, m) has finished (the last rank's B(m) needs its own F(m)). Messages are free. Returns
    each rank's spans (kind, microbatch, start, end), the makespan and the bubble fraction.
    """
    world_size = len(orders)
    done: dict[tuple[str, int, int], Fraction] = {}
    position, free = [0] * world_size, [Fraction(0)] * world_size
    spans = [[] for _ in range(world_size)]
    progressed = True
    while progressed:
        progressed = False
        for rank in range(world_size):
            if position[rank] == len(orders[rank]):
                continue
            kind, mb = orders[rank][position[rank]]
            needs = (("F", rank - 1, mb) if rank > 0 else None) if kind == "F" else \
                (("B", rank + 1, mb) if rank < world_size - 1 else ("F", rank, mb))
            if needs is not None and needs not in done:
                continue
            start = max(free[rank], done[needs]) if needs else free[rank]
            end = start + (forward if kind == "F" else backward)
            done[(kind, rank, mb)], free[rank] = end, end
            spans[rank].append((kind, mb, start, end))
            position[rank] += 1
            progressed = True
    stuck = [r for r in range(world_size) if position[r] < len(orders[r])]
    if stuck:
        raise ValueError(f"the schedule deadlocks: rank {stuck[0]} waits forever at {orders[stuck[0]][position[stuck[0]]]}")
    makespan = max(free)
    busy = sum(end - start for rank_spans in spans for _, _, start, end in rank_spans)
    return {"spans": spans, "makespan": makespan, "bubble": 1 - busy / (world_size * makespan)}
