"""`python main.py run 13 [--mesh 2x2]`: train module 06's Llama on a d x t mesh (FSDP over d, Megatron
over t), written in named axes; print the sharding table of every weight and activation, the losses
against single-process training, and the bytes each rank sends and keeps against the formulas."""
import argparse
import dataclasses
import math
import time

import torch

from course.costs import StepCost, measured_cost
from course.demos import log_every
from course.impl import load, reference
from course.mesh import check_mesh, init_mesh, parse_mesh


def add_args(parser: argparse.ArgumentParser):
    parser.add_argument("--mesh", default="2x2",
                        help="d x t, written DxT or d=D,t=T (an axis left out has size 1); d t must be the number "
                             "of ranks (default 2x2)")
    parser.add_argument("--steps", type=int, default=10, help="training steps (default 10)")
    parser.add_argument("--batch", type=int, default=8, help="global batch, its rows split over d (default 8)")
    parser.add_argument("--layers", type=int, default=2, help="blocks (default 2)")


def config(args):
    """The module's model (4 key/value heads, FFN 48, dim 32), with --layers blocks."""
    return dataclasses.replace(reference("m13_llama_2d").CONFIG, n_layers=args.layers)


def mesh_sizes(text: str) -> dict[str, int]:
    """{"d": d, "t": t} from --mesh (course/mesh.py's notation), both axes present."""
    sizes = parse_mesh(text)
    return {**sizes, "d": sizes.get("d", 1), "t": sizes.get("t", 1)}


def check_args(args):
    """One line for a bad mesh or option, before any rank starts (the given checks)."""
    if min(args.steps, args.batch, args.layers) < 1:
        raise ValueError(f"--steps, --batch and --layers must be positive, got {args.steps}, {args.batch}, "
                         f"{args.layers}")
    sizes = mesh_sizes(args.mesh)
    check_mesh(sizes, args.world_size)
    reference("m13_llama_2d").check_mesh_fits(config(args), sizes, args.batch)


def show_table(title: str, rows: list[tuple[str, object]], rank: int):
    """name, spec, whole shape, this rank's block, for rank 0 to print."""
    if rank != 0:
        return
    print(title)
    print(f"  {'name':14s} {'spec':22s} {'whole':>16s} {'this rank':>16s}")
    for name, x in rows:
        block = tuple(x.tensor.shape)
        whole = tuple(n * math.prod(x.mesh.sizes[a] for a in dim.axes) for n, dim in zip(block, x.spec.dims))
        print(f"  {name:14s} {str(x.spec):22s} {str(whole):>16s} {str(block):>16s}")


def demo(args):
    m02, m06_model = load("m02_comms"), load("m06_llama_model")
    specs, axes, model_2d = load("m13_specs"), load("m13_named_axes"), load("m13_llama_2d")
    costs = reference("m13_costs")  # the formulas the measurements are checked against
    rank, _, _ = m02.init_distributed(backend="gloo")  # CPU tensors: gloo, even with GPUs
    torch.set_num_threads(1)
    cfg, sizes = config(args), mesh_sizes(args.mesh)
    mesh = init_mesh(sizes)
    d, t = sizes["d"], sizes["t"]
    if rank == 0:
        print(f"Mesh {d}x{t} (rank = i_d * {t} + i_t): FSDP over d = {d}, Megatron over t = {t}; {cfg.n_layers} "
              f"blocks of dim {cfg.dim}, {cfg.n_heads} query / {cfg.n_kv_heads} key-value heads, FFN {cfg.ffn_dim}; "
              f"global batch {args.batch} x {cfg.max_seq_len} ({args.batch // d} rows a rank), {args.steps} steps")
    began = time.perf_counter()
    on_step = log_every(max(1, args.steps // 5), args.steps) if rank == 0 else None
    model, losses = m06_model.fit(model_2d.Llama2D(cfg, mesh), args.steps, args.batch, on_step=on_step)
    elapsed = time.perf_counter() - began
    measured = measured_cost(mesh.log[:len(mesh.log) // args.steps])  # every step issues the same: the first one's
    traffic = costs.step_traffic(cfg, sizes, args.batch, torch.float32)
    kept = sum(p.nbytes + p.grad.nbytes for p in model.parameters())
    state = costs.state_bytes(cfg, sizes, torch.float32).memory

    # The sharding table: every weight, and every activation one block keeps (a forward on a fresh store).
    weights = [("embedding", model.embedding), *((f"block 0 {name}", getattr(model.blocks[0], name))
                                                 for name in model_2d.BLOCK_SPECS),
               ("final_norm", model.final_norm), ("lm_head", model.lm_head)]
    show_table(f"\nWeights (rank 0's blocks; vocabulary {cfg.vocab_size} padded to {model.padded_vocab}):",
               weights, rank)
    tokens = torch.zeros(args.batch, cfg.max_seq_len, dtype=torch.long)
    store = reference("m06_llama_block").ActivationStore()
    top = model_2d.TopWeights(*axes.finish(model.start_gather(model.top(), "top")))  # the units gathered over d
    block = model_2d.BlockWeights(*axes.finish(model.start_gather(model.blocks[0], "block 0")))
    x = model.embed(top, specs.shard("B/d T", tokens, mesh), store)
    model.ffn_half(block, model.attention_half(block, x, store), store)
    show_table("\nActivations one block keeps (and the embedding's one-hot), the stream x between blocks:",
               [*store.tensors.items(), ("x (stream)", x)], rank)
    if rank != 0:
        return
    print(f"\n  {args.steps} steps in {elapsed:.1f} s")
    print("One step on rank 0, by axis and collective: calls measured (formula), bytes sent measured (formula)")
    for axis, op, calls, sent in measured.rows():
        print(f"  {axis} {op:15s} {calls:4d} ({traffic.n_calls(axis, op):4d})   {sent:12,.0f} "
              f"({traffic.sent_bytes(axis, op):12,.0f})")
    print(f"Bytes sent per step and rank: {measured.sent_bytes():,.0f}, formula {traffic.sent_bytes():,.0f}, in "
          f"{measured.n_calls()} collectives, formula {traffic.n_calls()} -> "
          f"{'equal' if measured == StepCost(traffic.sent, traffic.calls) else 'MISMATCH'}")
    both = state["parameters"] + state["gradients"]
    print(f"Parameters and gradients kept per rank: {kept:,} bytes, formula {both:,} -> "
          f"{'equal' if kept == both else 'MISMATCH'} (one process keeps "
          f"{2 * costs.state_bytes(cfg, {}).memory['parameters']:,})")
    _, expected = m06_model.train(cfg, args.steps, batch=args.batch)  # the same training in one process
    worst = max(abs(a - b) for a, b in zip(losses, expected))
    print(f"Single-process training of the same model on the same global batches: max |loss difference| "
          f"{worst:.2e} -> {'match' if worst < 1e-4 else 'MISMATCH'} (float32; the ranks sum in another order, "
          f"so agreement is to rounding, not bit for bit)")
