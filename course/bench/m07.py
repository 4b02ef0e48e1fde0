"""Module 07 benchmark: our FSDP against the formulas and against PyTorch's FSDP2, on CPU ranks.

    python main.py bench 07 [--nproc 2] [--steps 5] [--layers 4] [--dim 128]

Both train module 06's Llama (float32) on the same global batches over the same forked gloo ranks:
ours (m07_fsdp.py of the selected implementation: solutions/, or steps/ with --impl steps) and
`fully_shard` applied to each block and to the root of the nn.Module reference
(course/reference_llama.py), from the same initial weights. Columns:
  step ms              median wall time of one optimizer step (after one warm-up step)
  param bytes/rank     parameter memory one rank keeps between steps (FSDP2 also shards the
                       embedding and LM head; ours keeps them replicated)
  all-gathers, reduce-scatters, payload bytes: measured per step / per collective (logged by
                       course/collectives.py), then the formula of solutions/m07_payload.py
  final loss           mean over ranks at the last step
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from course.bench import llama_config, report, require_positive
from course.collectives import Collectives
from course.dataset import load_text, random_batch
from course.impl import load, reference
from course.launch import run_ranks
from course.reference_fsdp import fsdp2_llama


def _run(cfg, steps, batch, lr, which):
    torch.manual_seed(0)
    # The batches, the FSDP2 row's initial weights and the loss averaging come from the reference
    # (given code either way): what ours is compared with must not change with the code measured.
    ref06, ref07 = reference("m06_llama_model"), reference("m07_fsdp")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    rows = batch // world_size
    data, generator = load_text(), torch.Generator().manual_seed(0)
    collectives, block_params = Collectives(), None
    if which == "ours":
        model = load("m07_fsdp").FSDPLlama(cfg, rank, world_size, collectives)  # the implementation measured
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        param_bytes = sum(p.nbytes for p in model.parameters())
        block_params = model.layout.numel

        def step(tokens, targets):
            return model.train_step(tokens, targets, 1, optimizer)
    else:
        root = fsdp2_llama(ref06.LlamaModel(cfg))
        optimizer = torch.optim.AdamW(root.parameters(), lr=lr, weight_decay=0.0)
        param_bytes = sum(p.to_local().nbytes for p in root.parameters())

        def step(tokens, targets):
            loss = root(tokens, targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            return loss.item()
    times, losses = [], []
    for _ in range(steps + 1):
        tokens, targets = random_batch(data, batch, cfg.max_seq_len, generator)
        mine = slice(rank * rows, (rank + 1) * rows)
        dist.barrier()
        began = time.perf_counter()
        loss = step(tokens[mine], targets[mine])
        times.append(time.perf_counter() - began)
        losses.append(ref07.global_mean(loss))
    log = collectives.log
    return {"times": times[1:], "loss": losses[-1], "param_bytes": param_bytes,
            "all_gathers": sum(c.op == "all_gather" for c in log) / (steps + 1),
            "reduce_scatters": sum(c.op == "reduce_scatter" for c in log) / (steps + 1),
            "payloads": sorted({c.payload_bytes for c in log if c.op != "all_reduce"}),
            "block_params": block_params}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="main.py bench 07", description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5, help="timed steps (after one warm-up)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=128,
                        help="model width: dim // 16 query heads of 16, dim // 32 key/value heads (default 128)")
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args(argv)
    cfg = check(parser, args)
    # The formula columns are the theory the measurement is checked against: the reference's
    # formula, so that a wrong formula cannot agree with a wrong implementation.
    payload = reference("m07_payload")
    torch.set_num_threads(1)
    rows = []
    for which in ("ours", "FSDP2"):
        result = run_ranks(_run, args.nproc, cfg, args.steps, args.batch, 3e-3, which, timeout=300)[0]
        row = {"impl": which, "ranks": args.nproc, "step ms": 1e3 * statistics.median(result["times"]),
               "param bytes/rank": result["param_bytes"]}
        if which == "ours":
            t = payload.fsdp_traffic(result["block_params"], 4, args.nproc, cfg.n_layers, 1, kept=min(2, cfg.n_layers))
            row.update({"all-gathers": result["all_gathers"], "formula AG": t.all_gathers,
                        "reduce-scatters": result["reduce_scatters"], "formula RS": t.reduce_scatters,
                        "payload bytes": "/".join(map(str, result["payloads"])), "formula payload": t.payload_bytes})
        else:
            row.update({"all-gathers": "-", "formula AG": "-", "reduce-scatters": "-", "formula RS": "-",
                        "payload bytes": "-", "formula payload": "-"})
        row["final loss"] = result["loss"]
        rows.append(row)
    report("bench-07", f"FSDP on {args.nproc} CPU ranks: {cfg.n_layers} blocks of dim {cfg.dim}, "
                       f"batch {args.batch} x {cfg.max_seq_len} tokens, float32", rows,
           notes="Per step, after the first: the all-gathers of blocks still in the two buffers are skipped "
                 "(kept = 2). FSDP2's collectives are not logged (its own process-group calls).")


def check(parser, args):
    """Refuse bad arguments before any rank starts; returns the model's LlamaConfig (a given class,
    from the reference like every option check)."""
    require_positive(parser, args, "nproc", "steps", "layers", "batch")
    if args.batch % args.nproc:
        parser.error(f"--batch {args.batch} must be divisible by --nproc {args.nproc}")
    if args.dim < 32 or args.dim % 16:
        parser.error(f"--dim must be a multiple of 16 and at least 32 (dim // 16 query heads of 16, "
                     f"dim // 32 key/value heads), got {args.dim}")
    return llama_config(parser, f"--dim {args.dim}", dim=args.dim, n_heads=args.dim // 16,
                        n_kv_heads=args.dim // 32, head_dim=16, ffn_dim=args.dim * 8 // 3 // 16 * 16,
                        n_layers=args.layers, max_seq_len=64)
