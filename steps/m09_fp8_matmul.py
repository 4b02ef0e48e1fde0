# Generated from solutions/m09_fp8_matmul.py by `python -m course.skeleton`: fill in the TODOs.
# Grade your work with `python main.py grade 09`.
"""Module 09, part 2 - an FP8 linear layer, and the matmul policy a model's linears call.

A linear layer computes y = x W^T (x: tokens x in_features, W: out_features x in_features) and
in backward two more matmuls of the same size:

    forward        y  = x  W^T      x: e4m3, W: e4m3
    input grad     dx = dy W        dy: e5m2, W: e4m3
    weight grad    dW = dy^T x      dy: e5m2, x: e4m3

Each runs through torch._scaled_mm(a, b, scale_a, scale_b, out_dtype), which multiplies FP8
matrices, applies both scales in its fp32 accumulator and writes out_dtype (bf16 or fp32).
On CUDA it has layout rules (CPU is laxer, so we check them ourselves):
  - a is row-major and b is column-major,
  - every dimension is a multiple of 16,
  - at most one operand is e5m2 (there is no e5m2 x e5m2 kernel).

A model does not call any of this directly. Its linears call `policy.linear(x, w)`, where the
policy is `HighPrecisionMatmul()` (the reference) or `FP8Matmul(...)`; swapping the policy swaps
the forward and the backward of every linear, and nothing else.
"""
import torch
import torch.nn.functional as F

from .m09_fp8_scaling import E4M3, E5M2, FP8_MAX, Quantized, quantize

# Smallest matmul dimension (tokens, in_features, out_features) at which FP8Matmul uses FP8 by
# default. Measured on an H100 with torch 2.11 (notebooks/data/bench-09-gpu.json): the bare FP8
# GEMM is 1.4-2.0x bf16 from 4096 up, but forward + backward including this module's quantization
# (abs-max, scale, cast, transposed copies) was slower than bf16 at every shape below 16384^3
# (0.63x at 8192 x 4096 x 14336) and 1.03x at 16384^3. Re-measure with
# `python main.py bench 09 --device cuda` (the `fp8 selected` column) after changing `quantize`.
DEFAULT_MIN_DIM = 16384


def row_major(q: Quantized) -> Quantized:
    """The same values stored row by row (a copy unless they already are)."""
    return Quantized(q.data.contiguous(), q.scale)


def column_major(q: Quantized) -> Quantized:
    """The same values stored column by column: the transpose, made contiguous, transposed back."""
    return Quantized(q.data.t().contiguous().t(), q.scale)


def check_scaled_mm_operands(a: torch.Tensor, b: torch.Tensor) -> None:
    """Raise ValueError, saying what is wrong, unless a @ b meets CUDA's rules for torch._scaled_mm."""
    # TODO(m09): check the CUDA rules for torch._scaled_mm
    # Hint: check, in order: 2-D operands with matching inner dimension; FP8 dtypes and not both
    #       e5m2; every dimension a multiple of 16; a.stride(1) == 1 (row-major); b.stride(0) == 1
    #       (column-major).
    raise NotImplementedError('TODO(m09): check the CUDA rules for torch._scaled_mm')


def scaled_mm(a: Quantized, b: Quantized, out_dtype: torch.dtype, fast_accum: bool = False) -> torch.Tensor:
    """(a.data * a.scale) @ (b.data * b.scale), accumulated in fp32, returned as out_dtype.

    fast_accum lets an H100 accumulate in its faster, less precise FP8 mode: fine for the forward
    output, not for gradients (the usual choice). The CPU kernel ignores it.
    """
    check_scaled_mm_operands(a.data, b.data)
    return torch._scaled_mm(a.data, b.data, scale_a=a.scale, scale_b=b.scale,
                            out_dtype=out_dtype, use_fast_accum=fast_accum)


class FP8Linear(torch.autograd.Function):
    """y = x W^T with FP8 operands in forward and backward. x is 2-D: (tokens, in_features)."""

    @staticmethod
    def forward(ctx, x, w, x_amax, x_fp8, quantize_fn):
        # TODO(m09): forward: y = x W^T from e4m3 x and W; save the FP8 operands for backward
        # Hint: use x_fp8 if the caller already quantized x (several linears reading the same x),
        #       else quantize x with x_amax (None: computed here). Quantize W too.
        # Hint: W is (out, in) row-major, so W^T is (in, out) column-major as it stands.
        # Hint: save the FP8 x (1 byte per value), not x: backward needs only that.
        raise NotImplementedError('TODO(m09): forward: y = x W^T from e4m3 x and W; save the FP8 operands for backward')

    @staticmethod
    def backward(ctx, dy):
        # TODO(m09): backward: dx = dy W and dW = dy^T x, with dy in e5m2
        # Hint: rebuild the saved Quantized x and W; quantize dy to e5m2.
        # Hint: dW sums over tokens, which neither dy nor x stores contiguously: both need a copy.
        raise NotImplementedError('TODO(m09): backward: dx = dy W and dW = dy^T x, with dy in e5m2')


def fp8_linear(x, w, x_amax=None, x_fp8=None, quantize_fn=quantize):
    """x W^T for 2-D x, differentiable, with FP8 matmuls in forward and backward.

    x_amax: x's abs-max if a previous op already computed it (skips one pass over x).
    x_fp8: x already quantized (when several linears read the same x, quantize it once).
    quantize_fn: `quantize`, or a compiled version of it (see FP8Matmul).
    """
    return FP8Linear.apply(x, w, x_amax, x_fp8, quantize_fn)


class HighPrecisionMatmul:
    """The reference policy: y = x W^T in the inputs' own dtype (fp32, or bf16 on a GPU)."""

    def linear(self, x: torch.Tensor, w: torch.Tensor, x_amax: torch.Tensor | None = None) -> torch.Tensor:
        # x_amax is accepted so that a model can call any policy the same way; this one has no use for it.
        return F.linear(x, w)


class FP8Matmul:
    """The FP8 policy: linears at least `min_dim` in every dimension run `fp8_linear`; the rest
    (and any whose dimensions are not multiples of 16) stay in high precision.

    compile_quantize=True hands `quantize` to torch.compile, which fuses its float32 multiply,
    clamp and cast into one kernel; eager mode runs them as separate passes over memory. It needs
    a GPU toolchain (Triton) and costs a compile on first use (shapes are left dynamic, so one
    compile per FP8 format serves every size).
    """

    def __init__(self, min_dim: int = DEFAULT_MIN_DIM, compile_quantize: bool = False):
        self.min_dim = min_dim
        self.quantize_fn = torch.compile(quantize, dynamic=True) if compile_quantize else quantize

    def uses_fp8(self, tokens: int, in_features: int, out_features: int) -> bool:
        dims = (tokens, in_features, out_features)
        return min(dims) >= self.min_dim and all(d % 16 == 0 for d in dims)

    def linear(self, x: torch.Tensor, w: torch.Tensor, x_amax: torch.Tensor | None = None) -> torch.Tensor:
        """x W^T for x of shape (..., in_features) and w of shape (out_features, in_features)."""
        x2d = x.reshape(-1, x.shape[-1])
        if not self.uses_fp8(x2d.shape[0], w.shape[1], w.shape[0]):
            return F.linear(x, w)
        y = fp8_linear(x2d, w, x_amax, quantize_fn=self.quantize_fn)
        return y.reshape(*x.shape[:-1], w.shape[0])
