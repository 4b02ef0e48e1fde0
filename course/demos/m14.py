"""`python main.py run 14 [--nproc d] [--bucket-mb C] [--zero 0|1|2] [--microbatches m]`: train
course/reference_llama.py's Llama (autograd) data-parallel over d ranks with buckets of at most C
MiB, plain (ZeRO-0, DDP) or sharded (ZeRO-1, ZeRO-2); print the buckets and when each left during
the backward, the bytes sent per step and kept per rank against the formulas, and the losses
against one process trained on the whole batch."""
import argparse
import math
import time

import torch
import torch.nn.functional as F

from course.costs import measured_cost
from course.dataset import load_text, random_batch
from course.demos import log_every
from course.impl import load, reference
from course.mesh import world_group
from course.reference_llama import ModularLlama

MiB = 2 ** 20


def add_args(parser: argparse.ArgumentParser):
    parser.add_argument("--bucket-mb", type=float, default=0.1,
                        help="bucket cap C in MiB, as DDP's bucket_cap_mb (default 0.1: a few buckets of this model)")
    parser.add_argument("--zero", type=int, default=0, help="ZeRO stage: 0 (DDP), 1 (AdamW state sharded) or 2 "
                                                            "(gradients too) (default 0)")
    parser.add_argument("--microbatches", type=int, default=1,
                        help="micro-steps per optimizer step, gradients accumulated (default 1)")
    parser.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    parser.add_argument("--batch", type=int, default=8, help="global batch of sequences, split over the ranks (default 8)")
    parser.add_argument("--layers", type=int, default=2, help="blocks (default 2)")


def check_args(args):
    if not args.bucket_mb > 0:
        raise ValueError(f"--bucket-mb must be a positive number of MiB, got {args.bucket_mb:g}")
    if not math.isfinite(args.bucket_mb):
        raise ValueError(f"--bucket-mb must be a finite number of MiB, got {args.bucket_mb:g} (one bucket of "
                         f"everything: give more MiB than the model holds, e.g. 1000)")
    if int(args.bucket_mb * MiB) < 1:
        raise ValueError(f"--bucket-mb {args.bucket_mb:g} is under one byte (the cap is whole bytes): give at least "
                         f"{1 / MiB:.3g} MiB")
    if args.zero not in (0, 1, 2):
        raise ValueError(f"--zero must be a ZeRO stage, 0, 1 or 2, got {args.zero} (stage 3 is module 07's FSDP)")
    if min(args.steps, args.batch, args.microbatches, args.layers) < 1:
        raise ValueError(f"--steps, --batch, --microbatches and --layers must be at least 1, got {args.steps}, "
                         f"{args.batch}, {args.microbatches}, {args.layers}")
    if args.batch % args.world_size:
        raise ValueError(f"--batch {args.batch} must be divisible by d = --nproc {args.world_size}: every rank "
                         f"trains on the same number of rows")
    if (args.batch // args.world_size) % args.microbatches:
        raise ValueError(f"the {args.batch // args.world_size} rows of a rank do not split into --microbatches "
                         f"{args.microbatches} equal microbatches")


def config(args):
    return reference("m06_llama_block").LlamaConfig(n_layers=args.layers)


def build(cfg):
    torch.manual_seed(0)
    return ModularLlama(cfg, torch.float32)


def batches(cfg, steps, batch):
    """The global batches of every step, the same on every rank (drawn from one seed)."""
    data, generator = load_text(), torch.Generator().manual_seed(0)
    return [random_batch(data, batch, cfg.max_seq_len, generator) for _ in range(steps)]


def kept_bytes(model, ddp, optimizer) -> dict:
    """What this rank holds between steps: the memory behind its parameters and gradients, AdamW's moments."""
    def storages(tensors):
        return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in tensors if t is not None}.values())
    grads = [p.grad for p in model.parameters()] + [b.grads for b in ddp.buckets] + list(getattr(ddp, "grad_shards", []))
    return {"parameters": storages(model.parameters()), "gradients": storages(grads),
            "optimizer": sum(s[k].nbytes for s in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq"))}


def one_process(cfg, steps, batch) -> list[float]:
    model = build(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    losses = []
    for tokens, targets in batches(cfg, steps, batch):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(tokens).reshape(-1, cfg.vocab_size), targets.reshape(-1))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def demo(args):
    m02, dp, ts, zero = load("m02_comms"), load("m14_data_parallel"), load("m14_train_step"), load("m14_zero")
    costs = reference("m14_costs")  # the formulas the measurements are checked against
    rank, world_size, _ = m02.init_distributed(backend="gloo")  # CPU tensors: gloo, even with GPUs
    torch.set_num_threads(1)
    group, cfg, cap = world_group(), config(args), int(args.bucket_mb * MiB)
    model = build(cfg)
    # When the backward produces each gradient (hooks registered before replicate's run first) ...
    ready_at = []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: ready_at.append(time.perf_counter()))
    kind = {} if args.zero == 0 else {"kind": zero.ZeroDataParallel, "stage": args.zero}
    ddp = dp.replicate(model, group, cap, **kind)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=3e-3, weight_decay=0.0)
    # ... and when each bucket leaves.
    sent_at, launch = {}, ddp.launch

    def timed_launch(bucket):
        sent_at[bucket.index] = time.perf_counter()
        return launch(bucket)
    ddp.launch = timed_launch
    n_params = sum(p.numel() for p in model.parameters())
    if rank == 0:
        print(f"Data parallel over d={world_size} ranks, ZeRO-{args.zero}: course/reference_llama.py's ModularLlama, "
              f"{cfg.n_layers} blocks of dim {cfg.dim} ({n_params:,} float32 parameters); global batch {args.batch} x "
              f"{cfg.max_seq_len} ({args.batch // world_size} rows a rank, {args.microbatches} micro-step(s)); "
              f"buckets of C = {args.bucket_mb:g} MiB; {args.steps} steps")
    on_step = log_every(max(1, args.steps // 5), args.steps) if rank == 0 else None
    losses, began = [], time.perf_counter()
    for step, (tokens, targets) in enumerate(batches(cfg, args.steps, args.batch)):
        del group.collectives.log[:], ready_at[:]
        losses.append(ts.train_step(ddp, model, tokens, targets, args.microbatches, optimizer))
        if on_step:
            on_step(step, losses[-1])
    elapsed = time.perf_counter() - began
    numels = [b.numel for b in ddp.buckets]
    sent = measured_cost(group.collectives.log)  # the last step's collectives
    formula = costs.traffic(numels, 4, world_size, args.zero, args.microbatches, axis=group.axis)
    kept, kept_formula = kept_bytes(model, ddp, optimizer), costs.state(numels, 4, world_size, args.zero).memory
    if rank != 0:
        return
    print(f"  {args.steps} steps in {elapsed:.1f} s")
    first, last = ready_at[-len(list(model.parameters()))], ready_at[-1]  # the last micro-step's backward
    print(f"Buckets, in the order they are sent (last step, rank 0; times from the backward's first gradient, "
          f"its last at {1e3 * (last - first):.1f} ms):")
    for bucket in ddp.buckets:
        names = bucket.names[0] if len(bucket.names) == 1 else f"{bucket.names[0]} .. {bucket.names[-1]}"
        when = 1e3 * (sent_at[bucket.index] - first)
        print(f"  bucket {bucket.index}: {len(bucket.names):2d} tensors, {bucket.numel * 4:9,d} bytes, sent at "
              f"{when:6.1f} ms{' (during the backward)' if sent_at[bucket.index] < last else ''}  {names}")
    same = sent.calls == formula.calls and all(abs(sent.sent.get(k, 0) - v) <= 1e-9 * v for k, v in formula.sent.items())
    print(f"Per step and rank: {sent.sent_bytes():,.0f} bytes sent in {sent.n_calls()} collectives "
          f"({', '.join(f'{c} {op}' for (_, op), c in sorted(sent.calls.items()))}); formula "
          f"{formula.sent_bytes():,.0f} in {formula.n_calls()} -> {'equal' if same else 'MISMATCH'}")
    replicated = 4 * n_params * 4
    print(f"Kept per rank: " + ", ".join(f"{what} {kept[what]:,}" for what in kept) + f" bytes; formula "
          + ", ".join(f"{kept_formula.get(what, 0):,}" for what in kept)
          + f" -> {'equal' if kept == {w: kept_formula.get(w, 0) for w in kept} else 'MISMATCH'} "
          f"({sum(kept.values()) / replicated:.2f} of plain data parallelism's 4 Ψ b = {replicated:,})")
    expected = one_process(cfg, args.steps, args.batch)  # the same training in one process (rank 0 only)
    worst = max(abs(a - b) for a, b in zip(losses, expected))
    print(f"One process on the whole batch, same steps: max |loss difference| {worst:.2e} -> "
          f"{'match' if worst < 1e-4 else 'MISMATCH'} (float32; the ranks add each gradient in another order, so "
          f"agreement is to rounding, not bit for bit)")
