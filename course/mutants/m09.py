"""Module 09's planted bugs (FP8 matmuls): see course/mutants/__init__.py."""
from course.mutants import Plant

SCALING, MATMUL = "m09_fp8_scaling.py", "m09_fp8_matmul.py"
PLANTS = [
    Plant(SCALING, "return Quantized(data, to_fp8.reciprocal())", "return Quantized(data, to_fp8)",
          "the quantizing scale stored where the dequantizing one belongs (FP8_MAX/amax, not amax/FP8_MAX)"),
    Plant(SCALING, "data = (t.float() * to_fp8).clamp(-FP8_MAX[dtype], FP8_MAX[dtype]).to(dtype)",
          "data = (t.float() * to_fp8).to(dtype)",
          "no saturation: with a kept (older) abs-max a larger value overflows e4m3 to NaN instead of its maximum"),
    Plant(SCALING, "amax = amax.float().clamp(min=AMAX_FLOOR)", "amax = amax.float()",
          "no floor on the abs-max: an all-zero tensor gets an infinite scale and quantizes to NaN"),
    Plant(SCALING, "to_fp8 = amax.new_tensor(FP8_MAX[dtype]) / amax", "to_fp8 = FP8_MAX[dtype] / amax",
          "a float divided by a tensor: computed as FP8_MAX * (1/amax), two roundings, not the reference's one"),
    Plant(MATMUL, "dy_fp8 = self.quantize(dy, E5M2)", "dy_fp8 = self.quantize(dy, E4M3)",
          "gradients quantized to e4m3: they need e5m2's range more than e4m3's precision"),
    Plant(MATMUL, "out_dtype=w.dtype, fast_accum=True)", "out_dtype=w.dtype)",
          "the forward without fast accumulation: the contract uses it for the forward product (what the bench times)"),
    Plant(MATMUL, "dx = scaled_mm(row_major(dy_fp8), self.weights.column_major(w), out_dtype=dy.dtype)",
          "dx = scaled_mm(row_major(dy_fp8), self.weights.column_major(w), out_dtype=dy.dtype, fast_accum=True)",
          "fast accumulation in the backward: gradients lose the precision the forward can spare"),
    Plant(MATMUL, "amax = store[amax_name] if amax_name in store else abs_max(x)", "amax = abs_max(x)",
          "the abs-max found again on a recompute, not the kept one: the recomputed FP8 input may differ"),
    Plant(MATMUL, "if entry is not None and entry.version == w._version:", "if entry is not None:",
          "the FP8 copy of a weight served after the optimizer changed it: a stale weight in every later step"),
    Plant(MATMUL, "    if b.stride(0) != 1:\n", "    if b.stride(1) != 1:\n",
          "b checked for row-major: _scaled_mm wants b column-major, the other of the two layouts"),
    Plant(MATMUL, "if m % 16 or k % 16 or n % 16:", "if m % 16 or n % 16:",
          "the inner dimension not checked for a multiple of 16: CUDA rejects it, the check lets it pass"),
    Plant(MATMUL, "if a.dtype == E5M2 and b.dtype == E5M2:", "if a.dtype == E5M2 or b.dtype == E5M2:",
          "e5m2 refused in either operand: dy (e5m2) @ W (e4m3) is exactly what the backward needs"),
]
