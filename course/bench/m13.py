"""Module 13 benchmark: the 2-D model on every mesh, its bytes against the formulas, its step time
against PyTorch's own 2-D stack, on CPU ranks.

    python main.py bench 13 [--meshes 1x1,1x4,2x2,4x1] [--steps 5] [--dim 64] [--layers 2] [--batch 8]

For each mesh d x t, both train module 06's Llama (float32) on the same global batches over the same
forked gloo ranks, from the same initial weights: ours (m13_llama_2d.py of the selected
implementation, --impl) and PyTorch's DTensor tensor parallelism over t with FSDP2 over d
(course/reference_2d.py). Columns:
  step ms         median wall time of one optimizer step (after one warm-up step), rank 0
  ours/torch      our step time over PyTorch's, same mesh
  sent B/step     bytes rank 0 sends per step with the ring algorithms, then the formula of
                  solutions/m13_costs.py (a course/costs.py StepCost); ours logged by
                  course/collectives.py and read by course/costs.py's measured_cost, PyTorch's from the
                  collectives its FSDP2 and DTensor issue (course/reference_2d.TorchCollectiveLog)
  calls/step      ours: the collectives rank 0 issues per step, then the formula's
  state B/rank    rank 0's weights, gradients and AdamW moments after a step (local blocks only),
                  then the formula (ours: 1/(d t) of everything; PyTorch's plan keeps the norms whole
                  over t, so it holds a little more)
  final loss      the mean over the global batch at the last step
"""
from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed.fsdp  # noqa: F401  imported once here, not in every forked rank
import torch.distributed.tensor.parallel  # noqa: F401

from course.bench import narrow_llama, report, require_positive
from course.costs import measured_cost
from course.dataset import load_text, random_batch
from course.impl import load, reference
from course.launch import run_ranks
from course.mesh import init_mesh, parse_mesh
from course.timing import StepTimer


class Stepping:
    """A model as module 06's fit drives it, noting after each step the bytes this rank keeps: its
    weights, their gradients and AdamW's two moments (before any zero_grad frees the gradients)."""

    def __init__(self, cfg, step, params, zero_grad: bool = False):
        self.cfg, self.step, self.params, self.zero_grad = cfg, step, params, zero_grad
        self.state, self.optimizer = 0, None

    def parameters(self):
        return self.params

    def train_step(self, tokens, targets, n_microbatches, optimizer):
        loss = self.step(tokens, targets, n_microbatches, optimizer)
        self.state, self.optimizer = _state_bytes(self.params, optimizer), optimizer
        if self.zero_grad:  # PyTorch's backward adds into .grad: clear it for the next step
            optimizer.zero_grad()
        return loss


def _run(cfg, mesh_shape, steps, batch, lr, which):
    torch.manual_seed(0)
    d, t = mesh_shape
    m06 = reference("m06_llama_model")  # the loop, and the initial weights of PyTorch's row: given code either way
    log = []
    if which == "ours":
        mesh = init_mesh({"d": d, "t": t})
        log = mesh.log
        ours = load("m13_llama_2d").Llama2D(cfg, mesh)  # the implementation measured
        model = Stepping(cfg, ours.train_step, ours.parameters())
    else:
        from course.reference_2d import TorchCollectiveLog, fsdp_tp_llama, loss_and_backward
        llama, device_mesh = fsdp_tp_llama(m06.LlamaModel(cfg), d, t)

        def step(tokens, targets, n_microbatches, optimizer):
            loss = loss_and_backward(llama, device_mesh, tokens, targets)
            optimizer.step()
            return loss
        model = Stepping(cfg, step, list(llama.parameters()), zero_grad=True)
    timer = StepTimer(log)
    m06.fit(model, steps + 1, batch, lr, on_step=timer)  # the first step: a warm-up
    if which == "ours":
        sent = measured_cost(log[:timer.calls[0]])  # every step issues the same: the first one's
    else:  # one more step, untimed: the dispatch mode that counts would slow the timed ones
        counter = TorchCollectiveLog()
        with counter:
            model.train_step(*random_batch(load_text(), batch, cfg.max_seq_len, torch.Generator().manual_seed(1)), 1,
                             model.optimizer)
        sent = measured_cost(counter.log)
        if counter.unknown:  # a collective it could not read: no total rather than a wrong one
            sent = f"? ({', '.join(sorted(counter.unknown))})"
    return {"times": timer.times[1:], "loss": timer.losses[-1], "state": model.state, "sent": sent}


def _whole(x: float):
    """A byte count as an int when it is one (sums of ring shares usually are), so the table prints it whole."""
    return int(x) if float(x).is_integer() else x


def _state_bytes(params, optimizer) -> int:
    """This rank's bytes of weights, gradients and AdamW's two moments (DTensors: their local part)."""
    from course.reference_2d import local_bytes
    moments = [optimizer.state[p][m] for p in params for m in ("exp_avg", "exp_avg_sq")]
    return local_bytes([*params, *(p.grad for p in params), *moments])


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="main.py bench 13", description=__doc__.split("\n\n")[0])
    parser.add_argument("--meshes", default="1x1,1x4,2x2,4x1", help="comma-separated DxT meshes (default: the four)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps, after one warm-up (default 5)")
    parser.add_argument("--dim", type=int, default=64,
                        help="model width: dim // 8 query heads of 8, 4 key/value heads (default 64)")
    parser.add_argument("--layers", type=int, default=2, help="blocks (default 2)")
    parser.add_argument("--batch", type=int, default=8, help="global batch, its rows split over d (default 8)")
    parser.add_argument("--seq", type=int, default=64, help="sequence length (default 64)")
    args = parser.parse_args(argv)
    cfg, meshes = check(parser, args)
    costs = reference("m13_costs")  # the theory the measurement is checked against: the reference's formula
    torch.set_num_threads(1)
    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])
    rows = []
    for d, t in meshes:
        results = {which: run_ranks(_run, d * t, cfg, (d, t), args.steps, args.batch, 3e-3, which, timeout=300)[0]
                   for which in ("ours", "torch")}
        ours_ms, torch_ms = (1e3 * statistics.median(results[w]["times"]) for w in ("ours", "torch"))
        sizes = {"d": d, "t": t}
        traffic, state = costs.step_traffic(cfg, sizes, args.batch), costs.state_bytes(cfg, sizes).state_bytes
        for which, ms in (("ours", ours_ms), ("torch", torch_ms)):
            r, ours = results[which], which == "ours"
            sent = r["sent"]
            rows.append({"mesh": f"{d}x{t}", "impl": which, "step ms": ms,
                         "ours/torch": ours_ms / torch_ms if ours else "-",
                         "calls/step": sent.n_calls() if ours else "-",
                         "formula calls": traffic.n_calls() if ours else "-",
                         "sent B/step": sent if isinstance(sent, str) else _whole(sent.sent_bytes()),
                         "formula sent": _whole(traffic.sent_bytes()) if ours else "-",
                         "state B/rank": r["state"], "formula state": state if ours else "-",
                         "= formula": ("yes" if sent == traffic and r["state"] == state else "NO") if ours else "-",
                         "final loss": r["loss"]})
        print(f"  measured {d}x{t}", flush=True)
    report("bench-13", f"2-D sharding (FSDP over d, Megatron over t) on CPU ranks: {cfg.n_layers} blocks of dim "
                       f"{cfg.dim}, batch {args.batch} x {cfg.max_seq_len} tokens, float32", rows,
           notes="ours: m13_llama_2d (named axes, course/collectives.py); torch: FSDP2 fully_shard over d + DTensor "
                 "parallelize_module over t (course/reference_2d.py).")


def check(parser, args):
    """Refuse bad arguments before any rank starts (the reference's given checks); returns (cfg, meshes)."""
    require_positive(parser, args, "steps", "layers", "batch", "seq")
    cfg = narrow_llama(parser, args)
    model_2d = reference("m13_llama_2d")
    meshes = []
    for text in args.meshes.split(","):
        try:
            sizes = parse_mesh(text)
            if set(sizes) - {"d", "t"}:
                raise ValueError(f"--meshes lists DxT meshes (d, then t), got {text.strip()!r}")
            d, t = sizes.get("d", 1), sizes.get("t", 1)
            if d * t > 4:
                raise ValueError(f"mesh {text.strip()} needs {d * t} ranks: this benchmark runs 4 CPU ranks at most")
            model_2d.check_mesh_fits(cfg, sizes, args.batch)
        except ValueError as exc:
            parser.error(str(exc))
        meshes.append((d, t))
    return cfg, meshes
