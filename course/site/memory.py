"""The memory explorer's data (given): what one rank of module 13's 2-D model keeps and sends, on every d x t
mesh of a few sizes, from the module's own cost functions (solutions/m13_costs.py: `state_bytes`,
`block_activation_bytes`, `step_traffic`). A d x 1 mesh is FSDP alone (module 07), a 1 x t mesh tensor
parallelism alone (module 12). A mesh the model cannot be split over maps to the reference's reason
(`check_mesh_fits`). The page (static/memory.js) draws `_static/memory/data.js`, a script for file://.
"""
from __future__ import annotations

import json
from pathlib import Path

RANKS = (1, 2, 4, 8, 16, 32, 64)
SEQUENCES_PER_DATA_RANK = (1, 2, 4, 8)  # the global batch is this times d
DTYPES = ("float32", "bfloat16")


def models():
    """The model shapes to explore: the course's Llama, and the shape of Llama 3 8B for scale."""
    from course.impl import reference

    LlamaConfig = reference("m06_llama_block").LlamaConfig
    return {"the course's Llama (module 06's LlamaConfig)": LlamaConfig(),
            "Llama 3 8B's shape (32 blocks, dim 4096, 8 KV heads, 8192 tokens)": LlamaConfig(
                dim=4096, n_heads=32, n_kv_heads=8, head_dim=128, ffn_dim=14336, vocab_size=128256, n_layers=32,
                max_seq_len=8192)}


def meshes(ranks: int) -> list[tuple[int, int]]:
    return [(ranks // t, t) for t in range(1, ranks + 1) if ranks % t == 0]


# What a rank sends, by axis and kind of collective, as module 13's step_traffic counts it (StepCost.sent).
SENT = (("d", "all_gather"), ("d", "reduce_scatter"), ("t", "all_gather"), ("t", "reduce_scatter"),
        ("t", "all_reduce"), ("d", "all_reduce"))


def mesh_data(costs, fits, cfg, d: int, t: int, per_rank: int, dtype) -> dict:
    batch, sizes = per_rank * d, {"d": d, "t": t}
    try:
        fits(cfg, sizes, batch)
    except ValueError as error:
        return {"refused": str(error)}
    kept = (costs.state_bytes(cfg, sizes, dtype) + costs.block_activation_bytes(cfg, sizes, batch, dtype)).memory
    sent = costs.step_traffic(cfg, sizes, batch, dtype).sent
    return {**{what: kept.get(what, 0) for what in ("parameters", "gradients", "optimizer", "activations")},
            "sent": {f"{axis} {op}": sent.get((axis, op), 0) for axis, op in SENT}}


def write_memory_data(folder: Path) -> None:
    import torch

    from course.impl import reference

    costs, fits = reference("m13_costs"), reference("m13_llama_2d").check_mesh_fits
    data = {"ranks": RANKS, "sequences": SEQUENCES_PER_DATA_RANK, "dtypes": DTYPES, "models": []}
    for name, cfg in models().items():
        table = {f"{dtype},{n},{per_rank}": {f"{d}x{t}": mesh_data(costs, fits, cfg, d, t, per_rank, getattr(torch, dtype))
                                             for d, t in meshes(n)}
                 for dtype in DTYPES for n in RANKS for per_rank in SEQUENCES_PER_DATA_RANK}
        data["models"].append({"name": name, "layers": cfg.n_layers, "tokens": cfg.max_seq_len, "table": table})
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "data.js").write_text(f"window.MEMORY = {json.dumps(data, separators=(',', ':'))};\n")
