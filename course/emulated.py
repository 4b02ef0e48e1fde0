"""Emulated devices (given): compute that takes the time a device would, by sleeping.

For pipeline stages (modules 05 and 11): each layer's forward takes a fixed extra time
(time.sleep), its backward twice that. Module 11's stages, whose backward comes in two halves, take
that time once in I (input gradient) and once in W (weight gradient).

For any autograd model: `SleepInBackward.apply(x, seconds)` is the identity whose backward sleeps
`seconds` first; put after a layer, it emulates that layer's backward (module 14's overlap
benchmark and notebook: gradients that become ready one layer at a time, as on a busy device).

For GEMMs (module 12's overlap benchmark): `EmulatedGemms` makes every matrix product sleep the
time a device of a given speed would take, and do no arithmetic.

Emulation, not measurement of a device: the sleep stands for the compute a real device would do.
Sleeping ranks do not compete for the CPU, so 4 ranks on 2 cores show the bubble a pipeline of 4
devices would have, decided by the schedule's shape rather than by CPU contention between ranks,
and a collective in flight progresses beside a "busy" GEMM as it would beside a busy device.
"""
from __future__ import annotations

import math
import time

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode


class SleepInBackward(torch.autograd.Function):
    """Identity whose backward first sleeps `seconds`: the emulated cost of a stage's (or a layer's) backward."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None


class EmulatedStage(nn.Module):
    """A stage whose layers each take `ms_per_layer` more in forward and twice that in backward."""

    def __init__(self, stage: nn.Module, ms_per_layer: float):
        super().__init__()
        self.stage = stage
        self.hidden, self.is_first, self.is_last = stage.hidden, stage.is_first, stage.is_last
        self.seconds = ms_per_layer * len(stage.layers) / 1000

    def forward(self, x):
        out = self.stage(x)
        time.sleep(self.seconds)
        return SleepInBackward.apply(out, 2 * self.seconds)

    def loss(self, logits, targets):
        return self.stage.loss(logits, targets)


class EmulatedSplitStage:
    """A module-11 stage (forward / backward_input / backward_weight / backward) whose layers each
    take `ms_per_layer` more in forward, in I and in W: F = I = W per stage, B = I + W = 2F."""

    def __init__(self, stage, ms_per_layer: float):
        self.stage_module = stage
        self.seconds = ms_per_layer * len(stage.layers) / 1000

    def __getattr__(self, name):  # stage, is_first, is_last, hidden, saved, parameters, ...
        return getattr(self.stage_module, name)

    def forward(self, x, microbatch, *args):
        out = self.stage_module.forward(x, microbatch, *args)
        time.sleep(self.seconds)
        return out

    def backward_input(self, microbatch, grad_output=None):
        grad_input = self.stage_module.backward_input(microbatch, grad_output)
        time.sleep(self.seconds)
        return grad_input

    def backward_weight(self, microbatch):
        self.stage_module.backward_weight(microbatch)
        time.sleep(self.seconds)

    def backward(self, microbatch, grad_output=None):
        grad_input = self.backward_input(microbatch, grad_output)
        self.backward_weight(microbatch)
        return grad_input


MATMULS = {"matmul", "__matmul__", "mm", "addmm", "bmm", "baddbmm"}


def _on_meta(value):
    """Tensors (also in lists, tuples and dicts) moved to the meta device: shapes without data."""
    if isinstance(value, torch.Tensor):
        return value.to("meta")
    if isinstance(value, (list, tuple)):
        return type(value)(_on_meta(v) for v in value)
    if isinstance(value, dict):
        return {k: _on_meta(v) for k, v in value.items()}
    return value


class EmulatedGemms(TorchFunctionMode):
    """Every matrix product sleeps the time a device of `gflops` GFLOP/s would take. By default it does
    no arithmetic (its result is uninitialized memory of the right shape, or `out` untouched); with
    compute=True it computes the product too, before sleeping, for code whose later steps need the
    values. Sleeping frees the CPU, so a collective in flight progresses as it would beside a busy
    device. With a `spans` list, each sleep is recorded as ("compute", start, end, seconds asked for)."""

    def __init__(self, gflops: float, compute: bool = False, spans: list | None = None):
        super().__init__()
        self.seconds_per_flop, self.slept = 1e-9 / gflops, 0.0
        self.compute, self.spans = compute, spans

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") not in MATMULS:
            return func(*args, **kwargs)
        shape = func(*_on_meta(args), **_on_meta(kwargs)).shape  # the result's shape, computed on no data
        # Its operand's last dimension is the one summed over (addmm's and baddbmm's first is the bias).
        operand = args[1] if func.__name__ in ("addmm", "baddbmm") else args[0]
        seconds = 2 * math.prod(shape) * operand.shape[-1] * self.seconds_per_flop
        if self.compute:
            out = func(*args, **kwargs)
        else:
            out = kwargs.get("out")
            out = out if out is not None else torch.empty(shape, dtype=operand.dtype)
        began = time.perf_counter()
        time.sleep(seconds)
        self.slept += seconds
        if self.spans is not None:
            self.spans.append(("compute", began, time.perf_counter(), seconds))  # as slept, and as asked for
        return out
