"""`python main.py run 12 [--nproc t] [--sequence-parallel]`: train module 06's Llama with tensor (and
sequence) parallelism over the t ranks of one tensor group; compare its losses with single-process
training, the calls and bytes of its collectives with the formula, and the activations each rank
keeps with the formula."""
import argparse
import dataclasses
import time

import torch

from course.arguments import check_counts
from course.costs import StepCost, measured_activations, measured_cost
from course.demos import log_every
from course.impl import load, reference
from course.mesh import world_group
from course.splits import check_splits


def add_args(parser: argparse.ArgumentParser):
    parser.add_argument("--sequence-parallel", action="store_true",
                        help="split the residual stream and the norms along the sequence between the linears")
    parser.add_argument("--steps", type=int, default=30, help="training steps (default 30)")
    parser.add_argument("--batch", type=int, default=8, help="batch, the same on every rank (default 8)")
    parser.add_argument("--microbatches", type=int, default=1,
                        help="microbatches per optimizer step, gradients accumulated (default 1)")
    parser.add_argument("--layers", type=int, default=2, help="blocks (default 2)")


def config(args):
    """The module's model (8 query, 4 key/value heads: t up to 4), with --layers blocks."""
    return dataclasses.replace(reference("m12_tp_model").CONFIG, n_layers=args.layers)


def check_args(args):
    check_counts(args, "steps", "batch", "microbatches", "layers")
    cfg = config(args)
    check_splits(cfg, {"t": args.world_size}, args.batch, args.microbatches, cfg.max_seq_len, args.sequence_parallel)


def demo(args):
    m02, m06_model = load("m02_comms"), load("m06_llama_model")
    m12_model = load("m12_tp_model")
    costs = reference("m12_tp_costs")  # the formulas the measurements are checked against
    m02.init_distributed(backend="gloo")  # CPU tensors: gloo, even with GPUs
    torch.set_num_threads(1)
    cfg, sp = config(args), args.sequence_parallel
    tp = world_group("t")  # the whole job is one tensor-parallel group
    t = tp.size
    if tp.index == 0:
        print(f"Tensor parallel over t={t} ranks, sequence parallelism {'on' if sp else 'off'}: "
              f"{cfg.n_layers} blocks of dim {cfg.dim}, {cfg.n_heads} query / {cfg.n_kv_heads} key-value heads "
              f"({cfg.n_heads // t} / {cfg.n_kv_heads // t} a rank), FFN {cfg.ffn_dim} "
              f"({cfg.ffn_dim // t} a rank); batch {args.batch} x {cfg.max_seq_len}, "
              f"{args.microbatches} microbatch(es), {args.steps} steps")
    began = time.perf_counter()
    on_step = log_every(max(1, args.steps // 5), args.steps) if tp.index == 0 else None
    model, losses = m06_model.fit(m12_model.TPLlama(cfg, tp, sequence_parallel=sp), args.steps, args.batch,
                                  n_microbatches=args.microbatches, on_step=on_step)
    elapsed = time.perf_counter() - began
    log = tp.collectives.log
    measured = measured_cost(log[:len(log) // args.steps])  # every step issues the same: the first one's
    formula = costs.tp_traffic(cfg, {"t": t}, args.batch, torch.float32, args.microbatches, sp)
    tokens = torch.zeros(args.batch // args.microbatches, cfg.max_seq_len, dtype=torch.long)
    kept = measured_activations(model, tokens, tokens)
    kept_formula = costs.tp_activation_bytes(cfg, {"t": t}, args.batch, torch.float32, args.microbatches, sp)
    alone = costs.tp_activation_bytes(cfg, {"t": 1}, args.batch, torch.float32, args.microbatches)
    if tp.index != 0:
        return
    print(f"  {args.steps} steps in {elapsed:.1f} s")
    print(f"Vocabulary {cfg.vocab_size}, padded to {model.padded_vocab}: {model.padded_vocab // t} "
          f"embedding and LM-head rows a rank")
    calls = ", ".join(f"{measured.n_calls('t', op):g} ({formula.n_calls('t', op)}) {op.replace('_', '-')}s"
                      for op in ("all_reduce", "all_gather", "reduce_scatter"))
    same = measured == StepCost(formula.sent, formula.calls)
    print(f"One step on one rank, measured (formula): {calls}; bytes sent {measured.sent_bytes():,.0f} "
          f"({formula.sent_bytes():,.0f}) -> {'equal' if same else 'MISMATCH'}")
    kept_formula, alone = kept_formula.memory["activations"], alone.memory["activations"]
    print(f"Activations the blocks keep, per rank and microbatch: {kept:,} bytes, formula {kept_formula:,} -> "
          f"{'equal' if kept == kept_formula else 'MISMATCH'} (one process keeps {alone:,}: {kept / alone:.2f} of it)")
    _, expected = m06_model.train(cfg, args.steps, args.batch)  # the same training in one process (rank 0 only)
    worst = max(abs(a - b) for a, b in zip(losses, expected))
    print(f"Single-process training of the same model on the same batches: max |loss difference| {worst:.2e} -> "
          f"{'match' if worst < 1e-4 else 'MISMATCH'} (float32; the ranks sum partial products in another "
          f"order, so agreement is to rounding, not bit for bit)")
