"""The chapters' figures, drawn from the course's own code (given): course/site/figures.py says which chapter
shows which, and calls these at build time.

Every figure is computed, never drawn by hand, and none starts a rank: the schedules are timed by
course/simulate.py, the streams' event graphs recorded by course/streams.py, FSDP's calls recorded on a group
of one (whose collectives are logged, not sent), the costs are the modules' formulas and the GPU numbers the
tables under notebooks/data/ and module 18's presets. Each draws a neighbouring instance of what its chapter
asks you to write (another p, m, c, model or card), so it shows the idea without giving the answer away.
Each function takes the path of the PNG to write; the figures are bare matplotlib Figures (no pyplot).
"""
from __future__ import annotations

import json
import types
from pathlib import Path

import matplotlib
import torch
from matplotlib.figure import Figure

from course import REPO
from course.impl import reference
from course.plotting import plot_timeline
from course.simulate import Costs, simulate_schedule

DATA = REPO / "notebooks" / "data"
GB, MS = 1e9, 1e3
KIND_COLOURS = {"parameters": "tab:blue", "gradients": "tab:orange", "optimizer": "tab:green",
                "activations": "tab:red", "buffers": "tab:purple"}


def save(figure: Figure, path: Path):
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def saved_table(name: str) -> dict:
    """A benchmark table measured on a GPU and committed under notebooks/data/ (NaN where not measured)."""
    return json.loads((DATA / name).read_text())


def presets():
    return reference("m18_presets")


def llama3_8b():
    return presets().MODELS["llama3-8b"]


def seconds_per_block(model, tokens: int, gpu, time_model) -> tuple[float, float]:
    """(forward, backward) seconds of one block for `tokens` tokens on one GPU, by module 18's time model: its
    GEMMs on the roofline (block_gemms, gemm_time) and its flash attention (attention_times), a backward
    twice the GEMMs' forward."""
    step_time, layout = reference("m18_step_time"), reference("m18_layout").Layout()
    gemms = sum(step_time.gemm_time(*shape, gpu, time_model)
                for shapes in step_time.block_gemms(model, 1, 1, tokens).values() for shape in shapes)
    attention_forward, attention_backward = step_time.attention_times(model, layout, tokens, gpu, time_model)
    return gemms + attention_forward, 2 * gemms + attention_backward


def draw_simulated(ax, name: str, p: int, m: int, costs: Costs = Costs(), v: int = 2):
    """Module 11's schedule `name`, timed by the simulator, drawn on `ax`; returns the timeline."""
    generators = reference("m11_generators")
    schedule = generators.make_schedule(name, p, m, v)
    timeline = simulate_schedule(schedule.orders, schedule.placement, costs)
    peaks = "/".join(map(str, timeline.peak_live))
    plot_timeline(timeline.as_profiles(), ax=ax, unit="units",
                  title=f"{name}, p = {p}, m = {m}: bubble {timeline.bubble} = {float(timeline.bubble):.0%}, "
                        f"peak live microbatches per rank {peaks}")
    return timeline


def alpha_beta(path: Path):
    """03: one message's time against its size, α + n/β, on the links module 18 plans with (its presets'
    NVLink and network bandwidths at the time model's link efficiency, and its latencies α); the
    half-bandwidth size α β marked on each."""
    step_time = reference("m18_step_time")
    model, gpus = step_time.TimeModel(), presets().GPUS
    links = [(f"{gpus['h100'].name} NVLink", gpus["h100"].intra, model.latency_intra, "tab:green"),
             (f"{gpus['h100'].name} network", gpus["h100"].inter, model.latency_inter, "tab:blue"),
             (f"{gpus['a100'].name} network", gpus["a100"].inter, model.latency_inter, "tab:purple")]
    sizes = [2.0 ** k for k in range(6, 34)]
    figure = Figure(figsize=(9, 4.2))
    ax = figure.add_subplot()
    for name, bandwidth, alpha, colour in links:
        beta = bandwidth * model.link_efficiency
        ax.loglog(sizes, [(alpha + n / beta) * 1e6 for n in sizes], color=colour,
                  label=f"{name}: α = {alpha * 1e6:.0f} µs, β = {beta / GB:.0f} GB/s, "
                        f"αβ = {alpha * beta / 1e6:.2g} MB")
        ax.plot([alpha * beta], [2 * alpha * 1e6], "o", color=colour)
    ax.set_xlabel("message size n (bytes)")
    ax.set_ylabel("time of one message (µs)")
    ax.set_title("t = α + n/β: flat where latency rules, a slope of 1 where bandwidth does (dots: n = αβ, t = 2α)")
    ax.legend(fontsize=8)
    ax.grid(True, which="major", alpha=0.3)
    save(figure, path)


def relay(path: Path):
    """04: one batch through 8 pipeline ranks: each rank computes its stage, then waits (forward cost 1,
    backward 2: the simulator's GPipe with a single microbatch)."""
    figure = Figure(figsize=(10, 4.2))
    draw_simulated(figure.add_subplot(), "gpipe", 8, 1, Costs())
    save(figure, path)


def bubble(path: Path):
    """05: GPipe and 1F1B on 3 ranks and 6 microbatches (a backward twice a forward): the same bubble,
    (p-1)/(m+p-1), and different activation peaks."""
    figure = Figure(figsize=(10, 4.6))
    axes = figure.subplots(2, 1, sharex=True)
    for ax, name in zip(axes, ("gpipe", "1f1b")):
        draw_simulated(ax, name, 3, 6)
    axes[0].set_xlabel("")
    save(figure, path)


def attention_memory(path: Path):
    """06: what one attention layer of Llama 3 8B would keep per sequence to rebuild p in the backward: the
    whole (T, T) probabilities per head, against one chunk of scores (module 06's ATTENTION_CHUNK queries)
    and the log-sum-exp that replaces them (one float per query and head)."""
    ops, cfg = reference("m06_llama_ops"), llama3_8b().cfg
    chunk, heads, lengths = ops.ATTENTION_CHUNK, cfg.n_heads, [2 ** k for k in range(9, 18)]
    series = {f"p, (T, T) per head, bf16": lambda T: heads * T * T * 2,
              f"one chunk of scores, ({chunk}, T) per head, float32": lambda T: heads * min(chunk, T) * T * 4,
              "q, (T, H D) in bf16, for scale": lambda T: T * heads * cfg.head_dim * 2,
              "lse, (T, H) in float32": lambda T: heads * T * 4}
    figure = Figure(figsize=(8, 4.2))
    ax = figure.add_subplot()
    for label, nbytes in series.items():
        ax.loglog(lengths, [nbytes(T) / 2 ** 30 for T in lengths], "o-", markersize=3, label=label)
    ax.set_xlabel("sequence length T")
    ax.set_ylabel("GiB per layer and sequence")
    ax.set_title(f"Attention of Llama 3 8B (H = {heads}): keep lse, recompute p")
    ax.legend(fontsize=8)
    ax.grid(True, which="major", alpha=0.3)
    save(figure, path)


def fsdp_calls(n_layers: int = 4) -> list[tuple[str, int]]:
    """The calls module 07's FSDPLlama makes in one training step, in the order it makes them: ("gather",
    layer) for every all-gather it issues, ("forward" | "backward", layer) for every block it computes,
    ("reduce_scatter", layer). Recorded from the reference on a group of one, whose collectives are logged
    and not sent."""
    from course.mesh import single_group

    LlamaConfig = reference("m06_llama_block").LlamaConfig
    cfg = LlamaConfig(dim=32, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=48, n_layers=n_layers, max_seq_len=16)
    model = reference("m07_fsdp").FSDPLlama(cfg, single_group("d"))
    calls, current = [], []
    collectives = model.dp.collectives

    def logged(name, run):
        def call(*args, **kwargs):
            if name in ("all_gather", "reduce_scatter") and kwargs.get("label", "").startswith("block"):
                calls.append(("gather" if name == "all_gather" else name, int(kwargs["label"].split()[-1])))
            return run(*args, **kwargs)
        return call

    for name in ("all_gather", "reduce_scatter"):
        setattr(collectives, name, logged(name, getattr(collectives, name)))
    get = model.weights.get
    model.weights.get = lambda layer: current.append(layer) or get(layer)
    for kind in ("forward", "backward"):
        run = getattr(model.block, kind)
        setattr(model.block, kind,
                lambda w, *args, run=run, kind=kind: calls.append((kind, current[-1])) or run(w, *args))
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.max_seq_len), generator=torch.Generator().manual_seed(0))
    model.train_step(tokens, tokens, 1, types.SimpleNamespace(step=lambda: None))  # the calls, not an update
    return calls


def without_prefetch(calls):
    """The same calls with each gather issued just before the block that needs it, not one block ahead."""
    out, pending = [], {}
    for kind, layer in calls:
        if kind == "gather":
            pending[layer] = (kind, layer)
            continue
        if kind in ("forward", "backward") and layer in pending:
            out.append(pending.pop(layer))
        out.append((kind, layer))
    return out


def two_streams(calls, seconds, prefetch: bool) -> list[tuple[str, int, float, float]]:
    """(kind, layer, start, end) of each call on a compute stream and one communication queue: a block waits
    for its gather, a gather for the block that last used its buffer (layer % 2) to finish, a reduce-scatter
    for its block's backward. Without prefetch each gather is issued just before its block and every call
    waits for the one issued before it (a host that waits for each transfer)."""
    calls = calls if prefetch else without_prefetch(calls)
    done, last = {}, 0.0
    streams = {"compute": 0.0, "comm": 0.0}
    out = []
    for kind, layer in calls:
        stream = "compute" if kind in ("forward", "backward") else "comm"
        ready = streams[stream]
        if kind in ("forward", "backward"):
            ready = max(ready, done.get(("gather", layer), 0.0))
        elif kind == "gather":
            ready = max(ready, done.get(("buffer", layer % 2), 0.0))
        else:
            ready = max(ready, done.get(("backward", layer), 0.0))
        if not prefetch:
            ready = max(ready, last)
        end = ready + seconds(kind)
        streams[stream], last = end, end
        done[(kind, layer)] = end
        if kind in ("forward", "backward"):
            done[("buffer", layer % 2)] = end
        out.append((kind, layer, ready, end))
    return out


def fsdp_prefetch(path: Path):
    """07: one FSDP step of four Llama 3 8B blocks over d = 32 ranks on H100s' network (two sequences a
    rank, η = 0.5): the reference's calls in the order it issues them, on a compute stream and one
    communication queue, timed with module 18's time model, without and with the prefetch."""
    step_time, gpu, model = reference("m18_step_time"), presets().GPUS["h100"], llama3_8b()
    time_model, d, tokens = step_time.TimeModel(), 32, 2 * model.cfg.max_seq_len
    forward, backward = seconds_per_block(model, tokens, gpu, time_model)
    block_bytes = (reference("m07_payload").block_matrix_params(model.cfg) + 2 * model.cfg.dim) * 2  # bf16
    collective = time_model.latency_inter + (d - 1) / d * block_bytes / (gpu.inter * time_model.link_efficiency)
    seconds = {"forward": forward, "backward": backward, "gather": collective, "reduce_scatter": collective}.get
    calls = fsdp_calls()
    colours = {"forward": "tab:green", "backward": "tab:olive", "gather": "tab:blue", "reduce_scatter": "tab:red"}
    figure = Figure(figsize=(10, 4.2))
    axes = figure.subplots(2, 1, sharex=True)
    for ax, prefetch in zip(axes, (False, True)):
        spans = two_streams(calls, seconds, prefetch)
        for kind, layer, start, end in spans:
            row = 1 if kind in ("forward", "backward") else 0
            ax.barh(row, (end - start) * MS, left=start * MS, color=colours[kind], edgecolor="white")
            short = {"forward": "F", "backward": "B", "gather": "AG", "reduce_scatter": "RS"}[kind]
            ax.text((start + end) / 2 * MS, row, f"{short}{layer}", ha="center", va="center", fontsize=7)
        ax.set_yticks([0, 1], ["communication", "compute"])
        ax.set_title(f"{'with' if prefetch else 'without'} prefetch: step {max(e for *_, e in spans) * MS:.0f} ms",
                     fontsize=10)
    axes[-1].set_xlabel(f"ms (Llama 3 8B block: forward {forward * MS:.1f} ms, all-gather or reduce-scatter "
                        f"{collective * MS:.1f} ms at d = {d} over the network)")
    save(figure, path)


def stream_overlap(path: Path):
    """08: module 08's weight source, recorded on the CPU's event graph (course/streams.py) for a model of six
    blocks, then timed with the per-block copy and compute times bench 08 measured on an H200."""
    from course.streams import FakeRuntime, record_compute, schedule

    table = saved_table("bench-08-gpu.json")
    rows = {row["variant"]: row for row in table["rows"]}
    n_blocks = 6
    compute = rows["compute only (all resident)"]["ms/step"] / (3 * n_blocks)   # a backward: two forwards
    copy = rows["copy only"]["ms/step"] / rows["copy only"]["block copies"]
    LlamaConfig, LlamaModel = reference("m06_llama_block").LlamaConfig, reference("m06_llama_model").LlamaModel
    host = reference("m08_host_weights")
    cfg = LlamaConfig(n_layers=n_blocks, max_seq_len=16)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    figure = Figure(figsize=(10, 4.2))
    axes = figure.subplots(2, 1, sharex=True)
    for ax, prefetch, measured in zip(axes, (False, True), ("streamed, no prefetch", "streamed, prefetch")):
        model, runtime = LlamaModel(cfg), FakeRuntime()
        source = host.HostWeights(model.blocks, runtime)
        model.weights, model.blocks = (source if prefetch else host.NoPrefetch(source)), []
        record_compute(model, runtime).forward_backward(tokens, tokens)
        spans = schedule(runtime.nodes, lambda node: {"copy": copy, "block forward": compute,
                                                      "block backward": 2 * compute}.get(node.label, 0.0))
        for node, start, end in spans:
            if end > start:
                row = 1 if node.stream == "compute" else 0
                ax.barh(row, end - start, left=start, color="tab:orange" if node.label == "copy" else "tab:blue",
                        edgecolor="white")
        ax.set_yticks([0, 1], ["copy stream", "compute stream"])
        ax.set_title(f"{'with' if prefetch else 'without'} prefetch: {max(e for *_, e in spans):.0f} ms from the "
                     f"graph, {rows[measured]['ms/step']:.0f} ms measured", fontsize=10)
    axes[-1].set_xlabel(f"ms ({table['device']}: a block's copy {copy:.1f} ms, its forward {compute:.1f} ms)")
    save(figure, path)


def fp8_speedup(path: Path):
    """09: bench 09's FP8 linear against bf16, forward and backward, measured on an H200
    (notebooks/data/bench-09-gpu.json), against the size of the product."""
    table = saved_table("bench-09-gpu.json")
    rows = sorted(table["rows"], key=lambda r: r["tokens"] * r["in"] * r["out"])
    size = [2 * r["tokens"] * r["in"] * r["out"] for r in rows]
    figure = Figure(figsize=(8.5, 4.2))
    ax = figure.add_subplot()
    for column in [c for c in rows[0] if c.endswith("speedup")]:
        ax.semilogx(size, [r[column] for r in rows], "o-", label=column.replace(" speedup", ""))
    ax.axhline(1.0, color="grey", linewidth=1)
    ax.set_xlabel("FLOPs of one forward product, 2 N K M")
    ax.set_ylabel("speed-up over bf16")
    ax.set_title(f"FP8 pays where the product is large: {table['device']}")
    ax.legend(fontsize=8)
    save(figure, path)


def recompute_memory(path: Path):
    """10: the bytes one block of Llama 3 8B keeps for one 8192-token sequence in bf16, by name, under each of
    module 10's options (activation_bytes and DROPPED); beside it, bench 10's measured trade-off on an H200."""
    m10, cfg = reference("m10_recompute"), llama3_8b().cfg
    sizes = m10.activation_bytes(cfg, 1, cfg.max_seq_len, torch.bfloat16)
    names = list(sizes)
    colours = matplotlib.colormaps["tab20"]
    figure = Figure(figsize=(11, 4.2))
    left, right = figure.subplots(1, 2, gridspec_kw={"width_ratios": [1.4, 1]})
    bottom = [0.0] * len(m10.OPTIONS)
    for i, name in enumerate(names):
        heights = [0 if name in m10.DROPPED[o] else sizes[name] / 2 ** 20 for o in m10.OPTIONS]
        left.bar(m10.OPTIONS, heights, bottom=bottom, label=name, color=colours(i))
        bottom = [b + h for b, h in zip(bottom, heights)]
    left.set_ylabel("MiB a block keeps")
    left.set_title("Llama 3 8B, one sequence of 8192 tokens, bf16")
    left.legend(ncol=2, fontsize=7)
    table = saved_table("bench-10-gpu.json")
    for row in (r for r in table["rows"] if r["impl"] == "hand-written"):
        right.scatter(row["held_vs_base"], row["time_vs_base"])
        right.annotate(row["option"], (row["held_vs_base"], row["time_vs_base"]), textcoords="offset points",
                       xytext=(5, 4), fontsize=8)
    right.set_xlabel("memory held after the forward (none = 1)")
    right.set_ylabel("step time (none = 1)")
    right.set_title(f"measured: {table['device']}", fontsize=9)
    save(figure, path)


def zero_bubble(path: Path):
    """11: 1F1B, ZB-H1 and ZB-V on 3 ranks and 6 microbatches, τ_F = τ_I = τ_W (the simulator's timelines)."""
    names = ("1f1b", "zbh1", "zbv")
    figure = Figure(figsize=(10, 6.4))
    axes = figure.subplots(len(names), 1, sharex=True)
    for ax, name in zip(axes, names):
        draw_simulated(ax, name, 3, 6)
    for ax in axes[:-1]:
        ax.set_xlabel("")
    save(figure, path)


def sequence_parallel(path: Path):
    """12: the bytes one block of Llama 3 70B keeps on one rank for one sequence, in bf16, over t tensor
    ranks, with and without sequence parallelism (module 12's tp_activations_by_name)."""
    costs, cfg = reference("m12_tp_costs"), presets().MODELS["llama3-70b"].cfg
    stream, ranks = set(costs.STREAM_NAMES), (1, 2, 4, 8)
    figure = Figure(figsize=(8.5, 4.2))
    ax = figure.add_subplot()
    for i, t in enumerate(ranks):
        for offset, sp in ((-0.2, False), (0.2, True)):
            kept = costs.tp_activations_by_name(cfg, {"t": t}, 1, torch.bfloat16, sequence_parallel=sp)
            split = sum(v for k, v in kept.items() if k not in stream) / 2 ** 20
            whole = sum(v for k, v in kept.items() if k in stream) / 2 ** 20
            ax.bar(i + offset, split, 0.38, color="tab:blue",
                   label="split by heads or FFN units" if i == 0 and sp else None)
            ax.bar(i + offset, whole, 0.38, bottom=split, color="tab:orange" if not sp else "tab:green",
                   label=("residual stream, whole" if not sp else "residual stream, T/t positions") if i == 0 else None)
    ax.set_xticks(range(len(ranks)), [f"t = {t}\n(left: TP, right: TP + SP)" for t in ranks], fontsize=8)
    ax.set_ylabel("MiB one block keeps on one rank")
    ax.set_title("Llama 3 70B, one sequence of 8192 tokens, bf16")
    ax.legend(fontsize=8)
    save(figure, path)


def mesh_costs(path: Path):
    """13: Llama 3 70B on 64 ranks, every d x t mesh that divides it, 2 sequences a data rank in bf16: what
    a rank keeps and what it sends in one step (module 13's state_bytes, block_activation_bytes,
    step_traffic)."""
    costs, cfg = reference("m13_costs"), presets().MODELS["llama3-70b"].cfg
    fits = reference("m13_llama_2d").check_mesh_fits
    meshes = []
    for t in (1, 2, 4, 8, 16):
        try:
            fits(cfg, {"d": 64 // t, "t": t}, 2 * 64 // t)
            meshes.append((64 // t, t))
        except ValueError:
            pass
    figure = Figure(figsize=(11, 4.2))
    left, right = figure.subplots(1, 2)
    labels = [f"{d} x {t}" for d, t in meshes]
    bottom = [0.0] * len(meshes)
    for kind in ("parameters", "gradients", "optimizer", "activations"):
        values = []
        for d, t in meshes:
            kept = (costs.state_bytes(cfg, {"d": d, "t": t}, torch.bfloat16)
                    + costs.block_activation_bytes(cfg, {"d": d, "t": t}, 2 * d, torch.bfloat16)).memory
            values.append(kept.get(kind, 0) / GB)
        left.bar(labels, values, bottom=bottom, label=kind, color=KIND_COLOURS[kind])
        bottom = [b + v for b, v in zip(bottom, values)]
    left.set_ylabel("GB one rank keeps")
    left.set_xlabel("d x t")
    left.legend(fontsize=8)
    for axis, colour in (("d", "tab:blue"), ("t", "tab:red")):
        sent = [costs.step_traffic(cfg, {"d": d, "t": t}, 2 * d, torch.bfloat16).sent_bytes(axis) / GB
                for d, t in meshes]
        right.bar([i + (0.2 if axis == "t" else -0.2) for i in range(len(meshes))], sent, 0.4, color=colour,
                  label=f"over {axis}")
    right.set_xticks(range(len(meshes)), labels)
    right.set_ylabel("GB one rank sends a step")
    right.set_xlabel("d x t")
    right.legend(fontsize=8)
    figure.suptitle("Llama 3 70B on 64 ranks, 2 sequences of 8192 tokens a data rank, bf16", fontsize=10)
    save(figure, path)


def bucket_timeline(path: Path):
    """14: the backward of Llama 3 8B on H100s, d = 16 data ranks on two nodes (their all-reduce goes over the
    network), two sequences a rank, and the all-reduce of its bf16 gradients: module 14's buckets
    (assign_buckets over module 18's rank_parameters), each sent once its last gradient exists, on one
    communication queue, against one bucket sent at the end. Times from module 18's time model."""
    layout_module, step_time = reference("m18_layout"), reference("m18_step_time")
    assign = reference("m14_buckets").assign_buckets
    model, gpu, time_model, d = llama3_8b(), presets().GPUS["h100"], step_time.TimeModel(), 16
    numels, _ = layout_module.rank_parameters(model, layout_module.Layout(d=d))
    _, backward = seconds_per_block(model, 2 * model.cfg.max_seq_len, gpu, time_model)
    L = model.cfg.n_layers
    per_block = (len(numels) - 3) // L
    # when each parameter's gradient exists: the head and final norm first (the loss), then the blocks from
    # the last, then the embedding (rank_parameters' order: head, norm, embedding, blocks from the first)
    ready = [0.0, 0.0, L * backward] + [(L - i // per_block) * backward for i in range(len(numels) - 3)]
    bandwidth = gpu.inter * time_model.link_efficiency

    def timeline(cap):
        tensors = [torch.empty(n, dtype=torch.bfloat16, device="meta") for n in numels]
        free, spans = 0.0, []
        for bucket in assign(tensors, cap):
            start = max(free, max(ready[i] for i in bucket))
            nbytes = 2 * sum(numels[i] for i in bucket)
            free = start + time_model.latency_inter + 2 * (d - 1) / d * nbytes / bandwidth
            spans.append((start, free))
        return spans

    figure = Figure(figsize=(10, 4.4))
    caps = ((layout_module.BUCKET_CAP, f"buckets of {layout_module.BUCKET_CAP / 2 ** 20:.0f} MiB (DDP's default)"),
            (2 ** 62, "one bucket"))
    axes = figure.subplots(len(caps), 1, sharex=True)
    for ax, (cap, label) in zip(axes, caps):
        spans = timeline(cap)
        ax.barh([1] * L, [backward * MS] * L, left=[i * backward * MS for i in range(L)], color="tab:olive",
                edgecolor="white")
        ax.barh([0] * len(spans), [(e - s) * MS for s, e in spans], left=[s * MS for s, _ in spans],
                color=["tab:blue" if k % 2 else "tab:cyan" for k in range(len(spans))], linewidth=0)
        exposed = max(e for _, e in spans) - L * backward
        ax.set_yticks([0, 1], ["all-reduce queue", "backward"])
        ax.set_title(f"{label}: {len(spans)} all-reduce(s), the last ends {max(exposed, 0) * MS:.0f} ms after "
                     "the backward", fontsize=10)
    axes[-1].set_xlabel(f"ms since the backward started ({L} blocks of {backward * MS:.0f} ms; the network at "
                        f"{bandwidth / GB:.0f} GB/s a GPU)")
    save(figure, path)


def ring_balance(path: Path):
    """15: the ring's c steps on c = 3 context ranks of a 48-token sequence: the unmasked (query, key) pairs
    each rank scores at each step (rank i holds rank (i - s) mod c's keys at step s), with module 15's
    contiguous and zig-zag layouts. A step lasts as long as its busiest rank."""
    layouts, c, T = reference("m15_layout"), 3, 48
    figure = Figure(figsize=(10, 3.8))
    for ax, kind in zip(figure.subplots(1, 2), layouts.LAYOUTS):
        split = layouts.SequenceLayout(kind, T, c)
        positions = [split.positions(i) for i in range(c)]
        work = [[int((positions[(i - s) % c][None, :] <= positions[i][:, None]).sum()) for s in range(c)]
                for i in range(c)]
        ax.imshow(work, cmap="Blues", vmin=0, vmax=2 * max(map(max, work)))
        for i in range(c):
            for s in range(c):
                ax.text(s, i, str(work[i][s]), ha="center", va="center", fontsize=9)
        ax.set_xticks(range(c), [f"step {s}" for s in range(c)])
        ax.set_yticks(range(c), [f"rank {i}" for i in range(c)])
        slowest = sum(max(work[i][s] for i in range(c)) for s in range(c))
        ax.set_title(f"{kind}: the slowest rank of each step adds up to {slowest} pairs", fontsize=10)
    figure.suptitle(f"Causal pairs scored per ring step, c = {c}, T = {T} ({T * (T + 1) // 2} pairs in all)",
                    fontsize=10)
    save(figure, path)


def expert_exchange(path: Path):
    """16: one all-to-all of a mixture of experts: 4 expert ranks, 2 experts each, 256 tokens a rank routed
    top-2 by module 16's router (random weights) and planned by plan_dispatch; the rows each rank sends to
    each rank, and each expert's rows against the capacity κ of a factor 1.0."""
    router, dispatch = reference("m16_router"), reference("m16_dispatch")
    moe = router.MoEConfig(n_experts=8, top_k=2, expert_dim=64, capacity_factor=1.0)
    e, tokens, dim = 4, 256, 32
    g = torch.Generator().manual_seed(0)
    w_router = torch.randn(moe.n_experts, dim, generator=g) / dim ** 0.5
    sent, per_expert, kept = [], torch.zeros(moe.n_experts), 0
    for _ in range(e):
        n = torch.randn(tokens, dim, generator=g)
        plan = dispatch.plan_dispatch(router.route(n, w_router, None, moe).experts, moe.n_experts,
                                      moe.capacity(tokens))
        sent.append(plan.counts.view(e, -1).sum(1).tolist())
        per_expert += plan.counts
        kept += int(plan.kept.sum())
    figure = Figure(figsize=(10, 3.8))
    left, right = figure.subplots(1, 2)
    left.imshow(sent, cmap="Oranges", vmin=0, vmax=2 * max(map(max, sent)))
    for i in range(e):
        for j in range(e):
            left.text(j, i, str(sent[i][j]), ha="center", va="center", fontsize=9)
    left.set_xticks(range(e), [f"to {j}" for j in range(e)])
    left.set_yticks(range(e), [f"from {i}" for i in range(e)])
    left.set_title("rows sent by the all-to-all (diagonal: kept at home)", fontsize=10)
    right.bar(range(moe.n_experts), per_expert.tolist(),
              color=[matplotlib.colormaps["tab10"](x // (moe.n_experts // e)) for x in range(moe.n_experts)])
    right.axhline(e * moe.capacity(tokens), color="grey", linestyle="--",
                  label=f"κ = {moe.capacity(tokens)} a source, x {e}")
    right.set_xlabel("expert (colour: the rank that holds it)")
    right.set_ylabel("rows computed")
    right.set_title(f"{kept} of {e * tokens * moe.top_k} slots kept", fontsize=10)
    right.legend(fontsize=8)
    save(figure, path)


def mesh_groups(path: Path):
    """17: a mesh of p = d = c = t = 2 (16 ranks, course/mesh.py's order): the group rank 11 belongs to along
    each axis."""
    from course.mesh import index_of

    sizes, me = {"p": 2, "d": 2, "c": 2, "t": 2}, 11
    ranks = range(16)
    where = index_of(sizes, me)
    figure = Figure(figsize=(10, 2.9))
    for ax, axes in zip(figure.subplots(1, 4), (("p",), ("d",), ("c",), ("t",))):
        group = [r for r in ranks if all(index_of(sizes, r)[a] == where[a] for a in sizes if a not in axes)]
        for r in ranks:
            i = index_of(sizes, r)
            row, column = 2 * i["p"] + i["d"], 2 * i["c"] + i["t"]
            colour = "tab:red" if r == me else "tab:orange" if r in group else "0.9"
            ax.add_patch(matplotlib.patches.Rectangle((column, -row), 0.9, 0.9, color=colour))
            ax.text(column + 0.45, -row + 0.45, str(r), ha="center", va="center", fontsize=8)
        ax.set_xlim(-0.1, 4)
        ax.set_ylim(-3.1, 1)
        ax.set_axis_off()
        ax.set_title(f"group {''.join(axes)}: {group}", fontsize=8)
    figure.suptitle("rank 11 (red) and its groups; rows: (p, d), columns: (c, t)", fontsize=10)
    save(figure, path)


def step_time_parts(path: Path):
    """18: where the predicted step time goes, for the fastest layout of each of the fastest meshes the site's
    layout calculator costs for Llama 3 70B (module 18's step_time): the compute and the collectives on the
    critical path, then the rest of the step (the bubble, or the weights' traffic where it outlasts the rest),
    and below, the traffic that runs behind the compute."""
    from course.site import calculator

    exposed, hidden = calculator.axes_on_the_path()
    case = next(c for c in calculator.CASES if c.model == "llama3-70b")
    planned = calculator.fastest(case, 8, one_per_mesh=True)
    figure = Figure(figsize=(10, 4.8))
    ax = figure.add_subplot()
    colours = {"compute": "tab:green", "rest": "0.8", **{a: matplotlib.colormaps["tab10"](i)
                                                        for i, a in enumerate((*exposed, *hidden))}}
    labelled = set()

    def bar(row, parts, height):
        left = 0.0
        for name, seconds in parts:
            ax.barh(row, seconds, left=left, height=height, color=colours[name], edgecolor="white",
                    label=None if name in labelled else {"rest": "rest of the step"}.get(name, name))
            labelled.add(name)
            left += seconds

    for row, q in enumerate(planned):
        busy = [("compute", q.time.compute)] + [(a, q.time.comm[a]) for a in exposed if a in q.time.comm]
        bar(row - 0.15, busy + [("rest", max(q.time.step - sum(s for _, s in busy), 0.0))], 0.5)
        bar(row + 0.3, [(a, q.time.comm[a]) for a in hidden if a in q.time.comm], 0.2)
    ax.set_yticks(range(len(planned)), [str(q.layout) for q in planned], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("seconds of one step (thick: the critical path up to the predicted step; thin: the weights' "
                  "traffic behind it)", fontsize=9)
    ax.set_title(f"{case.title()}: the fastest layout of each of the {len(planned)} fastest meshes", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    save(figure, path)
