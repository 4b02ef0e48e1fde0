# Generated from solutions/m16_expert_parallel.py by `python -m course.skeleton`: fill in the TODOs.
# Grade your work with `python main.py grade 16`. (skeleton 47e17bb13b2c)
"""Module 16, part 3 - expert parallelism: the E experts split over the e ranks of an expert group,
rows sent to their expert and back with two all-to-alls.

Member i of the expert group (`Group` "e", carved out of the data ranks: every member has its own
tokens) holds experts i E/e .. (i + 1) E/e - 1, so the expert-major rows of part 2 are already
*member-major*: the first block goes to member 0, the next to member 1, ... One exchange is

  1. counts   an all-to-all of the per-expert counts, (E,) -> (e, E/e): received[s, j] is how many rows
              member s will send this member's local expert j. Both sides of the next all-to-all need
              its split sizes before it starts, and only the senders know them.
  2. rows     an all-to-all with uneven splits: member s sends send_splits[s'] rows to each member s'
              (the sum of its counts of s''s experts) and receives recv_splits[s'] from each (the sum
              of received[s']). They arrive source-major: member 0's rows for each local expert, then
              member 1's, ...
  3. regroup  a local permutation from source-major to expert-major, so each local expert has its rows
              side by side: local expert j's rows from member 0, then from member 1, ...

and the way back (`return_from_experts`, yours) is the inverse of the way out (`send_to_experts`,
given: steps 2 and 3). A layer's backward needs the adjoints of both; the two functions below are
all it uses, each twice (the chapter's "Expert parallelism" says why).

Every all-to-all goes through the group's `collectives` (course/collectives.py), which logs it
with the bytes that leave this rank: the rows for the other members.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from course.mesh import Group


@dataclass
class Exchange:
    """What one exchange needs to know, from the counts' all-to-all."""
    send_splits: list[int]      # rows this member sends to each member of the group
    recv_splits: list[int]      # rows it receives from each
    received: torch.Tensor      # (e, E/e) int64: rows each member sends each of this member's experts
    regroup: torch.Tensor       # (sum of recv_splits,) int64: grouped = arrived[regroup] (source- to expert-major)

    @property
    def expert_counts(self) -> torch.Tensor:
        """(E/e,): rows each local expert processes."""
        return self.received.sum(0)


def local_experts(n_experts: int, group: Group) -> range:
    """The experts this member of the expert group holds (given)."""
    per_rank = n_experts // group.size
    return range(group.index * per_rank, (group.index + 1) * per_rank)


def exchange_rows(rows: torch.Tensor, send_splits: list[int], recv_splits: list[int], group: Group,
                  label: str) -> torch.Tensor:
    """rows (sum(send_splits), M) cut into one block per member, exchanged: returns (sum(recv_splits), M),
    the blocks from member 0, 1, ... in turn (given)."""
    arrived = rows.new_empty(sum(recv_splits), *rows.shape[1:])
    group.collectives.all_to_all(arrived, rows.contiguous(), recv_splits, send_splits, label=label)
    return arrived


def check_exchange(exchange: Exchange, group: Group):
    """A debug check (given; the tests run it after plan_exchange, before any rows move): raises ValueError
    unless every member receives from each member t the rows t sends it. Splits that disagree make the
    rows' all-to-all fail inside gloo ("Connection reset by peer", or an abort) without saying which
    sizes were wrong. It gathers every member's splits with one more collective, outside
    group.collectives (it is no part of a training step, and is not logged); every member raises the
    same error, so none is left waiting."""
    if group.size == 1:
        return
    every = [None] * group.size
    dist.all_gather_object(every, (list(exchange.send_splits), list(exchange.recv_splits)),
                           group=group.collectives.group)
    for s, (send, recv) in enumerate(every):
        if len(send) != group.size or len(recv) != group.size:
            raise ValueError(f"your plan_exchange: member {s} has {len(send)} send splits and {len(recv)} recv splits: one per member of "
                             f"the group ({group.size}) each")
    for s, (_, recv) in enumerate(every):
        for t, (send, _) in enumerate(every):
            if int(recv[t]) != int(send[s]):
                raise ValueError(f"your plan_exchange: member {s} receives {int(recv[t])} rows from member {t} by its "
                                 f"recv_splits, but {t} sends {int(send[s])} (whose counts say what arrives?)")


def plan_exchange(counts: torch.Tensor, group: Group) -> Exchange:
    """The counts' all-to-all: counts (E,) int64 are the rows this member sends to each expert (in
    expert-major order, so member-major too)."""
    # TODO(m16): the counts' all-to-all, the split sizes of both sides, and the regroup permutation
    # Contract: return Exchange(send_splits, recv_splits, received, regroup) as the dataclass describes: splits as
    #   Python ints (one per member, in group order), received (e, E/e) int64, regroup the permutation that turns the
    #   arriving source-major rows into local-expert-major order (within one expert, member 0's rows first, each
    #   member's in the order it sent them). One all-to-all through group.collectives labelled "counts" (the tests
    #   read the log, and compare every field with what they work out from all members' counts, routed unevenly).
    # Maths: the module docstring, steps 1 and 3. An all-to-all of a tensor viewed (e, ...) with equal splits hands
    #   member s block s of every member's tensor, member 0's first.
    # Question: who knows how many rows will arrive from each member, and which permutation puts the arrivals in
    #   local-expert-major order?
    # Pitfalls: does what this member receives depend on its own counts or on the counts it received? Within one
    #   expert, do your rows keep member 0's first and each member's order? With one member, what must every step give?
    raise NotImplementedError("TODO(m16): the counts' all-to-all, the split sizes of both sides, and the regroup permutation")


def send_to_experts(rows: torch.Tensor, exchange: Exchange, group: Group, label: str = "dispatch") -> torch.Tensor:
    """Rows in this member's expert-major order (sum(send_splits), M) -> the rows this member's experts
    process, local-expert-major (sum(recv_splits), M): the rows' all-to-all, then the regroup (given)."""
    return exchange_rows(rows, exchange.send_splits, exchange.recv_splits, group, label)[exchange.regroup]


def return_from_experts(rows: torch.Tensor, exchange: Exchange, group: Group, label: str = "combine") -> torch.Tensor:
    """The experts' output rows, local-expert-major (sum(recv_splits), M) -> back to the members they
    came from: this member's rows in its own expert-major order (sum(send_splits), M). Also the
    backward of send_to_experts."""
    # TODO(m16): the way back: every row from the experts home to where it left
    # Contract: the inverse of send_to_experts (given, above): row r of the result is the output for row r this member
    #   sent, in its own expert-major order, (sum(send_splits), M). The tests feed it the rows each expert should have
    #   received, labelled, and check that every row comes home to its place.
    # Maths: send_to_experts exchanges the rows and then regroups them; exchange_rows (given) cuts what it sends by
    #   its first splits and lays out what arrives by its second.
    # Question: what undoes each of send_to_experts' two steps, and in which order?
    # Pitfalls: does indexing by regroup a second time undo the regroup or apply it twice? Which sizes describe the
    #   rows going home: the ones that left, or the ones that arrived?
    raise NotImplementedError('TODO(m16): the way back: every row from the experts home to where it left')
