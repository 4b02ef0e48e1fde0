"""Module 16 benchmark: the MoE Llama's experts over ranks, against the formulas; load balancing; the
price of imbalance on an emulated device.

    python main.py bench 16                  # the four tables below (about 15 s on 2 idle cores)
    python main.py bench 16 --only bytes     # one table: bytes, memory, balance or imbalance

1. Bytes: one training step of module 16's model (m16_moe_model.CONFIG, float32) on 4 data ranks with
   the experts over e in {1, 2, 4}, dropless and with a capacity factor f = 1: the bytes each rank's
   all-to-alls send (over "e") and its all-reduces (over "dc", "ed"), counted by course/collectives.py,
   beside m16_costs.step_cost of the rank's own routing records (must be equal on every rank), and the
   all-to-all bytes evenly spread routing would send, L m [8 (e - 1) E / e + 4 (e - 1) / e k N M b].
2. Memory: the bytes one rank holds after that step (parameters, gradients, AdamW's moments, the
   biases) beside m16_costs.state_bytes.
3. Balance: one process trains the model for --steps steps with no balancing, the auxiliary loss
   (λ = 0.1) and the auxiliary-loss-free bias (γ = 0.01); the max / mean load of the experts (mean over
   the layers) every few steps: 1 is perfect balance, the slowest expert does max / mean of the work.
4. Imbalance on an emulated device: one MoE layer's forward and backward on 4 ranks, e = 4, with a
   fixed bias that sends more tokens to rank 0's experts. Every GEMM sleeps the time a device of
   --gflops GFLOP/s would take (course/emulated.py's EmulatedGemms; the all-to-alls are real gloo
   ones). Rows per rank (max / mean), the measured time of the layer, and the GEMM time of the slowest
   and of the average rank: the slowest rank sets the pace, since everyone waits for it in the combine.
The measured code is the selected implementation (steps/, or solutions/ with --impl solutions); the
formulas come from the reference.
"""
from __future__ import annotations

import dataclasses
import statistics
import time

import torch
import torch.distributed as dist

from course.bench import bench_parser, chosen_parts, report, require_positive, start
from course.emulated import EmulatedGemms
from course.costs import measured_cost
from course.impl import load, reference
from course.launch import run_ranks
from course.mesh import init_mesh

PARTS = ("bytes", "memory", "balance", "imbalance")


# --- 1 and 2. bytes and memory of one step ---------------------------------------------------------

def _one_step(e, moe, batch):
    m06, m16 = load("m06_llama_model"), load("m16_moe_model")
    mesh = init_mesh({"d": dist.get_world_size(), "e": e})
    model, _ = m06.fit(m16.MoELlama(m16.CONFIG, moe, mesh), 1, batch)
    params = model.parameters()
    optimizer = torch.optim.AdamW(params, lr=0.0)   # the state fit's AdamW held, rebuilt by one step that moves nothing
    optimizer.step()
    held = {"parameters": sum(p.nbytes for p in params), "gradients": sum(p.grad.nbytes for p in params),
            "optimizer": sum(optimizer.state[p][m].nbytes for p in params for m in ("exp_avg", "exp_avg_sq")),
            "buffers": sum(b.nbytes for b in model.biases())}
    return measured_cost(mesh.log), model.layer.records, mesh.group("e").index, held


def step_rows(args) -> tuple[list[dict], list[dict]]:
    cfg, costs = reference("m16_moe_model").CONFIG, reference("m16_costs")
    world, bytes_rows, memory_rows = 4, [], []
    for capacity in (None, 1.0):
        moe = dataclasses.replace(reference("m16_moe_model").MOE, capacity_factor=capacity)
        for e in (1, 2, 4):
            results = run_ranks(_one_step, world, e, moe, args.batch, timeout=120)
            sizes = {"d": world, "e": e}
            formulas = [costs.step_cost(cfg, moe, sizes, index, records) for _, records, index, _ in results]
            equal = all(f == measured for f, (measured, *_) in zip(formulas, results))
            measured, formula = results[0][0], formulas[0]
            n_tokens = args.batch // world * cfg.max_seq_len
            away = (e - 1) / e * moe.top_k * n_tokens   # rows out, as many back; twice: forward and backward
            even = cfg.n_layers * (8 * (e - 1) * moe.n_experts // e + 4 * away * cfg.dim * 4)
            bytes_rows.append({"e": e, "f": "dropless" if capacity is None else f"{capacity:g}",
                               "a2a B r0": round(measured.sent_bytes("e", "all_to_all")),
                               "a2a formula": round(formula.sent_bytes("e", "all_to_all")),
                               "a2a max rank": round(max(r[0].sent_bytes("e", "all_to_all") for r in results)),
                               "if even": round(even),
                               "dc B": round(measured.sent_bytes("dc")), "dc formula": round(formula.sent_bytes("dc")),
                               "ed B": round(measured.sent_bytes("ed")), "ed formula": round(formula.sent_bytes("ed")),
                               "all ranks equal": "yes" if equal else "NO"})
            if capacity is None:
                kept = costs.state_bytes(cfg, moe, e).memory
                held = results[0][3]
                memory_rows.append({"e": e, **{f"{k} B": held[k] for k in held}, "formula total": sum(kept.values()),
                                    "measured total": sum(held.values()),
                                    "equal": "yes" if all(r[3] == kept for r in results) else "NO"})
            print(f"  measured e={e}, {bytes_rows[-1]['f']}", flush=True)
    return bytes_rows, memory_rows


# --- 3. balance over training ----------------------------------------------------------------------

def balance_rows(args) -> list[dict]:
    m06, m16 = load("m06_llama_model"), load("m16_moe_model")
    methods = {"none": dict(balance="none"), "aux": dict(balance="aux", aux_coef=0.1),
               "bias": dict(balance="bias", bias_rate=0.01)}
    ratios, losses = {}, {}
    for name, fields in methods.items():
        model = m16.MoELlama(m16.CONFIG, dataclasses.replace(m16.MOE, **fields), m16.one_rank_mesh())
        ratios[name] = []

        def max_over_mean(step, loss):
            loads = model.last_step.loads.double()
            ratios[name].append((loads.max(-1).values / loads.mean(-1)).mean().item())
        losses[name] = m06.fit(model, args.steps, args.batch, on_step=max_over_mean)[1][-1]
        print(f"  trained with balance {name}", flush=True)
    every = max(1, args.steps // 10)
    rows = []
    for start in range(0, args.steps, every):   # the mean over each window of steps: single steps are noisy
        rows.append({"steps": f"{start}-{min(start + every, args.steps) - 1}",
                     **{f"max/mean {name}": statistics.mean(r[start:start + every]) for name, r in ratios.items()}})
    rows.append({"steps": "final loss", **{f"max/mean {name}": losses[name] for name in methods}})
    return rows


# --- 4. imbalance on an emulated device --------------------------------------------------------------

def _imbalanced_layer(skews, tokens, dim, ffn, gflops, repeats):
    layer_module, router = load("m16_moe_layer"), load("m16_router")
    mesh = init_mesh({"d": dist.get_world_size(), "e": dist.get_world_size()})
    group = mesh.group("e")
    moe = router.MoEConfig(n_experts=8, top_k=2, expert_dim=ffn, score="sigmoid", balance="bias")
    w = layer_module.init_moe_weights(moe, dim, torch.Generator().manual_seed(0), layer_module.local_experts(8, group))
    g = torch.Generator().manual_seed(1 + mesh.rank)
    h, n, dy = (torch.randn(1, tokens, dim, generator=g) for _ in range(3))
    device = EmulatedGemms(gflops)

    def on_device(experts_pass):   # only the experts' GEMMs are emulated: the router must still route
        def emulated(*args):
            with device:
                return experts_pass(*args)
        return emulated
    layer_module.experts_forward = on_device(layer_module.experts_forward)
    layer_module.experts_backward = on_device(layer_module.experts_backward)
    rows = []
    for skew in skews:
        w.bias = torch.zeros(8)
        w.bias[:2] = skew   # rank 0's experts look better to every router
        layer = layer_module.MoELayer(moe, group)
        times, slept = [], []
        for _ in range(repeats + 1):
            device.slept = 0.0
            store = layer_module.ActivationStore()
            dist.barrier()
            began = time.perf_counter()
            layer.forward(w, h, n, store)
            layer.backward(w, dy, store)
            times.append(time.perf_counter() - began)
            slept.append(device.slept)
        received = int(layer.records[-1].received.sum())
        rows.append((skew, received, statistics.median(times[1:]), statistics.median(slept[1:])))
    return rows


def imbalance_rows(args) -> list[dict]:
    skews = (0.0, 0.05, 0.1, 0.2, 0.4)
    results = run_ranks(_imbalanced_layer, 4, skews, args.tokens, args.dim, args.ffn, args.gflops, args.repeats,
                        timeout=300)
    rows = []
    for i, skew in enumerate(skews):
        received = [r[i][1] for r in results]
        slept = [r[i][3] for r in results]
        rows.append({"bias on rank 0": skew, "rows per rank": "/".join(map(str, received)),
                     "max/mean rows": max(received) / statistics.mean(received),
                     "layer ms": 1e3 * max(r[i][2] for r in results),
                     "GEMMs slowest ms": 1e3 * max(slept), "GEMMs mean ms": 1e3 * statistics.mean(slept)})
    return rows


def main(argv: list[str]) -> None:
    parser = bench_parser("16", __doc__, PARTS)
    parser.add_argument("--batch", type=int, default=8, help="bytes, memory, balance: global batch (default 8)")
    parser.add_argument("--steps", type=int, default=100, help="balance: training steps (default 100)")
    parser.add_argument("--tokens", type=int, default=256, help="imbalance: tokens per rank (default 256)")
    parser.add_argument("--dim", type=int, default=64, help="imbalance: model width (default 64)")
    parser.add_argument("--ffn", type=int, default=64, help="imbalance: each expert's width (default 64)")
    parser.add_argument("--gflops", type=float, default=0.25,
                        help="imbalance: the emulated device's GFLOP/s (default 0.25)")
    parser.add_argument("--repeats", type=int, default=3, help="imbalance: timed repeats (median; default 3)")
    args = start(parser, argv, check)
    parts = chosen_parts(args, PARTS)
    cfg, moe = reference("m16_moe_model").CONFIG, reference("m16_moe_model").MOE
    if "bytes" in parts or "memory" in parts:
        bytes_rows, memory_rows = step_rows(args)
        if "bytes" in parts:
            report("bench-16-bytes",
                   f"Module 16: bytes one rank sends in a step; {cfg.n_layers} blocks of dim {cfg.dim}, "
                   f"E={moe.n_experts} experts of width {moe.expert_dim}, top-{moe.top_k}, 4 data ranks, batch "
                   f"{args.batch} x {cfg.max_seq_len}, float32", bytes_rows,
                   notes="a2a: the all-to-alls over e (counts, rows out and back, both directions), rank 0, then "
                         "m16_costs.step_cost of its routing; if even: what evenly spread, dropless routing would "
                         "send. dc, ed: the all-reduces (dense gradients and statistics, expert gradients).")
        if "memory" in parts:
            report("bench-16-memory", "Module 16: bytes one rank holds after a step, against m16_costs.state_bytes",
                   memory_rows, notes="parameters, gradients, AdamW's two moments, the biases; e of 4 data ranks")
    if "balance" in parts:
        report("bench-16-balance",
               f"Module 16: max / mean expert load during training (one process, batch {args.batch} x "
               f"{cfg.max_seq_len}, mean over the {cfg.n_layers} layers and over each window of steps)",
               balance_rows(args),
               notes="none: the router alone; aux: the per-sequence auxiliary loss, λ = 0.1; bias: the auxiliary-"
                     "loss-free bias, γ = 0.01. 1 is perfect balance.")
    if "imbalance" in parts:
        report("bench-16-imbalance",
               f"Module 16: one MoE layer, forward and backward, e = 4 ranks, {args.tokens} tokens a rank, dim "
               f"{args.dim}, 8 experts of width {args.ffn}, top-2; emulated device {args.gflops:g} GFLOP/s",
               imbalance_rows(args),
               notes="rows per rank: the rows each rank's experts computed; layer ms: the slowest rank's median "
                     "time; GEMMs ms: the emulated GEMM time of the slowest and of the average rank.")


def check(parser, args):
    """Refuse bad arguments before any rank starts."""
    require_positive(parser, args, "batch", "steps", "tokens", "dim", "ffn", "repeats")
    if not args.gflops > 0:
        parser.error(f"--gflops must be positive, got {args.gflops}")
    if args.batch % 4:
        parser.error(f"--batch {args.batch} must be divisible by the 4 ranks")
