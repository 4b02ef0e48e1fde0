"""Module 07 benchmark: our FSDP against the formulas and against PyTorch's FSDP2, on CPU ranks.

    python main.py bench 07 [--nproc 2] [--steps 5] [--layers 4] [--dim 128]

Both train module 06's Llama (float32) on the same global batches over the same forked gloo ranks:
ours (m07_fsdp.py of the selected implementation: solutions/, or steps/ with --impl steps) and
`fully_shard` applied to each block and to the root of the nn.Module reference
(course/reference_llama.py), from the same initial weights. Columns:
  step ms              median wall time of one optimizer step (after one warm-up step)
  param bytes/rank     parameter memory one rank keeps between steps (FSDP2 also shards the
                       embedding and LM head; ours keeps them replicated)
  state bytes/rank     what rank 0 keeps between steps: weights, gradients, AdamW's two moments, and
                       (ours) the two gather buffers; then the formula (state_formula)
  all-gathers, reduce-scatters, payload bytes: measured per step / per collective (logged by
                       course/collectives.py), then the formula of solutions/m07_payload.py
  final loss           mean over ranks at the last step
"""
from __future__ import annotations

import argparse
import math
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

        def state_bytes():  # the shards' and replicated weights' state, and the two gather buffers
            return (_bytes(model.parameters(), model.grads(), optimizer)
                    + sum(b.flat.nbytes for b in model.weights.buffers))
    else:
        root = fsdp2_llama(ref06.LlamaModel(cfg))
        optimizer = torch.optim.AdamW(root.parameters(), lr=lr, weight_decay=0.0)
        param_bytes = sum(p.to_local().nbytes for p in root.parameters())

        def step(tokens, targets):
            loss = root(tokens, targets)
            loss.backward()
            optimizer.step()
            kept["state"] = state_bytes()  # before zero_grad frees the gradients
            optimizer.zero_grad()
            return loss.item()

        def state_bytes():  # every parameter sharded: this rank's slices of weights, gradients, AdamW state
            return _bytes(list(root.parameters()), [p.grad for p in root.parameters()], optimizer)
    times, losses, kept = [], [], {}
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
            "state_bytes": kept["state"] if "state" in kept else state_bytes(),
            "all_gathers": sum(c.op == "all_gather" for c in log) / (steps + 1),
            "reduce_scatters": sum(c.op == "reduce_scatter" for c in log) / (steps + 1),
            "payloads": sorted({c.payload_bytes for c in log if c.op != "all_reduce"}),
            "block_params": block_params}


def _bytes(params, grads, optimizer) -> int:
    """Bytes of weights, gradients and AdamW's two moments (its scalar step counters left out); for
    DTensors, this rank's local part."""
    moments = [optimizer.state[p][m] for p in optimizer.param_groups[0]["params"] for m in ("exp_avg", "exp_avg_sq")]
    return sum(getattr(t, "to_local", lambda: t)().nbytes for t in [*params, *grads, *moments])


def state_formula(cfg, world_size: int, which: str, dtype_bytes: int = 4) -> int:
    """Bytes one rank (rank 0) keeps between steps, from the chapter: weights, gradients and AdamW's
    two moments are 4 copies of what it owns. Ours owns ceil(P / N) of each block's P parameters and
    the replicated embedding, final norm and LM head, plus two full-block gather buffers; FSDP2 owns
    ceil(rows / N) rows of every parameter, replicated ones included, and keeps no buffer."""
    block = reference("m06_llama_model").LlamaModel(cfg).blocks[0]
    shapes = [tuple(t.shape) for t in block.tensors()] * cfg.n_layers
    replicated = [(cfg.vocab_size, cfg.dim), (cfg.dim,), (cfg.vocab_size, cfg.dim)]
    if which == "ours":
        shard = -(-sum(math.prod(s) for s in shapes[:len(shapes) // cfg.n_layers]) // world_size)
        owned = cfg.n_layers * shard + sum(math.prod(s) for s in replicated)
        return 4 * owned * dtype_bytes + 2 * world_size * shard * dtype_bytes
    rows = lambda shape: -(-shape[0] // world_size) * math.prod(shape[1:])  # noqa: E731
    return 4 * sum(rows(s) for s in shapes + replicated) * dtype_bytes


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
               "param bytes/rank": result["param_bytes"], "state bytes/rank": result["state_bytes"],
               "formula state": state_formula(cfg, args.nproc, which)}
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
