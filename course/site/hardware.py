"""The site's hardware page (given): the GPUs and links module 18's costs assume, with their sources, a roofline
of each GPU with the course's GEMMs placed on it, and which link each axis of a layout talks over.

The numbers are module 18's presets (solutions/m18_presets.py), their sources the comments written above
them there, read from its source; the time model's constants are its TimeModel's fields; the link of an
axis is its `link` function. The one number the planner does not use, each GPU's memory bandwidth (the
roofline's slope: the planner's time model has a flat efficiency η instead), is `HBM` below, with its
source, unless a preset carries it.
"""
from __future__ import annotations

import dataclasses
import inspect
import json
import re
from pathlib import Path

import matplotlib
from matplotlib.figure import Figure

from course.impl import reference
from course.site import drawings

# Bytes/s of HBM, from the datasheets the presets cite: NVIDIA H100 Tensor Core GPU datasheet (H100 SXM:
# 3.35 TB/s), NVIDIA H200 datasheet (H200 SXM: 4.8 TB/s), NVIDIA A100 Tensor Core GPU datasheet (A100 80GB
# SXM: 2,039 GB/s).
HBM = {"h100": 3.35e12, "h200": 4.8e12, "a100": 2.039e12}
HBM_SOURCE = ("the GPU's datasheet, as for the other numbers (H100 SXM 3.35 TB/s, H200 SXM 4.8 TB/s, "
              "A100 80GB SXM 2,039 GB/s); module 18 does not use it")
FIELD_NAMES = {"memory": "memory (HBM)", "bf16": "bf16 peak Φ", "fp8": "fp8 peak", "intra": "NVLink, one way",
               "inter": "network, one way", "per_node": "GPUs a node"}
UNITS = {"memory": (1e9, "GB"), "bf16": (1e12, "TFLOP/s"), "fp8": (1e12, "TFLOP/s"), "intra": (1e9, "GB/s"),
         "inter": (1e9, "GB/s")}
EXAMPLE = dict(p=2, d=4, c=2, t=4, schedule="1f1b", m=8)  # a layout of 64 GPUs whose axes use both links


def comment_above(source: str, pattern: str) -> str:
    """The comment block nearest above the first line matching `pattern`, past the lines of the statements
    between them (a comment above LLAMA3_8B = ... also covers LLAMA3_70B = ... below it)."""
    lines = source.splitlines()
    at = next(i for i, line in enumerate(lines) if re.search(pattern, line))
    block = []
    for line in reversed(lines[:at]):
        text = line.strip()
        if text.startswith("#"):
            block.insert(0, text.lstrip("#").strip())
        elif block or not text:
            break
    return " ".join(block)


def gpu_source(presets, key: str) -> str:
    return comment_above(inspect.getsource(presets), rf'^\s*"{re.escape(key)}":')


def model_source(presets, key: str) -> str:
    source = inspect.getsource(presets)
    line = next(line for line in source.splitlines() if re.match(rf'\s*"{re.escape(key)}":', line))
    config = re.search(r"Model\([^,]+,\s*(\w+)", line)[1]
    return comment_above(source, rf"^{config}\s*=")


def hbm(key: str, gpu) -> float:
    return getattr(gpu, "hbm", None) or HBM[key]


def shown(field: str, value) -> str:
    if value is None:
        return "none"
    if field in UNITS:
        scale, unit = UNITS[field]
        return f"{value / scale:g} {unit}"
    return str(value)


def gemms(model, tokens: int) -> dict[str, tuple[int, int, int]]:
    """(N, K, M) of the products of one block of `model` and its LM head for `tokens` tokens, forward: the
    linears module 06's block runs (q, k, v; o; gate, up; down) and the LM head."""
    cfg = model.cfg
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    return {"q k v": (tokens, cfg.dim, q + 2 * kv), "o": (tokens, q, cfg.dim),
            "gate, up": (tokens, cfg.dim, 2 * cfg.ffn_dim), "down": (tokens, cfg.ffn_dim, cfg.dim),
            "LM head": (tokens, cfg.dim, cfg.vocab_size)}


def intensity(n: int, k: int, m: int, itemsize: int) -> float:
    """FLOPs a byte moved of one (N, K) x (K, M) product: 2 N K M over the bytes of its three matrices."""
    return 2 * n * k * m / (itemsize * (n * k + k * m + n * m))


def roofline(path: Path):
    """One panel per GPU preset: attainable FLOP/s against arithmetic intensity (the HBM slope, the bf16 and FP8
    roofs), the linears of a Llama 3 8B block at 8192 tokens (one sequence) and at 128 tokens placed on it;
    on the card bench 09 ran on (an H200), its measured bf16 linears (forward and backward,
    notebooks/data/bench-09-gpu.json)."""
    presets = reference("m18_presets")
    model = presets.MODELS["llama3-8b"]
    table = drawings.saved_table("bench-09-gpu.json")
    figure = Figure(figsize=(12, 4.4))
    colours = matplotlib.colormaps["tab10"]
    for ax, (key, gpu) in zip(figure.subplots(1, len(presets.GPUS), sharey=True), presets.GPUS.items()):
        bandwidth = hbm(key, gpu)
        for peak, label, style in ((gpu.bf16, "bf16", "-"), (gpu.fp8, "fp8", "--")):
            if peak:
                xs = [8.0, peak / bandwidth, 2e4]
                ax.loglog(xs, [min(peak, x * bandwidth) / 1e12 for x in xs], style, color="black", linewidth=1,
                          label=f"{label} roof, ridge at {peak / bandwidth:.0f} FLOP/B")
        for tokens, marker in ((8192, "o"), (128, "s")):
            for i, (name, (n, k, m)) in enumerate(gemms(model, tokens).items()):
                x = intensity(n, k, m, 2)
                ax.loglog([x], [min(gpu.bf16, x * bandwidth) / 1e12], marker, color=colours(i),
                          label=f"{name}" if tokens == 8192 else None)
        if table["device"].split(",")[0].replace("NVIDIA ", "") in gpu.name:
            measured = [(intensity(r["tokens"], r["in"], r["out"], 2), 6 * r["tokens"] * r["in"] * r["out"] /
                         (r["bf16 ms"] / 1e3) / 1e12) for r in table["rows"]]
            ax.loglog(*zip(*measured), "x", color="tab:red", label="bench 09's linears, measured in bf16")
        ax.set_title(f"{gpu.name}: HBM {bandwidth / 1e12:g} TB/s", fontsize=10)
        ax.set_xlabel("FLOPs per byte of HBM (o: 8192 tokens, ▪: 128)", fontsize=9)
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=6, loc="lower right")
    figure.axes[0].set_ylabel("TFLOP/s at most")
    drawings.save(figure, path)


def link_rows(presets, step_time) -> list[str]:
    """The table of the links EXAMPLE's axes are timed on: one row per axis, a column per GPU preset."""
    layout = reference("m18_layout").Layout(**EXAMPLE)
    model = step_time.TimeModel()
    rows = ["| axis | span (ranks) | " + " | ".join(gpu.name for gpu in presets.GPUS.values()) + " |",
            "| --- " * (2 + len(presets.GPUS)) + "|"]
    for axis in ("t", "c", "d", "dc", "p"):
        cells = []
        for gpu in presets.GPUS.values():
            bandwidth, alpha = step_time.link(axis, layout, gpu, model)
            where = "NVLink" if bandwidth == gpu.intra * model.link_efficiency else "network"
            cells.append(f"{where}: {bandwidth / 1e9:g} GB/s, α {alpha * 1e6:g} µs")
        rows.append(f"| {axis} | {step_time.group_span(axis, layout)} | " + " | ".join(cells) + " |")
    return rows


def write_hardware(folder: Path) -> str:
    """Draw the page's figures into `folder`; return the page's Markdown (links relative to its parent)."""
    presets, step_time = reference("m18_presets"), reference("m18_step_time")
    folder.mkdir(parents=True, exist_ok=True)
    roofline(folder / "roofline.png")
    drawings.alpha_beta(folder / "links.png")
    fields = [f.name for f in dataclasses.fields(presets.GPU) if f.name != "name"]
    lines = ["# Hardware", "", '<span id="hardware-page"></span>', "",
             "The GPUs and links that module 18's plan (`python main.py plan`, the [layout calculator](calculator.md)) "
             "assumes: the numbers of `solutions/m18_presets.py`, each with the source written above it there, "
             "read from it when the site was built. Peaks are dense (the datasheets print FP8 and BF16 with "
             "sparsity, twice these); a link's bandwidth is what one GPU sends one way.", "",
             "## GPUs", "",
             "| preset | " + " | ".join(f"{FIELD_NAMES.get(f, f)} (`{f}`)" for f in fields) + " | HBM bandwidth |",
             "| --- " * (len(fields) + 2) + "|"]
    for key, gpu in presets.GPUS.items():
        lines.append(f"| `{key}`: {gpu.name} | " + " | ".join(shown(f, getattr(gpu, f)) for f in fields)
                     + f" | {hbm(key, gpu) / 1e12:g} TB/s |")
    lines += ["", "Sources, as the presets give them:", ""]
    lines += [f"- **{gpu.name}**: {gpu_source(presets, key)}" for key, gpu in presets.GPUS.items()]
    lines += [f"- **HBM bandwidth**: {HBM_SOURCE}.", "",
              "## The roofline", "",
              "A product of an (N, K) and a (K, M) matrix does 2 N K M FLOPs and moves at least its three "
              "matrices through HBM, so it runs at most at min(Φ, I β_HBM), where I is its FLOPs a byte. Below "
              "the ridge (Φ / β_HBM) a kernel waits on memory; above it, on the tensor cores. A block's linears "
              "at one 8192-token sequence (circles) sit well above the ridge on every card; at 128 tokens "
              "(squares) they fall below it, and bench 09's smallest product, measured, lies far under its "
              "roof. The time model of chapter 18 charges every FLOP at the same fraction η of Φ "
              "(`TimeModel.efficiency`): a product below the ridge would run slower than that.", "",
              "![Roofline of each GPU preset, with Llama 3 8B's linears and bench 09's measured ones]"
              "(hardware/roofline.png)",
              "", "## Models", "", "| preset | name | L | M | H | K | F | V | T | B | experts |",
              "| --- " * 11 + "|"]
    for key, model in presets.MODELS.items():
        cfg, moe = model.cfg, model.moe
        experts = f"{moe.n_experts}, top-{moe.top_k}" if moe else "dense"
        lines.append(f"| `{key}` | {model.name} | {cfg.n_layers} | {cfg.dim} | {cfg.n_heads} | {cfg.n_kv_heads} | "
                     f"{cfg.ffn_dim} | {cfg.vocab_size} | {cfg.max_seq_len} | {model.batch} | {experts} |")
    lines += ["", "Sources, as the presets give them:", ""]
    sources = {}
    for key, model in presets.MODELS.items():
        sources.setdefault(model_source(presets, key), []).append(model.name)
    lines += [f"- **{', '.join(names)}**: {source}" for source, names in sources.items()]
    tm = step_time.TimeModel()
    lines += ["", "## The links the costs use", "",
              "Over axis x a rank sends Y_x bytes in ν_x collectives and the plan times them as ν_x α + Y_x / β_x "
              "(`solutions/m18_step_time.py`): β_x is NVLink's bandwidth if a group of x lies within one node "
              "(its span, the consecutive ranks it covers, divides the GPUs of a node), the network card's "
              "otherwise, each at the time model's link efficiency. The time model's constants "
              "(`TimeModel`): " + ", ".join(f"{f.name} = {json.dumps(getattr(tm, f.name))}"
                                            for f in dataclasses.fields(tm)) + ".", "",
              "![One message's time against its size on each link](hardware/links.png)", "",
              f"For one layout of 64 GPUs ({', '.join(f'{k} = {v}' for k, v in EXAMPLE.items())}), the link each "
              "axis's collectives are timed on (β at the link efficiency):", "",
              *link_rows(presets, step_time), ""]
    return "\n".join(lines)
