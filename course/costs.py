"""One shape for what a training step costs one rank (given code).

Every module's byte and memory formulas return a `StepCost`, and `measured_cost` reads the same
shape off a collectives log, so a benchmark prints formula beside measurement from one record, and
a planner adds the costs of several axes with `+`:

    sent[(axis, op)]    bytes this rank sends in one optimizer step over that axis's group with
                        that kind of collective ("all_gather", "reduce_scatter", "all_reduce",
                        "all_to_all", "send"), by the ring formulas of course/collectives.py
    calls[(axis, op)]   how many such collectives it issues in one step
    memory[what]        bytes this rank keeps: "parameters", "gradients", "optimizer" (state kept
                        between steps), "buffers" (communication buffers), "activations" (kept
                        for the backward, at the peak of the step)

A key that is absent counts 0, so two costs compare equal when they agree on every non-zero entry.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

OPS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send")
MEMORY = ("parameters", "gradients", "optimizer", "buffers", "activations")


@dataclass(frozen=True)
class StepCost:
    """Bytes sent (by axis and collective kind), collectives issued, and bytes kept, on one rank."""
    sent: dict = field(default_factory=dict)    # (axis, op) -> bytes sent per step
    calls: dict = field(default_factory=dict)   # (axis, op) -> collectives per step
    memory: dict = field(default_factory=dict)  # what -> bytes kept

    def __post_init__(self):
        for axis, op in (*self.sent, *self.calls):
            if op not in OPS:
                raise ValueError(f"unknown collective kind {op!r} (axis {axis!r}); kinds: {', '.join(OPS)}")
        for what in self.memory:
            if what not in MEMORY:
                raise ValueError(f"unknown kind of memory {what!r}; kinds: {', '.join(MEMORY)}")
        # Drop zeros, so that equality means "the same on every entry that is not zero".
        for table in (self.sent, self.calls, self.memory):
            for key in [k for k, v in table.items() if v == 0]:
                del table[key]

    def sent_bytes(self, axis: str | None = None, op: str | None = None) -> float:
        """Bytes sent per step, over one axis and/or one kind of collective (None: all of them)."""
        return sum(v for (a, o), v in self.sent.items() if axis in (None, a) and op in (None, o))

    def n_calls(self, axis: str | None = None, op: str | None = None) -> int:
        return sum(v for (a, o), v in self.calls.items() if axis in (None, a) and op in (None, o))

    @property
    def state_bytes(self) -> int:
        """What is kept between steps: parameters, gradients and optimizer state."""
        return sum(self.memory.get(what, 0) for what in ("parameters", "gradients", "optimizer"))

    def __add__(self, other: StepCost) -> StepCost:
        return StepCost(dict(Counter(self.sent) + Counter(other.sent)),
                        dict(Counter(self.calls) + Counter(other.calls)),
                        dict(Counter(self.memory) + Counter(other.memory)))

    def rows(self) -> list[tuple[str, str, int, float]]:
        """(axis, op, calls, bytes sent) for every entry, sorted: what a benchmark prints."""
        keys = sorted(set(self.sent) | set(self.calls))
        return [(axis, op, self.calls.get((axis, op), 0), self.sent.get((axis, op), 0)) for axis, op in keys]


def measured_cost(log, memory: dict | None = None) -> StepCost:
    """The sent bytes and calls of the collectives in `log` (records of course/collectives.py, one
    step's worth), as a StepCost; receives send nothing and are not counted as calls."""
    sent, calls = Counter(), Counter()
    for record in log:
        if record.op == "recv":
            continue
        sent[(record.axis, record.op)] += record.sent_bytes
        calls[(record.axis, record.op)] += 1
    return StepCost(dict(sent), dict(calls), dict(memory or {}))


def measured_activations(model, tokens, targets) -> int:
    """Bytes every block's store holds once the forward is done (read as the first block's backward
    starts), in one forward_backward of `model` on tokens, targets: what its blocks keep for the
    backward, for memory["activations"]. The model is module 06's or one like it (its `block` makes
    the stores with new_store() and runs backward()); the gradients it computes are the caller's to
    discard (a train_step zeroes its accumulators first)."""
    stores, kept = [], []
    new_store, backward = model.block.new_store, model.block.backward

    def counted_store():
        stores.append(new_store())
        return stores[-1]

    def first_backward(*args, **kwargs):
        if not kept:
            kept.append(sum(store.nbytes() for store in stores))
        return backward(*args, **kwargs)
    model.block.new_store, model.block.backward = counted_store, first_backward
    try:
        model.forward_backward(tokens, targets)
    finally:
        del model.block.new_store, model.block.backward  # the class's methods again
    return kept[0]
