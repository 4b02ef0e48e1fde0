"""Module 11's independent references (given): the monolith trained with gradient accumulation by
autograd (`accumulating_monolith`), which every schedule must reproduce bit for bit, and PyTorch's
own pipeline schedules (torch.distributed.pipelining) on module 11's stages, an independent
implementation of every schedule of module 11 but ZB-H2 (which torch does not ship), to compare losses,
gradients and step times with.
Run `run_torch_schedule` (or a `TorchSchedule`, one step at a time) on every rank of a gloo group.

Torch runs its stages with autograd, so each stage is wrapped as an nn.Module (`TorchStage`) that
shares the SplitStage's layers. With an emulated device the three costs land where torch pays
them: F after the forward, I on the path from the output to the input (it runs in torch's input
backward), W on the path to the first layer's weight (it runs in torch's weight backward); a full
backward pays both, as our EmulatedSplitStage does.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from course.impl import reference
from course.mesh import world_group

TORCH_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B",
                   "zbh1": "ScheduleInterleavedZeroBubble", "interleaved_zb": "ScheduleInterleavedZeroBubble",
                   "zbv": "ScheduleZBVZeroBubble", "dualpipev": "ScheduleDualPipeV"}  # torch has no ZB-H2


def accumulating_monolith(cfg, n_microbatches: int):
    """Module 00's monolith trained for cfg.steps steps with autograd, each step's gradient accumulated
    over the batch's n_microbatches microbatches in order (each loss share divided by m, one backward
    each). Returns (model, losses), the loss of a step being the sum of its shares. Every module-11
    schedule adds each stage's microbatch gradients in this order, so it matches bit for bit; the
    model's .grad still holds the last step's accumulated gradient."""
    m00 = reference("m00_monolith")
    model = m00.build_model(cfg)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    x, y = m00.make_batch(cfg)
    losses = []
    for _ in range(cfg.steps):
        optimizer.zero_grad()
        shares = []
        for xm, ym in zip(x.chunk(n_microbatches), y.chunk(n_microbatches), strict=True):
            share = F.cross_entropy(model(xm), ym) / n_microbatches
            share.backward()
            shares.append(share.detach())
        optimizer.step()
        losses.append(sum(shares).item())
    return model, losses


class _SleepInBackward(torch.autograd.Function):
    """Identity whose backward first sleeps. It returns a copy, not a view (course/emulated.py's does):
    torch's input backward detaches the stage output in place, which a view refuses."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None


class TorchStage(nn.Module):
    """A SplitStage's layers (shared, not copied) as the nn.Module a torch PipelineStage runs."""

    def __init__(self, split_stage, ms_per_layer: float = 0.0):
        super().__init__()
        self.layers, self.head = split_stage.layers, split_stage.head
        self.seconds = ms_per_layer * len(split_stage.layers) / 1000

    def forward(self, x):
        for index, layer in enumerate(self.layers):
            weight = layer.weight
            if index == 0 and self.seconds:
                weight = _SleepInBackward.apply(weight, self.seconds)  # W's share of the emulated backward
            x = F.relu(F.linear(x, weight, layer.bias))
        if self.head is not None:
            x = F.linear(x, self.head.weight, self.head.bias)
        if self.seconds:
            time.sleep(self.seconds)  # F
            x = _SleepInBackward.apply(x, self.seconds)  # I's share
        return x


class TorchSchedule:
    """On this rank: module 11's stages for schedule `name`, trained with torch's schedule for it, one
    step per call of `step()` (a barrier first, so that every rank starts the timed step together).
    `steps` holds each step's (start, end), `losses` the batch loss (None off the last stage),
    `first_grads` the gradients of the first step, before the optimizer, by stage, in the order of each
    stage's parameters(). Its constructor raises what torch raises for a configuration it refuses."""

    def __init__(self, name: str, world_size: int, n_microbatches: int, ms_per_layer: float = 0.0,
                 stages_per_rank: int = 2):
        from torch.distributed.pipelining import PipelineStage, schedules

        m00, m11 = reference("m00_monolith"), reference("m11_executor")
        cfg = m00.MLPConfig()
        plan = reference("m11_generators").make_schedule(name, world_size, n_microbatches, stages_per_rank)
        self.split = m11.build_stages(cfg, plan, world_group())
        pipe_stages = [PipelineStage(TorchStage(self.split[s], ms_per_layer), s, plan.n_stages, torch.device("cpu"))
                       for s in sorted(self.split)]
        kind = getattr(schedules, TORCH_SCHEDULES[name])
        one_stage = name in ("gpipe", "1f1b")
        self.pipe = kind(pipe_stages[0] if one_stage else pipe_stages, n_microbatches, loss_fn=F.cross_entropy)
        self.optimizer = torch.optim.Adam([p for s in self.split.values() for p in s.parameters()], lr=cfg.lr)
        self.x, self.y = m00.make_batch(cfg)
        self.first, self.last = 0 in self.split, plan.n_stages - 1 in self.split
        self.steps, self.losses, self.first_grads = [], [], None

    def step(self):
        self.optimizer.zero_grad()
        dist.barrier()
        start, shares = time.perf_counter(), []
        args = (self.x,) if self.first else ()
        kwargs = {"target": self.y, "losses": shares} if self.last else {}
        self.pipe.step(*args, **kwargs)
        self.steps.append((start, time.perf_counter()))
        self.losses.append(torch.stack(shares).mean().item() if self.last else None)
        if self.first_grads is None:
            self.first_grads = {s: [p.grad.clone() for p in stage.parameters()] for s, stage in self.split.items()}
        self.optimizer.step()

    def result(self) -> dict:
        return {"steps": self.steps, "losses": self.losses, "first_grads": self.first_grads}


def run_torch_schedule(name: str, world_size: int, n_microbatches: int, steps: int, ms_per_layer: float = 0.0,
                       stages_per_rank: int = 2) -> dict:
    """On this rank: train module 11's stages for `steps` steps with torch's schedule for `name` (a
    TorchSchedule). Returns {"steps": [(start, end)], "losses": [batch loss or None], "first_grads":
    {stage: [grads]}}."""
    run = TorchSchedule(name, world_size, n_microbatches, ms_per_layer, stages_per_rank)
    for _ in range(steps):
        run.step()
    return run.result()
