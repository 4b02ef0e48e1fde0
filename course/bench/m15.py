"""Module 15 benchmark: context parallelism on CPU ranks, against the formulas and against float64.

    python main.py bench 15                     # the three tables below (a few minutes on 2 cores)
    python main.py bench 15 --only overlap      # one table: traffic, overlap or error

1. Traffic and memory: module 15's model (m15_cp_model.CONFIG, float32), one training step of a batch
   of --batch sequences on c in {2, 4} context ranks, for each variant:
     sent B/step    bytes one rank sends in the step over the context axis "c" (sends, all-gathers,
                    reduce-scatters, all-to-alls by the ring formulas of course/collectives.py) and over
                    "dc" (the gradients' and the loss's all-reduces), then the formula (m15_costs.cp_traffic)
     kept B/rank    bytes the blocks' stores hold after the forward, then the formula
                    (m15_costs.cp_activation_bytes): module 06's store for T/c tokens
     attn buffer    the largest transient buffer of one attention forward (formula only)
2. Overlap and balance, on an emulated device: one ring attention forward of one sequence of --tokens
   tokens whose matmuls take the time a device of --gflops GFLOP/s would need (a sleep, no arithmetic),
   while the blocks travel by real gloo messages. The exchange of one block is timed alone (receive
   and send posted, both waited), c - 1 times, just before each forward: "comm alone". "exposed" is
   the time the busiest rank (the most compute) spends blocked in the ring's waits; hidden = 1 -
   exposed / alone, per repeat, printed in percent (below 0, exposed > alone: measurement noise on a
   busy machine, printed "0 % (noise)"). "forward" is the time from the first rank's start to the
   last rank's end (the emulated compute plus the CPU's own work and its scheduling on a busy
   machine). imbalance = the busiest rank's compute / the mean: measured (the emulated compute, which
   counts the masked half of diagonal blocks the chunked kernel scores) and formula (unmasked pairs,
   m15_layout.unmasked_pairs).
3. Error against ring size: ring (zig-zag) and all-gather attention of one sequence in float32 and
   bf16 on c in {1, 2, 4, 8} ranks, largest |error| / largest |value| of o, dq, dk, dv against float64
   SDPA and autograd on the whole sequence, of the same inputs rounded to the dtype (so the error is
   the arithmetic's, not the inputs' rounding); 8 ranks on 2 cores: slow, but only accuracy counts.
The measured code is the selected implementation (steps/, or solutions/ with --impl solutions); the
formulas come from the reference.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from course.bench import bench_parser, chosen_parts, report, require_positive, start
from course.costs import measured_activations, measured_cost
from course.cp_timeline import emulated_attention
from course.impl import load, reference
from course.launch import run_ranks
from course.mesh import init_mesh
from course.reference_attention import whole_attention

PARTS = ("traffic", "overlap", "error")
VARIANT_NAMES = ("ring", "zigzag", "allgather", "ulysses")


# --- 1. traffic and memory -------------------------------------------------------------------------

def _traffic(batch):
    cp_model = load("m15_cp_model")
    cfg = reference("m15_cp_model").CONFIG
    mesh = init_mesh({"d": 1, "c": dist.get_world_size()})
    data = torch.randint(0, cfg.vocab_size, (batch, cfg.max_seq_len), generator=torch.Generator().manual_seed(0))
    results = {}
    for variant in VARIANT_NAMES:
        model = cp_model.CPLlama(cfg, mesh, variant)
        kept = measured_activations(model, model.share(data), model.share(data))
        start = len(mesh.log)
        model.train_step(data, data, 1, torch.optim.AdamW(model.parameters(), lr=1e-3))
        results[variant] = (measured_cost(mesh.log[start:]), kept)
    return results


def traffic_rows(args) -> list[dict]:
    costs, cfg = reference("m15_costs"), reference("m15_cp_model").CONFIG
    rows = []
    for c in (2, 4):
        measured = run_ranks(_traffic, c, args.batch, timeout=300)[0]
        for variant in VARIANT_NAMES:
            cost, kept = measured[variant]
            formula = costs.cp_traffic(cfg, args.batch, cfg.max_seq_len, torch.float32, c, variant)
            rows.append({"variant": variant, "c": c,
                         "sent c B/step": round(cost.sent_bytes(axis="c")),
                         "formula": round(formula.sent_bytes(axis="c")),
                         "calls c": cost.n_calls(axis="c"), "formula calls": formula.n_calls(axis="c"),
                         "sent dc B/step": round(cost.sent_bytes(axis="dc")),
                         "formula dc": round(formula.sent_bytes(axis="dc")),
                         "kept B/rank": kept,
                         "kept formula": costs.cp_activation_bytes(cfg, args.batch, cfg.max_seq_len, torch.float32, c),
                         "attn buffer B": costs.attention_buffer_bytes(cfg, args.batch, cfg.max_seq_len, torch.float32,
                                                                       c, variant)})
        print(f"  measured traffic and memory, c={c}", flush=True)
    return rows


# --- 2. overlap and balance on an emulated device -------------------------------------------------

def _overlap(layout, tokens, heads, kv_heads, head_dim, gflops, repeats):
    mesh = init_mesh({"c": dist.get_world_size()})
    group = mesh.group("c")
    c, me, n = group.size, group.index, tokens // group.size
    q, k, v = (torch.randn(1, n, h, head_dim) for h in (heads, kv_heads, kv_heads))
    block = torch.randn(2, 1, n, kv_heads, head_dim)
    runs = []
    for _ in range(repeats):  # alternately: the exchanges alone, then the ring, so both see the same machine
        dist.barrier()
        began = time.perf_counter()
        for _ in range(c - 1):  # one block's exchange with nothing to hide behind, c - 1 times
            recv = group.collectives.irecv(torch.empty_like(block), (me - 1) % c)
            send = group.collectives.isend(block, (me + 1) % c)
            recv.wait()
            send.wait()
        alone = time.perf_counter() - began
        spans = emulated_attention("ring" if layout == "contiguous" else "zigzag", group, q, k, v, gflops,
                                   compute=False)
        runs.append({"alone": alone, "step": next((start, stop) for kind, start, stop, _ in spans if kind == "step"),
                     "compute": sum(asked for kind, _, _, asked in spans if kind == "compute"),
                     "wait": sum(stop - start for kind, start, stop, _ in spans if kind == "wait")})
    return runs


def hidden_percent(hidden: float) -> str:
    """The hidden fraction of the exchange as the chapter prints it ("98 %"). Below 0 the busiest rank
    waited longer in the ring than the exchange took alone: not a transfer it failed to hide (its
    neighbours have less to compute) but a busy machine's noise, printed as 0 % and marked."""
    return f"{100 * hidden:.0f} %" if hidden >= 0 else "0 % (noise)"


def overlap_rows(args) -> list[dict]:
    layouts = reference("m15_layout")
    rows = []
    for c in (2, 4):
        for layout in ("contiguous", "zigzag"):
            per_rank = run_ranks(_overlap, c, layout, args.tokens, args.heads, args.kv_heads, args.head_dim,
                                 args.gflops, args.repeats, timeout=300)
            # Per repeat: the forward lasts from the first rank's start to the last rank's end.
            repeats = range(len(per_rank[0]))
            compute = [runs[0]["compute"] for runs in per_rank]  # emulated: the same in every repeat
            busiest = per_rank[max(range(c), key=lambda rank: compute[rank])]
            forward = [max(runs[i]["step"][1] for runs in per_rank) - min(runs[i]["step"][0] for runs in per_rank)
                       for i in repeats]
            pairs = [layouts.unmasked_pairs(layouts.SequenceLayout(layout, args.tokens, c), i) for i in range(c)]
            rows.append({"layout": layout, "c": c,
                         "comm alone ms": 1e3 * statistics.median(run["alone"] for run in busiest),
                         "exposed ms": 1e3 * statistics.median(run["wait"] for run in busiest),
                         "hidden": hidden_percent(statistics.median(1 - run["wait"] / run["alone"]
                                                                    for run in busiest)),
                         "compute ms (busiest)": 1e3 * max(compute),
                         "forward ms": 1e3 * statistics.median(forward),
                         "imbalance": max(compute) / statistics.mean(compute),
                         "imbalance formula": max(pairs) / statistics.mean(pairs)})
            print(f"  measured overlap, {layout} c={c}", flush=True)
    return rows


# --- 3. error against ring size --------------------------------------------------------------------

# The ring (zig-zag layout) as written, the same with its merge and its gradient accumulators in the
# values' dtype (the module's compute_dtype made the identity), and the all-gather (zig-zag).
ERROR_VARIANTS = ("ring", "ring, accumulating in the dtype", "allgather")


def _errors(q, k, v, do):
    cp_model, ring, layouts = load("m15_cp_model"), load("m15_ring_attention"), reference("m15_layout")
    group = init_mesh({"c": dist.get_world_size()}).group("c")
    results = {}
    for variant in ERROR_VARIANTS:
        split = layouts.SequenceLayout("zigzag", q.shape[1], group.size)
        for dtype in (torch.float32, torch.bfloat16):
            mine = [split.shard(t, group.index).to(dtype).contiguous() for t in (q, k, v, do)]
            attention = cp_model.context_attention("allgather" if variant == "allgather" else "zigzag", group)
            widened = ring.compute_dtype
            if variant == "ring, accumulating in the dtype":  # the ring's merge and accumulators not widened
                ring.compute_dtype = lambda dtype: dtype
            try:
                o, lse = attention.forward(*mine[:3])
                results[variant, dtype] = (o, *attention.backward(mine[3], *mine[:3], o, lse))
            finally:
                ring.compute_dtype = widened
    return results


def error_rows(args) -> list[dict]:
    layouts = reference("m15_layout")
    g = torch.Generator().manual_seed(0)
    T = args.error_tokens
    q, k, v = (torch.randn(1, T, heads, args.head_dim, generator=g, dtype=torch.float64)
               for heads in (args.heads, args.kv_heads, args.kv_heads))
    do = torch.randn(1, T, args.heads * args.head_dim, generator=g, dtype=torch.float64)
    # The reference attends to the same rounded inputs in float64, so that the error is the arithmetic's.
    expected = {}
    for dtype in (torch.float32, torch.bfloat16):
        o, _, *grads = whole_attention(*(t.to(dtype) for t in (q, k, v, do)))  # the lse is not compared
        expected[dtype] = (o, *grads)
    rows = []
    for c in (1, 2, 4, 8):
        per_rank = run_ranks(_errors, c, q, k, v, do, timeout=600)
        for dtype in (torch.float32, torch.bfloat16):
            for variant in ERROR_VARIANTS:
                split = layouts.SequenceLayout("zigzag", T, c)
                got = [split.unshard([r[variant, dtype][i] for r in per_rank]) for i in range(4)]
                row = {"c": c, "variant": variant, "dtype": str(dtype).removeprefix("torch.")}
                for name, x, ref in zip(("o", "dq", "dk", "dv"), got, expected[dtype], strict=True):
                    row[name] = ((x.double() - ref).abs().max() / ref.abs().max()).item()
                rows.append(row)
        print(f"  measured errors, c={c}", flush=True)
    return rows


def main(argv: list[str]) -> None:
    parser = bench_parser("15", __doc__, PARTS)
    parser.add_argument("--batch", type=int, default=4, help="traffic: global batch (default 4)")
    parser.add_argument("--tokens", type=int, default=1024, help="overlap: sequence length (default 1024)")
    parser.add_argument("--heads", type=int, default=8, help="overlap and error: query heads (default 8)")
    parser.add_argument("--kv-heads", type=int, default=2, help="overlap and error: key/value heads (default 2)")
    parser.add_argument("--head-dim", type=int, default=64, help="overlap and error: head dimension (default 64)")
    parser.add_argument("--gflops", type=float, default=2.0,
                        help="overlap: the emulated device's GFLOP/s (default 2)")
    parser.add_argument("--repeats", type=int, default=5, help="overlap: repeats, median (default 5)")
    parser.add_argument("--error-tokens", type=int, default=256, help="error: sequence length (default 256)")
    args = start(parser, argv, check)
    parts = chosen_parts(args, PARTS)
    cfg = reference("m15_cp_model").CONFIG
    if "traffic" in parts:
        report("bench-15-traffic",
               f"Module 15: bytes per rank per step and activations per rank; {cfg.n_layers} blocks of dim {cfg.dim}, "
               f"H={cfg.n_heads}, K={cfg.n_kv_heads}, batch {args.batch} x T={cfg.max_seq_len}, float32, d=1",
               traffic_rows(args),
               notes="sent: ring algorithm bytes one rank sends, from the log of one step (axis c: attention; dc: "
                     "gradients and loss), each beside its formula; kept: the blocks' stores after the forward; attn "
                     "buffer: the largest transient of one attention forward (formula).")
    if "overlap" in parts:
        report("bench-15-overlap",
               f"Module 15: ring attention forward on an emulated device of {args.gflops:g} GFLOP/s; one sequence of "
               f"{args.tokens} tokens, H={args.heads}, K={args.kv_heads}, D={args.head_dim}, float32",
               overlap_rows(args),
               notes="On the busiest rank: comm alone, its exposed part and hidden = 1 - exposed / alone; forward: "
                     "first start to last end; imbalance = busiest rank's compute / mean (measured: emulated compute; "
                     "formula: unmasked pairs). Medians over repeats. 0 % (noise): exposed > alone: measurement noise "
                     "(the busiest rank's neighbours have less to compute, so its blocks are ready when it asks).")
    if "error" in parts:
        report("bench-15-error",
               f"Module 15: error against ring size; one sequence of {args.error_tokens} tokens, H={args.heads}, "
               f"K={args.kv_heads}, D={args.head_dim}; max |error| / max |value| against float64 SDPA and autograd",
               error_rows(args),
               notes="ring: c partial outputs, each rounded to the dtype, merged (and dq, dk, dv summed) in float32 "
                     "at least; accumulating in the dtype: the same ring with its merge and accumulators in bf16; "
                     "all-gather: one attention call per piece of queries, no merge. Zig-zag layout throughout.")


def check(parser, args):
    """Refuse bad arguments before any rank starts."""
    require_positive(parser, args, "batch", "tokens", "heads", "kv_heads", "head_dim", "repeats", "error_tokens")
    if not args.gflops > 0:
        parser.error(f"--gflops must be positive, got {args.gflops}")
    if args.heads % args.kv_heads:
        parser.error(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}")
    if args.tokens % 8:
        parser.error(f"--tokens {args.tokens} must be divisible by 8 (zig-zag on c = 4: 2c chunks)")
    if args.error_tokens % 16:
        parser.error(f"--error-tokens {args.error_tokens} must be divisible by 16 (zig-zag on c = 8: 2c chunks)")
