"""Module 07 benchmark: our FSDP against the formulas and against PyTorch's FSDP2, on CPU ranks.

    python main.py bench 07 [--nproc 2] [--steps 5] [--layers 4] [--dim 128]

Both train module 06's Llama (float32) on the same global batches over the same forked gloo ranks:
ours (m07_fsdp.py of the selected implementation: solutions/, or steps/ with --impl steps) and
`fully_shard` applied to each block and to the root of the nn.Module reference
(course/reference_llama.py), from the same initial weights. Columns:
  step ms              median wall time of one optimizer step (after one warm-up step)
  param bytes/rank     parameter memory one rank keeps between steps (both shard every weight: the
                       blocks, and the embedding, final norm and LM head as one more group)
  state bytes/rank     what rank 0 keeps between steps: weights, gradients, AdamW's two moments, and
                       every whole copy of a weight still allocated (ours: the gather buffers and the
                       outer weights; FSDP2: its unsharded parameters' storage, read from its
                       FSDPParams; both free theirs, so both count 0); then the formula (ours:
                       solutions/m07_payload.py's fsdp_traffic, its state_bytes; FSDP2:
                       fsdp2_state_formula below)
  buffers              ours: the whole copies allocated at once inside a step (both gather buffers
                       and the outer weights, read at the end of a microbatch's backward); then the
                       formula's buffers, which also count the FSDP Notes' two shard-sized
                       communication buffers (not allocated by ours, so not in the measured column)
  all-gathers, reduce-scatters, sent B/step: rank 0's calls and bytes sent in one step (logged by
                       course/collectives.py, read by course/costs.py's measured_cost), then the
                       formula's (fsdp_traffic)
  final loss           mean over the global batch at the last step
"""
from __future__ import annotations

import argparse
import math
import statistics

import torch
import torch.distributed as dist

from course.bench import llama_config, report, require_positive
from course.costs import measured_cost
from course.impl import load, reference
from course.launch import run_ranks
from course.mesh import world_group
from course.splits import check_splits
from course.timing import StepTimer
from course.reference_fsdp import fsdp2_llama, fsdp2_unsharded_bytes


class Ours:
    """Our FSDPLlama as module 06's fit drives it, noting after each step the bytes it keeps (its
    shards, their gradients, AdamW's two moments, and any whole copy still allocated), and inside the
    step the most bytes of whole copies allocated at once."""

    def __init__(self, model):
        self.model, self.cfg, self.state, self.whole = model, model.cfg, 0, 0
        reduce_scatter_outer = model.reduce_scatter_outer

        def measured(grads):  # at a microbatch's end both gather buffers and the outer weights are whole
            self.whole = max(self.whole, _whole_bytes(model))
            reduce_scatter_outer(grads)
        model.reduce_scatter_outer = measured

    def parameters(self):
        return self.model.parameters()

    def train_step(self, tokens, targets, n_microbatches, optimizer):
        loss = self.model.train_step(tokens, targets, n_microbatches, optimizer)  # the global batch
        self.state = _bytes(self.parameters(), self.model.grads(), optimizer) + _whole_bytes(self.model)
        return loss


def _whole_bytes(model) -> int:
    """Bytes of our FSDPLlama's whole copies now allocated: its gather buffers and its outer weights."""
    buffers = sum(b.flat.untyped_storage().nbytes() for b in model.weights.buffers if b.flat is not None)
    return buffers + (model.embedding.untyped_storage().nbytes() if model.embedding is not None else 0)


class FSDP2:
    """PyTorch's FSDP2 on the nn.Module reference, as module 06's fit drives a model: train_step on
    the global batch (this rank's rows), returning the global batch's mean loss."""

    def __init__(self, cfg, dp):
        self.cfg, self.dp, self.state = cfg, dp, 0
        self.root = fsdp2_llama(reference("m06_llama_model").LlamaModel(cfg))

    def parameters(self):
        return list(self.root.parameters())

    def train_step(self, tokens, targets, n_microbatches, optimizer):
        rows = tokens.shape[0] // self.dp.size
        mine = slice(self.dp.index * rows, (self.dp.index + 1) * rows)
        loss = self.root(tokens[mine], targets[mine])  # this rank's rows' mean loss
        loss.backward()  # FSDP2 averages the gradients over the ranks
        optimizer.step()
        self.state = (_bytes(self.parameters(), [p.grad for p in self.parameters()], optimizer)  # before zero_grad
                      + fsdp2_unsharded_bytes(self.root))
        optimizer.zero_grad()
        return _mean_over_ranks(loss.item())


def _run(cfg, steps, batch, lr, which):
    torch.manual_seed(0)
    # The loop and its batches (module 06's fit) and the FSDP2 row's initial weights come from the
    # reference (given code either way): what ours is compared with must not change with the code measured.
    dp = world_group("d")  # every rank of the job: one data-parallel group
    timer = StepTimer(dp.collectives.log)
    if which == "ours":
        model = Ours(load("m07_fsdp").FSDPLlama(cfg, dp))  # the implementation measured
        param_bytes = sum(p.nbytes for p in model.parameters())
    else:
        model = FSDP2(cfg, dp)
        param_bytes = sum(p.to_local().nbytes for p in model.parameters())
    reference("m06_llama_model").fit(model, steps + 1, batch, lr, on_step=timer)  # the first step: a warm-up
    cost = measured_cost(dp.collectives.log[:timer.calls[0]]) if which == "ours" else None  # each step the same
    return {"times": timer.times[1:], "loss": timer.losses[-1], "param_bytes": param_bytes,
            "buffers": getattr(model, "whole", 0), "state_bytes": model.state, "cost": cost}


def _mean_over_ranks(value: float) -> float:
    total = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def _bytes(params, grads, optimizer) -> int:
    """Bytes of weights, gradients and AdamW's two moments (its scalar step counters left out); for
    DTensors, this rank's local part."""
    moments = [optimizer.state[p][m] for p in optimizer.param_groups[0]["params"] for m in ("exp_avg", "exp_avg_sq")]
    return sum(getattr(t, "to_local", lambda: t)().nbytes for t in [*params, *grads, *moments])


def fsdp2_state_formula(cfg, d: int, dtype_bytes: int = 4) -> int:
    """Bytes one rank (rank 0) of FSDP2 keeps between steps: weights, gradients and AdamW's two moments
    are 4 copies of what it owns, ceil(rows / d) rows of every parameter (FSDP2 shards each parameter
    along its first dimension), the embedding, final norm and LM head included."""
    block = reference("m06_llama_model").LlamaModel(cfg).blocks[0]
    shapes = [tuple(t.shape) for t in block.tensors()] * cfg.n_layers
    outer = [(cfg.vocab_size, cfg.dim), (cfg.dim,), (cfg.vocab_size, cfg.dim)]
    rows = lambda shape: -(-shape[0] // d) * math.prod(shape[1:])  # noqa: E731
    return 4 * sum(rows(s) for s in shapes + outer) * dtype_bytes


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
               "param bytes/rank": result["param_bytes"], "state bytes/rank": result["state_bytes"]}
        if which == "ours":
            formula = payload.fsdp_traffic(cfg, {"d": args.nproc}, torch.float32, kept=min(2, cfg.n_layers))
            measured = result["cost"]
            row.update({"formula state": formula.state_bytes, "buffers": result["buffers"],
                        "formula buffers": formula.memory["buffers"],
                        "all-gathers": measured.n_calls("d", "all_gather"),
                        "formula AG": formula.n_calls("d", "all_gather"),
                        "reduce-scatters": measured.n_calls("d", "reduce_scatter"),
                        "formula RS": formula.n_calls("d", "reduce_scatter"),
                        "sent B/step": measured.sent_bytes(), "formula sent": formula.sent_bytes()})
        else:
            row.update({"formula state": fsdp2_state_formula(cfg, args.nproc), "buffers": "-", "formula buffers": "-",
                        "all-gathers": "-", "formula AG": "-", "reduce-scatters": "-", "formula RS": "-",
                        "sent B/step": "-", "formula sent": "-"})
        row["final loss"] = result["loss"]
        rows.append(row)
    report("bench-07", f"FSDP on {args.nproc} CPU ranks: {cfg.n_layers} blocks of dim {cfg.dim}, "
                       f"batch {args.batch} x {cfg.max_seq_len} tokens, float32", rows,
           notes="Per step: the all-gathers of blocks still in the two buffers are skipped (kept = 2); the outer "
                 "weights (embedding, final norm, LM head) are gathered and reduce-scattered once a microbatch. The "
                 "formula's buffers add the two shard-sized communication buffers of PyTorch's FSDP Notes. FSDP2's "
                 "collectives are not logged (its own process-group calls).")


def check(parser, args):
    """Refuse bad arguments before any rank starts; returns the model's LlamaConfig (a given class,
    from the reference like every option check)."""
    require_positive(parser, args, "nproc", "steps", "layers", "batch")
    if args.dim < 32 or args.dim % 16:
        parser.error(f"--dim must be a multiple of 16 and at least 32 (dim // 16 query heads of 16, "
                     f"dim // 32 key/value heads), got {args.dim}")
    cfg = llama_config(parser, f"--dim {args.dim}", dim=args.dim, n_heads=args.dim // 16,
                       n_kv_heads=args.dim // 32, head_dim=16, ffn_dim=args.dim * 8 // 3 // 16 * 16,
                       n_layers=args.layers, max_seq_len=64)
    try:
        check_splits(cfg, {"d": args.nproc}, args.batch)  # --batch over --nproc ranks
    except ValueError as exc:
        parser.error(f"--batch, --nproc: {exc}")
    return cfg
