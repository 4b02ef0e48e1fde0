"""Module 13 benchmark: the 2-D model on every mesh, its bytes against the formulas, its step time
against PyTorch's own 2-D stack, on CPU ranks.

    python main.py bench 13 [--meshes 1x1,1x4,2x2,4x1] [--steps 10] [--dim 64] [--layers 2] [--batch 8]

For each mesh d x t, both train module 06's Llama (float32) on the same global batches on the same
forked gloo ranks, from the same initial weights, their steps interleaved (who goes first alternates
from step to step, so that other jobs on the machine slow both alike): ours (m13_llama_2d.py of the
selected implementation, --impl) and PyTorch's DTensor tensor parallelism over t with FSDP2 over d
(course/reference_2d.py). Columns:
  step ms         median wall time of one optimizer step, from a barrier to the next (the slowest
                  rank), over the timed steps (after one warm-up step)
  ours/torch      the median of the step-by-step ratios of our step time over PyTorch's
  sent B/step     bytes rank 0 sends per step with the ring algorithms, then the formula of
                  solutions/m13_costs.py (a course/costs.py StepCost); ours logged by
                  course/collectives.py and read by course/costs.py's measured_cost, PyTorch's from the
                  collectives its FSDP2 and DTensor issue (course/reference_2d.TorchCollectiveLog)
  calls/step      the collectives rank 0 issues per step (ours also on a mesh axis of size 1, where
                  nothing is sent), then the formula's
  state B/rank    rank 0's weights, gradients and AdamW moments after a step (local blocks only),
                  then the formula (ours: 1/(d t) of everything; PyTorch's plan keeps the norms whole
                  over t, so it holds a little more)
  final loss      the mean over the global batch at the last step
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed.fsdp  # noqa: F401  imported once here, not in every forked rank
import torch.distributed.tensor.parallel  # noqa: F401

from course.bench import narrow_llama, report, require_positive
from course.costs import measured_cost
from course.dataset import load_text, random_batch
from course.impl import load, reference
from course.launch import run_ranks
from course.mesh import init_mesh, parse_mesh


def _run(cfg, mesh_shape, steps, batch, lr):
    """Both stacks on the same forked ranks, their steps interleaved (ours, torch, torch, ours, ours, ...: who
    goes first alternates), so that a CPU that gets busier or quieter (other jobs) slows both alike. Both
    train from module 06's initial weights on the same global batches, drawn as module 06's fit draws them,
    with AdamW (fit's settings). Returns, per stack, each step's time from a barrier to the next (the slowest
    rank's step), its last loss, the state rank 0 keeps and the bytes and calls of one step."""
    import torch.distributed as dist
    from course.reference_2d import TorchCollectiveLog, fsdp_tp_llama, loss_and_backward

    torch.manual_seed(0)
    d, t = mesh_shape
    m06 = reference("m06_llama_model")  # the initial weights and the batches: given code either way
    mesh = init_mesh({"d": d, "t": t})
    ours = load("m13_llama_2d").Llama2D(cfg, mesh)  # the implementation measured
    llama, device_mesh = fsdp_tp_llama(m06.LlamaModel(cfg), d, t)
    params = {"ours": ours.parameters(), "torch": list(llama.parameters())}
    optimizers = {which: torch.optim.AdamW(p, lr=lr, weight_decay=0.0) for which, p in params.items()}

    def torch_step(tokens, targets, n_microbatches, optimizer):
        optimizer.zero_grad()  # its backward adds into .grad: cleared before, so the last step's stay to be counted
        loss = loss_and_backward(llama, device_mesh, tokens, targets)
        optimizer.step()
        return loss
    step_of = {"ours": ours.train_step, "torch": torch_step}
    data, generator = load_text(), torch.Generator().manual_seed(0)
    times, losses, first_step = {w: [] for w in step_of}, {w: [] for w in step_of}, 0
    for step in range(steps + 1):  # the first step: a warm-up, untimed
        tokens, targets = random_batch(data, batch, cfg.max_seq_len, generator)
        for which in (("ours", "torch") if step % 2 == 0 else ("torch", "ours")):
            dist.barrier()
            began = time.perf_counter()
            losses[which].append(step_of[which](tokens, targets, 1, optimizers[which]))
            dist.barrier()
            times[which].append(time.perf_counter() - began)
        if step == 0:
            first_step = len(mesh.log)  # every step of ours issues the same: the first one's
    results = {which: {"times": times[which][1:], "loss": losses[which][-1],
                       "state": _state_bytes(params[which], optimizers[which])} for which in step_of}
    results["ours"]["sent"] = measured_cost(mesh.log[:first_step])
    counter = TorchCollectiveLog()  # one more step of PyTorch's, untimed: the dispatch mode that counts is slow
    with counter:
        torch_step(*random_batch(data, batch, cfg.max_seq_len, generator), 1, optimizers["torch"])
    results["torch"]["sent"] = (measured_cost(counter.log) if not counter.unknown else  # no total, not a wrong one
                                f"? ({', '.join(sorted(counter.unknown))})")
    return results


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
    parser.add_argument("--steps", type=int, default=10, help="timed steps of each, after one warm-up (default 10)")
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
        results = run_ranks(_run, d * t, cfg, (d, t), args.steps, args.batch, 3e-3, timeout=300)[0]
        ms = {which: 1e3 * statistics.median(r["times"]) for which, r in results.items()}
        ratio = statistics.median(a / b for a, b in zip(results["ours"]["times"], results["torch"]["times"]))
        sizes = {"d": d, "t": t}
        traffic, state = costs.step_traffic(cfg, sizes, args.batch), costs.state_bytes(cfg, sizes).state_bytes
        for which, r in results.items():
            sent, ours = r["sent"], which == "ours"
            rows.append({"mesh": f"{d}x{t}", "impl": which, "step ms": ms[which],
                         "ours/torch": ratio if ours else "-",
                         "calls/step": sent.n_calls() if not isinstance(sent, str) else "?",
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
                 "parallelize_module over t (course/reference_2d.py). Both on the same ranks, their steps interleaved; "
                 "ours/torch is the median of the step-by-step ratios.")


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
