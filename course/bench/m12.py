"""Module 12 benchmark: tensor and sequence parallelism on CPU ranks, against the formulas and DTensor.

    python main.py bench 12                        # the three tables below, on CPU (a few minutes on 2 cores)
    python main.py bench 12 --only traffic         # one table: traffic, overlap or accumulation
    python main.py bench 12 --only accumulation --device cuda    # + fused vs unfused GEMM timing (.ci/gpu)

1. Traffic, memory, speed: module 12's model (m12_tp_model.CONFIG, float32) trained for --steps steps
   (after one untimed step) on t in {1, 2, 4} ranks, sequence parallelism off and on:
     calls/step     collectives one rank issues per step (logged by course/collectives.py), then the
                    formula (m12_tp_costs.tp_traffic, a course/costs.py StepCost): must be equal
     sent B/step    bytes one rank sends per step (ring algorithm; measured_cost of the log), then the
                    formula: must be equal
     kept B/rank    bytes the blocks' stores hold after the forward of one step, then the formula
                    (m12_tp_costs.tp_activation_bytes): must be equal
     step ms        median step time, ours and DTensor's (parallelize_module on the nn.Module Llama,
                    course/reference_tp.py, with the same plan), and their ratio
2. Overlap, on an emulated device (course/emulated.py's EmulatedGemms): one column-parallel backward
   (gate and up of an FFN) whose GEMMs take the time a device of --gflops GFLOP/s would need (a sleep;
   no arithmetic is done) while the collectives are real gloo ones. The input gradient's collective is timed alone (started and waited
   at once), then as the backward overlaps it (the time left to wait after the weight-gradient GEMMs).
   hidden = 1 - exposed / alone; "full overlap" = min(1, weight-gradient GEMM time / alone).
3. Fused weight-gradient accumulation: the error against float64 of m microbatches of bf16 gradients
   summed three ways: a bf16 accumulator (each microbatch's gradient in bf16, added in bf16), bf16
   partials added into a float32 main_grad (unfused), and float32 accumulation inside the GEMM (fused).
   On CUDA, also the time of a fused and an unfused accumulation at GPU size.
The measured code is the selected implementation (steps/, or solutions/ with --impl solutions); the
formulas, the DTensor model and the reference weights come from the reference.
"""
from __future__ import annotations

import dataclasses
import statistics
import time

import torch
import torch.distributed as dist

from course.bench import bench_parser, chosen_parts, report, require_positive, start
from course.collectives import Collectives
from course.costs import measured_activations, measured_cost
from course.dataset import load_text, random_batch
from course.emulated import EmulatedGemms
from course.impl import load, reference
from course.launch import run_ranks
from course.mesh import world_group
from course.splits import check_splits
from course.timing import StepTimer

PARTS = ("traffic", "overlap", "accumulation")


# --- 1. traffic, memory and step time --------------------------------------------------------

def _train_ours(cfg, sequence_parallel, steps, batch):
    tp = world_group("t")  # every rank of the job: one tensor-parallel group
    model = load("m12_tp_model").TPLlama(cfg, tp, sequence_parallel=sequence_parallel)  # the code measured
    first = random_batch(load_text(), batch, cfg.max_seq_len, torch.Generator().manual_seed(0))  # fit's first
    kept = measured_activations(model, *first)  # train_step zeroes the gradients it leaves
    tp.collectives.log.clear()
    timer = StepTimer(tp.collectives.log)
    reference("m06_llama_model").fit(model, steps + 1, batch, on_step=timer)  # module 06's loop; a warm-up first
    return {"times": timer.times[1:], "loss": timer.losses[-1], "kept": kept,
            "cost": measured_cost(tp.collectives.log[:timer.calls[0]])}  # every step issues the same


class DTensorModel:
    """DTensor's tensor parallelism on the nn.Module reference, as module 06's fit drives a model."""

    def __init__(self, cfg, sequence_parallel):
        from course.reference_tp import dtensor_llama
        self.cfg = cfg
        self.llama = dtensor_llama(reference("m06_llama_model").LlamaModel(cfg), sequence_parallel)

    def parameters(self):
        return self.llama.parameters()

    def train_step(self, tokens, targets, n_microbatches, optimizer):
        from course.reference_tp import dtensor_loss
        loss = dtensor_loss(self.llama, tokens, targets)  # forward and backward
        optimizer.step()
        optimizer.zero_grad()
        return loss


def _train_dtensor(cfg, sequence_parallel, steps, batch):
    timer = StepTimer()
    reference("m06_llama_model").fit(DTensorModel(cfg, sequence_parallel), steps + 1, batch, on_step=timer)
    return {"times": timer.times[1:], "loss": timer.losses[-1]}


def traffic_rows(args) -> list[dict]:
    cfg, costs = reference("m12_tp_model").CONFIG, reference("m12_tp_costs")
    rows = []
    for t in args.nproc:
        for sequence_parallel in (False, True):
            ours = run_ranks(_train_ours, t, cfg, sequence_parallel, args.steps, args.batch, timeout=300)[0]
            theirs = run_ranks(_train_dtensor, t, cfg, sequence_parallel, args.steps, args.batch, timeout=300)[0]
            formula_args = (cfg, {"t": t}, args.batch, torch.float32, 1, sequence_parallel)
            traffic, kept = costs.tp_traffic(*formula_args), costs.tp_activation_bytes(*formula_args)
            measured = ours["cost"]
            ours_ms, theirs_ms = (1e3 * statistics.median(r["times"]) for r in (ours, theirs))
            rows.append({"t": t, "SP": "on" if sequence_parallel else "off",
                         "calls/step": measured.n_calls(), "calls formula": traffic.n_calls(),
                         "sent B/step": round(measured.sent_bytes()), "sent formula": round(traffic.sent_bytes()),
                         "kept B/rank": ours["kept"], "kept formula": kept.memory["activations"],
                         "ours ms": ours_ms, "DTensor ms": theirs_ms, "ours/DTensor": ours_ms / theirs_ms,
                         "loss ours": ours["loss"], "loss DTensor": theirs["loss"]})
            print(f"  measured t={t}, sequence parallelism {rows[-1]['SP']}", flush=True)
    return rows


# --- 2. overlap on an emulated device --------------------------------------------------------

class TimedWaits(Collectives):
    """Collectives whose async works record how long each wait() blocked, by op, in `waited`."""

    def __init__(self):
        super().__init__()
        self.waited = {}

    def _timed(self, op, work):
        if work is None:
            return None
        waits = self.waited

        class Timed:
            def wait(self):
                began = time.perf_counter()
                work.wait()
                waits[op] = waits.get(op, 0.0) + time.perf_counter() - began
        return Timed()

    def all_gather(self, output, shard, label="", async_op=False, dim=0):
        return self._timed("all_gather", super().all_gather(output, shard, label, async_op, dim))

    def reduce_scatter(self, shard, full, label="", async_op=False, dim=0):
        return self._timed("reduce_scatter", super().reduce_scatter(shard, full, label, async_op, dim))

    def all_reduce(self, tensor, label="", async_op=False, op="sum"):
        return self._timed("all_reduce", super().all_reduce(tensor, label, async_op, op))


def _overlap(sequence_parallel, tokens, dim, ffn, gflops, repeats):
    linear = load("m12_tp_linear")
    collectives = TimedWaits()
    tp = dataclasses.replace(world_group("t"), collectives=collectives)
    t, sp = tp.size, sequence_parallel
    x = torch.randn(1, tokens // t if sequence_parallel else tokens, dim)
    weights = [torch.randn(ffn // t, dim) for _ in range(2)]
    dys = [torch.randn(1, tokens, ffn // t) for _ in weights]
    grads = [torch.zeros_like(w) for w in weights]
    dx_op = "reduce_scatter" if sequence_parallel else "all_reduce"
    alone, exposed, gather_alone, gather_exposed = [], [], [], []
    for _ in range(repeats):  # the input gradient's collective (and the re-gather of x) with nothing to hide behind
        dist.barrier()
        began = time.perf_counter()
        linear.enter_tp_backward(torch.randn(1, tokens, dim), tp, sp, async_op=True).wait()
        alone.append(time.perf_counter() - began)
        if sequence_parallel:
            dist.barrier()
            began = time.perf_counter()
            linear.enter_tp_forward(x, tp, sp, async_op=True).wait()
            gather_alone.append(time.perf_counter() - began)
    gemm_s = 2 * 2 * tokens * dim * (ffn // t) * 1e-9 / gflops  # one of the two GEMM kinds: 2 weights
    for _ in range(repeats):
        collectives.waited.clear()
        dist.barrier()
        with EmulatedGemms(gflops):
            linear.column_parallel_backward(dys, x, weights, grads, tp, sp, "ffn in")
        exposed.append(collectives.waited.get(dx_op, 0.0))
        gather_exposed.append(collectives.waited.get("all_gather", 0.0))
    return {"alone": statistics.median(alone), "exposed": statistics.median(exposed), "gemm": gemm_s,
            "gather_alone": statistics.median(gather_alone) if gather_alone else None,
            "gather_exposed": statistics.median(gather_exposed)}


def overlap_rows(args) -> list[dict]:
    rows = []
    for t in [t for t in args.nproc if t > 1]:
        for sequence_parallel in (False, True):
            per_rank = run_ranks(_overlap, t, sequence_parallel, args.tokens, args.dim, args.ffn, args.gflops,
                                 args.repeats, timeout=300)
            alone = statistics.mean(r["alone"] for r in per_rank)
            exposed = statistics.mean(r["exposed"] for r in per_rank)
            gemm = per_rank[0]["gemm"]
            row = {"t": t, "SP": "on" if sequence_parallel else "off",
                   "dx collective": "reduce-scatter" if sequence_parallel else "all-reduce",
                   "alone ms": 1e3 * alone, "wgrad GEMMs ms": 1e3 * gemm, "exposed ms": 1e3 * exposed,
                   "hidden": 1 - exposed / alone, "full overlap": min(1.0, gemm / alone)}
            if sequence_parallel:  # the re-gather of x, behind the input-gradient GEMMs (as long as the wgrad ones)
                gather_alone = statistics.mean(r["gather_alone"] for r in per_rank)
                gather_exposed = statistics.mean(r["gather_exposed"] for r in per_rank)
                row["x gather hidden"] = 1 - gather_exposed / gather_alone
            else:
                row["x gather hidden"] = "-"
            rows.append(row)
            print(f"  measured overlap t={t}, sequence parallelism {row['SP']}", flush=True)
    return rows


# --- 3. fused weight-gradient accumulation ---------------------------------------------------

def accumulation_rows(args) -> list[dict]:
    linear = load("m12_tp_linear")
    generator = torch.Generator().manual_seed(0)
    rows = []
    for n_microbatches in (1, 8, 32):
        pairs = [(torch.randn(args.acc_tokens, args.acc_out, generator=generator).bfloat16(),
                  torch.randn(args.acc_tokens, args.acc_in, generator=generator).bfloat16())
                 for _ in range(n_microbatches)]
        exact = sum(dy.double().t() @ x.double() for dy, x in pairs)
        bf16_grad = torch.zeros(args.acc_out, args.acc_in, dtype=torch.bfloat16)
        unfused, fused = (torch.zeros(args.acc_out, args.acc_in) for _ in range(2))
        for dy, x in pairs:
            bf16_grad += dy.t() @ x  # no main_grad: the gradient itself accumulates in bf16
            linear.accumulate_weight_grad(unfused, dy, x, fused=False)
            linear.accumulate_weight_grad(fused, dy, x)

        def error(got):
            return ((got.double() - exact).norm() / exact.norm()).item()
        rows.append({"m": n_microbatches, "bf16 accumulator": error(bf16_grad),
                     "fp32 main_grad, unfused": error(unfused), "fp32 main_grad, fused": error(fused)})
    return rows


def cuda_timing_rows(args) -> list[dict]:
    """Fused vs unfused accumulation of bf16 weight gradients into a float32 main_grad, on CUDA."""
    linear = load("m12_tp_linear")
    device = torch.device(args.device)
    dy = torch.randn(args.gpu_tokens, args.gpu_out, device=device).bfloat16()
    x = torch.randn(args.gpu_tokens, args.gpu_in, device=device).bfloat16()
    main_grad = torch.zeros(args.gpu_out, args.gpu_in, device=device)
    rows = []
    for fused in (False, True):
        for _ in range(3):
            linear.accumulate_weight_grad(main_grad, dy, x, fused)
        torch.cuda.synchronize(device)
        times = []
        for _ in range(args.repeats):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(10):
                linear.accumulate_weight_grad(main_grad, dy, x, fused)
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop) / 10)
        rows.append({"path": "fused (addmm into fp32)" if fused else "unfused (bf16 GEMM, then add)",
                     "ms": statistics.median(times),
                     "TFLOP/s": 2 * args.gpu_tokens * args.gpu_out * args.gpu_in / statistics.median(times) / 1e9})
    rows[1]["unfused/fused"] = rows[0]["ms"] / rows[1]["ms"]
    rows[0]["unfused/fused"] = 1.0
    return rows


def main(argv: list[str]) -> None:
    parser = bench_parser("12", __doc__, PARTS)
    parser.add_argument("--nproc", type=int, nargs="+", default=[1, 2, 4], help="values of t (default 1 2 4)")
    parser.add_argument("--steps", type=int, default=3, help="timed training steps per row (default 3)")
    parser.add_argument("--batch", type=int, default=8, help="training batch (default 8)")
    parser.add_argument("--tokens", type=int, default=4096, help="overlap: tokens of the backward (default 4096)")
    parser.add_argument("--dim", type=int, default=256, help="overlap: model width (default 256)")
    parser.add_argument("--ffn", type=int, default=2048, help="overlap: FFN width, split over t (default 2048)")
    parser.add_argument("--gflops", type=float, default=50.0, help="overlap: the emulated device's GFLOP/s (default 50)")
    parser.add_argument("--repeats", type=int, default=5, help="overlap and CUDA timing: repeats (median; default 5)")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda for the accumulation timing")
    parser.set_defaults(acc_tokens=1024, acc_out=256, acc_in=256, gpu_tokens=8192, gpu_out=4096, gpu_in=4096)
    args = start(parser, argv, check)
    parts = chosen_parts(args, PARTS)
    cfg = reference("m12_tp_model").CONFIG
    if "traffic" in parts:
        report("bench-12-traffic",
               f"Module 12: bytes, activations and step time per rank; {cfg.n_layers} blocks of dim {cfg.dim}, "
               f"batch {args.batch} x {cfg.max_seq_len} tokens, float32, {args.steps} timed steps",
               traffic_rows(args),
               notes="sent B/step: ring algorithm, per rank, summed over the logged collectives; kept B/rank: "
                     "the blocks' stores after the forward. Each measured column is followed by its formula; the "
                     "losses are the last timed step's.")
    if "overlap" in parts:
        report("bench-12-overlap",
               f"Module 12: the input gradient's collective behind the weight-gradient GEMMs; emulated device "
               f"{args.gflops:g} GFLOP/s, {args.tokens} tokens, dim {args.dim}, gate and up of width {args.ffn} / t",
               overlap_rows(args),
               notes="hidden = 1 - exposed / alone (mean over ranks of medians over repeats); full overlap = "
                     "min(1, wgrad GEMMs / alone). x gather hidden: the sequence-parallel re-gather of the input, "
                     "behind the input-gradient GEMMs.")
    if "accumulation" in parts:
        report("bench-12-accumulation",
               f"Module 12: m microbatches of bf16 weight gradients ({args.acc_tokens} tokens, "
               f"{args.acc_out} x {args.acc_in}), relative error against float64",
               accumulation_rows(args),
               notes="bf16 accumulator: grad += bf16 GEMM output, in bf16. unfused: the bf16 GEMM output added "
                     "into a float32 main_grad. fused: torch.addmm into the float32 main_grad.")
        if args.device.startswith("cuda"):
            report("bench-12-accumulation-cuda",
                   f"Module 12: fused vs unfused weight-gradient accumulation, bf16 {args.gpu_tokens} tokens x "
                   f"{args.gpu_out} x {args.gpu_in} into a float32 main_grad", cuda_timing_rows(args),
                   device=args.device)


def check(parser, args):
    """Refuse bad arguments before any rank starts."""
    require_positive(parser, args, "steps", "batch", "tokens", "dim", "ffn", "repeats")
    if not args.gflops > 0:
        parser.error(f"--gflops must be positive, got {args.gflops}")
    cfg = reference("m12_tp_model").CONFIG
    for t in args.nproc:
        try:
            check_splits(cfg, {"t": t}, args.batch, seq_len=cfg.max_seq_len, sequence_parallel=True)
        except ValueError as exc:
            parser.error(f"--nproc: {exc}")
        if args.tokens % t or args.ffn % t:
            parser.error(f"--tokens {args.tokens} and --ffn {args.ffn} must be divisible by every --nproc value ({t})")
    if args.device.startswith("cuda") and args.only not in (None, "accumulation"):
        parser.error("--device cuda times the accumulation only: add --only accumulation")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda, but torch sees no CUDA device")
