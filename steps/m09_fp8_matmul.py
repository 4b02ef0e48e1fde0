# Generated from solutions/m09_fp8_matmul.py by `python -m course.skeleton`: fill in the TODOs.
# Grade your work with `python main.py grade 09`. (skeleton 8e6ce9bdc894)
"""Module 09, part 2 - FP8 linears: module 06's matmul policy with FP8 operands.

A linear layer computes y = x W^T (x: tokens x in_features, W: out_features x in_features) and
in backward two more matmuls of the same size:

    forward        y  = x  W^T      x: e4m3, W: e4m3
    input grad     dx = dy W        dy: e5m2, W: e4m3
    weight grad    dW = dy^T x      dy: e5m2, x: e4m3 (the one quantized in forward, kept in the store)

Each runs through torch._scaled_mm(a, b, scale_a=..., scale_b=..., out_dtype=...), which multiplies
FP8 matrices, applies both scales in its fp32 accumulator and writes out_dtype (bf16 or fp32).
On an H100 it has layout rules (CPU is laxer, so we check them ourselves):
  - a is row-major and b is column-major,
  - K and N are multiples of 16 (we also require M: the forward's tokens are K in dW = dy^T x),
  - at most one operand is e5m2 (there is no e5m2 x e5m2 kernel).

The Llama block of module 06 sends every linear through a `Matmul` policy: `prepare(x, store,
name)` once per linear input (saving what backward needs), then `forward(x, w)` and
`backward(dy, x, w)`. `FP8Matmul` overrides these three; `LlamaBlock(cfg, matmul=FP8Matmul())`
runs all seven linears in FP8, and nothing else in the block changes.
"""
import weakref
from dataclasses import dataclass

import torch

from .m06_llama_ops import Matmul
from .m09_fp8_scaling import E4M3, E5M2, FP8_MAX, Quantized, abs_max, quantize

# Smallest linear input (tokens and in_features) that FP8Matmul quantizes by default. Measured on
# an H100 with torch 2.11 (notebooks/data/bench-09-gpu.json): the bare FP8 GEMM is 1.5-2.1x bf16
# from 4096 up, but forward + backward including this module's quantization (abs-max, scale,
# cast, transposed copies) was slower than bf16 at every shape below 16384^3 (0.55x at
# 8192 x 4096 x 14336) and 0.99x at 16384^3. Re-measure with
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
    # Hint: each message names the rule it checks ("2-D", "inner dimension", "FP8", "e5m2", "16",
    #       "row-major", "column-major"): the tests look for those words.
    raise NotImplementedError('TODO(m09): check the CUDA rules for torch._scaled_mm')


def scaled_mm(a: Quantized, b: Quantized, out_dtype: torch.dtype, fast_accum: bool = False) -> torch.Tensor:
    """(a.data * a.scale) @ (b.data * b.scale), accumulated in fp32, returned as out_dtype.

    fast_accum lets an H100 accumulate in its faster, less precise FP8 mode: fine for the forward
    output, not for gradients (the usual choice). The CPU kernel ignores it.
    """
    check_scaled_mm_operands(a.data, b.data)
    return torch._scaled_mm(a.data, b.data, scale_a=a.scale, scale_b=b.scale,
                            out_dtype=out_dtype, use_fast_accum=fast_accum)


@dataclass
class CachedWeight:
    version: int               # the weight's version counter when it was quantized
    row_major: Quantized       # W itself: forward multiplies by its transpose, W^T (column-major)
    column_major: Quantized | None = None  # a transposed copy for dx = dy W, made on first use
    dropper: weakref.ref | None = None     # removes this entry when the weight is freed


class FP8WeightCache:
    """Each weight's e4m3 copies, quantized once per optimizer step.

    One training step reads every weight in forward (y = x W^T) and in backward (dx = dy W), and
    again for every microbatch when gradients accumulate. Its values change only when the optimizer
    writes it, so production FP8 recipes quantize each weight once per change and reuse the copy.

    Entries are keyed by the weight tensor. A copy is valid while the weight's `_version` is the
    one it was made at: PyTorch bumps that counter on every in-place write (an optimizer step,
    `copy_`), and autograd uses it to notice a saved tensor changed under it. Writes through
    `w.data` or into storage from outside autograd (a collective filling a buffer) do not bump it;
    modules 07 and 08 hand out new views after each such write, and a new tensor is a miss. An
    entry goes when its weight is freed, so those temporary views leave nothing behind.
    Cost: up to 2 bytes per parameter.
    """

    def __init__(self, quantize):
        self.quantize = quantize
        self.entries: dict[int, CachedWeight] = {}  # id(weight) -> its copies

    def row_major(self, w: torch.Tensor) -> Quantized:
        return self.lookup(w).row_major

    def column_major(self, w: torch.Tensor) -> Quantized:
        entry = self.lookup(w)
        if entry.column_major is None:
            entry.column_major = column_major(entry.row_major)
        return entry.column_major

    def lookup(self, w: torch.Tensor) -> CachedWeight:
        entry = self.entries.get(id(w))
        # TODO(m09): serve the cached copy only while the weight is unchanged since it was made
        # Hint: w._version counts the in-place writes to w; the entry recorded it at quantization.
        raise NotImplementedError('TODO(m09): serve the cached copy only while the weight is unchanged since it was made')
        entry = CachedWeight(w._version, self.quantize(w, E4M3))
        # A weak reference does not keep w alive; its callback runs when w is freed, before its
        # id can be reused by another tensor.
        entry.dropper = weakref.ref(w, lambda _, key=id(w): self.entries.pop(key, None))
        self.entries[id(w)] = entry
        return entry


def abs_max_name(name: str) -> str:
    """Where FP8Matmul keeps the abs-max of the linear input saved under `name`."""
    return name + "_amax"


class FP8Matmul(Matmul):
    """The FP8 policy: linear inputs of at least `min_dim` tokens and features (both multiples of
    16) are multiplied in FP8; smaller ones stay in high precision (module 06's Matmul).

    An input goes through `prepare` once, however many linears read it (q, k and v; gate and up),
    and its e4m3 copy is what the store keeps for the weight gradient. Its abs-max is kept too
    (4 bytes): when module 10 drops the input and recomputes it, `prepare` finds that abs-max in
    the store instead of computing it again, so the recomputed FP8 values are the same bits.

    compile_quantize=True hands `quantize` to torch.compile, which fuses its float32 multiply,
    clamp and cast into one kernel; eager mode runs them as separate passes over memory. It needs
    a GPU toolchain (Triton) and costs a compile on first use (shapes are left dynamic, so one
    compile per FP8 format serves every size).

    Weights are quantized through an FP8WeightCache: once per optimizer step, not per matmul.
    """

    def __init__(self, min_dim: int = DEFAULT_MIN_DIM, compile_quantize: bool = False):
        self.min_dim = min_dim
        self.quantize = torch.compile(quantize, dynamic=True) if compile_quantize else quantize
        self.weights = FP8WeightCache(self.quantize)

    def uses_fp8(self, tokens: int, in_features: int) -> bool:
        return min(tokens, in_features) >= self.min_dim and tokens % 16 == 0 and in_features % 16 == 0

    def prepare(self, x: torch.Tensor, store, name: str):
        # TODO(m09): quantize a linear input once; keep it and its abs-max in the store
        # Hint: an input too small for FP8 goes to Matmul.prepare. x may be (B, T, features): ask
        #       uses_fp8(tokens, features) with tokens = x.numel() // x.shape[-1].
        # Hint: the abs-max lives in the store under abs_max_name(name). If it is already there (module
        #       10's recompute), reuse it, so the recomputed FP8 bits equal the forward's; else compute and
        #       save it.
        # Hint: the store keeps, under `name`, x quantized to e4m3 with that abs-max by self.quantize (which
        #       may be compiled); that is also what forward multiplies, so return it.
        raise NotImplementedError('TODO(m09): quantize a linear input once; keep it and its abs-max in the store')

    def fp8_input(self, x) -> Quantized | None:
        """The 2-D input x in e4m3, or None where this linear stays in high precision. Inputs the
        store keeps as they are (attention's o) are quantized here, in forward and again in backward."""
        if isinstance(x, Quantized):
            return x
        return self.quantize(x, E4M3) if self.uses_fp8(*x.shape) else None

    def forward(self, x, w: torch.Tensor) -> torch.Tensor:
        x_fp8 = self.fp8_input(x)
        if x_fp8 is None:
            return super().forward(x, w)
        # TODO(m09): y = x W^T from the e4m3 x and W, in w's dtype
        # Hint: self.weights.row_major(w) is W in e4m3, (out, in) row-major, so its .t() is W^T (in, out)
        #       column-major as it stands.
        # Hint: the forward output tolerates fast accumulation (fast_accum=True).
        raise NotImplementedError("TODO(m09): y = x W^T from the e4m3 x and W, in w's dtype")

    def backward(self, dy: torch.Tensor, x, w: torch.Tensor):
        x_fp8 = self.fp8_input(x)
        if x_fp8 is None:
            return super().backward(dy, x, w)
        # TODO(m09): dx = dy W and dW = dy^T x, with dy in e5m2
        # Hint: quantize dy to e5m2; W in e4m3, column-major, is self.weights.column_major(w).
        # Hint: dW sums over tokens, which neither dy nor x stores contiguously: both need a copy.
        # Hint: dx comes out in dy's dtype, dW in w's dtype (bf16 in, bf16 out).
        raise NotImplementedError('TODO(m09): dx = dy W and dW = dy^T x, with dy in e5m2')
