"""Module 09, part 1 - FP8 numbers and per-tensor abs-max scaling.

An FP8 number has 8 bits: a sign, some exponent bits and some mantissa bits. Two layouts are used
for training (the `fn` in e4m3fn means "finite": no infinities, one NaN pattern, so that range is
not wasted on them):

    e4m3  4 exponent, 3 mantissa bits  largest 448     relative rounding error <= 2^-4
    e5m2  5 exponent, 2 mantissa bits  largest 57344   relative rounding error <= 2^-3

Weights and activations use e4m3 (more precision). Gradients use e5m2: they span many more orders
of magnitude (a few large entries, many tiny ones), and a value below the smallest FP8 number
becomes zero, so range matters more than the last mantissa bit.

Eight bits cover a tiny range, so a tensor is first multiplied by a scale that maps its largest
absolute value (its abs-max) onto the format's largest number, then cast. The matmul gets the
inverse scale and undoes it in its fp32 accumulator. One scale per tensor is "tensorwise" scaling.
"""
from typing import NamedTuple

import torch

E4M3 = torch.float8_e4m3fn  # weights and activations
E5M2 = torch.float8_e5m2    # gradients
FP8_MAX = {E4M3: torch.finfo(E4M3).max, E5M2: torch.finfo(E5M2).max}  # 448.0, 57344.0
# An abs-max below this is treated as this. It keeps the scale FP8_MAX / amax finite in float32
# for an all-zero tensor (amax 0 would give an infinite scale, and 0 * inf = NaN). Values this
# small are far below anything a training run cares about.
AMAX_FLOOR = 1e-12


class Quantized(NamedTuple):
    """An FP8 tensor and its float32 scale: the values it stands for are `data * scale`.

    `scale` is the inverse of the factor applied before the cast; it is what torch._scaled_mm
    takes as scale_a / scale_b.
    """
    data: torch.Tensor
    scale: torch.Tensor

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.data.to(dtype) * self.scale

    def t(self) -> "Quantized":
        """The transpose: a view of the same bytes, same scale."""
        return Quantized(self.data.t(), self.scale)

    # shape and reshape, so module 06's linear_forward/backward handle a Quantized input like a tensor
    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def reshape(self, *shape) -> "Quantized":
        return Quantized(self.data.reshape(*shape), self.scale)


def abs_max(t: torch.Tensor) -> torch.Tensor:
    """max |t| as a float32 scalar tensor on t's device, in one pass (no copy of |t|, no host sync).

    A previous op (a norm, an activation) can compute this on the fly and hand it to `quantize`.
    """
    return torch.linalg.vector_norm(t, ord=float("inf")).float()


def quantize(t: torch.Tensor, dtype: torch.dtype, amax: torch.Tensor | None = None) -> Quantized:
    """Cast `t` to the FP8 `dtype` with one scale for the whole tensor.

    `amax` is t's abs-max when it is already known (computed by the op that produced t); without
    it, it is computed here. An amax smaller than the true one (a stale or "delayed" scale) must not
    overflow: values beyond the format's range saturate at +-FP8_MAX[dtype].
    """
    # >>> TODO(m09): per-tensor abs-max scaling and a saturating cast to FP8
    # Contract: t (any shape and float dtype), an FP8 dtype (E4M3 or E5M2) and maybe a known abs-max (a float32
    # scalar tensor). Return Quantized(data, scale): data in `dtype` with t's shape, scale a float32 scalar
    # tensor such that data * scale gives t back (up to rounding). No host sync: amax stays a tensor.
    # Maths: the factor FP8_MAX[dtype] / amax maps the largest |value| onto the format's largest number; scale is
    # its inverse. amax is floored at AMAX_FLOOR first (an all-zero tensor would get an infinite factor, and
    # 0 * inf = NaN). Values beyond the range (a given amax that is too small, a stale one) saturate at
    # +-FP8_MAX[dtype] instead of overflowing (e5m2 turns overflow into inf).
    # Pitfalls the tests catch: the abs-max must land exactly on +-FP8_MAX; the factor must be *one* correctly
    # rounded float32 division: a Python float divided by a tensor computes 1 / amax and then multiplies (two
    # roundings, 1 ulp off for about a quarter of abs-maxes), and the test compares the FP8 bytes with a
    # single division. Scale in float32 (a bf16 t times the factor would round in bf16 before the cast).
    # Hint 1: floor the abs-max, divide the format's max by it, multiply, clamp, cast; return the data and the
    #         factor's inverse.
    # Hint 2: abs_max(t) when no amax is given; .float() and .clamp(min=...); amax.new_tensor(number) makes a
    #         float32 tensor on amax's device, so the division is tensor by tensor; .clamp(-m, m); .to(dtype);
    #         .reciprocal().
    # Hint 3: amax = the given abs-max, or abs_max(t); in float32, floored at AMAX_FLOOR
    #         to_fp8 = FP8_MAX[dtype] as a float32 tensor, divided by amax
    #         data = (t in float32 times to_fp8), clamped to +-FP8_MAX[dtype], cast to dtype
    #         return Quantized(data, the reciprocal of to_fp8)
    if amax is None:
        amax = abs_max(t)
    amax = amax.float().clamp(min=AMAX_FLOOR)
    to_fp8 = amax.new_tensor(FP8_MAX[dtype]) / amax  # tensor / tensor: one rounding (a float / tensor is 1/amax, then * FP8_MAX)
    data = (t.float() * to_fp8).clamp(-FP8_MAX[dtype], FP8_MAX[dtype]).to(dtype)
    return Quantized(data, to_fp8.reciprocal())
    # <<<
