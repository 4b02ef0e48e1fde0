"""The validator of module 11's schedules (given): is a schedule one that the executor can run to the end?

A schedule is refused, with a ScheduleError (a ValueError) whose first line says what is wrong,
before any process starts: a rank that waits forever for a message nobody sends is a hang, and
a hang is the worst way to learn that a list was wrong. Checks, in order:

1. every action names a stage, microbatch and kind that exist, on the rank that holds the stage;
2. every (stage, microbatch) has exactly one F, and either one B or one I and one W;
3. on its rank, each F comes before its B or I, and each I before its W;
4. a dry run: every rank runs its list in order, an action waiting for its input (blocking
   receives, non-blocking sends, as the executor does). If at some point no rank can take its
   next step, the schedule deadlocks: the error prints the ranks' lists with each rank's first
   stuck action in brackets.

The dry run is the schedule simulator (course/simulate.py) at unit costs: a schedule it can
finish, the executor can too, whatever the real costs, because only the order of each rank's list
matters. A schedule is module 11's `Schedule` (m11_actions): `placement`, `orders`, its sizes and
`table`; the ranks it names are places in the pipeline's group.
"""
from collections import Counter

from course.simulate import KINDS, Deadlock, simulate_schedule


class ScheduleError(ValueError):
    """A schedule that cannot run: malformed, or one that would deadlock."""

    def __init__(self, message: str):
        super().__init__(message)


def validate(schedule) -> None:
    """Raise ScheduleError if `schedule` is malformed or would deadlock; return None if it is fine."""
    _check_actions(schedule)
    _check_counts(schedule)
    _check_local_order(schedule)
    _dry_run(schedule)


def _check_actions(schedule):
    if any(not 0 <= rank < schedule.world_size for rank in schedule.placement):
        raise ScheduleError(f"{schedule.name}: the placement {list(schedule.placement)} names ranks beyond the "
                            f"{schedule.world_size} that have a list of actions")
    for rank, order in enumerate(schedule.orders):
        for action in order:
            if action.kind not in KINDS:
                raise ScheduleError(f"{schedule.name}: rank {rank} runs {action}, whose kind is none of {KINDS}")
            if not 0 <= action.stage < schedule.n_stages:
                raise ScheduleError(f"{schedule.name}: rank {rank} runs {action}, but the stages are "
                                    f"0..{schedule.n_stages - 1}")
            if not 0 <= action.microbatch < schedule.n_microbatches:
                raise ScheduleError(f"{schedule.name}: rank {rank} runs {action}, but the microbatches are "
                                    f"0..{schedule.n_microbatches - 1}")
            if schedule.placement[action.stage] != rank:
                raise ScheduleError(f"{schedule.name}: rank {rank} runs {action}, but stage {action.stage} is on "
                                    f"rank {schedule.placement[action.stage]}")


def _check_counts(schedule):
    counts = Counter((a.stage, a.microbatch, a.kind) for order in schedule.orders for a in order)
    for stage in range(schedule.n_stages):
        for microbatch in range(schedule.n_microbatches):
            n = {kind: counts[(stage, microbatch, kind)] for kind in KINDS}
            where = f"{schedule.name}: stage {stage}, microbatch {microbatch}"
            if n["F"] != 1:
                raise ScheduleError(f"{where} has {n['F']} forwards (F), expected exactly one")
            if (n["B"], n["I"], n["W"]) not in ((1, 0, 0), (0, 1, 1)):
                raise ScheduleError(f"{where} has {n['B']} B, {n['I']} I and {n['W']} W: expected one B, "
                                    "or one I and one W" + (" (an I without its W never computes the weight "
                                                            "gradient)" if n["I"] > n["W"] else ""))


def _check_local_order(schedule):
    for rank, order in enumerate(schedule.orders):
        seen = set()
        for action in order:
            before = {"B": "F", "I": "F", "W": "I"}.get(action.kind)
            if before and (action.stage, before, action.microbatch) not in seen:
                raise ScheduleError(f"{schedule.name}: rank {rank} runs {action} before "
                                    f"{action.stage}{before}{action.microbatch}, which it needs")
            seen.add((action.stage, action.kind, action.microbatch))


def _dry_run(schedule):
    try:
        simulate_schedule(schedule.orders, schedule.placement)
    except Deadlock as stuck:
        marks = {r: i for r, i in enumerate(stuck.positions) if i < len(schedule.orders[r])}
        raise ScheduleError(f"{schedule.name} deadlocks: {'; '.join(stuck.waiting)}\n{schedule.table(marks)}") from None
