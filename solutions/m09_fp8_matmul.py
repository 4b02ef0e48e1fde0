"""Module 09, part 2 - FP8 linears: module 06's matmul policy with FP8 operands.

A linear layer computes y = x W^T (x: tokens x in_features, W: out_features x in_features) and
in backward two more matmuls of the same size:

    forward        y  = x  W^T      x: e4m3, W: e4m3
    input grad     dx = dy W        dy: e5m2, W: e4m3
    weight grad    dW = dy^T x      dy: e5m2, x: e4m3 (the one quantized in forward, kept in the store)

Each runs through `scaled_mm` (given, below): on CUDA torch._scaled_mm(a, b, scale_a=..., scale_b=...,
out_dtype=...), which multiplies FP8 matrices, applies both scales in its fp32 accumulator and
writes out_dtype (bf16 or fp32); on CPU the same product computed from the dequantized operands.
On an H100 it has layout rules (the CPU path has none, so we check them ourselves): a @ b wants a
row-major, b column-major, every dimension a multiple of 16, and not both operands e5m2 (the
chapter's "CUDA's layout rules").

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
# an H200 with torch 2.11 (notebooks/data/bench-09-gpu.json): the bare FP8 GEMM is 1.6-1.9x bf16
# from 4096 up, but forward + backward including this module's eager quantization (abs-max, scale,
# cast, transposed copies) is slower than bf16 at every shape below 16384^3 (0.77x at 8192^3,
# 0.70x at 8192 x 4096 x 14336) and 1.19x at 16384^3. Re-measure with
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
    # Given: the chapter's "CUDA's layout rules", one check each, on every device (the CPU path accepts
    # anything, so without it a CPU run would not catch what an H100 rejects). A layout is one stride:
    # row-major steps 1 along a row (dimension 1), column-major 1 down a column (dimension 0), whether
    # or not the tensor is contiguous (the forward's W^T is a column-major view, not a copy).
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"_scaled_mm multiplies 2-D matrices, got shapes {tuple(a.shape)} and {tuple(b.shape)}")
    (m, k), (k2, n) = a.shape, b.shape
    if k != k2:
        raise ValueError(f"inner dimensions differ: {m}x{k} @ {k2}x{n}")
    for name, t in (("a", a), ("b", b)):
        if t.dtype not in FP8_MAX:
            raise ValueError(f"{name} must be float8_e4m3fn or float8_e5m2, got {t.dtype}")
    if a.dtype == E5M2 and b.dtype == E5M2:
        raise ValueError("e5m2 @ e5m2 has no CUDA kernel: one operand must be e4m3")
    if m % 16 or k % 16 or n % 16:
        raise ValueError(f"every dimension must be a multiple of 16, got {m}x{k} @ {k}x{n}")
    if a.stride(1) != 1:
        raise ValueError(f"a must be row-major (stride (k, 1)), got strides {a.stride()}")
    if b.stride(0) != 1:
        raise ValueError(f"b must be column-major (stride (1, k)), got strides {b.stride()}")


def scaled_mm(a: Quantized, b: Quantized, out_dtype: torch.dtype, fast_accum: bool = False) -> torch.Tensor:
    """(a.data * a.scale) @ (b.data * b.scale), accumulated in fp32, returned as out_dtype.

    fast_accum lets an H100 accumulate in its faster, less precise FP8 mode: fine for the forward
    output, not for gradients (the usual choice).

    On CUDA this is torch._scaled_mm. On CPU we compute the same thing ourselves, dequantizing first
    and multiplying in float32: torch's CPU _scaled_mm picks its kernel by the CPU's instruction set
    (on AVX-512 FP16 / AMX machines oneDNN's FP8 path, hundreds of times slower and rounded
    differently), so results and speed would depend on the machine. This form is bit for bit what
    torch's emulated CPU kernel returns for float32 and bf16 outputs.
    """
    check_scaled_mm_operands(a.data, b.data)
    if a.data.is_cuda:
        return torch._scaled_mm(a.data, b.data, scale_a=a.scale, scale_b=b.scale,
                                out_dtype=out_dtype, use_fast_accum=fast_accum)
    return ((a.data.float() * a.scale) @ (b.data.float() * b.scale)).to(out_dtype)


@dataclass
class CachedWeight:
    version: int               # the weight's version counter when it was quantized
    row_major: Quantized       # W in e4m3, stored as W is: (out, in), row by row
    column_major: Quantized | None = None  # the same values stored column by column, made on first use
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
        if entry is not None and entry.version == w._version:  # unchanged since it was quantized
            return entry
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
    (4 bytes): module 10 drops the input and recomputes it, and the recomputed input's FP8 values
    must be the forward's bits.

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
        # >>> TODO(m09): quantize a linear input once, and keep it and its abs-max in the store
        # Contract: x is a linear input (any leading shape, features last); name is where the store keeps it ('n1',
        #   'n2', 's'). An input uses_fp8 rejects (its tokens are all its leading dimensions together) goes to module
        #   06's prepare unchanged. Otherwise the linears multiply what prepare returns, x went through self.quantize
        #   (which may be the compiled one) exactly once, and afterwards store[name] is that very Quantized in e4m3 and
        #   store[abs_max_name(name)] the abs-max it was scaled by (the test counts 1 byte a value, the scale and the
        #   abs-max). Module 10 drops the input and prepares its recomputation into the same store: prepared again, it
        #   must give the forward's FP8 bits, even where the recomputed values differ from the forward's by a rounding.
        # Question: besides x's values, what decides its FP8 bits, and where must prepare take it from so that a
        #   second preparation repeats the first?
        # Pitfalls: what does the store count if it keeps x itself? Is a recomputed input the forward's bit for bit,
        #   and if its largest value moved by one rounding, what would its bytes be scaled by?
        # Hint 1: the chapter's "Abs-maxes computed earlier" works a delayed scale: which abs-max does it hand to
        #         quantize, and why? Which abs-max does a recomputation have that the first forward had not?
        # Hint 2: tokens = numel / features; below the threshold, module 06's prepare. amax = the store's, if it has
        #         one, else max |x|; keep it; x_fp8 = quantize(x, e4m3, amax); keep x_fp8 under name; return it.
        # Hint 3: if not self.uses_fp8(x.numel() // x.shape[-1], x.shape[-1]): return super().prepare(x, store, name)
        #         key = abs_max_name(name);  amax = store[key] if key in store else abs_max(x)
        #         store.save(key, amax);  x_fp8 = self.quantize(x, E4M3, amax)
        #         store.save(name, x_fp8);  return x_fp8
        if not self.uses_fp8(x.numel() // x.shape[-1], x.shape[-1]):
            return super().prepare(x, store, name)
        amax_name = abs_max_name(name)
        amax = store[amax_name] if amax_name in store else abs_max(x)
        store.save(amax_name, amax)
        x_fp8 = self.quantize(x, E4M3, amax)
        store.save(name, x_fp8)
        return x_fp8
        # <<<

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
        # >>> TODO(m09): the forward product from FP8 operands, in the weight's dtype
        # Contract: x_fp8 is the input in e4m3 (tokens, in), w the weight (out, in) in high precision. Return y = x W^T
        #   (tokens, out) in w's dtype, computed by scaled_mm from e4m3 operands that meet CUDA's layout rules. W's e4m3
        #   copy comes from self.weights (the weight cache, row_major(w): W as stored, (out, in), quantized once per
        #   optimizer step), never from quantizing w here (a test counts the quantizations and checks which bytes
        #   scaled_mm multiplies). The forward output uses the H100's fast accumulation (scaled_mm's fast_accum; the
        #   gradients do not).
        # Question: which layout does each operand already have, and which of them needs a copy, if any?
        # Pitfalls: is a transposed view of a row-major matrix row-major or column-major? Would a result equal to the
        #   fp32 one mean FP8 was used (the test bounds the error against float64 from e4m3's rounding)?
        # Hint 1: the chapter's "Strides" and its worked s = q k^T: where is W^T, as a view of the cached copy?
        # Hint 2: y = x W^T with x row-major and W^T = (the cached row-major W)^T, column-major as a view: no copy;
        #         fast accumulation on, out in w's dtype.
        # Hint 3: return scaled_mm(row_major(x_fp8), self.weights.row_major(w).t(), out_dtype=w.dtype,
        #                          fast_accum=True)
        return scaled_mm(row_major(x_fp8), self.weights.row_major(w).t(), out_dtype=w.dtype, fast_accum=True)
        # <<<

    def backward(self, dy: torch.Tensor, x, w: torch.Tensor):
        x_fp8 = self.fp8_input(x)
        if x_fp8 is None:
            return super().backward(dy, x, w)
        # >>> TODO(m09): the input and weight gradients from FP8 operands: dy e5m2, W and x e4m3
        # Contract: dy is (tokens, out) in high precision, x_fp8 the kept e4m3 input (tokens, in), w the weight (out,
        #   in). Return (dx, dw): dx (tokens, in) in dy's dtype and dw (out, in) in w's dtype, module 06's two gradient
        #   products, each by scaled_mm from operands that meet CUDA's layout rules, in the formats of the module
        #   docstring's table (never two e5m2 operands). dy goes through self.quantize once for both products; W's
        #   copies come from self.weights (a test checks which bytes scaled_mm multiplies); gradients accumulate
        #   without fast accumulation. The tests bound both errors against float64 for e5m2 x e4m3, plant an outlier
        #   2^20 times the rest in dy, and check bf16 in gives bf16 out.
        # Question: for each product, which operand is already in the layout its side needs, and which needs a copy?
        # Pitfalls: in e4m3, what becomes of gradient entries 2^20 times smaller than the largest? Which dimension
        #   does dw sum over, and does either operand store it contiguously where the rules want it?
        # Hint 1: the chapter's "Strides" and its worked p v: for dx = dy W and dW = dy^T x, which operand is a or b,
        #         and where is each one's step 1?
        # Hint 2: dy_e5m2 = quantize(dy, e5m2) once; dx = dy_e5m2 (row-major) · W (the cache's column-major copy);
        #         dW = dy_e5m2^T (a row-major copy) · x_fp8 (a column-major copy); out dtypes dy's and w's.
        # Hint 3: dy_fp8 = self.quantize(dy, E5M2)
        #         dx = scaled_mm(row_major(dy_fp8), self.weights.column_major(w), out_dtype=dy.dtype)
        #         dw = scaled_mm(row_major(dy_fp8.t()), column_major(x_fp8), out_dtype=w.dtype);  return dx, dw
        dy_fp8 = self.quantize(dy, E5M2)
        dx = scaled_mm(row_major(dy_fp8), self.weights.column_major(w), out_dtype=dy.dtype)
        dw = scaled_mm(row_major(dy_fp8.t()), column_major(x_fp8), out_dtype=w.dtype)
        return dx, dw
        # <<<
