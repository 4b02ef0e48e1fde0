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


MATMULS = {"matmul", "__matmul__", "mm", "addmm", "bmm"}


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
    """Every matrix product sleeps the time a device of `gflops` GFLOP/s would take and does no
    arithmetic (its result is uninitialized memory of the right shape, or `out` untouched). Sleeping
    frees the CPU, so a collective in flight progresses as it would beside a busy device."""

    def __init__(self, gflops: float):
        super().__init__()
        self.seconds_per_flop, self.slept = 1e-9 / gflops, 0.0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") not in MATMULS:
            return func(*args, **kwargs)
        shape = func(*_on_meta(args), **_on_meta(kwargs)).shape  # the result's shape, computed on no data
        operand = args[1] if func.__name__ == "addmm" else args[0]  # its last dimension is the one summed over
        flops = 2 * math.prod(shape) * operand.shape[-1]
        seconds = flops * self.seconds_per_flop
        time.sleep(seconds)
        self.slept += seconds
        out = kwargs.get("out")
        return out if out is not None else torch.empty(shape, dtype=operand.dtype)
