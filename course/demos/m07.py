"""`python main.py run 07 [--nproc d]`: train module 06's Llama with FSDP over the d ranks of one data
group, count the collectives against the payload formula, and compare the losses with single-process
training."""
import argparse
import time

import torch

from course.costs import StepCost, measured_cost
from course.demos import log_every
from course.impl import load, reference
from course.mesh import world_group
from course.splits import check_splits


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
    check_splits(reference("m06_llama_block").LlamaConfig(n_layers=args.layers), {"d": args.world_size}, args.batch,
                 args.microbatches)


def demo(args):
    m02, m06_block, m06_model = load("m02_comms"), load("m06_llama_block"), load("m06_llama_model")
    m07_fsdp, m07_payload = load("m07_fsdp"), load("m07_payload")
    # This module's shards, buffers and collectives are CPU tensors: gloo, even on a machine with GPUs.
    m02.init_distributed(backend="gloo")
    torch.set_num_threads(1)
    dp = world_group("d")  # the whole job is one data-parallel group
    cfg = m06_block.LlamaConfig(n_layers=args.layers)
    if dp.index == 0:
        print(f"FSDP over d={dp.size} ranks: {cfg.n_layers} blocks, global batch {args.batch} "
              f"({args.batch // dp.size} rows per rank, {args.microbatches} microbatch(es)), {args.steps} steps")
    began = time.perf_counter()
    on_step = log_every(max(1, args.steps // 5), args.steps) if dp.index == 0 else None
    model, losses = m06_model.fit(m07_fsdp.FSDPLlama(cfg, dp), args.steps, args.batch,
                                  n_microbatches=args.microbatches, on_step=on_step)
    elapsed = time.perf_counter() - began
    log = dp.collectives.log
    measured = measured_cost(log[:len(log) // args.steps])  # every step issues the same: the first one's
    formula = m07_payload.fsdp_traffic(cfg, {"d": dp.size}, torch.float32, args.microbatches, kept=min(2, cfg.n_layers))
    if dp.index != 0:
        return
    print(f"  {args.steps} steps in {elapsed:.1f} s")
    print(f"One step on one rank, measured (formula): {measured.n_calls(op='all_gather')} "
          f"({formula.n_calls(op='all_gather')}) all-gathers, {measured.n_calls(op='reduce_scatter')} "
          f"({formula.n_calls(op='reduce_scatter')}) reduce-scatters (the outer weights' one each a microbatch "
          f"included); {measured.sent_bytes():,.0f} ({formula.sent_bytes():,.0f}) bytes sent -> "
          f"{'equal' if measured == StepCost(formula.sent, formula.calls) else 'MISMATCH'}")
    print(f"Kept per rank between steps: {formula.state_bytes:,} bytes of shards (blocks, embedding, final norm, "
          f"LM head), their gradients and AdamW moments (formula); inside a step {formula.memory['buffers']:,} of "
          f"buffers (two full blocks, the outer weights whole, two shards)")
    # The same training in one process, on the whole batch (rank 0 only).
    _, expected = m06_model.train(cfg, args.steps, batch=args.batch)
    worst = max(abs(a - b) for a, b in zip(losses, expected))
    print(f"Single-process training of the same model on the same global batches: max |loss difference| "
          f"{worst:.2e} -> {'match' if worst < 1e-4 else 'MISMATCH'} (float32; the ranks sum the gradient "
          f"in a different order, so agreement is to rounding, not bit for bit)")
