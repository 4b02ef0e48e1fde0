"""Collectives that deliver late (given, for tests): what a slow network does, every time.

Module 14's tests run the buckets' collectives through `LateCollectives`: an asynchronous
collective reads its input when it is started, fills its output with NaN (an integer output with its
dtype's most negative value) and delivers its result only in wait(). So a bucket sent before its
last gradient misses that gradient, and a result read before it was waited for is NaN (or a
negative count): both are wrong on every run, not only when the network happens to be slow.
Blocking collectives (the broadcast, the norm) run at once.

What it records, for the tests to check:
- `never_waited()`: the labels of the collectives started and never waited for;
- `waited_at`: for every asynchronous collective, (label, its place in the log, how many collectives
  had been issued when it was first waited for): module 14's token count must be waited for only
  after the step's last bucket has left;
- `pending_at_start`: for every asynchronous collective, when it was started, the labels of the
  others of the same kind still in flight (ZeRO-2 keeps one bucket's reduce-scatter in flight at
  most: that list must be empty at every start);
- a bucket's collective ("bucket <k>") started with async_op=False fails at once (no overlap).

`late_group()` hands out a `Group` (course/mesh.py) with these collectives: every rank, or this
rank's d group of a mesh. Used by tests/test_14_data_parallel.py and tests/test_14_zero.py.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from course.collectives import Collectives
from course.mesh import Group, init_mesh


class DeliveredOnWait:
    """The work of a late collective: it runs for real, once, in the first wait()."""

    def __init__(self, deliver, label: str, op: str, on_first_wait=None):
        self.deliver, self.label, self.op, self.waited, self.on_first_wait = deliver, label, op, False, on_first_wait

    def wait(self):
        if not self.waited:
            self.waited = True
            if self.on_first_wait:
                self.on_first_wait()
            self.deliver()
        return True


class LateCollectives(Collectives):
    """The group's collectives as a slow network delivers them: an asynchronous one copies its input
    when started, fills its output with NaN, and runs for real only in wait(). Buckets' collectives
    must be asynchronous."""

    def __init__(self, group, axis, ranks):
        super().__init__(group, axis, ranks)
        self.now = Collectives(group, axis, ranks, log=[])  # runs the deferred collectives, unlogged
        self.works: list[DeliveredOnWait] = []
        self.pending_at_start: list[tuple[str, str, list[str]]] = []  # (op, label, others of op still in flight)
        self.waited_at: list[tuple[str, int, int]] = []  # (label, place in the log, collectives issued at its wait)

    @staticmethod
    def check_async(op: str, label: str, async_op: bool):
        assert async_op or not label.startswith("bucket"), (
            f"{label}: a blocking {op}: the backward stood still while it crossed the network. How can a "
            f"collective be started so that it travels while the backward computes the earlier layers, and where "
            f"is it then waited for?")

    def _late(self, op, label, output, source, run):
        self._record(op, output.nbytes if op != "all_gather" else source.nbytes, label)
        self.pending_at_start.append((op, label, [w.label for w in self.works if w.op == op and not w.waited]))
        sent = source.clone()  # what the collective reads: the input as it is now
        output.fill_(float("nan") if output.is_floating_point() else torch.iinfo(output.dtype).min)
        place = len(self.log) - 1
        work = DeliveredOnWait(lambda: run(output, sent), label, op,
                               lambda: self.waited_at.append((label, place, len(self.log))))
        self.works.append(work)
        return work

    def all_reduce(self, tensor, label="", async_op=False, op="sum"):
        self.check_async("all-reduce", label, async_op)
        if not async_op:
            return super().all_reduce(tensor, label, async_op, op)
        return self._late("all_reduce", label, tensor, tensor,
                          lambda out, sent: (self.now.all_reduce(sent, label, op=op), out.copy_(sent)))

    def reduce_scatter(self, shard, full, label="", async_op=False, dim=0):
        self.check_async("reduce-scatter", label, async_op)
        if not async_op:
            return super().reduce_scatter(shard, full, label, async_op, dim)
        return self._late("reduce_scatter", label, shard, full,
                          lambda out, sent: self.now.reduce_scatter(out, sent, label, dim=dim))

    def all_gather(self, output, shard, label="", async_op=False, dim=0):
        if not async_op:
            return super().all_gather(output, shard, label, async_op, dim)
        return self._late("all_gather", label, output, shard,
                          lambda out, sent: self.now.all_gather(out, sent, label, dim=dim))

    def never_waited(self) -> list[str]:
        return [w.label for w in self.works if not w.waited]


def late_group(mesh_sizes: dict | None = None) -> Group:
    """Every rank (axis "world"), or this rank's d group of a mesh of `mesh_sizes`, with LateCollectives."""
    if mesh_sizes is None:
        ranks = tuple(range(dist.get_world_size()))
        return Group("world", dist.get_rank(), ranks, LateCollectives(None, "world", ranks))
    group = init_mesh(mesh_sizes).group("d")
    return Group(group.axis, group.index, group.ranks, LateCollectives(group.collectives.group, group.axis, group.ranks))


def check_waited(group: Group):
    """Fail if a collective of the group's LateCollectives was started and never waited for."""
    lost = group.collectives.never_waited()
    who = ("your finish waits for every bucket" if lost and lost[0].startswith("bucket") else
           "your train_step, or DataParallelLlama.train_step, waits for the count global_token_count started "
           "before it reads it"
           if lost and lost[0] == "token count" else
           "ZeroDataParallel.step waits for its all-gathers before it returns")
    assert not lost, (f"{lost[0]}'s collective was started and never waited for: its result may not have arrived "
                      f"when it was read ({who})")


def token_counts(group: Group) -> list[tuple[int, str, int | None]]:
    """Module 14's token counts in the log: (place in the log, op, collectives issued when it was first
    waited for; None if it was blocking)."""
    waits = {place: at for label, place, at in group.collectives.waited_at if label == "token count"}
    return [(i, record.op, waits.get(i)) for i, record in enumerate(group.collectives.log)
            if record.label == "token count"]


def check_count_in_flight(where: str, counts, buckets: list[int], n_buckets: int, waits: str):
    """Module 14's step count: one all-reduce a step ("token count", see `token_counts`), started without
    waiting before the step's first bucket and waited for only after its last one has left, so that it
    travels while the micro-steps compute. `buckets`: the buckets' places in the log, `waits`: the culprit."""
    steps = len(buckets) // n_buckets
    assert len(counts) == steps and all(op == "all_reduce" for _, op, _ in counts), (
        f"{where}: {len(counts)} collectives labelled \"token count\" in {steps} steps ({[op for _, op, _ in counts]}): "
        f"one all-reduce a step (global_token_count)")
    for step, (place, _, waited) in enumerate(counts):
        assert waited is not None, (
            f"{where}: step {step}'s count was a blocking all-reduce: the step then waits for it before its first "
            f"backward, with nothing to hide it behind (global_token_count starts it without waiting)")
        first, last = buckets[step * n_buckets], buckets[(step + 1) * n_buckets - 1]
        assert place < first and waited > last, (
            f"{where}: {waits} waited for step {step}'s count when {waited} collectives had been issued; it was "
            f"started as collective {place}, the buckets went out as collectives {first} .. {last}: the count is "
            f"started before them and waited for only after the last has left, so that nothing but the buckets is "
            f"waited for while the micro-steps compute")
