"""Module 09 benchmark: the FP8 linear against a bf16 linear, forward + backward.

    python main.py bench 09 --device cuda   timings on a GPU (H100-class: FP8 tensor cores)
    python main.py bench 09                 CPU: correctness only (errors vs float64), no timings

On a GPU, for each (tokens, in_features, out_features):
  bf16 ms            F.linear in bf16, forward + backward (dx and dW)
  fp8 ms             fp8_linear, forward + backward, quantization included (eager: several passes)
  fp8+compile ms     the same with `quantize` fused by torch.compile (one kernel per pass)
  quantize ms        quantizing x, W (e4m3) and dy (e5m2) alone, eager and compiled
  gemm speedup       one bare GEMM, bf16 time / FP8 time (operands already quantized)
  fp8 selected       whether FP8Matmul() with its default min_dim would use FP8 for this shape
The rule to check: where `fp8 selected` is yes, fp8 must not be more than 5% slower than bf16.
The GPU table is saved as results/bench-09-gpu.json; copy it to notebooks/data/ for the notebook.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from course.bench import report
from course.impl import load

GPU_SHAPES = [  # (tokens, in_features, out_features)
    (1024, 1024, 1024), (2048, 2048, 2048), (4096, 4096, 4096), (8192, 8192, 8192), (16384, 16384, 16384),
    (1024, 4096, 14336), (4096, 4096, 14336), (8192, 4096, 14336), (8192, 14336, 4096), (16384, 4096, 14336),
]
CPU_SHAPES = [(64, 128, 96), (256, 512, 1024), (1024, 1024, 512)]


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="main.py bench 09", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu (correctness only) or cuda")
    parser.add_argument("--reps", type=int, default=10, help="timed repetitions per measurement (GPU)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile variants (GPU)")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda"):
        gpu_timings(args)
    else:
        cpu_errors()


# --- CPU: correctness at small sizes ---------------------------------------------------------

def cpu_errors():
    matmul = load("m09_fp8_matmul")
    rows = []
    for tokens, d_in, d_out in CPU_SHAPES:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(tokens, d_in, generator=g, requires_grad=True)
        w = (torch.randn(d_out, d_in, generator=g) / d_in ** 0.5).requires_grad_()
        dy = torch.randn(tokens, d_out, generator=g)
        y = matmul.fp8_linear(x, w)
        y.backward(dy)
        x64, w64, dy64 = x.detach().double(), w.detach().double(), dy.double()
        bf16_y = F.linear(x.detach().bfloat16(), w.detach().bfloat16())
        rows.append({"tokens": tokens, "in": d_in, "out": d_out,
                     "y rel err": relative_error(y, x64 @ w64.T),
                     "dx rel err": relative_error(x.grad, dy64 @ w64),
                     "dW rel err": relative_error(w.grad, dy64.T @ x64),
                     "bf16 y rel err": relative_error(bf16_y, x64 @ w64.T)})
    report("bench-09-cpu", "FP8 linear vs float64 (CPU: correctness only, no timings)", rows, "cpu",
           notes="rel err = ||result - float64|| / ||float64|| (Frobenius). y uses two e4m3 operands; dx "
                 "and dW one e5m2 and one e4m3, hence larger errors. bf16 (8 mantissa bits) for comparison.")


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.double() - expected).norm() / expected.norm()).item()


# --- GPU: timings ----------------------------------------------------------------------------

def gpu_timings(args):
    scaling, matmul = load("m09_fp8_scaling"), load("m09_fp8_matmul")
    device = torch.device(args.device)
    default_policy = matmul.FP8Matmul()
    variants = {"fp8": scaling.quantize}
    if not args.no_compile:
        variants["fp8+compile"] = torch.compile(scaling.quantize, dynamic=True)
    rows = []
    for tokens, d_in, d_out in GPU_SHAPES:
        x = torch.randn(tokens, d_in, device=device, dtype=torch.bfloat16, requires_grad=True)
        w = (torch.randn(d_out, d_in, device=device) / d_in ** 0.5).bfloat16().requires_grad_()
        dy = torch.randn(tokens, d_out, device=device, dtype=torch.bfloat16)

        def forward_backward(linear):
            return lambda: torch.autograd.grad(linear(x, w), (x, w), dy)

        row = {"tokens": tokens, "in": d_in, "out": d_out}
        bf16 = gpu_ms(forward_backward(F.linear), args.reps)
        row["bf16 ms"] = bf16
        for name, quantize_fn in variants.items():
            fp8 = gpu_ms(forward_backward(lambda a, b: matmul.fp8_linear(a, b, quantize_fn=quantize_fn)), args.reps)
            row[f"{name} ms"] = fp8
            row[f"{name} speedup"] = bf16 / fp8
        xd, wd = x.detach(), w.detach()
        for name, quantize_fn in variants.items():
            row[f"quantize ms ({name})"] = gpu_ms(
                lambda: (quantize_fn(xd, scaling.E4M3), quantize_fn(wd, scaling.E4M3), quantize_fn(dy, scaling.E5M2)),
                args.reps)
        x8, w8 = scaling.quantize(xd, scaling.E4M3), scaling.quantize(wd, scaling.E4M3)
        gemm_bf16 = gpu_ms(lambda: torch.mm(xd, wd.t()), args.reps)
        gemm_fp8 = gpu_ms(lambda: matmul.scaled_mm(x8, w8.t(), torch.bfloat16, fast_accum=True), args.reps)
        row["gemm speedup"] = gemm_bf16 / gemm_fp8
        row["fp8 selected"] = "yes" if default_policy.uses_fp8(tokens, d_in, d_out) else "no"
        rows.append(row)
        del x, w, dy, xd, wd, x8, w8
        torch.cuda.empty_cache()
    report("bench-09-gpu", "FP8 linear vs bf16 linear, forward + backward (median ms)", rows, args.device,
           notes=f"speedup = bf16 ms / fp8 ms; FP8Matmul() selects FP8 when every dimension is at least "
                 f"{default_policy.min_dim} (DEFAULT_MIN_DIM). Copy results/bench-09-gpu.json to "
                 f"notebooks/data/ for the notebook.")


def gpu_ms(fn, reps: int, warmup: int = 3) -> float:
    """Median wall time of fn() in milliseconds, synchronizing around each call."""
    for _ in range(warmup):  # also triggers any torch.compile
        fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)
