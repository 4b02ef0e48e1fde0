"""One attention forward of module 15 on an emulated device, with every rank's waits timed (given):
what `run 15` draws as a timeline and `bench 15` reads for how much of the ring's traffic the
compute hides.

Every matrix product sleeps the time a device of a given speed would take (course/emulated.py's
EmulatedGemms, recording each as a compute span), and every collective or message of the context
group records the time its caller was blocked in it as a wait span. Spans are (kind, start, end,
emulated seconds or None), kind "compute", "wait" or "step" (the whole forward).
"""
from __future__ import annotations

import time

import torch.distributed as dist

from course.collectives import Collectives
from course.emulated import EmulatedGemms
from course.impl import load
from course.mesh import Group


class _TimedWork:
    def __init__(self, work, spans):
        self.work, self.spans = work, spans

    def wait(self):
        began = time.perf_counter()
        self.work.wait()
        self.spans.append(("wait", began, time.perf_counter(), None))
        return True


class TimedCollectives(Collectives):
    """The same collectives, logged the same, with the time spent blocked in each recorded as a wait span."""

    def __init__(self, collectives: Collectives, spans: list):
        super().__init__(collectives.group, collectives.axis, collectives.ranks, collectives.log)
        self.spans = spans

    def _timed(self, call, *args, **kwargs):
        began = time.perf_counter()
        work = call(*args, **kwargs)
        if work is None:  # a blocking collective: all of its time was spent waiting for it
            self.spans.append(("wait", began, time.perf_counter(), None))
            return None
        return _TimedWork(work, self.spans)

    def isend(self, *args, **kwargs):
        return self._timed(super().isend, *args, **kwargs)

    def irecv(self, *args, **kwargs):
        return self._timed(super().irecv, *args, **kwargs)

    def all_gather(self, *args, **kwargs):
        return self._timed(super().all_gather, *args, **kwargs)

    def reduce_scatter(self, *args, **kwargs):
        return self._timed(super().reduce_scatter, *args, **kwargs)

    def all_to_all(self, *args, **kwargs):
        return self._timed(super().all_to_all, *args, **kwargs)


def timed_group(group: Group, spans: list) -> Group:
    """`group` whose collectives also record their waits in `spans`."""
    return Group(group.axis, group.index, group.ranks, TimedCollectives(group.collectives, spans))


def emulated_attention(variant: str, group: Group, q, k, v, gflops: float, compute: bool = True) -> list:
    """The spans (kind, start, end, emulated seconds or None) of one forward of `variant`'s attention (the
    selected implementation) on this rank, on the emulated device."""
    spans = []
    attention = load("m15_cp_model").context_attention(variant, timed_group(group, spans))
    dist.barrier()
    began = time.perf_counter()
    with EmulatedGemms(gflops, compute=compute, spans=spans):
        attention.forward(q, k, v)
    spans.append(("step", began, time.perf_counter(), None))
    return spans
