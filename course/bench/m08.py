"""Module 08 benchmark: one training step with all weights resident vs streamed from host memory.

    python main.py bench 08 --device cuda     (on CPU it only says that it needs CUDA)

Module 06's Llama in bf16, with blocks the size of a Llama-3-8B block by default (dim 4096, 32/8
heads, FFN 14336: 218M parameters, 436 MB per block). One step = forward + backward; after each
step the weights are invalidated, as an optimizer step would, so every step copies 2L - 2 blocks
(the last two stay resident for the backward). Rows:
  compute only          every block resident on the GPU (ResidentWeights): no copies at all
  copy only             the same 2L - 2 block copies, pinned host -> device, with no compute
  streamed, no prefetch HostWeights, but each copy issued only when its block is needed (NoPrefetch)
  streamed, prefetch    HostWeights as the model loop drives it: copy l+1 while computing l
Target: prefetch <= 1.15 x max(compute only, copy only); no prefetch ~ their sum.

The batch (--batch 0, the default) is chosen so that a block's forward takes about as long as its
copy; its backward, about twice as long, then hides the copies too. A step computes L forwards and
L backwards (~3L copy times) and copies 2L - 2 blocks, so compute ~ 3L / (2L - 2) x copies (2x for
L = 4, 1.8x for the default L = 6): comparable, and prefetch can approach the bound. One resident step at batch 1 is timed,
and the batch is scaled to that target.
Peak GB is torch.cuda.max_memory_allocated during the variant's steps.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from course.bench import llama_config, report, require_positive
from course.impl import load


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="main.py bench 08", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cuda (timings); on cpu the benchmark only explains itself")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--ffn", type=int, default=14336)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=0, help="sequences per step (0: balance compute and copies)")
    parser.add_argument("--reps", type=int, default=5, help="timed steps per variant (after one warm-up)")
    args = parser.parse_args(argv)
    cfg = check(parser, args)
    if not args.device.startswith("cuda"):
        print("bench 08 needs CUDA: it times copies from pinned host memory overlapping GPU compute.\n"
              "Run `python main.py bench 08 --device cuda` on a GPU machine; on CPU, "
              "`python main.py run 08` checks the same weight source's stream logic.")
        return
    if not torch.cuda.is_available():
        print("bench 08 needs CUDA, and torch.cuda.is_available() is False here.")
        return
    gpu_timings(args, cfg)


def check(parser, args):
    """Refuse bad arguments before anything is built; returns the model's LlamaConfig (a given class,
    from the reference like every option check)."""
    require_positive(parser, args, "layers", "dim", "heads", "kv_heads", "ffn", "seq", "reps")
    if args.batch < 0:
        parser.error(f"--batch must be at least 0 (0: balance compute and copies), got {args.batch}")
    if args.dim % args.heads:
        parser.error(f"--dim {args.dim} must be divisible by --heads {args.heads} (head_dim = dim // heads)")
    return llama_config(parser, f"--dim {args.dim} --heads {args.heads} --kv-heads {args.kv_heads}",
                        dim=args.dim, n_heads=args.heads, n_kv_heads=args.kv_heads, head_dim=args.dim // args.heads,
                        ffn_dim=args.ffn, n_layers=args.layers, max_seq_len=args.seq)


def gpu_timings(args, cfg):
    # The selected implementation (--impl): module 08's weight source, and module 06's model loop,
    # which drives it (the prefetch order is the loop's) and also runs the all-resident baseline.
    m06, m08 = load("m06_llama_model"), load("m08_host_weights")
    from course.streams import CudaRuntime

    BlockWeights = load("m06_llama_block").BlockWeights
    print(f"Building {cfg.n_layers} blocks of dim {cfg.dim}, FFN {cfg.ffn_dim} in bf16 on the host ...", flush=True)
    model = m06.LlamaModel(cfg, dtype=torch.bfloat16)
    host_blocks, model.blocks = model.blocks, []
    model.to("cuda")
    runtime = CudaRuntime()
    block_bytes = sum(t.nbytes for t in host_blocks[0].tensors())

    def tokens_for(batch):
        g = torch.Generator().manual_seed(0)
        t = torch.randint(0, cfg.vocab_size, (batch, cfg.max_seq_len + 1), generator=g)
        return t[:, :-1].cuda(), t[:, 1:].cuda()

    def time_steps(weights, batch, reps):
        model.weights = weights
        tokens, targets = tokens_for(batch)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(reps + 1):
            began = time.perf_counter()
            loss, grads = model.forward_backward(tokens, targets)
            del grads
            torch.cuda.synchronize()
            times.append(time.perf_counter() - began)
            weights.invalidate()  # as an optimizer step would: the next step copies again
        return statistics.median(times[1:]), torch.cuda.max_memory_allocated() / 1e9

    copies_per_step = 2 * cfg.n_layers - 2 if cfg.n_layers > 1 else 1

    def time_copies(streamed, reps):
        stream = torch.cuda.Stream()
        times = []
        for _ in range(reps + 1):
            torch.cuda.synchronize()
            began = time.perf_counter()
            with torch.cuda.stream(stream):
                for i in range(copies_per_step):
                    streamed.buffers[i % 2].flat.copy_(streamed.host[i % cfg.n_layers], non_blocking=True)
            stream.synchronize()
            times.append(time.perf_counter() - began)
        return statistics.median(times[1:])

    # Its own HostWeights, freed before the resident run, so its two device buffers do not count
    # in the resident run's peak memory.
    copy_s = time_copies(m08.HostWeights(host_blocks, runtime), args.reps)
    torch.cuda.empty_cache()
    print(f"One block: {block_bytes / 1e6:.0f} MB; {copies_per_step} copies per step take {copy_s * 1e3:.1f} ms "
          f"({copies_per_step * block_bytes / copy_s / 1e9:.1f} GB/s)", flush=True)

    resident = m06.ResidentWeights([BlockWeights(*(t.cuda() for t in b.tensors())) for b in host_blocks])
    batch = args.batch
    if batch == 0:
        one, _ = time_steps(resident, 1, 2)
        target = copy_s / copies_per_step * 3 * cfg.n_layers  # a block's forward ~ its copy
        batch = max(1, min(32, round(target / one)))
        print(f"Compute at batch 1: {one * 1e3:.1f} ms per step -> batch {batch}, so that a block's forward "
              f"takes about as long as its copy", flush=True)
    compute_s, compute_gb = time_steps(resident, batch, args.reps)
    model.weights = resident = None  # free the resident copies before measuring the streamed runs
    torch.cuda.empty_cache()
    streamed = m08.HostWeights(host_blocks, runtime)
    no_prefetch_s, no_prefetch_gb = time_steps(m08.NoPrefetch(streamed), batch, args.reps)
    prefetch_s, prefetch_gb = time_steps(streamed, batch, args.reps)
    bound = max(compute_s, copy_s)
    rows = [
        {"variant": "compute only (all resident)", "ms/step": compute_s * 1e3, "x max(compute, copy)": compute_s / bound,
         "block copies": 0, "peak GB": compute_gb},
        {"variant": "copy only", "ms/step": copy_s * 1e3, "x max(compute, copy)": copy_s / bound,
         "block copies": copies_per_step, "peak GB": float("nan")},
        {"variant": "streamed, no prefetch", "ms/step": no_prefetch_s * 1e3,
         "x max(compute, copy)": no_prefetch_s / bound, "block copies": copies_per_step, "peak GB": no_prefetch_gb},
        {"variant": "streamed, prefetch", "ms/step": prefetch_s * 1e3, "x max(compute, copy)": prefetch_s / bound,
         "block copies": copies_per_step, "peak GB": prefetch_gb},
    ]
    report("bench-08-gpu", f"Weights streamed from pinned host memory: {cfg.n_layers} blocks of {block_bytes / 1e6:.0f} MB, "
                           f"batch {batch} x {cfg.max_seq_len} tokens, bf16", rows, device="cuda",
           notes=f"Targets: prefetch <= 1.15 x max(compute, copy) (measured {prefetch_s / bound:.2f}); "
                 f"no prefetch ~ compute + copy = {(compute_s + copy_s) * 1e3:.1f} ms (measured {no_prefetch_s * 1e3:.1f}). "
                 f"Streamed runs hold 2 blocks on the GPU instead of {cfg.n_layers}.")
