"""Module 09, part 1 - FP8 numbers and per-tensor abs-max scaling.

An FP8 number has 8 bits: a sign, some exponent bits and some mantissa bits. Two layouts are used
for training (the `fn` in e4m3fn means "finite": no infinities, one NaN pattern, so that range is
not wasted on them):

    e4m3  4 exponent, 3 mantissa bits  largest 448     relative rounding error <= 2^-4
    e5m2  5 exponent, 2 mantissa bits  largest 57344   relative rounding error <= 2^-3

Weights and activations use e4m3 (more precision). Gradients use e5m2: they span many more orders
of magnitude (a few large entries, many tiny ones), and a value below the smallest FP8 number
becomes zero, so range matters more than the last mantissa bit.

Eight bits cover a tiny range, so a tensor is first multiplied by a factor chosen from its largest
absolute value (its abs-max), then cast; the matmul is given the scale that undoes the factor and
applies it in its fp32 accumulator. One scale per tensor is "tensorwise" scaling.
"""
from typing import NamedTuple

import torch

E4M3 = torch.float8_e4m3fn  # weights and activations
E5M2 = torch.float8_e5m2    # gradients
FP8_MAX = {E4M3: torch.finfo(E4M3).max, E5M2: torch.finfo(E5M2).max}  # 448.0, 57344.0
# An abs-max below this is treated as this: an all-zero tensor (abs-max 0) would otherwise get an
# infinite factor, and 0 * inf = NaN. Values this small are far below anything a training run cares
# about.
AMAX_FLOOR = 1e-12


class Quantized(NamedTuple):
    """An FP8 tensor and its float32 scale: the values it stands for are `data * scale`, what
    torch._scaled_mm takes as scale_a / scale_b."""
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
    # Contract: t (any shape and float dtype), an FP8 dtype (E4M3 or E5M2) and maybe t's abs-max, already known (a
    #   float32 scalar tensor). Return Quantized(data, scale): data in `dtype` with t's shape, scale a float32 scalar
    #   tensor, and afterwards:
    #   - data * scale gives t back within the format's rounding (the round-trip test bounds it, subnormals too);
    #   - the element of largest |t| lands exactly on +-FP8_MAX[dtype]: the whole range is used;
    #   - a value beyond the range the given abs-max implies saturates at +-FP8_MAX[dtype] (never inf or NaN);
    #   - an all-zero t gives zeros and a finite scale (AMAX_FLOOR is the smallest abs-max to use);
    #   - the factor t is multiplied by is one correctly rounded float32 division, and t is multiplied in float32
    #     (a test compares the FP8 bytes with torchao's tensorwise recipe, bf16 inputs too); scale is that factor's
    #     float32 reciprocal, as torchao keeps it (its bits are compared too);
    #   - no value is read back to the host (amax stays a tensor).
    # Question: which factor puts the abs-max on the format's largest number, and what must happen to values
    #   beyond it before the cast?
    # Pitfalls: in PyTorch, is a Python number divided by a tensor one rounding or two? What does casting 70000.0 to
    #   e5m2 give, and may you count on what a cast to e4m3fn does beyond 448? And a bf16 t times a float32 scalar tensor: which dtype is the product?
    # Hint 1: the chapter's "Abs-max scaling" works int8 out: what changes with FP8's largest number, and with
    #         a cast that rounds to the nearest FP8 value instead of an integer?
    # Hint 2: amax = max(amax, AMAX_FLOOR); factor = FP8_MAX / amax, one float32 division of two tensors;
    #         data = clamp(t · factor, -FP8_MAX, FP8_MAX) cast to the format; scale = 1 / factor.
    # Hint 3: if amax is None: amax = abs_max(t)
    #         amax = amax.float().clamp(min=AMAX_FLOOR)
    #         to_fp8 = amax.new_tensor(FP8_MAX[dtype]) / amax   (tensor / tensor: one rounding)
    #         data = (t.float() * to_fp8).clamp(-FP8_MAX[dtype], FP8_MAX[dtype]).to(dtype)
    #         return Quantized(data, to_fp8.reciprocal())
    if amax is None:
        amax = abs_max(t)
    amax = amax.float().clamp(min=AMAX_FLOOR)
    to_fp8 = amax.new_tensor(FP8_MAX[dtype]) / amax  # tensor / tensor: one rounding (a float / tensor is 1/amax, then * FP8_MAX)
    data = (t.float() * to_fp8).clamp(-FP8_MAX[dtype], FP8_MAX[dtype]).to(dtype)
    return Quantized(data, to_fp8.reciprocal())
    # <<<
