"""`python main.py plan --model M --gpus N --gpu G [options]` (given): module 18's planner on a real
cluster. Every layout of N GPUs that fits is costed with the modules' formulas (solutions/ or your
steps/m18_*.py, `--impl`) and ranked by the predicted step time of docs/18-planning.md's model.

    --model  a preset (llama3-8b, llama3-70b, llama3-405b, mixtral-8x7b) or dimensions:
             dim=4096,layers=32,heads=32,kv_heads=8,ffn=14336,vocab=128256,seq=8192
             [,experts=8,top_k=2] [,batch=512]
    --gpu    a preset (h100, h200, a100) or specs: memory=80,bf16=989,fp8=1979,intra=450,inter=50
             [,per_node=8] (GB, dense TFLOP/s, GB/s one way)
    --mesh   pins axes, e.g. p=16,t=8 (the others are searched); --zero, --schedule, --microbatches,
             --recompute, --cp pin those choices; --fp8 off (default), on or both

`python main.py plan --published` sets the planner beside the training runs papers published
(m18_presets.PUBLISHED): each run's speed in its paper's convention, the planner's prediction on
the run's own layout with the residual, and the planner's own top pick, as the markdown table of
docs/18-planning.md; where a pick sends more data-parallel bytes, whether it is faster even charged all
of them, and where each step's time goes.

Bad arguments, a preset that does not exist, a GPU count no layout can use and contradictory
options are refused in one line before the search starts; a model that fits no layout is told
which came closest and why.
"""
from __future__ import annotations

import argparse
import os
import sys

from course.arguments import MAX_GPUS, MAX_SIZE, check_count, check_number
from course.impl import IMPLS, reference

DIMS = {"dim": "dim", "layers": "n_layers", "heads": "n_heads", "kv_heads": "n_kv_heads", "head_dim": "head_dim",
        "ffn": "ffn_dim", "vocab": "vocab_size", "seq": "max_seq_len"}
MOE_DIMS = {"experts": "n_experts", "top_k": "top_k"}
GPU_UNITS = {"memory": 1e9, "bf16": 1e12, "fp8": 1e12, "intra": 1e9, "inter": 1e9, "per_node": 1}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="main.py plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a preset (llama3-8b, llama3-70b, llama3-405b, mixtral-8x7b) "
                   "or dim=..,layers=..,heads=..,kv_heads=..,ffn=..,vocab=..,seq=..[,experts=..,top_k=..][,batch=..]")
    p.add_argument("--gpus", type=int, help="R, the GPUs to plan for")
    p.add_argument("--gpu", default="h100", help="a preset (h100, h200, a100) or memory=..,bf16=..,fp8=..,intra=..,"
                   "inter=..[,per_node=..] in GB, TFLOP/s, GB/s (default h100)")
    p.add_argument("--batch", type=int, default=None, help="B, sequences in the global batch (default: the model's)")
    p.add_argument("--seq-len", type=int, default=None, help="T, tokens a sequence (default: the model's)")
    p.add_argument("--mesh", default=None, help="axes to pin, e.g. p=16,t=8 (the others are searched)")
    p.add_argument("--zero", default=None, help="pin the ZeRO stage as a row names it: 0, 1, 2 (gradients "
                   "reduce-scattered each micro-step, module 14's), 2once (once a step) or 3 (FSDP)")
    p.add_argument("--schedule", default=None, help="pin the pipeline schedule (module 11's names)")
    p.add_argument("--microbatches", type=int, default=None, help="pin m, microbatches a step")
    p.add_argument("--recompute", default=None, help="pin module 10's recompute option")
    p.add_argument("--cp", default=None, help="pin module 15's context variant: zigzag (ring is planned as zigzag), allgather or ulysses")
    p.add_argument("--fp8", choices=("off", "on", "both"), default="off", help="FP8 linears: off (default), on, both")
    p.add_argument("--precision", choices=("mixed", "course"), default="mixed",
                   help="mixed: bf16 with a float32 master copy and moments (default); course: float32, the modules' runs")
    p.add_argument("--efficiency", type=float, default=None,
                   help="η, the fraction of the peak FLOP/s a compute-bound kernel reaches (default 0.65)")
    p.add_argument("--top", type=int, default=10, help="rows to print (default 10)")
    p.add_argument("--gpu-mtbf", type=float, default=None,
                   help="τ_gpu, hours between failures of one GPU: adds module 19's goodput to each row (e.g. 50676, "
                        "Llama 3's 419 unexpected interruptions in 54 days on 16,384 GPUs)")
    p.add_argument("--restart", type=float, default=600.0,
                   help="τ_restart with --gpu-mtbf: seconds from a failure to the next useful step (default 600)")
    p.add_argument("--save-gbps", type=float, default=1.0,
                   help="with --gpu-mtbf: GB/s at which a GPU writes its share of a checkpoint (default 1.0); "
                        "τ_save = the row's state / this")
    p.add_argument("--impl", choices=IMPLS, default="steps", help="your steps/ (default) or the reference solutions/")
    p.add_argument("--published", action="store_true",
                   help="the published runs against the planner (docs/18-planning.md's table); takes no other option")
    return p


def pairs(text: str, what: str) -> dict[str, float]:
    """{key: number} from 'a=1,b=2' (one line for anything else)."""
    out = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        try:
            out[key.strip()] = float(value)
        except ValueError:
            raise ValueError(f"{what} {text!r}: expected key=number pairs separated by commas, got {item!r}") from None
        if not sep:
            raise ValueError(f"{what} {text!r}: expected key=number pairs separated by commas, got {item!r}")
    return out


def parse_model(text: str, presets):
    """A preset's Model, or one built from dimensions (module 06's LlamaConfig checks them)."""
    if "=" not in text:
        if text not in presets.MODELS:
            raise ValueError(f"unknown model preset {text!r}; presets: {', '.join(presets.MODELS)}, or dimensions "
                             f"dim=..,layers=..,heads=..,kv_heads=..,ffn=..,vocab=..,seq=..")
        return presets.MODELS[text]
    given = pairs(text, "--model")
    unknown = set(given) - set(DIMS) - set(MOE_DIMS) - {"batch"}
    missing = set(DIMS) - {"head_dim"} - set(given)
    if unknown or missing:
        raise ValueError(f"--model {text!r}: " + (f"unknown keys {sorted(unknown)}" if unknown else
                         f"missing {sorted(missing)}") + f"; keys: {', '.join([*DIMS, *MOE_DIMS, 'batch'])}")
    given = {key: check_count(value, f"--model {key}") for key, value in given.items()}  # dim=inf, dim=1e300
    dims = {DIMS[k]: v for k, v in given.items() if k in DIMS}
    dims.setdefault("head_dim", dims["dim"] // max(dims["n_heads"], 1))
    cfg = reference("m06_llama_block").LlamaConfig(**dims)
    moe = None
    if "experts" in given:
        moe = reference("m16_router").MoEConfig(n_experts=int(given["experts"]), top_k=int(given.get("top_k", 2)),
                                                expert_dim=cfg.ffn_dim)
    return presets.Model(f"model {text}", cfg, moe, int(given.get("batch", 512)))


def parse_gpu(text: str, presets):
    if "=" not in text:
        if text not in presets.GPUS:
            raise ValueError(f"unknown GPU preset {text!r}; presets: {', '.join(presets.GPUS)}, or specs "
                             f"memory=..,bf16=..,fp8=..,intra=..,inter=.. (GB, TFLOP/s, GB/s)")
        return presets.GPUS[text]
    given = pairs(text, "--gpu")
    unknown, missing = set(given) - set(GPU_UNITS), {"memory", "bf16", "intra", "inter"} - set(given)
    if unknown or missing:
        raise ValueError(f"--gpu {text!r}: " + (f"unknown keys {sorted(unknown)}" if unknown else
                         f"missing {sorted(missing)}") + f"; keys: {', '.join(GPU_UNITS)}")
    for key, value in given.items():  # memory=nan or bf16=inf would rank layouts by nonsense
        if key == "per_node":
            check_count(value, "--gpu per_node", 1, MAX_GPUS)
        else:
            check_number(value, f"--gpu {key}")
    spec = {k: v * GPU_UNITS[k] for k, v in given.items()}
    return presets.GPU(f"GPU {text}", spec["memory"], spec["bf16"], spec.get("fp8"), spec["intra"], spec["inter"],
                       int(spec.get("per_node", 8)))


def check(args):
    """(model, gpu, batch, fixed): every bad or contradictory option refused in one line."""
    import dataclasses

    from course.mesh import MeshError, parse_mesh

    presets, layout = reference("m18_presets"), reference("m18_layout")
    if args.model is None or args.gpus is None:
        raise ValueError("--model and --gpus are needed (or --published alone)")
    model = parse_model(args.model, presets)
    if args.seq_len is not None:
        check_count(args.seq_len, "--seq-len")
        model = dataclasses.replace(model, cfg=dataclasses.replace(model.cfg, max_seq_len=args.seq_len))
    gpu = parse_gpu(args.gpu, presets)
    batch = model.batch if args.batch is None else args.batch
    check_count(args.gpus, "--gpus", 1, MAX_GPUS)  # the search goes over its divisors: 10**30 would take minutes
    for name, value in (("--batch", batch), ("--top", args.top), ("--microbatches", args.microbatches)):
        if value is not None:
            check_count(value, name, 1, MAX_SIZE)
    if args.gpu_mtbf is not None:
        check_number(args.gpu_mtbf, "--gpu-mtbf")
        check_number(args.restart, "--restart")
        check_number(args.save_gbps, "--save-gbps")
    if args.efficiency is not None and not 0 < args.efficiency <= 1:
        raise ValueError(f"--efficiency is a fraction of the peak, in (0, 1], got {args.efficiency}")
    fixed = {}
    if args.mesh:
        try:
            fixed.update(parse_mesh(args.mesh))
        except MeshError as error:
            raise ValueError(str(error)) from None
        grid = fixed.get("p", 1) * fixed.get("d", 1) * fixed.get("c", 1) * fixed.get("t", 1)
        if args.gpus % grid:
            raise ValueError(f"--mesh {args.mesh} uses {grid} GPUs per group of axes, which does not divide --gpus "
                             f"{args.gpus}")
    if args.zero is not None:
        stages = {name: stage for stage in layout.ZERO_STAGES
                  for name in ((str(stage), f"{stage}once") if stage == 2 else (str(stage),))}
        if args.zero not in stages:
            raise ValueError(f"--zero {args.zero!r} is not one of {', '.join(stages)}")
        fixed["zero"] = stages[args.zero]
        if fixed["zero"] == 2:   # a row's "zero2" and "zero2once" are two layouts: pin the one named
            fixed["reduce_once"] = args.zero == "2once"
    for name in ("schedule", "recompute", "cp"):
        if getattr(args, name) is not None:
            fixed[name] = getattr(args, name)
    if args.microbatches is not None:
        fixed["m"] = args.microbatches
    if args.fp8 != "both":
        fixed["fp8"] = args.fp8 == "on"
    if fixed.get("fp8") and gpu.fp8 is None:
        raise ValueError(f"--fp8 on for the {gpu.name}, which has no FP8 tensor cores; use --fp8 off or another GPU")
    if model.moe is None and fixed.get("e", 1) > 1:
        raise ValueError(f"--mesh e={fixed['e']} for {model.name}, a dense model: there are no experts to split")
    if model.moe is not None and fixed.get("t", 1) > 1:
        raise ValueError(f"--mesh t={fixed['t']} for {model.name}: the course has no tensor-parallel expert layer "
                         "(plan its experts over e)")
    if model.moe is not None and fixed.get("zero") == 3:
        raise ValueError(f"--zero 3 for {model.name}: module 13's FSDP formula counts a dense FFN; use 0, 1 or 2")
    if fixed.get("p") == 1 and fixed.get("schedule") not in (None, "none"):
        raise ValueError(f"--schedule {fixed['schedule']} with --mesh p=1: there is no pipeline to schedule")
    if "m" in fixed and batch % fixed["m"]:
        raise ValueError(f"--microbatches {fixed['m']} does not divide --batch {batch}: every microbatch needs "
                         "whole sequences")
    for name, known in (("schedule", tuple(reference("m11_generators").SCHEDULES)),
                        ("recompute", reference("m10_recompute").OPTIONS),
                        ("cp", ("ring",) + layout.CONTEXT_VARIANTS)):
        if name in fixed and fixed[name] not in known:
            raise ValueError(f"--{name} {fixed[name]!r} is not one of {', '.join(map(str, known))}")
    if fixed.get("cp") == "ring":   # module 15's zigzag is its ring with the causal work balanced: the same bytes
        fixed["cp"] = "zigzag"
    if not reference("m18_search").candidates(model, args.gpus, batch, gpu, fixed):
        raise ValueError(cannot_factor(model, args.gpus, batch, gpu, fixed))
    return model, gpu, batch, fixed


def cannot_factor(model, gpus: int, batch: int, gpu, fixed: dict) -> str:
    cfg = model.cfg
    pinned = f" with {', '.join(f'{k}={v}' for k, v in fixed.items())}" if fixed else ""
    return (f"no layout of {gpus} GPUs runs {model.name}{pinned}: p d c t = {gpus} with t dividing K={cfg.n_kv_heads} "
            f"and H={cfg.n_heads} within a node of {gpu.per_node}, c cutting T={cfg.max_seq_len} into 2c pieces, "
            f"d dividing B={batch} (and m the B/d sequences), p at most L={cfg.n_layers}")


def gb(n: float) -> str:
    return f"{n / 1e9:.1f}"


def state_bytes(memory: dict) -> float:
    """What a rank keeps between steps, of a layout's memory by kind: parameters, gradients and optimizer."""
    return sum(memory.get(k, 0) for k in ("parameters", "gradients", "optimizer"))


def describe_miss(closest, budget: float) -> str:
    """Why the closest layout does not fit: its memory, by kind, against the budget."""
    memory = closest.cost.memory
    parts = ", ".join(f"{kind} {gb(memory.get(kind, 0))}" for kind in
                      ("parameters", "gradients", "optimizer", "activations", "buffers") if memory.get(kind))
    state = state_bytes(memory)
    why = ("the weights' state alone exceeds it: more GPUs (or a larger GPU) are needed" if state > budget else
           "its activations do not fit: a longer recompute, more microbatches or more GPUs on t, c or p")
    return (f"nothing fits: the closest layout, {closest.layout}, keeps {gb(closest.memory)} GB a GPU of "
            f"{gb(budget)} GB usable ({parts}); {why}")


def under_failures(planned, gpus: int, failures, goodput) -> str:
    """Module 19's goodput of a planned row: the job fails once in τ_gpu / R (every GPU's failures add up), a
    checkpoint blocks for the row's state written at the given bandwidth (a synchronous save: the upper bound).
    `goodput`: module 19's m19_goodput, the implementation asked for (--impl)."""
    gpu_mtbf_h, restart, save_gbps = failures
    save_cost = state_bytes(planned.cost.memory) / (save_gbps * 1e9)
    result = goodput.goodput(planned.time.step, save_cost, restart, gpu_mtbf_h * 3600 / gpus)
    return f" {result.goodput:>5.1%} {result.every:>6}"


def print_plan(model, gpu, gpus: int, batch: int, plan, step_time, time_model, top: int, failures=None):
    cfg = model.cfg
    psi = step_time.dense_parameters(model) if model.moe is None else None
    flops = step_time.model_flops(model, batch)
    size = f"Ψ = {psi / 1e9:.2f} B, " if psi else ""
    print(f"{model.name} ({size}L={cfg.n_layers}, T={cfg.max_seq_len}), B={batch} sequences "
          f"({batch * cfg.max_seq_len / 1e6:.1f}M tokens a step) on {gpus} x {gpu.name} "
          f"({gb(gpu.memory)} GB, {gpu.bf16 / 1e12:.0f} TFLOP/s bf16, NVLink {gb(gpu.intra)} GB/s, "
          f"network {gb(gpu.inter)} GB/s)")
    print(f"time model: η = {time_model.efficiency}, links at {time_model.link_efficiency:.0%}, α = "
          f"{time_model.latency_intra * 1e6:.0f}/{time_model.latency_inter * 1e6:.0f} µs; "
          f"{plan.considered} layouts costed, {len(plan.fits)} fit (one per recompute family)")
    full = step_time.model_flops(model, batch, full_attention=True)
    header = (f"{'#':>3}  {'layout':<58} {'state':>6} {'acts':>6} {'total':>6}  {'GB sent a step by axis':<30} "
              f"{'bubble':>6} {'step s':>7} {'tok/s/GPU':>9} {'MFU half/full':>13}"
              + (f" {'Γ':>6} {'ckpt every':>6}" if failures else ""))
    if failures:
        (gpu_mtbf_h, restart, save_gbps), _ = failures
        print(f"failures: a GPU fails once in {gpu_mtbf_h:g} h, so the job once in {gpu_mtbf_h / gpus:.1f} h; "
              f"restart {restart:g} s; a checkpoint written at {save_gbps:g} GB/s a GPU (module 19's "
              f"goodput Γ at Daly's interval, in steps)")
    print(header)
    for rank, planned in enumerate(plan.fits[:top], start=1):
        memory, t = planned.cost.memory, planned.time
        state = state_bytes(memory)
        sent = " ".join(f"{axis}:{gb(planned.cost.sent_bytes(axis))}" for axis in
                        sorted({a for a, _ in planned.cost.sent}, key="pdcetx".find)) or "-"
        tokens = batch * cfg.max_seq_len / t.step / gpus
        mfu = f"{flops / (t.step * gpus * gpu.bf16):.1%}/{full / (t.step * gpus * gpu.bf16):.1%}"
        print(f"{rank:>3}  {str(planned.layout):<58} {gb(state):>6} {gb(memory.get('activations', 0)):>6} "
              f"{gb(planned.memory):>6}  {sent:<30} {t.bubble:>6.1%} {t.step:>7.2f} {tokens:>9.0f} {mfu:>13}"
              + (under_failures(planned, gpus, *failures) if failures else ""))
    print("GB: 10^9 bytes a GPU. state: parameters, gradients and optimizer; acts: activations at the peak; "
          "total adds buffers. MFU: causal attention counted at half / full (torchtitan's count), docs/18-planning.md.")


def data_parallel_bytes(planned) -> float:
    return sum(planned.cost.sent_bytes(axis) for axis in ("d", "dc", "ed"))


def data_parallel_seconds(step_time, planned) -> float:
    """Seconds the step spends on the weights' traffic over d, dc and ed, all of it as if none hid."""
    return sum(planned.time.comm.get(axis, 0.0) for axis in step_time.HIDDEN_AXES)


def wins_without_its_traffic(step_time, own, top) -> bool:
    """Whether the top pick is still faster with all its data-parallel traffic on the step and none of the
    published layout's: then its win is made elsewhere (compute, recompute, bubble), not by hiding bytes."""
    return top.time.step - top.time.exposed + data_parallel_seconds(step_time, top) < own.time.step - own.time.exposed


def where_the_step_goes(step_time, planned) -> str:
    """One row of the breakdown: compute, the model's axes, the bubble, the weights' traffic that waits, the step."""
    axes = sum(planned.time.comm.get(axis, 0.0) for axis in step_time.EXPOSED_AXES)
    return (f"`{planned.layout}` | {planned.time.compute:.2f} | {axes:.2f} | {planned.time.bubble:.1%} | "
            f"{planned.time.exposed:.2f} of {data_parallel_seconds(step_time, planned):.2f} | {planned.time.step:.2f}")


def print_published(presets, search, layout, step_time, costs):
    """docs/18-planning.md's table: each published run in its paper's convention, the planner on its layout
    (the fields the paper states pinned, the rest the planner's fastest that fits), and its own top pick; then,
    where the pick sends more data-parallel bytes, where each step's time goes."""
    rows, more = [], []
    for run in presets.PUBLISHED:
        model, cfg = run.model, run.model.cfg
        time_model = step_time.TimeModel(**({} if run.overlapped else {"hidden": 0.0}))
        tokens = model.batch * cfg.max_seq_len
        if run.counts == "eq3":   # Narayanan et al.'s Eq. 3: full attention, one more forward
            conventions = [step_time.model_flops(model, model.batch, True, True) / tokens]
        else:                     # unstated: causal attention at half, or full (torchtitan's count)
            conventions = [step_time.model_flops(model, model.batch) / tokens,
                           step_time.model_flops(model, model.batch, full_attention=True) / tokens]
        published = [run.tflops * 1e12 / flops for flops in conventions]
        own = search.search(model, run.gpus, model.batch, run.gpu, layout.MIXED, time_model, {**run.layout, "fp8": False})
        software = {key: run.layout[key] for key in ("attention", "sequence_parallel") if key in run.layout}   # the run's kernels
        top = search.search(model, run.gpus, model.batch, run.gpu, layout.MIXED, time_model, {"fp8": False, **software})
        costs.forget()
        if not own.fits or not top.fits:
            rows.append(f"| {run.source} | {run.gpus:,} | {run.tflops:g} | nothing fits | | | | | |")
            continue
        own, top = own.fits[0], top.fits[0]
        speed = {name: tokens / planned.time.step / run.gpus for name, planned in (("own", own), ("top", top))}
        flag = ""
        if data_parallel_bytes(top) > data_parallel_bytes(own) and top.time.step < own.time.step:
            flag = " (more: faster " + ("even with all of it waited for" if wins_without_its_traffic(step_time, own, top)
                                        else "by hiding it") + ")"
            more += [f"| {run.source} | published | {where_the_step_goes(step_time, own)} |",
                     f"| | top pick | {where_the_step_goes(step_time, top)} |"]
        theirs = " / ".join(f"{x:,.1f}" for x in published)
        residual = " / ".join(f"{speed['own'] / x - 1:+.0%}".replace("-0%", "0%").replace("+0%", "0%")
                              for x in published)
        rows.append(f"| {run.source} | {run.gpus:,} {run.gpu.name.split()[0]} | {run.tflops:g} | {theirs} | "
                    f"`{own.layout}` | {speed['own']:,.1f} | {residual} | {gb(data_parallel_bytes(own))} | "
                    f"`{top.layout}` | {speed['top']:,.1f} | {gb(data_parallel_bytes(top))}{flag} |")
        print(f"  planned {run.source}", file=sys.stderr, flush=True)
    print("| run | GPUs | TFLOP/s a GPU, printed | tokens/s a GPU, their convention | the planner on their layout | "
          "tokens/s a GPU | residual | data-parallel GB a step | the planner's top pick | tokens/s a GPU | "
          "data-parallel GB a step |")
    print("| --- " * 11 + "|")
    print("\n".join(rows))
    if more:
        print("\nWhere the step goes (seconds) where the top pick sends more data-parallel bytes:\n")
        print("| run | | layout | compute | t, c, e, p | bubble | data-parallel s waited, of | step |")
        print("| --- " * 8 + "|")
        print("\n".join(more))
    for name, why in presets.NOT_PLANNED.items():
        print(f"\nNot planned: {name}: {why}.")


def main(argv: list[str]) -> None:
    args = parser().parse_args(argv)
    if args.published:
        others = [name for name, value in vars(args).items()
                  if name not in ("published", "impl") and value != parser().get_default(name)]
        if others:
            sys.exit(f"error: --published takes no other option (got --{others[0].replace('_', '-')}): it plans the "
                     "published runs as their papers describe them")
        os.environ["COURSE_IMPL"] = args.impl
        from course.impl import load
        from course.launch import failures_explained

        with failures_explained("18", args.impl):
            print_published(load("m18_presets"), load("m18_search"), load("m18_layout"), load("m18_step_time"),
                            load("m18_costs"))
        return
    try:
        model, gpu, batch, fixed = check(args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None  # a usage error: exit code 2, as run's
    os.environ["COURSE_IMPL"] = args.impl
    from course.impl import load
    from course.launch import failures_explained

    if args.cp == "ring":
        print("--cp ring: planned as zigzag (module 15's ring with the causal work balanced: the same bytes, less idle)")
    with failures_explained("18", args.impl):
        search = load("m18_search")
        layout, step_time = load("m18_layout"), load("m18_step_time")
        precision = layout.MIXED if args.precision == "mixed" else layout.COURSE
        time_model = step_time.TimeModel(**({} if args.efficiency is None else {"efficiency": args.efficiency}))
        plan = search.search(model, args.gpus, batch, gpu, precision, time_model, fixed)
        if not plan.fits:
            sys.exit(f"error: {describe_miss(plan.closest, (1 - search.RESERVE) * gpu.memory)}")
        failures = None if args.gpu_mtbf is None else ((args.gpu_mtbf, args.restart, args.save_gbps),
                                                       load("m19_goodput"))
        print_plan(model, gpu, args.gpus, batch, plan, step_time, time_model, args.top, failures)
