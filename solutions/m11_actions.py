"""Module 11 - a pipeline schedule as data.

Module 05 wrote each schedule as a loop that computes, sends and receives. Here a schedule is a
*value*: for every rank, the ordered list of what it computes. Then one validator checks any
schedule, one simulator times it, one profiler draws it and one executor runs it, and writing a
new schedule is writing a list.

An action is (stage, kind, microbatch); its text form is those three run together, `2F0`:

    F  forward of the stage for the microbatch
    B  full backward: the gradient of the stage's input and of its weights, in one go
    I  input gradient only (what the stage before is waiting for); keeps what W needs
    W  weight gradient only, from what I kept (nobody waits for it: it can fill a gap)

A Schedule is one list of actions per rank and a placement: placement[stage] is the rank that
holds it. With one stage per rank (modules 04-05) stage r is on rank r; with v stages per rank the
model is cut into S = p v stages (p pipeline ranks, v stages each), placed round the ranks in a
loop or folded into a V. A rank here is a place in the pipeline's group, 0 .. p - 1.
"""
import re
from dataclasses import dataclass
from typing import NamedTuple

from course.simulate import KINDS  # F, B, I, W: what each needs and produces is the simulator's

TEXT = re.compile(r"(\d+)([FBIW])(\d+)")  # the text form of an action: stage, kind, microbatch


class Action(NamedTuple):
    stage: int
    kind: str  # one of KINDS
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> "Action":
        """The action written `text`, e.g. Action.parse("1I3") == Action(1, "I", 3); a ValueError
        that quotes the text if it is not one."""
        # >>> TODO(m11): parse an action's text form, the inverse of __str__
        # Contract: "12W3" -> Action(stage=12, kind="W", microbatch=3), stage and microbatch as ints;
        # spaces around the text are allowed. Anything that is not stage, kind, microbatch run together
        # raises ValueError with the text quoted in its message.
        # The question: how do you read the three fields off the text, and refuse anything else?
        # Pitfalls:
        # - stages and microbatches can have several digits ("12F10" is stage 12, microbatch 10);
        # - a kind outside F, B, I, W ("1X2") or a missing number ("F2", "2F") must be refused, not read
        #   as something else: the tests write schedules in this form, and a misread action makes a
        #   schedule that looks valid but is not the one written.
        # Hint 1: which object defined above the class already describes the text form, one group per field,
        #         and must it match the whole text or only a part of it?
        # Hint 2: the whole stripped text must match stage, kind, microbatch (a full match, not a search); its
        #         three groups are the fields, the numbers read as ints; no match is a ValueError.
        # Hint 3: match = TEXT.fullmatch(text.strip())
        #         if match is None: raise ValueError naming the text
        #         return cls(int(match[1]), match[2], int(match[3]))
        match = TEXT.fullmatch(text.strip())
        if match is None:
            raise ValueError(f"{text!r} is not an action: write stage, kind (one of {', '.join(KINDS)}) and "
                             "microbatch, e.g. 2F0")
        return cls(int(match[1]), match[2], int(match[3]))
        # <<<


@dataclass(frozen=True)
class Schedule:
    name: str
    placement: tuple[int, ...]             # placement[stage] = the rank that holds the stage
    orders: tuple[tuple[Action, ...], ...]  # orders[rank] = what the rank computes, in order
    n_microbatches: int

    def __post_init__(self):  # accept lists (and plain tuples as actions); keep immutable tuples
        object.__setattr__(self, "placement", tuple(self.placement))
        object.__setattr__(self, "orders", tuple(tuple(Action(*a) for a in order) for order in self.orders))

    @property
    def world_size(self) -> int:
        return len(self.orders)

    @property
    def n_stages(self) -> int:
        return len(self.placement)

    def stages_of(self, rank: int) -> list[int]:
        return [stage for stage, holder in enumerate(self.placement) if holder == rank]

    def table(self, marks: dict[int, int] | None = None) -> str:
        """One line per rank, `rank 0: 0F0 0F1 0B0 ...`, which parse_schedule reads back. `marks`
        (rank -> index) puts that action in brackets, e.g. where a dry run got stuck."""
        marks = marks or {}
        lines = []
        for rank, order in enumerate(self.orders):
            cells = [f"[{a}]" if marks.get(rank) == i else str(a) for i, a in enumerate(order)]
            lines.append(f"rank {rank}: " + " ".join(cells))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def one_stage_per_rank(world_size: int) -> tuple[int, ...]:
    """Modules 04-05: stage r on rank r."""
    return tuple(range(world_size))


def looped_placement(world_size: int, stages_per_rank: int) -> tuple[int, ...]:
    """p v stages round the p ranks in a loop: stage s on rank s % p, so rank r holds r, r+p, r+2p...
    The activation of stage p-1 travels from the last rank back to rank 0."""
    return tuple(stage % world_size for stage in range(world_size * stages_per_rank))


def v_placement(world_size: int) -> tuple[int, ...]:
    """2p stages folded into a V: down the p ranks, then back up. Rank r holds stages r and 2p-1-r, so
    rank 0 holds the first and the last stage, and the V turns on the last rank (stages p-1 and p),
    where the activation does not travel at all."""
    return tuple(stage if stage < world_size else 2 * world_size - 1 - stage for stage in range(2 * world_size))


def parse_schedule(text: str, placement=None, name: str = "hand-written") -> Schedule:
    """A schedule from one line of actions per rank (rank 0 first), optionally prefixed `rank r:`
    as Schedule.table prints it. Without a placement, each stage goes to the rank whose line
    mentions it first. The number of microbatches is the largest one mentioned, plus one."""
    lines = [line.split(":", 1)[-1] for line in text.strip().splitlines() if line.strip()]
    orders = [[Action.parse(word) for word in line.split()] for line in lines]
    if placement is None:
        first_rank = {}
        for rank, order in enumerate(orders):
            for action in order:
                first_rank.setdefault(action.stage, rank)
        placement = [first_rank.get(stage, 0) for stage in range(1 + max(first_rank, default=-1))]
    n_microbatches = 1 + max((a.microbatch for order in orders for a in order), default=-1)
    return Schedule(name, placement, orders, n_microbatches)
