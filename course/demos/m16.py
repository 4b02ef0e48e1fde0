"""`python main.py run 16 [--nproc R] [--experts E --top-k k --capacity-factor f | --dropless]
[--balance aux|bias|none] [--expert-ranks e]`: train module 06's Llama with MoE blocks, the experts
over e of the R data-parallel ranks; print the tokens each expert gets and the slots dropped, step by
step, the bytes a rank sends against the formula, and the losses against one process on the whole
batch (with a capacity: one process that drops by the same groups, one per rank and microbatch)."""
import argparse
import dataclasses
import time

import torch

from course.arguments import check_count, check_counts, check_number
from course.costs import measured_cost
from course.impl import load, reference
from course.mesh import init_mesh


def add_args(parser: argparse.ArgumentParser):
    parser.add_argument("--experts", type=int, default=8, help="E, experts per layer (default 8)")
    parser.add_argument("--top-k", type=int, default=2, help="k, experts per token (default 2)")
    parser.add_argument("--capacity-factor", type=float, default=None,
                        help="f: each rank may send an expert ceil(f k N / E) slots (default: dropless)")
    parser.add_argument("--dropless", action="store_true", help="no capacity: every routed slot is computed (default)")
    parser.add_argument("--balance", default="aux", help="aux (the loss), bias (auxiliary-loss-free) or none")
    parser.add_argument("--score", default="softmax", help="the router's scores: softmax or sigmoid (default softmax)")
    parser.add_argument("--shared-expert", action="store_true", help="add a shared expert every token goes through")
    parser.add_argument("--expert-ranks", type=int, default=None,
                        help="e, the ranks each layer's experts are split over (default: all of them)")
    parser.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    parser.add_argument("--batch", type=int, default=8, help="global batch, split over the ranks (default 8)")
    parser.add_argument("--microbatches", type=int, default=1,
                        help="microbatches a rank's share is cut into (default 1)")
    parser.add_argument("--layers", type=int, default=2, help="blocks (default 2)")


def configs(args):
    """(LlamaConfig, MoEConfig, e) from the options; MoEConfig raises its own one-line errors (given code).
    λ = 0.1 and γ = 0.01, ten times the published values: a tiny model trained for a few steps."""
    m16 = reference("m16_moe_model")
    router = reference("m16_router")
    cfg = dataclasses.replace(m16.CONFIG, n_layers=args.layers)
    moe = router.MoEConfig(n_experts=args.experts, top_k=args.top_k, expert_dim=m16.MOE.expert_dim,
                           shared_expert=args.shared_expert, score=args.score, capacity_factor=args.capacity_factor,
                           balance=args.balance, aux_coef=0.1, bias_rate=0.01)
    return cfg, moe, args.world_size if args.expert_ranks is None else args.expert_ranks


def check_args(args):
    if args.dropless and args.capacity_factor is not None:
        raise ValueError("--dropless and --capacity-factor exclude each other: a capacity drops slots")
    if args.capacity_factor is not None:
        if not args.capacity_factor > 0:
            raise ValueError(f"--capacity-factor must be positive (or --dropless), got {args.capacity_factor:g}")
        check_number(args.capacity_factor, "--capacity-factor")  # inf: no capacity at all is --dropless
    check_counts(args, "steps", "batch", "microbatches", "layers", "experts")
    if args.expert_ranks is not None:  # 0 is not "all of them": that is the default, without the option
        check_count(args.expert_ranks, "--expert-ranks", 1, args.world_size)
    _, moe, e = configs(args)
    if args.world_size % e:
        raise ValueError(f"--expert-ranks {e} must divide the {args.world_size} ranks: expert groups are carved out "
                         f"of the data ranks")
    try:
        reference("m16_router").check_expert_split(moe, e)
    except ValueError as error:
        raise ValueError(f"{error} (e = --expert-ranks, default --nproc)") from None
    if args.batch % (args.world_size * args.microbatches):
        raise ValueError(f"--batch {args.batch} must be divisible by ranks x microbatches = "
                         f"{args.world_size} x {args.microbatches}")


def demo(args):
    m02, m06, m16 = load("m02_comms"), load("m06_llama_model"), load("m16_moe_model")
    costs = reference("m16_costs")   # the formulas the measurements are checked against
    rank, world_size, _ = m02.init_distributed(backend="gloo")
    torch.set_num_threads(1)
    cfg, moe, e = configs(args)
    mesh = init_mesh({"d": world_size, "e": e})
    dtype = torch.float64   # so that the two runs route the same tokens: no near-tie decided by rounding
    if rank == 0:
        n_tokens = args.batch // world_size // args.microbatches * cfg.max_seq_len
        capacity = "dropless" if moe.capacity_factor is None else \
            f"capacity factor f={moe.capacity_factor:g} (κ={moe.capacity(n_tokens)} slots per expert, rank, microbatch)"
        print(f"MoE Llama: {cfg.n_layers} blocks of dim {cfg.dim}, E={moe.n_experts} experts of width "
              f"{moe.expert_dim}, top-{moe.top_k} {moe.score}, {capacity}, balance {moe.balance}"
              f"{dict(aux=f' (λ={moe.aux_coef:g})', bias=f' (γ={moe.bias_rate:g})').get(moe.balance, '')}"
              f"{', a shared expert' if moe.shared_expert else ''}")
        print(f"d={world_size} data ranks; experts over e={e} ({moe.n_experts // e} a rank), each expert on "
              f"{world_size // e} rank(s); batch {args.batch} x {cfg.max_seq_len}, {args.microbatches} microbatch(es), "
              f"{args.steps} steps, float64")
    model = m16.MoELlama(cfg, moe, mesh, 0, dtype)
    every = max(1, args.steps // 5)

    def on_step(step, loss):
        stats = model.last_step
        if rank == 0 and (step % every == 0 or step == args.steps - 1):
            mean = stats.loads.sum(-1, keepdim=True) / moe.n_experts
            imbalance = " ".join(f"{x:.2f}" for x in (stats.loads.max(-1).values / mean.squeeze(-1)).tolist())
            print(f"  step {step:3d}  loss {loss:.4f}  aux {stats.aux:.5f}  dropped slots {stats.dropped:4d}  "
                  f"max/mean load per layer {imbalance}")
        if step < args.steps - 1:
            mesh.log.clear()   # keep the last step's collectives only, for the bytes below
    began = time.perf_counter()
    _, losses = m06.fit(model, args.steps, args.batch, seed=0, n_microbatches=args.microbatches, on_step=on_step)
    elapsed = time.perf_counter() - began
    measured = measured_cost(mesh.log)   # the last step's
    formula = costs.step_cost(cfg, moe, mesh.sizes, mesh.group("e").index, model.layer.records, dtype)
    if rank != 0:
        return
    print(f"  {args.steps} steps in {elapsed:.1f} s")
    print("Tokens per expert in the last step (slots the routers chose, over the whole batch), layer by layer:")
    for layer, loads in enumerate(model.last_step.loads.tolist()):
        print(f"  layer {layer}: {loads}")
    print("Bytes rank 0 sent in the last step (the all-to-alls depend on its routing), measured and formula:")
    for axis, op, calls, sent in measured.rows():
        want = formula.sent.get((axis, op), 0)
        print(f"  {op:>10} over {axis:>2}: {calls} calls, {sent:>12,.0f} bytes, formula {want:>12,.0f} -> "
              f"{'equal' if sent == want and formula.calls.get((axis, op)) == calls else 'MISMATCH'}")
    n_sources = world_size * args.microbatches
    _, expected = m16.train(cfg, moe, args.steps, m16.one_rank_mesh(), args.batch, n_sources, dtype=dtype)
    worst = max(abs(a - b) for a, b in zip(losses, expected))
    same = "the whole batch" if moe.capacity_factor is None else \
        f"the whole batch in {n_sources} microbatches, so that it drops by the same groups"
    print(f"One process on {same}: max |loss difference| {worst:.1e} -> {'match' if worst < 1e-10 else 'MISMATCH'}")
