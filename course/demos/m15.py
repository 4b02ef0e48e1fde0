"""`python main.py run 15 [--nproc 4] [--variant ring|zigzag|allgather|ulysses] [--data D]`: train module
06's Llama with context parallelism over c = nproc / D ranks (and data parallelism over D); compare
its losses with single-process training, show each context rank's work (unmasked query-key pairs),
the bytes one step sends against the formula, and a timeline of one attention forward on an
emulated device (every matmul takes the time a device of --gflops would need)."""
import argparse
import dataclasses
import math
import os
import time

import torch
import torch.distributed as dist

from course.arguments import check_counts, check_number
from course.costs import measured_cost
from course.cp_timeline import emulated_attention
from course.demos import check_writable, log_every, same_curve
from course.impl import load, reference
from course.mesh import init_mesh

VARIANT_NAMES = ("ring", "zigzag", "allgather", "ulysses")


def add_args(parser: argparse.ArgumentParser):
    parser.add_argument("--variant", default="zigzag",
                        help=f"how attention crosses the context ranks: {', '.join(VARIANT_NAMES)} (default zigzag)")
    parser.add_argument("--data", type=int, default=1, help="data-parallel ranks d; c = nproc / d (default 1)")
    parser.add_argument("--steps", type=int, default=10, help="training steps (default 10)")
    parser.add_argument("--batch", type=int, default=8, help="global batch, its rows split over d (default 8)")
    parser.add_argument("--layers", type=int, default=2, help="blocks (default 2)")
    parser.add_argument("--seq-len", type=int, default=32, help="sequence length T, split over c (default 32)")
    parser.add_argument("--gflops", type=float, default=0.01,
                        help="the emulated device's speed for the timeline, GFLOP/s (default 0.01)")
    parser.add_argument("--timeline", default=None, metavar="PATH", help="also draw the timeline into PATH.png")


def config(args):
    """The module's model (4 query, 2 key/value heads), with --layers blocks and sequences of --seq-len."""
    return dataclasses.replace(reference("m15_cp_model").CONFIG, n_layers=args.layers, max_seq_len=args.seq_len)


def check_args(args):
    """One line for a bad option, before any rank starts (the reference's given checks)."""
    check_counts(args, "steps", "batch", "layers", "seq_len", "data")
    check_number(args.gflops, "--gflops")  # 1e-300: each product would sleep longer than time.sleep can
    if args.world_size % args.data:
        raise ValueError(f"--data {args.data} must divide the {args.world_size} ranks: c = nproc / d")
    c = args.world_size // args.data
    reference("m15_cp_model").check_cp(config(args), args.variant, c, args.seq_len, args.data, args.batch)
    if args.timeline:
        check_timeline(args.timeline)


def check_timeline(prefix: str):
    """One line unless PREFIX.png can be written: its folder must exist (a typo is not made a new folder)."""
    folder = os.path.dirname(prefix)
    if folder and not os.path.isdir(folder):
        raise ValueError(f"--timeline {prefix}: there is no folder {folder} (make it first, or pick another PATH)")

    def refuse(message):
        raise ValueError(message)
    check_writable(prefix, "--timeline", refuse)


def text_timeline(per_rank: list[list], width: int = 64) -> list[str]:
    """One line a rank: '#' computing, '.' blocked in a message or collective, ' ' neither."""
    origin = min(start for spans in per_rank for kind, start, _, _ in spans if kind == "step")
    end = max(stop for spans in per_rank for kind, _, stop, _ in spans if kind == "step")
    scale = width / (end - origin)
    lines = []
    for rank, spans in enumerate(per_rank):
        row = [" "] * width
        for kind, start, stop, _ in spans:
            if kind in ("compute", "wait"):
                for column in range(int((start - origin) * scale), min(width, math.ceil((stop - origin) * scale))):
                    row[column] = "#" if kind == "compute" or row[column] == "#" else "."
        busy = sum(stop - start for kind, start, stop, _ in spans if kind == "compute")
        lines.append(f"  rank {rank} |{''.join(row)}| computing {1e3 * busy:6.1f} ms")
    lines.append(f"  {'':6s}  0 ms{'':{width - 12}s}{1e3 * (end - origin):6.1f} ms")
    return lines


def as_profiles(per_rank: list[list]) -> list[dict]:
    """The spans in course.profiler's export format, for course.plotting.plot_timeline: a compute span's
    colour is the number of waits before it (the ring's step)."""
    profiles = []
    for rank, spans in enumerate(per_rank):
        step = next((start, stop) for kind, start, stop, _ in spans if kind == "step")
        drawn, waits = [], 0
        for kind, start, stop, _ in sorted((s for s in spans if s[0] != "step"), key=lambda s: s[1]):
            waits += kind == "wait"
            drawn.append({"rank": rank, "kind": "forward" if kind == "compute" else "wait", "microbatch": waits,
                          "start": start, "end": stop, "step": 0, "stage": None})
        profiles.append({"rank": rank, "steps": [step], "peak_live": 0, "spans": drawn})
    return profiles


# --- the demo ------------------------------------------------------------------------------------

def demo(args):
    m02, cp_model, m06_model = load("m02_comms"), load("m15_cp_model"), load("m06_llama_model")
    costs, layouts = reference("m15_costs"), reference("m15_layout")  # the formulas the measurements meet
    rank, world_size, _ = m02.init_distributed(backend="gloo")  # CPU tensors: gloo, even with GPUs
    torch.set_num_threads(1)
    cfg, d = config(args), args.data
    c = world_size // d
    mesh = init_mesh({"d": d, "c": c})
    attention_kind, layout_kind = reference("m15_cp_model").VARIANTS[args.variant]
    if rank == 0:
        print(f"Context parallel, variant {args.variant} ({attention_kind.__name__}, {layout_kind} layout): c={c} "
              f"context x d={d} data ranks; {cfg.n_layers} blocks of dim {cfg.dim}, {cfg.n_heads} query / "
              f"{cfg.n_kv_heads} key-value heads; batch {args.batch} x {cfg.max_seq_len} tokens, {args.steps} steps")
    began = time.perf_counter()
    on_step = log_every(max(1, args.steps // 5), args.steps) if rank == 0 else None
    _, losses = m06_model.fit(cp_model.CPLlama(cfg, mesh, args.variant), args.steps, args.batch,
                              on_step=on_step)  # module 06's loop: the same batches as one process's
    elapsed = time.perf_counter() - began
    measured = measured_cost(mesh.log)
    formula = costs.cp_traffic(cfg, args.batch, cfg.max_seq_len, torch.float32, c, args.variant, d)

    # One attention forward of a block's size on the emulated device, every rank's spans to rank 0.
    b, n = args.batch // d, cfg.max_seq_len // c
    g = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(b, n, heads, cfg.head_dim, generator=g) for heads in
               (cfg.n_heads, cfg.n_kv_heads, cfg.n_kv_heads))
    spans = emulated_attention(args.variant, mesh.group("c"), q, k, v, args.gflops)
    per_rank = [None] * world_size
    dist.all_gather_object(per_rank, spans)
    if rank != 0:
        return
    print(f"  {args.steps} steps in {elapsed:.1f} s")
    _, expected = m06_model.train(cfg, args.steps, args.batch)  # the same training in one process
    print(f"Single-process training on the same batches: {same_curve(losses, expected)} (float32; the ranks add "
          f"the same terms in another order)")
    layout = layouts.SequenceLayout(layout_kind, cfg.max_seq_len, c)
    pairs = [layouts.unmasked_pairs(layout, i) for i in range(c)]
    print(f"Work per context rank, unmasked (query, key) pairs of one sequence ({layout_kind} layout): {pairs}; "
          f"largest / mean {max(pairs) / (sum(pairs) / c):.2f}")
    for (axis, op) in sorted(set(formula.sent) | set(measured.sent)):
        got, want = measured.sent.get((axis, op), 0) / args.steps, formula.sent.get((axis, op), 0)
        calls = measured.calls.get((axis, op), 0) / args.steps
        print(f"Bytes rank 0 sends per step over {axis!r} by {op}: {got:,.0f} in {calls:g} calls, formula {want:,.0f} "
              f"-> {'equal' if got == want else 'MISMATCH'}")
    print(f"Timeline of one attention forward on an emulated device of {args.gflops:g} GFLOP/s "
          f"(B={b}, T/c={n} tokens a rank; #: computing, .: waiting for a message or collective):")
    print("\n".join(text_timeline(per_rank)))
    if args.timeline:
        from course.plotting import plot_timeline
        plot_timeline(as_profiles(per_rank), args.timeline + ".png", step=0,
                      title=f"{args.variant}, c={c}: one attention forward (colour: ring step)")
        print(f"timeline: {args.timeline}.png")
