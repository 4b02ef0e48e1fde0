"""Module 09 benchmark: FP8 linears against bf16 ones, forward + backward, alone and in the Llama.

    python main.py bench 09 --device cuda   timings on a GPU (H100-class: FP8 tensor cores)
    python main.py bench 09                 CPU: correctness only (errors vs float64), no timings

Table 1, on a GPU, for each (tokens, in_features, out_features), one linear as the Llama block
runs it (prepare, forward, backward):
  bf16 ms            module 06's Matmul in bf16, forward + backward (dx and dW)
  fp8 ms             FP8Matmul(min_dim=0), quantization included (eager: several passes), with an
                     optimizer step between calls: W is quantized again every time
  fp8+compile ms     the same with `quantize` fused by torch.compile (one kernel per pass)
  W cached ms        fp8+compile (fp8 with --no-compile) with W unchanged between calls, so its
                     FP8 copies are reused: the limit of gradient accumulation over many
                     microbatches per optimizer step
  quantize ms        quantizing x, W (e4m3) and dy (e5m2) alone, eager and compiled
  gemm speedup       one bare GEMM, bf16 time / FP8 time (operands already quantized)
  fp8 selected       whether FP8Matmul() with its default min_dim would use FP8 for this shape
The rule to check: where `fp8 selected` is yes, fp8 must not be more than 5% slower than bf16.
The GPU table is saved as results/bench-09-gpu.json; copy it to notebooks/data/ for the notebook.

Table 1b, on a GPU: where the time of one FP8 forward + backward goes, at the Llama MLP shape
8192 x 4096 -> 14336, one row per pass the policy makes. Passes over memory are measured against
the time a plain copy of the same number of bytes takes (the GPU's achievable bandwidth), so a
row far above its `at copy speed` time is a slow kernel, not a necessary cost.

Table 2: one training step (forward_backward) of module 06's Llama with each policy, from the
same weights and tokens. On a GPU at a size where the linears dominate (dim 4096, ffn 14336,
2 layers, 4 x 2048 tokens, bf16; FP8 forced with min_dim=0); on a CPU a tiny fp32 model, for the
losses only.
"""
from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

from course.bench import report, require_positive
from course.impl import load

GPU_SHAPES = [  # (tokens, in_features, out_features)
    (1024, 1024, 1024), (2048, 2048, 2048), (4096, 4096, 4096), (8192, 8192, 8192), (16384, 16384, 16384),
    (1024, 4096, 14336), (4096, 4096, 14336), (8192, 4096, 14336), (8192, 14336, 4096), (16384, 4096, 14336),
]
CPU_SHAPES = [(64, 128, 96), (256, 512, 1024), (1024, 1024, 512)]
GPU_LLAMA = dict(dim=4096, n_heads=32, n_kv_heads=8, head_dim=128, ffn_dim=14336, n_layers=2, max_seq_len=2048)
GPU_BATCH = 4  # x 2048 = 8192 tokens
CPU_BATCH = 4  # x 64 tokens, the default tiny LlamaConfig


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="main.py bench 09", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu (correctness only) or cuda")
    parser.add_argument("--reps", type=int, default=10, help="timed repetitions per measurement (GPU)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile variants (GPU)")
    args = parser.parse_args(argv)
    require_positive(parser, args, "reps")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda, but torch sees no CUDA device")
    if args.device.startswith("cuda"):
        gpu_timings(args)
        overhead_breakdown(args)
    else:
        cpu_errors()
    llama_steps(args)


def linear_step(policy, x, w, dy, optimizer_step=False):
    """y, (dx, dW) of one linear through a matmul policy, the way the Llama block calls it.

    optimizer_step=True first marks w as written in place, as an optimizer step does, so the
    FP8 policy cannot reuse the copy of w it quantized on the previous call."""
    if optimizer_step:
        torch.autograd.graph.increment_version(w)
    store = load("m06_llama_block").ActivationStore()
    y = policy.forward(policy.prepare(x, store, "x"), w)
    return y, policy.backward(dy, store["x"], w)


# --- CPU: correctness at small sizes ---------------------------------------------------------

def cpu_errors():
    matmul = load("m09_fp8_matmul")
    rows = []
    for tokens, d_in, d_out in CPU_SHAPES:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(tokens, d_in, generator=g)
        w = torch.randn(d_out, d_in, generator=g) / d_in ** 0.5
        dy = torch.randn(tokens, d_out, generator=g)
        y, (dx, dw) = linear_step(matmul.FP8Matmul(min_dim=0), x, w, dy)
        x64, w64, dy64 = x.double(), w.double(), dy.double()
        bf16_y = x.bfloat16() @ w.bfloat16().T
        e4m3, e5m2, bf16 = torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16
        rows.append({"tokens": tokens, "in": d_in, "out": d_out,
                     "y rel err": relative_error(y, x64 @ w64.T), "y theory": rounding_noise(e4m3, e4m3),
                     "dx rel err": relative_error(dx, dy64 @ w64), "dx theory": rounding_noise(e5m2, e4m3),
                     "dW rel err": relative_error(dw, dy64.T @ x64), "dW theory": rounding_noise(e5m2, e4m3),
                     "bf16 y rel err": relative_error(bf16_y, x64 @ w64.T),
                     "bf16 theory": rounding_noise(bf16, bf16, bf16)})
    report("bench-09-cpu", "FP8 linear vs float64 (CPU: correctness only, no timings)", rows, "cpu",
           notes="rel err = ||result - float64|| / ||float64|| (Frobenius). theory = the root-sum-square of\n"
                 "rounding_noise over the roundings: y rounds two e4m3 operands; dx and dW one e5m2 and one e4m3\n"
                 "(fp32 outputs, accumulation error negligible); bf16 rounds both operands and its output.")


def rounding_noise(*dtypes: torch.dtype) -> float:
    """Expected relative (Frobenius) error of a matmul whose operands, and maybe output, are rounded
    to `dtypes`: each rounding adds independent noise, so their RMS relative errors add in squares.

    One rounding to a format with significand spacing eps (torch.finfo(dtype).eps) errs uniformly
    within +-eps/2 on a significand m in [1, 2); for m spread log-uniformly (random data, abs-max
    scaled so nothing saturates or underflows much), E[1/m^2] = 3 / (8 ln 2), so the RMS relative
    error is eps * sqrt(E[1/m^2] / 12) = 0.21 eps. A matmul of random matrices keeps that relative size."""
    per_rounding = [torch.finfo(dtype).eps * math.sqrt(3 / (8 * math.log(2)) / 12) for dtype in dtypes]
    return math.sqrt(sum(e * e for e in per_rounding))


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.double() - expected).norm() / expected.norm()).item()


# --- GPU: timings ----------------------------------------------------------------------------

def gpu_timings(args):
    scaling, matmul, ops = load("m09_fp8_scaling"), load("m09_fp8_matmul"), load("m06_llama_ops")
    device = torch.device(args.device)
    default_policy = matmul.FP8Matmul()
    variants = {"fp8": matmul.FP8Matmul(min_dim=0)}
    if not args.no_compile:
        variants["fp8+compile"] = matmul.FP8Matmul(min_dim=0, compile_quantize=True)
    rows = []
    for tokens, d_in, d_out in GPU_SHAPES:
        x = torch.randn(tokens, d_in, device=device, dtype=torch.bfloat16)
        w = (torch.randn(d_out, d_in, device=device) / d_in ** 0.5).bfloat16()
        dy = torch.randn(tokens, d_out, device=device, dtype=torch.bfloat16)
        row = {"tokens": tokens, "in": d_in, "out": d_out}
        bf16 = gpu_ms(lambda: linear_step(ops.Matmul(), x, w, dy), args.reps)
        row["bf16 ms"] = bf16
        for name, policy in variants.items():
            fp8 = gpu_ms(lambda: linear_step(policy, x, w, dy, optimizer_step=True), args.reps)
            row[f"{name} ms"] = fp8
            row[f"{name} speedup"] = bf16 / fp8
        best = variants.get("fp8+compile", variants["fp8"])
        cached = gpu_ms(lambda: linear_step(best, x, w, dy), args.reps)
        row["W cached ms"], row["W cached speedup"] = cached, bf16 / cached
        for name, policy in variants.items():
            row[f"quantize ms ({name})"] = gpu_ms(
                lambda: (policy.quantize(x, scaling.E4M3), policy.quantize(w, scaling.E4M3),
                         policy.quantize(dy, scaling.E5M2)), args.reps)
        x8, w8 = scaling.quantize(x, scaling.E4M3), scaling.quantize(w, scaling.E4M3)
        gemm_bf16 = gpu_ms(lambda: torch.mm(x, w.t()), args.reps)
        gemm_fp8 = gpu_ms(lambda: matmul.scaled_mm(x8, w8.t(), torch.bfloat16, fast_accum=True), args.reps)
        row["gemm speedup"] = gemm_bf16 / gemm_fp8
        row["fp8 selected"] = "yes" if default_policy.uses_fp8(tokens, d_in) else "no"
        rows.append(row)
        del x, w, dy, x8, w8
        torch.cuda.empty_cache()
    report("bench-09-gpu", "FP8 linear vs bf16 linear, forward + backward (median ms)", rows, args.device,
           notes=f"speedup = bf16 ms / fp8 ms; fp8 and fp8+compile quantize W on every call (one optimizer "
                 f"step per forward+backward), W cached reuses it (many microbatches per step). "
                 f"FP8Matmul() selects FP8 when tokens and in_features are at least "
                 f"{default_policy.min_dim} (DEFAULT_MIN_DIM). Copy results/bench-09-gpu.json to "
                 f"notebooks/data/ for the notebook.")


BREAKDOWN_SHAPE = (8192, 4096, 14336)  # tokens, in_features, out_features: the target shape


def overhead_breakdown(args):
    scaling, matmul = load("m09_fp8_scaling"), load("m09_fp8_matmul")
    E4M3, E5M2 = scaling.E4M3, scaling.E5M2
    device = torch.device(args.device)
    tokens, d_in, d_out = BREAKDOWN_SHAPE
    x = torch.randn(tokens, d_in, device=device, dtype=torch.bfloat16)
    w = (torch.randn(d_out, d_in, device=device) / d_in ** 0.5).bfloat16()
    dy = torch.randn(tokens, d_out, device=device, dtype=torch.bfloat16)
    amax = {name: scaling.abs_max(t) for name, t in (("x", x), ("w", w), ("dy", dy))}
    x8, w8, dy8 = (scaling.quantize(x, E4M3, amax["x"]), scaling.quantize(w, E4M3, amax["w"]),
                   scaling.quantize(dy, E5M2, amax["dy"]))
    w8_col, dy8_t, x8_col = matmul.column_major(w8), matmul.row_major(dy8.t()), matmul.column_major(x8)
    compiled = None if args.no_compile else torch.compile(scaling.quantize, dynamic=True)
    copy_bytes_per_ms = copy_bandwidth(device, args.reps)
    bf16, fp8 = 2, 1  # bytes per value
    passes = [  # (pass, eager fn, compiled fn or None, bytes read + written)
        ("abs_max(x)", lambda: scaling.abs_max(x), None, x.numel() * bf16),
        ("quantize x -> e4m3", lambda: scaling.quantize(x, E4M3, amax["x"]),
         compiled and (lambda: compiled(x, E4M3, amax["x"])), x.numel() * (bf16 + fp8)),
        ("abs_max(W)", lambda: scaling.abs_max(w), None, w.numel() * bf16),
        ("quantize W -> e4m3", lambda: scaling.quantize(w, E4M3, amax["w"]),
         compiled and (lambda: compiled(w, E4M3, amax["w"])), w.numel() * (bf16 + fp8)),
        ("W e4m3 column-major copy", lambda: matmul.column_major(w8), None, w.numel() * 2 * fp8),
        ("abs_max(dy)", lambda: scaling.abs_max(dy), None, dy.numel() * bf16),
        ("quantize dy -> e5m2", lambda: scaling.quantize(dy, E5M2, amax["dy"]),
         compiled and (lambda: compiled(dy, E5M2, amax["dy"])), dy.numel() * (bf16 + fp8)),
        ("dy^T e5m2 row-major copy", lambda: matmul.row_major(dy8.t()), None, dy.numel() * 2 * fp8),
        ("x e4m3 column-major copy", lambda: matmul.column_major(x8), None, x.numel() * 2 * fp8),
    ]
    rows = []
    for name, eager, fused, nbytes in passes:
        row = {"pass": name, "MB moved": nbytes / 1e6, "at copy speed ms": nbytes / copy_bytes_per_ms,
               "eager ms": gpu_ms(eager, args.reps)}
        row["compiled ms"] = gpu_ms(fused, args.reps) if fused else "-"
        rows.append(row)
    gemms = [("GEMM y = x W^T (fast accum)", lambda: matmul.scaled_mm(x8, w8.t(), torch.bfloat16, fast_accum=True),
              lambda: torch.mm(x, w.t())),
             ("GEMM dx = dy W", lambda: matmul.scaled_mm(dy8, w8_col, torch.bfloat16), lambda: torch.mm(dy, w)),
             ("GEMM dW = dy^T x", lambda: matmul.scaled_mm(dy8_t, x8_col, torch.bfloat16), lambda: torch.mm(dy.t(), x))]
    for name, fp8_gemm, bf16_gemm in gemms:
        rows.append({"pass": name, "MB moved": "-", "at copy speed ms": "-", "eager ms": gpu_ms(fp8_gemm, args.reps),
                     "compiled ms": "-", "bf16 ms": gpu_ms(bf16_gemm, args.reps)})
    for row in rows:
        row.setdefault("bf16 ms", "-")
    report("bench-09-gpu-breakdown", f"Where one FP8 linear's forward + backward goes, {tokens} x {d_in} -> {d_out} "
           f"(median ms per pass)", rows, args.device,
           notes=f"at copy speed = MB moved / the bandwidth of a plain 1 GiB copy "
                 f"({copy_bytes_per_ms / 1e6:.0f} GB/s here). The policy runs each pass once per forward + backward "
                 f"(W's only when the optimizer changed W); bf16 ms: the same GEMM in bf16, for comparison.")


def copy_bandwidth(device, reps: int) -> float:
    """Bytes per millisecond a pass over memory can reach: a plain copy of 1 GiB (read + write)."""
    big = torch.empty(2 ** 30, dtype=torch.uint8, device=device)
    return 2 * big.numel() / gpu_ms(lambda: torch.empty_like(big).copy_(big), reps)


# --- the Llama, one training step with each policy ----------------------------------------------

def llama_steps(args):
    block_module, model_module = load("m06_llama_block"), load("m06_llama_model")
    ops, matmul = load("m06_llama_ops"), load("m09_fp8_matmul")
    on_gpu = args.device.startswith("cuda")
    cfg = block_module.LlamaConfig(**GPU_LLAMA) if on_gpu else block_module.LlamaConfig()
    dtype, batch = (torch.bfloat16, GPU_BATCH) if on_gpu else (torch.float32, CPU_BATCH)
    high = "bf16" if on_gpu else "fp32"
    g = torch.Generator().manual_seed(0)
    tokens, targets = (torch.randint(0, cfg.vocab_size, (batch, cfg.max_seq_len), generator=g).to(args.device)
                       for _ in range(2))
    rows, baseline = [], None
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    for name, policy in ((high, ops.Matmul()), ("fp8", matmul.FP8Matmul(min_dim=0))):
        block = block_module.LlamaBlock(cfg, matmul=policy)
        model = model_module.LlamaModel(cfg, seed=0, dtype=dtype, block=block).to(args.device)
        row = {"policy": name, "loss": model.forward_backward(tokens, targets)[0].item()}
        if on_gpu:  # an optimizer step between steps: the FP8 policy quantizes the weights every time
            row["step ms"] = gpu_ms(lambda: optimizer_step(model) or model.forward_backward(tokens, targets),
                                    args.reps)
            baseline = baseline or row["step ms"]
            row["speedup"] = baseline / row["step ms"]
            row["peak GiB"] = torch.cuda.max_memory_allocated() / 2 ** 30
            del model
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        rows.append(row)
    size = (f"dim {cfg.dim}, ffn {cfg.ffn_dim}, {cfg.n_layers} layers, {batch} x {cfg.max_seq_len} tokens, "
            f"{str(dtype).removeprefix('torch.')}")
    report(f"bench-09-llama-{'gpu' if on_gpu else 'cpu'}",
           f"Llama training step (forward_backward), {high} vs FP8 linears ({size})", rows, args.device,
           notes="FP8 forced on all seven linears of every block (min_dim=0); embedding and LM head stay "
                 "high precision. Same weights and tokens: the losses differ only by FP8 rounding."
                 + ("" if on_gpu else " CPU: no timings (FP8 matmuls on a CPU are emulated)."))


def optimizer_step(model) -> None:
    """Mark every weight as written in place, as an optimizer step would (without changing it)."""
    for t in model.parameters():
        torch.autograd.graph.increment_version(t)


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
