# Generated from solutions/m18_presets.py by `python -m course.skeleton`. Given code: nothing
# to fill in here; read it, then run it with `python main.py run 18`. (skeleton ecbc92c80137)
"""Module 18, part 1 - what the planner plans for (given): published models in module 06's
`LlamaConfig` (module 16's `MoEConfig` for the experts), and GPUs, each number with its source.

A model is a `Model`: its configuration at real size, the sequence length T it is trained at
(cfg.max_seq_len) and a default global batch of B sequences. A GPU is a `GPU`: its memory, its
peak dense FLOP/s Φ in bf16 and fp8, and the bandwidth one GPU has to send to the others of its
node (NVLink) and to other nodes (its network card), each one way.

The formulas of modules 07 to 16 take a `LlamaConfig` whatever its size: they only count, so
Llama 3 405B is one more configuration to them. What cannot be written in it, and is therefore
not planned: tied embeddings, biases, and a dense FFN beside the experts (Mixtral has none).
"""
from __future__ import annotations

from dataclasses import dataclass

from .m06_llama_block import LlamaConfig
from .m16_router import MoEConfig

GB = 10**9  # the vendors' gigabyte (and the unit the plan prints)


@dataclass(frozen=True, eq=False)   # compared and hashed by identity: the planner's caches look models up fast
class Model:
    name: str
    cfg: LlamaConfig            # real dimensions; max_seq_len is T, the sequence length of training
    moe: MoEConfig | None = None
    batch: int = 512            # B: sequences in the global batch, unless --batch says otherwise


@dataclass(frozen=True)
class GPU:
    name: str
    memory: float               # bytes of HBM
    bf16: float                 # Φ: peak dense bf16 FLOP/s of its tensor cores
    fp8: float | None           # peak dense fp8 FLOP/s (None: no FP8 tensor cores)
    intra: float                # bytes/s one GPU sends to the others of its node (NVLink), one way
    inter: float                # bytes/s one GPU sends to other nodes (its NIC), one way
    per_node: int = 8           # GPUs per node (an HGX board)


# Llama 3: "The Llama 3 Herd of Models" (arXiv:2407.21783), Table 3 (layers, model dimension, FFN
# dimension, attention and key/value heads, vocabulary 128,000 "tokens"; the released config.json
# files say 128,256, which is what the weights have), RoPE base 500,000. Pre-training sequences
# are 8,192 tokens (§3.4.1); the 405B's batch grows to 16M tokens (§3.4.1), 2,048 sequences of
# 8,192, which Table 4 uses for its 4-D layouts. The 8B's and 70B's batches are not given there: we
# take 4M tokens (512 sequences), the scaling book's figure for 70B (jax-ml scaling book, part 6).
LLAMA3_8B = LlamaConfig(dim=4096, n_heads=32, n_kv_heads=8, head_dim=128, ffn_dim=14336, rope_theta=500000.0,
                        vocab_size=128256, n_layers=32, max_seq_len=8192)
LLAMA3_70B = LlamaConfig(dim=8192, n_heads=64, n_kv_heads=8, head_dim=128, ffn_dim=28672, rope_theta=500000.0,
                         vocab_size=128256, n_layers=80, max_seq_len=8192)
LLAMA3_405B = LlamaConfig(dim=16384, n_heads=128, n_kv_heads=8, head_dim=128, ffn_dim=53248, rope_theta=500000.0,
                          vocab_size=128256, n_layers=126, max_seq_len=8192)
# Mixtral 8x7B: "Mixtral of Experts" (arXiv:2401.04088), Table 1 (dim 4096, 32 layers, head_dim 128,
# 32 heads, 8 key/value heads, hidden_dim 14336, vocab 32000, 8 experts, top-2); rope_theta 1e6 from
# its config.json. Its training sequence length and batch are not published: T = 4,096 and 1,024
# sequences (4M tokens) are this planner's assumption. Every block is an MoE block (no dense FFN:
# cfg.ffn_dim is unused and set to the experts' width).
MIXTRAL_8X7B = LlamaConfig(dim=4096, n_heads=32, n_kv_heads=8, head_dim=128, ffn_dim=14336, rope_theta=1e6,
                           vocab_size=32000, n_layers=32, max_seq_len=4096)

MODELS = {
    "llama3-8b": Model("Llama 3 8B", LLAMA3_8B, batch=512),
    "llama3-70b": Model("Llama 3 70B", LLAMA3_70B, batch=512),
    "llama3-405b": Model("Llama 3 405B", LLAMA3_405B, batch=2048),
    "mixtral-8x7b": Model("Mixtral 8x7B", MIXTRAL_8X7B, MoEConfig(n_experts=8, top_k=2, expert_dim=14336), batch=1024),
}

# GPUs, SXM boards in 8-GPU HGX/DGX nodes. Peaks are dense (the datasheets print FP8 and BF16
# "with sparsity", twice these). NVLink is the datasheet's total (both directions) halved.
GPUS = {
    # NVIDIA H100 Tensor Core GPU datasheet (H100 SXM): BF16 1,979 TFLOPS and FP8 3,958 TFLOPS with
    # sparsity; 80 GB HBM3; NVLink 900 GB/s. Network: DGX H100 user guide, 8 ConnectX-7 400 Gb/s
    # ports, one per GPU (the Llama 3 paper's RoCE and InfiniBand fabrics are also 400 Gb/s a GPU).
    "h100": GPU("H100 SXM", 80 * GB, 989e12, 1979e12, 450 * GB, 50 * GB),
    # NVIDIA H200 datasheet (H200 SXM): the H100's tensor cores (BF16 1,979 / FP8 3,958 TFLOPS with
    # sparsity), 141 GB HBM3e, NVLink 900 GB/s; DGX H200 has the same 8 x 400 Gb/s ConnectX-7.
    "h200": GPU("H200 SXM", 141 * GB, 989e12, 1979e12, 450 * GB, 50 * GB),
    # NVIDIA A100 Tensor Core GPU datasheet (A100 80GB SXM): BF16 312 TFLOPS (624 with sparsity), no
    # FP8; 80 GB HBM2e; NVLink 600 GB/s. DGX A100: 8 ConnectX-6 200 Gb/s ports for the compute fabric.
    "a100": GPU("A100 SXM 80GB", 80 * GB, 312e12, None, 300 * GB, 25 * GB),
}
