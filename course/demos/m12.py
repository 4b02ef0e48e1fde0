"""`python main.py run 12 [--nproc t] [--sequence-parallel]`: train module 06's Llama with tensor (and
sequence) parallelism over t ranks; compare its losses with single-process training, the bytes its
collectives send with the formula, and the activations each rank keeps with the formula."""
import argparse
import dataclasses
import time

import torch

from course.collectives import Collectives
from course.demos import log_every
from course.impl import load, reference


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
    if min(args.steps, args.batch, args.microbatches, args.layers) < 1:
        raise ValueError(f"--steps, --batch, --microbatches and --layers must be positive, got {args.steps}, "
                         f"{args.batch}, {args.microbatches}, {args.layers}")
    if args.batch % args.microbatches:
        raise ValueError(f"--batch {args.batch} must be divisible by --microbatches {args.microbatches}")
    cfg = config(args)
    reference("m12_tp_block").check_tp_size(cfg, args.world_size, cfg.max_seq_len if args.sequence_parallel else None)


def kept_activation_bytes(model, tokens, targets) -> int:
    """Bytes every block's store holds once the forward is done (read at the first block's backward),
    for one forward_backward of `model`; its gradient accumulators are zeroed afterwards."""
    stores, kept = [], []
    new_store, backward = model.block.new_store, model.block.backward

    def counted_store():
        stores.append(new_store())
        return stores[-1]

    def first_backward(*args, **kwargs):
        if not kept:
            kept.append(sum(store.nbytes() for store in stores))
        return backward(*args, **kwargs)
    model.block.new_store, model.block.backward = counted_store, first_backward
    try:
        model.forward_backward(tokens, targets)
    finally:
        del model.block.new_store, model.block.backward  # the class's methods again
    for g in model.grads.tensors():
        g.zero_()
    return kept[0]


def demo(args):
    m02, m06_model = load("m02_comms"), load("m06_llama_model")
    m12_linear, m12_model = load("m12_tp_linear"), load("m12_tp_model")
    costs = reference("m12_tp_costs")  # the formulas the measurements are checked against
    rank, world_size, _ = m02.init_distributed(backend="gloo")  # CPU tensors: gloo, even with GPUs
    torch.set_num_threads(1)
    cfg, sp = config(args), args.sequence_parallel
    collectives = Collectives()
    tp = m12_linear.TPGroup(rank, world_size, collectives, sp)
    if rank == 0:
        print(f"Tensor parallel over t={world_size} ranks, sequence parallelism {'on' if sp else 'off'}: "
              f"{cfg.n_layers} blocks of dim {cfg.dim}, {cfg.n_heads} query / {cfg.n_kv_heads} key-value heads "
              f"({cfg.n_heads // world_size} / {cfg.n_kv_heads // world_size} a rank), FFN {cfg.ffn_dim} "
              f"({cfg.ffn_dim // world_size} a rank); batch {args.batch} x {cfg.max_seq_len}, "
              f"{args.microbatches} microbatch(es), {args.steps} steps")
    began = time.perf_counter()
    on_step = log_every(max(1, args.steps // 5), args.steps) if rank == 0 else None
    model, losses = m12_model.train(cfg, args.steps, tp, args.batch, args.microbatches, on_step=on_step)
    elapsed = time.perf_counter() - began
    sent = sum(c.sent_bytes for c in collectives.log) / args.steps
    counts = {op: collectives.counts(op) / args.steps for op in ("all_reduce", "all_gather", "reduce_scatter")}
    traffic = costs.tp_traffic(cfg, args.batch, cfg.max_seq_len, torch.float32, world_size, sp, args.microbatches)
    tokens = torch.zeros(args.batch // args.microbatches, cfg.max_seq_len, dtype=torch.long)
    kept = kept_activation_bytes(model, tokens, tokens)
    formula = cfg.n_layers * sum(costs.tp_activation_bytes(cfg, tokens.shape[0], cfg.max_seq_len, torch.float32,
                                                           world_size, sp).values())
    alone = cfg.n_layers * sum(costs.tp_activation_bytes(cfg, tokens.shape[0], cfg.max_seq_len, torch.float32,
                                                         1, False).values())
    if rank != 0:
        return
    print(f"  {args.steps} steps in {elapsed:.1f} s")
    print(f"Vocabulary {cfg.vocab_size}, padded to {model.padded_vocab}: {model.padded_vocab // world_size} "
          f"embedding and LM-head rows a rank")
    print(f"Per step: {counts['all_reduce']:g} all-reduces, {counts['all_gather']:g} all-gathers, "
          f"{counts['reduce_scatter']:g} reduce-scatters; bytes sent per rank {sent:,.0f}, formula "
          f"{traffic.sent_bytes:,.0f} -> {'equal' if sent == traffic.sent_bytes else 'MISMATCH'}")
    print(f"Activations the blocks keep, per rank and microbatch: {kept:,} bytes, formula {formula:,} -> "
          f"{'equal' if kept == formula else 'MISMATCH'} (one process keeps {alone:,}: {kept / alone:.2f} of it)")
    _, expected = m06_model.train(cfg, args.steps, args.batch)  # the same training in one process (rank 0 only)
    worst = max(abs(a - b) for a, b in zip(losses, expected))
    print(f"Single-process training of the same model on the same batches: max |loss difference| {worst:.2e} -> "
          f"{'match' if worst < 1e-4 else 'MISMATCH'} (float32; the ranks sum partial products in another "
          f"order, so agreement is to rounding, not bit for bit)")
