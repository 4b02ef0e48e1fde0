"""Module 14 benchmark: data parallelism on CPU ranks, against the formulas and against PyTorch.

    python main.py bench 14                  # the three tables below (a few minutes on 2 cores)
    python main.py bench 14 --only overlap   # one table: bytes, overlap or speed

1. Bytes: course/reference_llama.py's ModularLlama (float32, buckets of --cap-kib) trained for two
   steps on d in --nproc ranks, ZeRO stage 0, 1 and 2, m = 1 and 2 micro-steps:
     sent B/step    bytes one rank sends in a step, summed over the logged collectives (ring
                    algorithm, course/collectives.py), then the formula (m14_costs.traffic): equal
     state B/rank   parameters + gradients + AdamW's moments one rank holds between steps (the
                    memory behind its tensors), then the formula (m14_costs.state): equal
     ZeRO-R opt B   stage 1 rows: the AdamW state torch's ZeroRedundancyOptimizer keeps on the
                    rank that keeps the most (it shards whole parameters, unevenly), beside ours
2. Overlap, on an emulated device: module 00's MLP shape (--layers layers of --hidden) whose every
   layer's forward takes --emulate-ms more and its backward twice that (sleeps, as course/emulated.py
   does: the CPU is free, so a collective in flight progresses as beside a busy device); the
   collectives are real gloo ones. For each bucket cap C:
     alone ms       the buckets all-reduced with nothing to hide behind (all started, then all waited)
     exposed ms     the time finish() waits after the backward: communication not hidden
     hidden         1 - exposed / alone
3. Speed, same emulated model and ranks: median step time of ours and of PyTorch's
   DistributedDataParallel with the same cap (ours/DDP), and of our ZeRO-1 against DDP with
   ZeroRedundancyOptimizer (ours/ZeRO-R).
The measured code is the selected implementation (steps/, or solutions/ with --impl solutions); the
formulas come from the reference.
"""
from __future__ import annotations

import argparse
import math
import statistics
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from course.bench import bench_parser, chosen_parts, llama_config, report, require_positive, start
from course.costs import measured_cost
from course.dataset import load_text, random_batch
from course.emulated import SleepInBackward
from course.impl import load, reference
from course.launch import run_ranks
from course.mesh import world_group
from course.reference_llama import ModularLlama

PARTS = ("bytes", "overlap", "speed")
KiB, MiB = 2 ** 10, 2 ** 20


def zero_redundancy_optimizer(params, lr):
    with warnings.catch_warnings():  # torch.distributed.optim imports TorchScript, which torch 2.13 deprecates
        warnings.simplefilter("ignore", DeprecationWarning)
        from torch.distributed.optim import ZeroRedundancyOptimizer
    return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, lr=lr)


def ours(model, cap, stage, optimizer_class=torch.optim.AdamW):
    """The measured implementation's data parallelism of `model` over every rank, and its optimizer."""
    dp, zero = load("m14_data_parallel"), load("m14_zero")
    kind = {} if stage == 0 else {"kind": zero.ZeroDataParallel, "stage": stage}
    ddp = dp.replicate(model, world_group(), cap, **kind)
    return ddp, optimizer_class(ddp.parameters(), lr=1e-3)


def adamw_bytes(state) -> int:
    return sum(s[k].nbytes for s in state.values() for k in ("exp_avg", "exp_avg_sq") if k in s)


def storages(tensors) -> int:
    """Bytes of the distinct memory blocks behind `tensors` (a view counts its whole buffer, once)."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t is not None}.values())


# --- 1. bytes sent and kept, against the formulas -------------------------------------------------

def _bytes(cfg, batch, cap):
    ts, costs = load("m14_train_step"), reference("m14_costs")
    d, rows = dist.get_world_size(), []
    data, generator = load_text(), torch.Generator().manual_seed(0)
    batches = [random_batch(data, batch, cfg.max_seq_len, generator) for _ in range(2)]
    for stage in (0, 1, 2):
        for n_microbatches in (1, 2):
            torch.manual_seed(0)
            model = ModularLlama(cfg, torch.float32)
            ddp, optimizer = ours(model, cap, stage)
            for tokens, targets in batches:
                del ddp.group.collectives.log[:]
                loss = ts.train_step(ddp, model, tokens, targets, n_microbatches, optimizer)
            sent = measured_cost(ddp.group.collectives.log)
            numels = [b.numel for b in ddp.buckets]
            grads = [p.grad for p in model.parameters()] + [b.grads for b in ddp.buckets] + list(getattr(ddp, "grad_shards", []))
            kept = storages(model.parameters()) + storages(grads) + adamw_bytes(optimizer.state)
            rows.append({"d": d, "ZeRO": stage, "m": n_microbatches, "buckets": len(numels),
                         "sent B/step": round(sent.sent_bytes()),
                         "formula": round(costs.traffic(numels, 4, d, stage, n_microbatches, axis="world").sent_bytes()),
                         "calls": sent.n_calls(), "calls formula": costs.traffic(numels, 4, d, stage, n_microbatches).n_calls(),
                         "state B/rank": kept, "state formula": costs.state(numels, 4, d, stage).state_bytes,
                         "of 4Ψb": kept / (16 * sum(numels)), "opt B/rank": adamw_bytes(optimizer.state),
                         "ZeRO-R opt B": "-", "loss": loss})
    torch.manual_seed(0)  # ZeroRedundancyOptimizer's AdamW state after one step, beside our stage-1 rows
    theirs = DistributedDataParallel(ModularLlama(cfg, torch.float32), bucket_cap_mb=cap / MiB)
    optimizer = zero_redundancy_optimizer(theirs.parameters(), 1e-3)
    tokens, targets = batches[0]
    mine = slice(dist.get_rank() * batch // d, (dist.get_rank() + 1) * batch // d)
    F.cross_entropy(theirs(tokens[mine]).reshape(-1, cfg.vocab_size), targets[mine].reshape(-1)).backward()
    optimizer.step()
    held = torch.tensor([adamw_bytes(optimizer.optim.state)])
    dist.all_reduce(held, op=dist.ReduceOp.MAX)
    for row in rows:
        if row["ZeRO"] == 1:
            row["ZeRO-R opt B"] = held.item()
    return rows


def bytes_rows(args) -> list[dict]:
    cfg = llama_config(argparse.ArgumentParser(), "bytes", n_layers=2)
    rows = []
    for d in args.nproc:
        per_rank = run_ranks(_bytes, d, cfg, args.batch, args.cap_kib * KiB, timeout=300)
        rows += per_rank[0]
        print(f"  measured bytes on d={d}", flush=True)
    return rows


# --- 2. overlap on an emulated device --------------------------------------------------------------

class EmulatedMLP(nn.Module):
    """Module 00's MLP shape whose every layer's forward takes `ms` more and its backward twice that."""

    def __init__(self, layers: int, hidden: int, ms: float):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(layers))
        self.head = nn.Linear(hidden, 2)
        self.seconds = ms / 1000

    def forward(self, x):
        for layer in self.layers:
            x = F.relu(layer(x))
            time.sleep(self.seconds)
            x = SleepInBackward.apply(x, 2 * self.seconds)  # runs just before this layer's backward
        return self.head(x)


def emulated_batch(args, step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(args.rows, args.hidden, generator=g), torch.randint(0, 2, (args.rows,), generator=g)


def _overlap(args, cap):
    ts = load("m14_train_step")
    model = EmulatedMLP(args.layers, args.hidden, args.emulate_ms)
    ddp, optimizer = ours(model, cap, 0, torch.optim.SGD)  # the optimizer is no part of the overlap: the cheapest
    finish, waits = ddp.finish, []  # (entered, returned) of every finish(): perf_counter is one clock for all ranks

    def timed_finish():
        entered = time.perf_counter()
        finish()
        waits.append((entered, time.perf_counter()))
    ddp.finish = timed_finish
    steps, alone = [], []
    for step in range(args.steps + 1):
        dist.barrier()
        began = time.perf_counter()
        ts.train_step(ddp, model, *emulated_batch(args, step), 1, optimizer)
        steps.append((began, time.perf_counter()))
        dist.barrier()  # right after each step, the same buckets with nothing to hide behind: the two are paired,
        began = time.perf_counter()  # so a CPU that gets busier or quieter (other jobs) moves both
        for bucket in ddp.buckets:
            ddp.launch(bucket)
        for bucket in ddp.buckets:
            ddp.complete(bucket)
        alone.append((began, time.perf_counter()))
    return {"buckets": len(ddp.buckets), "waits": waits[1:], "alone": alone[1:], "steps": steps[1:]}


def after_the_last(per_rank: list[list[tuple[float, float]]]) -> list[float]:
    """Per repeat, the last rank's end minus the last rank's start: the ranks' clocks are one (one machine),
    and a rank that starts early also waits for the others, which is skew, not communication."""
    return [max(e for _, e in spans) - max(b for b, _ in spans) for spans in zip(*per_rank)]


def cap_label(cap: int) -> str:
    return f"{cap // MiB} MiB" if cap >= MiB else f"{cap // KiB} KiB"


def overlap_rows(args) -> list[dict]:
    rows = []
    for d in args.nproc:
        for cap_kib in args.caps_kib:
            per_rank = run_ranks(_overlap, d, args, cap_kib * KiB, timeout=300)
            # exposed: from the moment the last rank's backward ended to the moment the last rank's sums arrived
            exposed = after_the_last([r["waits"] for r in per_rank])
            alone = after_the_last([r["alone"] for r in per_rank])
            hidden = statistics.median(1 - e / a for e, a in zip(exposed, alone))  # step by step, paired
            rows.append({"d": d, "C": cap_label(cap_kib * KiB), "buckets": per_rank[0]["buckets"],
                         "alone ms": 1e3 * statistics.median(alone), "exposed ms": 1e3 * statistics.median(exposed),
                         "hidden": hidden, "backward ms": 2 * args.layers * args.emulate_ms,
                         "step ms": 1e3 * statistics.median(after_the_last([r["steps"] for r in per_rank]))})
            print(f"  measured overlap d={d}, C={rows[-1]['C']}", flush=True)
    return rows


# --- 3. step time against PyTorch --------------------------------------------------------------------

VARIANTS = ("ours", "DDP", "ours ZeRO-1", "ZeRO-R")


def _step_times(args, cap):
    """Every variant on the same ranks, their steps interleaved (ours, DDP, ours ZeRO-1, ZeRO-R, ours, ...), so
    that a CPU that gets busier or quieter (other jobs) slows all four alike. Returns each step's span."""
    rank, d, ts = dist.get_rank(), dist.get_world_size(), load("m14_train_step")
    rows = args.rows // d

    def make(which):
        model = EmulatedMLP(args.layers, args.hidden, args.emulate_ms)
        # DDP against ours: SGD, so that the step time is the data parallelism's, not AdamW's (the same in
        # both); ZeRO-1 against ZeroRedundancyOptimizer: AdamW, whose sharding is the point.
        if which.startswith("ours"):
            ddp, optimizer = ours(model, cap, 0 if which == "ours" else 1,
                                  torch.optim.SGD if which == "ours" else torch.optim.AdamW)
            return lambda x, y: ts.train_step(ddp, model, x, y, 1, optimizer)
        theirs = DistributedDataParallel(model, bucket_cap_mb=cap / MiB)
        optimizer = (torch.optim.SGD(theirs.parameters(), lr=1e-3) if which == "DDP" else
                     zero_redundancy_optimizer(theirs.parameters(), 1e-3))

        def step(x, y):
            loss = F.cross_entropy(theirs(x[rank * rows:(rank + 1) * rows]), y[rank * rows:(rank + 1) * rows])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            total = loss.detach().double().reshape(1)  # the step's global mean loss, as ours returns it
            dist.all_reduce(total)
            return total.item() / d
        return step
    steps, spans = {which: make(which) for which in VARIANTS}, {which: [] for which in VARIANTS}
    for s in range(args.steps + 2):  # two warm-up steps: DDP rebuilds its buckets after its first
        for which, step in steps.items():
            dist.barrier()
            began = time.perf_counter()
            step(*emulated_batch(args, s))
            spans[which].append((began, time.perf_counter()))
    return {which: times[2:] for which, times in spans.items()}


def speed_rows(args) -> list[dict]:
    rows = []
    for d in args.nproc:
        for cap_kib in args.speed_caps_kib:
            per_rank = run_ranks(_step_times, d, args, cap_kib * KiB, timeout=600)
            times = {which: after_the_last([r[which] for r in per_rank]) for which in VARIANTS}

            def ratio(a, b):  # step by step (paired), then the median
                return statistics.median(x / y for x, y in zip(times[a], times[b]))
            ms = {which: 1e3 * statistics.median(t) for which, t in times.items()}
            rows.append({"d": d, "C": cap_label(cap_kib * KiB), "ours ms": ms["ours"], "DDP ms": ms["DDP"],
                         "ours/DDP": ratio("ours", "DDP"), "ours ZeRO-1 ms": ms["ours ZeRO-1"],
                         "ZeRO-R ms": ms["ZeRO-R"], "ours/ZeRO-R": ratio("ours ZeRO-1", "ZeRO-R")})
            print(f"  measured speed d={d}, C={rows[-1]['C']}", flush=True)
    return rows


def main(argv: list[str]) -> None:
    parser = bench_parser("14", __doc__, PARTS)
    parser.add_argument("--nproc", type=int, nargs="+", default=None,
                        help="values of d (default: 2 4 for the bytes, 2 for overlap and speed)")
    parser.add_argument("--batch", type=int, default=8, help="bytes: global batch of sequences (default 8)")
    parser.add_argument("--cap-kib", type=int, default=100, help="bytes: bucket cap in KiB (default 100)")
    parser.add_argument("--layers", type=int, default=16, help="emulated MLP: layers (default 16)")
    parser.add_argument("--hidden", type=int, default=512, help="emulated MLP: width (default 512: 1 MiB a layer)")
    parser.add_argument("--rows", type=int, default=8, help="emulated MLP: global batch rows (default 8)")
    parser.add_argument("--emulate-ms", type=float, default=1.0,
                        help="emulated MLP: ms a layer's forward takes (its backward twice that; default 1)")
    parser.add_argument("--caps-kib", type=int, nargs="+", default=[1, 1024, 2048, 4096, 8192, 16384, 65536],
                        help="overlap: bucket caps in KiB (default 1 1024 2048 4096 8192 16384 65536)")
    parser.add_argument("--speed-caps-kib", type=int, nargs="+", default=[1024, 25600],
                        help="speed: bucket caps in KiB (default 1024 and DDP's default, 25600)")
    parser.add_argument("--steps", type=int, default=20, help="overlap and speed: timed steps (median; default 20)")
    args = start(parser, argv, check)
    parts = chosen_parts(args, PARTS)
    if "bytes" in parts:
        report("bench-14-bytes", f"Module 14: bytes sent per step and kept per rank, measured vs formula; "
                                 f"ModularLlama (2 blocks of dim 64, float32), batch {args.batch} x 64, "
                                 f"C = {args.cap_kib} KiB",
               bytes_rows(argparse.Namespace(**{**vars(args), "nproc": args.nproc or [2, 4]})),
               notes="sent: ring algorithm, per rank, summed over the logged collectives of the second step; "
                     "state: parameters + gradients + AdamW moments (the memory behind the tensors), of 4Ψb = "
                     "replicated AdamW training. ZeRO-R opt B: torch's ZeroRedundancyOptimizer's AdamW state on "
                     "its busiest rank (whole parameters per rank), beside our ZeRO-1's.")
    timed = argparse.Namespace(**{**vars(args), "nproc": args.nproc or [2]})
    if "overlap" in parts:
        report("bench-14-overlap", f"Module 14: gradient all-reduces hidden behind the backward, by bucket cap C; "
                                   f"emulated device, {args.layers} layers of {args.hidden} (float32), "
                                   f"{args.emulate_ms:g} ms forward / {2 * args.emulate_ms:g} ms backward a layer",
               overlap_rows(timed),
               notes="alone: the same buckets all-reduced back to back with nothing to hide behind; exposed: from "
                     "the end of the last rank's backward to the last rank's finish(); hidden = 1 - exposed / alone, "
                     "step by step (each step is followed by its alone measurement), median over the timed steps; "
                     "times read on the one clock all ranks share.")
    if "speed" in parts:
        report("bench-14-speed", f"Module 14: step time against PyTorch, same emulated device and bucket cap "
                                 f"({args.layers} layers of {args.hidden})", speed_rows(timed),
               notes="median step time over the timed steps (from the last rank's start to the last rank's end); the "
                     "four run on the same ranks, their steps interleaved, and each ratio is the median of step-by-"
                     "step ratios. ours and DDP: SGD; ours ZeRO-1 and ZeRO-R (DDP with torch.distributed.optim."
                     "ZeroRedundancyOptimizer): AdamW. Both loops all-reduce the step's loss for the log (ours while "
                     "the optimizer steps, the DDP loop after it); ours also the global count of real tokens, which "
                     "the DDP loop does without: started at the step's start, waited for after the last bucket.")


def check(parser, args):
    """Refuse bad arguments before any rank starts."""
    require_positive(parser, args, "batch", "cap_kib", "layers", "hidden", "rows", "steps")
    for name in ("nproc", "caps_kib", "speed_caps_kib"):
        values = getattr(args, name) or []
        if any(v < 1 for v in values):
            parser.error(f"--{name.replace('_', '-')} values must be at least 1, got {values}")
    if not args.emulate_ms >= 0:
        parser.error(f"--emulate-ms must be at least 0, got {args.emulate_ms:g}")
    if not math.isfinite(args.emulate_ms):  # a layer that never ends: every rank would sleep until the timeout
        parser.error(f"--emulate-ms must be a finite number of ms, got {args.emulate_ms:g}")
    for d in args.nproc or [2, 4]:
        if args.batch % d or args.rows % d:
            parser.error(f"--batch {args.batch} and --rows {args.rows} must be divisible by every --nproc value ({d})")
