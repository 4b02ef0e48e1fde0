"""Module 10's benchmark: activation memory and step time of each recompute option, next to an
autograd Llama with and without torch.utils.checkpoint.

    python main.py bench 10                                # CPU, a small model (well under a minute)
    python main.py bench 10 --device cuda --preset gpu     # dim 2048, 8 layers, 2048 tokens, batch 4, bf16
    python main.py bench 10 --device cuda --dim 4096       # any preset value can be overridden

For every option: the activation bytes one layer keeps, from the formula and as measured in the
store; on CUDA the peak memory of a training step above what was allocated before it
(torch.cuda.max_memory_allocated); the median step time (forward + backward, no optimizer); and
both relative to no recompute. The autograd reference shares the chunked LM head, so the two
sides differ only in their blocks.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.utils.checkpoint import checkpoint

from course.bench import llama_config, report, require_positive
from course.fused_attention import FusedAttention
from course.impl import load
from course.reference_llama import ReferenceLlama

PRESETS = {
    "cpu": dict(dim=128, heads=4, kv_heads=2, ffn=352, layers=4, seq_len=256, batch=4, vocab=256, dtype="float32"),
    "gpu": dict(dim=2048, heads=16, kv_heads=4, ffn=5632, layers=8, seq_len=2048, batch=4, vocab=32000,
                dtype="bfloat16"),
}
MiB = 2 ** 20


def parse(argv):
    parser = argparse.ArgumentParser(prog="main.py bench 10", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--preset", choices=PRESETS, default=None, help="model size (default: cpu, or gpu on cuda)")
    for name, value in PRESETS["cpu"].items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=None,
                            help=f"override the preset's {name}")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per row (median reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before each row (default 2)")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (default 1)")
    parser.add_argument("--attention", choices=("chunked", "fused"), default="chunked",
                        help="the hand-written block's attention: module 06's chunked one (default), or the "
                             "fused flash kernel of course/fused_attention.py")
    args = parser.parse_args(argv)
    preset = PRESETS[args.preset or ("gpu" if args.device.startswith("cuda") else "cpu")]
    for name, value in preset.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    check(parser, args)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda, but torch sees no CUDA device")
    return args


def check(parser, args):
    """Refuse bad sizes with one line before anything is built (LlamaConfig's own checks: a given
    class, from the reference like every option check)."""
    require_positive(parser, args, "dim", "heads", "kv_heads", "ffn", "layers", "seq_len", "batch", "vocab",
                     "steps", "threads")
    if args.warmup < 0:
        parser.error(f"--warmup must be at least 0, got {args.warmup}")
    dtype = getattr(torch, args.dtype, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        parser.error(f"--dtype {args.dtype!r} is not a floating-point torch dtype (e.g. float32, bfloat16)")
    if args.dim % args.heads:
        parser.error(f"--dim {args.dim} must be divisible by --heads {args.heads} (head_dim = dim // heads)")
    llama_config(parser, f"--dim {args.dim} --heads {args.heads} --kv-heads {args.kv_heads}",
                 dim=args.dim, n_heads=args.heads, n_kv_heads=args.kv_heads, head_dim=args.dim // args.heads,
                 ffn_dim=args.ffn, vocab_size=args.vocab, n_layers=args.layers, max_seq_len=args.seq_len)


def synchronize(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def median_seconds(step, device, steps, warmup) -> float:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        synchronize(device)
        began = time.perf_counter()
        step()
        synchronize(device)
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def peak_mib(step, device):
    """Peak CUDA memory of one step above what was allocated before it; None on CPU. Every step
    measured here drops its gradients before it returns, so the baseline never holds an earlier
    step's gradients and every row's peak includes its own (comparable rows)."""
    if not device.startswith("cuda"):
        return None
    synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    step()
    synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - before) / MiB


def held_after_mib(forward, device):
    """CUDA memory still allocated after `forward` returns (what it keeps for a backward); None on CPU."""
    if not device.startswith("cuda"):
        return None
    synchronize(device)
    before = torch.cuda.memory_allocated(device)
    kept = forward()
    synchronize(device)
    held = torch.cuda.memory_allocated(device) - before
    del kept
    return held / MiB


def main(argv):
    args = parse(argv)
    if not args.device.startswith("cuda"):
        torch.set_num_threads(args.threads)
    m06_block, m06_model, m10 = load("m06_llama_block"), load("m06_llama_model"), load("m10_recompute")
    dtype, device = getattr(torch, args.dtype), args.device
    cfg = m06_block.LlamaConfig(dim=args.dim, n_heads=args.heads, n_kv_heads=args.kv_heads,
                                head_dim=args.dim // args.heads, ffn_dim=args.ffn, vocab_size=args.vocab,
                                n_layers=args.layers, max_seq_len=args.seq_len)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len), generator=g).to(device)
    targets = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len), generator=g).to(device)

    rows, base = [], {}
    model = m06_model.LlamaModel(cfg, seed=0, dtype=dtype).to(device)
    for option in m10.OPTIONS:
        # The model loop is unchanged; only the block differs.
        model.block = m10.RecomputeBlock(cfg, option, attention=FusedAttention() if args.attention == "fused" else None)
        measured = m10.measure_store_bytes(model, tokens)
        formula = m10.kept_bytes(cfg, args.batch, args.seq_len, dtype, option)

        def forward():
            stores = [model.block.new_store() for _ in range(cfg.n_layers)]
            return stores, model.forward_blocks(model.embedding[tokens], stores)

        def step():
            model.forward_backward(tokens, targets)  # the gradients are dropped at once

        seconds = median_seconds(step, device, args.steps, args.warmup)  # warms up first
        held = held_after_mib(forward, device)
        peak = peak_mib(step, device)
        base.setdefault("ours", (formula, held, peak, seconds))
        rows.append(row("hand-written", option, formula, measured, held, peak, seconds, base["ours"]))
    del model

    with torch.device(device):
        reference = ReferenceLlama(cfg, dtype)
    with torch.no_grad():
        reference.embedding.normal_()
        reference.lm_head.normal_(std=cfg.dim ** -0.5)
    chunked_ce = m06_model.chunked_cross_entropy
    for name, run_block in (("autograd", None),
                            ("torch.utils.checkpoint", lambda block, x: checkpoint(block, x, use_reentrant=False))):
        def step():
            hidden = reference.final_hidden(tokens, run_block)
            # d_head is kept through the backward, as the hand-written model keeps its LM head's gradient
            _, d_hidden, d_head = chunked_ce(hidden.detach(), reference.lm_head.detach(), targets)
            hidden.backward(d_hidden)
            del d_head
            for p in reference.parameters():  # dropped at once, as the hand-written model's are: so
                p.grad = None                 # no step starts with gradients allocated (see peak_mib)

        seconds = median_seconds(step, device, args.steps, args.warmup)
        held = held_after_mib(lambda: reference.final_hidden(tokens, run_block), device)
        peak = peak_mib(step, device)
        base.setdefault("reference", (None, held, peak, seconds))
        rows.append(row("nn.Module", name, None, None, held, peak, seconds, base["reference"]))

    title = (f"bench 10: recompute options, {cfg.n_layers} layers, dim {cfg.dim}, {cfg.n_heads}/{cfg.n_kv_heads} "
             f"heads, ffn {cfg.ffn_dim}, vocab {cfg.vocab_size}, batch {args.batch} x {args.seq_len} tokens, {args.dtype}, "
             f"{args.attention} attention in the hand-written block")
    notes = ("kept = activation bytes one layer's store keeps (formula / measured in the store); held_after_fwd =\n"
             "CUDA memory a forward of all layers leaves allocated for the backward; peak = max CUDA memory of a\n"
             "whole step above what was allocated before it (weights excluded; the step's own gradients, about\n"
             "one copy of the weights, included in every row: each step drops them before it ends, so none are\n"
             "allocated before the next); *_vs_base: relative to no recompute (hand-written) or to plain\n"
             "autograd (nn.Module). CUDA columns are '-' on CPU." +
             ("\nOn a CPU at this size step times move by tens of percent from run to run (caches, the allocator,\n"
              "other processes), so a recompute option can look faster than none: read the byte columns here and\n"
              "the time trade-off from a GPU run (notebooks/data/bench-10-gpu.json)." if not device.startswith("cuda") else ""))
    # One file per attention path, so a GPU batch that runs both keeps both tables.
    report("bench-10" if args.attention == "chunked" else "bench-10-fused", title, rows, device, notes)


def row(impl, option, formula, measured, held, peak, seconds, base):
    base_formula, base_held, base_peak, base_seconds = base

    def ratio(a, b):
        return round(a / b, 3) if a is not None and b else "-"
    return {"impl": impl, "option": option,
            "kept_MiB_formula": round(formula / MiB, 3) if formula is not None else "-",
            "kept_MiB_measured": round(measured / MiB, 3) if measured is not None else "-",
            "kept_vs_base": ratio(formula, base_formula),
            "held_after_fwd_MiB": round(held, 1) if held is not None else "-",
            "held_vs_base": ratio(held, base_held),
            "peak_MiB": round(peak, 1) if peak is not None else "-",
            "peak_vs_base": ratio(peak, base_peak),
            "step_ms": round(seconds * 1e3, 2),
            "time_vs_base": ratio(seconds, base_seconds)}
