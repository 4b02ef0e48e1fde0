"""The unit-cost simulator (given): the exact timeline of a pipeline schedule with costs F = 1 and
B = 2 and free messages, so the textbook bubble comes out with no noise at all."""
from __future__ import annotations

from fractions import Fraction


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
