"""The schedule simulator (given): the exact timeline of a pipeline schedule with fixed costs per
action (unit costs unless told otherwise) and free (or fixed-latency) messages, so a bubble formula
can be checked with no noise at all.

Each rank runs its list of actions in order. An action starts when its rank is free and what it
needs has been computed (plus `hop` if that was on another rank):

    F(s, m)  needs F(s-1, m): the activation of the stage before (nothing on stage 0)
    B(s, m)  needs the input gradient of stage s+1 for m, from its B or I (on the last stage: its
    I(s, m)  own F(s, m), which computed the loss); and its own F(s, m)
    W(s, m)  needs its own I(s, m): the output gradients I kept

Sends never block (module 05's isend), receives do: this is the schedule run as the executors of
modules 05 and 11 run it. A rank that can never take its next step is a deadlock.

    simulate(orders)                    module 05: one stage per rank, orders[r] = [("F", m), ("B", m)...]
    simulate_schedule(orders, placement, costs)   module 11: (stage, kind, microbatch) actions,
                                        any placement of stages on ranks, F/B/I/W

DualPipe overlaps a forward of one stage with a backward of another on the device, one's
communication hidden behind the other's compute. With `atomic_pairs` the simulator runs each such
pair as one action of cost τ_F&B (`Costs.FB`; by default τ_F + τ_B, the two one after the other).
On the course's CPU ranks nothing overlaps: the executor runs a pair's halves in turn, so a pair
cheaper than its two halves exists only here, in the simulator.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction

KINDS = ("F", "B", "I", "W")  # the kinds of module 11's actions, as above


@dataclass(frozen=True)
class Costs:
    """How long each kind of action takes on one stage, and a message between ranks. A full backward
    B does the work of I and W together. FB is τ_F&B, an overlapped pair (atomic_pairs): None means
    τ_F + τ_B, no overlap. Fractions (or ints) keep the timeline exact."""
    F: Fraction = Fraction(1)
    I: Fraction = Fraction(1)
    W: Fraction = Fraction(1)
    hop: Fraction = Fraction(0)
    FB: Fraction | None = None

    @property
    def B(self) -> Fraction:
        return self.I + self.W

    @property
    def pair(self) -> Fraction:
        """τ_F&B: how long a pair started together (an F with a B of another stage) takes."""
        return self.F + self.B if self.FB is None else self.FB

    def of(self, kind: str) -> Fraction:
        return {"F": self.F, "B": self.B, "I": self.I, "W": self.W}[kind]


@dataclass
class Timeline:
    spans: list[list[tuple]]   # spans[rank] = [(action, start, end), ...] in the rank's order
    makespan: Fraction         # the step: from the first start (0) to the last end
    idle: list[Fraction]       # per rank: makespan minus its compute
    bubble: Fraction           # idle fraction of all ranks together: sum(idle) / (ranks * makespan)
    peak_live: list[int]       # per rank: most (stage, microbatch) activations kept at once
    paired: list[list[bool]] = field(default_factory=list)  # per rank, per span: half of a pair run as one

    def as_profiles(self) -> list[dict]:
        """The timeline in the profiler's export format (course/profiler.py), times in units, so the
        pictures and traces of measured runs draw simulated ones too. A span of a pair run as one
        action (atomic_pairs) has "pair": True (the picture outlines the two together)."""
        kinds = {"F": "forward", "B": "backward", "I": "input", "W": "weight"}
        paired = self.paired or [[False] * len(spans) for spans in self.spans]
        return [{"rank": rank, "steps": [(0.0, float(self.makespan))], "peak_live": [self.peak_live[rank]],
                 "spans": [{"rank": rank, "kind": kinds[a[1]], "microbatch": a[2], "stage": a[0], "step": 0,
                            "start": float(start), "end": float(end), "pair": pair}
                           for (a, start, end), pair in zip(spans, paired[rank])]}
                for rank, spans in enumerate(self.spans)]

    def spans_of_ranks(self) -> list[Fraction]:
        """Each rank's own span: from its first action's start to its last action's end."""
        return [spans[-1][2] - spans[0][1] if spans else Fraction(0) for spans in self.spans]


class Deadlock(ValueError):
    """No rank can take its next step. `positions[r]` is the index of rank r's first action that
    never ran (len(orders[r]) for a rank that finished); `waiting`, per stuck rank, "rank r at <its
    next action> waits for <what no rank has made>"."""

    def __init__(self, waiting: list[str], positions: list[int]):
        super().__init__(f"the schedule deadlocks: {'; '.join(waiting)}")
        self.positions, self.waiting = positions, waiting


def needs(action, n_stages: int) -> list[tuple]:
    """What `action` = (stage, kind, microbatch) waits for: ("act" | "grad", stage, microbatch) keys."""
    stage, kind, microbatch = action
    if kind == "F":
        return [("act", stage - 1, microbatch)] if stage > 0 else []
    if kind in ("B", "I"):
        later = [("grad", stage + 1, microbatch)] if stage < n_stages - 1 else []
        return later + [("act", stage, microbatch)]
    if kind == "W":
        return [("grad", stage, microbatch)]
    raise ValueError(f"unknown kind {kind!r} in {action}: actions are F, B, I or W")


def produces(action) -> list[tuple]:
    stage, kind, microbatch = action
    return {"F": [("act", stage, microbatch)], "B": [("grad", stage, microbatch)],
            "I": [("grad", stage, microbatch)], "W": []}[kind]


def peak_live(order) -> int:
    """Most (stage, microbatch) activations a rank keeps at once running `order`: each is kept from
    its F until its B, or until its W (I keeps what W needs)."""
    live = peak = 0
    for _, kind, _ in order:
        live += {"F": 1, "B": -1, "W": -1}.get(kind, 0)
        peak = max(peak, live)
    return peak


def simulate_schedule(orders, placement, costs: Costs = Costs(), atomic_pairs: bool = False) -> Timeline:
    """The exact timeline of `orders[rank]` (lists of (stage, kind, microbatch)) with stage s on rank
    `placement[s]`. Raises Deadlock if some rank can never take its next step.

    atomic_pairs: an F directly followed by a B of another stage on the same rank starts only when
    both have their inputs, and takes τ_F&B (costs.pair: τ_F + τ_B unless costs.FB says less): how
    DeepSeek's DualPipe runs its overlapped pairs, for checking its published bubble. The pair's spans
    are its F then its B, each scaled by τ_F&B / (τ_F + τ_B) (so a drawing shows both, and a rank's
    compute is the time it was busy). Our executor runs a pair's halves one after the other.
    """
    n_stages, world_size = len(placement), len(orders)
    units = [_units(order, n_stages, atomic_pairs) for order in orders]
    done: dict[tuple, tuple[Fraction, int]] = {}  # key -> (time it is ready, rank that made it)
    position, free = [0] * world_size, [Fraction(0)] * world_size
    spans = [[] for _ in range(world_size)]
    paired = [[] for _ in range(world_size)]
    progressed = True
    while progressed:
        progressed = False
        for rank in range(world_size):
            if position[rank] == len(units[rank]):
                continue
            unit = units[rank][position[rank]]
            made_here = {key for action in unit for key in produces(action)}
            waits = [key for action in unit for key in needs(action, n_stages) if key not in made_here]
            if any(key not in done for key in waits):
                continue
            start = max([free[rank], *(done[k][0] + (costs.hop if done[k][1] != rank else 0) for k in waits)])
            overlap = costs.pair / (costs.F + costs.B) if len(unit) == 2 else 1  # a pair takes τ_F&B in all
            for action in unit:
                end = start + costs.of(action[1]) * overlap
                spans[rank].append((action, start, end))
                paired[rank].append(len(unit) == 2)
                for key in produces(action):
                    done[key] = (end, rank)
                start = end
            free[rank] = start
            position[rank] += 1
            progressed = True
    if any(position[r] < len(units[r]) for r in range(world_size)):
        positions = [sum(len(u) for u in units[r][:position[r]]) for r in range(world_size)]
        waiting = []
        for r in range(world_size):
            if position[r] < len(units[r]):
                unit = units[r][position[r]]
                made_here = {key for action in unit for key in produces(action)}
                missing = [key for action in unit for key in needs(action, n_stages)
                           if key not in done and key not in made_here]
                waiting.append(f"rank {r} at {_text(unit[0])} waits for "
                               + " and ".join(describe(key, placement) for key in missing))
        raise Deadlock(waiting, positions)
    makespan = max(free)
    idle = [makespan - sum(end - start for _, start, end in rank_spans) for rank_spans in spans]
    return Timeline(spans, makespan, idle, sum(idle) / (world_size * makespan) if makespan else Fraction(0),
                    [peak_live(order) for order in orders], paired)


def _units(order, n_stages, atomic_pairs) -> list[tuple]:
    """The rank's order cut into what starts together: single actions, or (F, B) pairs."""
    units, i = [], 0
    while i < len(order):
        pair = tuple(order[i:i + 2])
        if atomic_pairs and len(pair) == 2 and pair[0][1] == "F" and pair[1][1] == "B" \
                and not set(produces(pair[0])) & set(needs(pair[1], n_stages)):
            units.append(pair)
            i += 2
        else:
            units.append((order[i],))
            i += 1
    return units


def describe(key, placement) -> str:
    """What makes message `key` = ("act" | "grad", stage, microbatch), and on which rank: "1F0 (rank 1)"."""
    what, stage, microbatch = key
    made_by = f"{stage}F{microbatch}" if what == "act" else f"{stage}B{microbatch} or {stage}I{microbatch}"
    return f"{made_by} (rank {placement[stage]})"


def _text(action) -> str:
    stage, kind, microbatch = action
    return f"{stage}{kind}{microbatch}"


def simulate(orders: list[list[tuple[str, int]]], forward=Fraction(1), backward=Fraction(2)) -> dict:
    """Module 05's form: `orders[r]` is rank r's compute in order, ("F", m) / ("B", m), rank r holding
    stage r. Returns each rank's spans (kind, microbatch, start, end), the makespan and the bubble."""
    actions = [[(rank, kind, m) for kind, m in order] for rank, order in enumerate(orders)]
    timeline = simulate_schedule(actions, list(range(len(orders))),
                                 Costs(F=Fraction(forward), I=Fraction(backward) / 2, W=Fraction(backward) / 2))
    spans = [[(a[1], a[2], start, end) for a, start, end in rank] for rank in timeline.spans]
    return {"spans": spans, "makespan": timeline.makespan, "bubble": timeline.bubble}
