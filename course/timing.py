"""The wall time of each training step, for the benchmarks (given code).

`StepTimer` is an `on_step` for module 06's `fit`, the Llama track's one training loop: the
benchmarks time the loop the learner's models train in rather than a copy of it. After each step
it records the time since the previous step began, then, in a distributed run, waits for every
rank (a barrier), so that every rank starts the next step together and a step's time is that
step's, not a peer's lateness. A step's time includes drawing its batch (microseconds).
"""
from __future__ import annotations

import time

import torch.distributed as dist


class StepTimer:
    """on_step(step, loss) for fit: `times[i]` is step i's wall time in seconds, `losses[i]` its loss,
    and, given a collectives `log`, `calls[i]` how many records the log held when step i ended."""

    def __init__(self, log: list | None = None):
        self.log, self.times, self.losses, self.calls = log, [], [], []
        self.began = time.perf_counter()

    def __call__(self, step: int, loss: float):
        self.times.append(time.perf_counter() - self.began)
        self.losses.append(loss)
        if self.log is not None:
            self.calls.append(len(self.log))
        if dist.is_initialized():
            dist.barrier()
        self.began = time.perf_counter()
