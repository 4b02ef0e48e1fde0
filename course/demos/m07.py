"""`python main.py run 07 [--nproc N]`: train module 06's Llama with FSDP over N ranks, count the
collectives against the payload formula, and compare the losses with single-process training."""
import argparse
import time

import torch

from course.collectives import Collectives
from course.demos import log_every
from course.impl import load


def add_args(parser: argparse.ArgumentParser):
    parser.add_argument("--steps", type=int, default=30, help="training steps (default 30)")
    parser.add_argument("--batch", type=int, default=16, help="global batch, split over the ranks (default 16)")
    parser.add_argument("--microbatches", type=int, default=1,
                        help="microbatches per optimizer step, gradients accumulated (default 1)")
    parser.add_argument("--layers", type=int, default=4, help="blocks (default 4)")


def check_args(args):
    if min(args.steps, args.batch, args.microbatches, args.layers) < 1:
        raise ValueError(f"--steps, --batch, --microbatches and --layers must be positive, got {args.steps}, "
                         f"{args.batch}, {args.microbatches}, {args.layers}")
    if args.batch % (args.world_size * args.microbatches):
        raise ValueError(f"--batch {args.batch} must be divisible by ranks * microbatches = {args.world_size} * "
                         f"{args.microbatches}: every rank and microbatch gets the same number of rows")


def demo(args):
    m02, m06_block, m06_model = load("m02_comms"), load("m06_llama_block"), load("m06_llama_model")
    m07_fsdp, m07_payload = load("m07_fsdp"), load("m07_payload")
    # This module's shards, buffers and collectives are CPU tensors: gloo, even on a machine with GPUs.
    rank, world_size, _ = m02.init_distributed(backend="gloo")
    torch.set_num_threads(1)
    cfg, collectives = m06_block.LlamaConfig(n_layers=args.layers), Collectives()
    if rank == 0:
        print(f"FSDP over {world_size} ranks: {cfg.n_layers} blocks, global batch {args.batch} "
              f"({args.batch // world_size} rows per rank, {args.microbatches} microbatch(es)), {args.steps} steps")
    began = time.perf_counter()
    on_step = log_every(max(1, args.steps // 5), args.steps) if rank == 0 else None
    model, losses = m07_fsdp.train_fsdp(cfg, args.steps, args.batch, args.microbatches,
                                        collectives=collectives, on_step=on_step)
    elapsed = time.perf_counter() - began
    traffic = m07_payload.fsdp_traffic(model.layout.numel, model.shards[0].element_size(), world_size,
                                       cfg.n_layers, args.microbatches, kept=min(2, cfg.n_layers))
    sent = {op: collectives.counts(op) / args.steps for op in ("all_gather", "reduce_scatter")}
    payloads = {c.payload_bytes for c in collectives.log if c.op != "all_reduce"}
    if rank != 0:
        return
    print(f"  {args.steps} steps in {elapsed:.1f} s")
    print(f"Per step: {sent['all_gather']:g} all-gathers + {sent['reduce_scatter']:g} reduce-scatters "
          f"(formula: {traffic.all_gathers} + {traffic.reduce_scatters}), payload {sorted(payloads)} bytes "
          f"(formula: {traffic.payload_bytes}); {traffic.full_buffer_bytes} bytes in the two full-block buffers")
    # The same training in one process, on the whole batch (rank 0 only).
    _, expected = m06_model.train(cfg, args.steps, batch=args.batch)
    worst = max(abs(a - b) for a, b in zip(losses, expected))
    print(f"Single-process training of the same model on the same global batches: max |loss difference| "
          f"{worst:.2e} -> {'match' if worst < 1e-4 else 'MISMATCH'} (float32; the ranks sum the gradient "
          f"in a different order, so agreement is to rounding, not bit for bit)")
