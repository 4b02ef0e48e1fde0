"""Module 18, part 1 - what the planner plans for (given): published models in module 06's
`LlamaConfig` (module 16's `MoEConfig` for the experts), and GPUs, each number with its source.

A model is a `Model`: its configuration at real size, the sequence length T it is trained at
(cfg.max_seq_len), a default global batch of B sequences, and its feed-forward: Llama's SwiGLU
(three F x M matrices) or GPT's GELU (two, F = 4M: the models of Megatron-LM's paper). A GPU is a
`GPU`: its memory and the bandwidth of that memory, its peak dense FLOP/s Φ in bf16 and fp8, and
the bandwidth one GPU has to send to the others of its node (NVLink) and to other nodes (its
network card), each one way.

The formulas of modules 07 to 16 take a `LlamaConfig` whatever its size: they only count, so
Llama 3 405B is one more configuration to them. What cannot be written in it, and is therefore
not planned: tied embeddings, biases, learned position embeddings (GPT's: counted as RoPE, which
has no weights), a dense FFN beside the experts (Mixtral has none) and module 16's shared expert.

`PUBLISHED` lists training runs whose speed a paper printed, each with its layout, its hardware and
its figure in the paper's own convention: `python main.py plan --published` sets the planner's
prediction beside each (docs/18-planning.md).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .m06_llama_block import LlamaConfig
from .m16_router import MoEConfig

GB = 10**9  # the vendors' gigabyte (and the unit the plan prints)


MLPS = ("swiglu", "gelu")


@dataclass(frozen=True, eq=False)   # compared and hashed by identity: the planner's caches look models up fast
class Model:
    name: str
    cfg: LlamaConfig            # real dimensions; max_seq_len is T, the sequence length of training
    moe: MoEConfig | None = None
    batch: int = 512            # B: sequences in the global batch, unless --batch says otherwise
    mlp: str = "swiglu"         # the dense feed-forward: "swiglu" (w_gate, w_up, w_down) or "gelu" (w_up, w_down)

    def __post_init__(self):
        if self.mlp not in MLPS:
            raise ValueError(f"unknown feed-forward {self.mlp!r}: one of {', '.join(MLPS)}")


@dataclass(frozen=True)
class GPU:
    name: str
    memory: float               # bytes of HBM
    bf16: float                 # Φ: peak dense bf16 FLOP/s of its tensor cores
    fp8: float | None           # peak dense fp8 FLOP/s (None: no FP8 tensor cores)
    intra: float                # bytes/s one GPU sends to the others of its node (NVLink), one way
    inter: float                # bytes/s one GPU sends to other nodes (its NIC), one way
    per_node: int = 8           # GPUs per node (an HGX board)
    bandwidth: float = 3.35e12  # β_mem: bytes/s between the GPU's memory and its cores (the roofline's slope)


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
    # sparsity; 80 GB HBM3 at 3.35 TB/s; NVLink 900 GB/s. Network: DGX H100 user guide, 8 ConnectX-7
    # 400 Gb/s ports, one per GPU (the Llama 3 paper's RoCE and InfiniBand fabrics are also 400 Gb/s a GPU).
    "h100": GPU("H100 SXM", 80 * GB, 989e12, 1979e12, 450 * GB, 50 * GB, bandwidth=3.35e12),
    # NVIDIA H200 datasheet (H200 SXM): the H100's tensor cores (BF16 1,979 / FP8 3,958 TFLOPS with
    # sparsity), 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s; DGX H200 has the same 8 x 400 Gb/s ConnectX-7.
    "h200": GPU("H200 SXM", 141 * GB, 989e12, 1979e12, 450 * GB, 50 * GB, bandwidth=4.8e12),
    # NVIDIA A100 Tensor Core GPU datasheet (A100 80GB SXM): BF16 312 TFLOPS (624 with sparsity), no
    # FP8; 80 GB HBM2e at 2,039 GB/s; NVLink 600 GB/s. DGX A100: 8 ConnectX-6 200 Gb/s ports for the
    # compute fabric.
    "a100": GPU("A100 SXM 80GB", 80 * GB, 312e12, None, 300 * GB, 25 * GB, bandwidth=2.039e12),
}


@dataclass(frozen=True)
class Published:
    """One training run whose speed a paper printed: the model, the hardware, the layout fields the
    paper states (the planner chooses the rest: m when only the batch per replica is given, the
    recompute option, v), and the figure in the paper's own convention."""
    source: str                 # paper, table and row
    model: Model
    gpu: GPU
    gpus: int
    layout: dict                # Layout fields the source states, e.g. {"p": 16, "t": 8, "d": 64, ...}
    tflops: float               # TFLOP/s per GPU as printed
    counts: str                 # what those FLOPs count: "eq3" (Narayanan et al.'s Eq. 3: full attention and a
                                # recomputed forward) or "unstated" (the Llama 3 paper does not say)
    overlapped: bool = True     # whether the run's gradient reduction overlaps the backward (m18_step_time)


def gpt(h: int, layers: int, heads: int) -> Model:
    """Narayanan et al. 2021's GPT models (arXiv:2104.04473, §5.1): vocabulary 51,200, sequences of 2,048,
    a GELU feed-forward of 4h, as many key/value heads as query heads."""
    cfg = LlamaConfig(dim=h, n_heads=heads, n_kv_heads=heads, head_dim=h // heads, ffn_dim=4 * h,
                      vocab_size=51200, n_layers=layers, max_seq_len=2048)
    return Model(f"GPT h={h} L={layers}", cfg, mlp="gelu")


def _megatron(billions: str, h: int, layers: int, heads: int, t: int, p: int, gpus: int, batch: int, tflops: float):
    # Table 1 states t, p, the GPUs and the batch; its runs recompute the whole forward (Eq. 3 counts it:
    # m18_layout's "full"), use the interleaved schedule (§5.1) and, in 2021, Megatron-LM's own data parallelism,
    # which all-reduces the gradients (ZeRO 0) after the backward of the last microbatch (its train_step calls
    # allreduce_gradients once forward_backward returns), and attention that writes its T x T scores
    # (FlashAttention came in 2022)
    layout = {"p": p, "t": t, "c": 1, "d": gpus // (t * p), "zero": 0, "recompute": "full",
              "schedule": "interleaved" if p > 1 else "none", "attention": "materialized", "sequence_parallel": False}
    return Published(f"Narayanan et al. 2021, Table 1, {billions}B", dataclasses.replace(gpt(h, layers, heads), batch=batch),
                     GPUS["a100"], gpus, layout, tflops, "eq3", overlapped=False)


# "The Llama 3 Herd of Models" (arXiv:2407.21783), Table 4: 405B with TP 8 and PP 16, 16M tokens a batch, the
# interleaved schedule (§3.3.2), FSDP that shards the gradients and the optimizer state and does not reshard the
# weights after the forward (§3.3.2: ZeRO-2 that reduce-scatters once a step); at 128K tokens, all-gather
# context parallelism (§3.3.2). TP, CP, PP, tokens a batch and TFLOP/s also on P. Balaji's SC'24 slide.
_LLAMA = {"t": 8, "p": 16, "schedule": "interleaved", "zero": 2, "reduce_once": True, "fp8": False}
PUBLISHED = [
    Published("Llama 3, Table 4, 8,192 GPUs", MODELS["llama3-405b"], GPUS["h100"], 8192,
              {**_LLAMA, "c": 1, "d": 64}, 430, "unstated"),
    Published("Llama 3, Table 4, 16,384 GPUs", MODELS["llama3-405b"], GPUS["h100"], 16384,
              {**_LLAMA, "c": 1, "d": 128}, 400, "unstated"),
    Published("Llama 3, Table 4, 16,384 GPUs, 128K", dataclasses.replace(
        MODELS["llama3-405b"], cfg=dataclasses.replace(LLAMA3_405B, max_seq_len=131072), batch=128),
              GPUS["h100"], 16384, {**_LLAMA, "c": 16, "d": 8, "cp": "allgather"}, 380, "unstated"),
    _megatron("1.7", 2304, 24, 24, 1, 1, 32, 512, 137),
    _megatron("3.6", 3072, 30, 32, 2, 1, 64, 512, 138),
    _megatron("7.5", 4096, 36, 32, 4, 1, 128, 512, 142),
    _megatron("18.4", 6144, 40, 48, 8, 1, 256, 1024, 135),
    _megatron("39.1", 8192, 48, 64, 8, 2, 512, 1536, 138),
    _megatron("76.1", 10240, 60, 80, 8, 4, 1024, 1792, 140),
    _megatron("145.6", 12288, 80, 96, 8, 8, 1536, 2304, 148),
    _megatron("310.1", 16384, 96, 128, 8, 16, 1920, 2160, 155),
    _megatron("529.6", 20480, 105, 128, 8, 35, 2520, 2520, 163),
    _megatron("1008.0", 25600, 128, 160, 8, 64, 3072, 3072, 163),
]

# What the planner cannot express, said rather than approximated.
NOT_PLANNED = {
    "DeepSeek-V3 (arXiv:2412.19437)": "multi-head latent attention (a low-rank key/value projection shared by the "
    "heads), a shared expert beside 256 routed ones, three dense blocks before the MoE blocks, and the expert "
    "exchange hidden behind the compute by DualPipe's overlapped forward-backward pairs: the planner's Model has "
    "none of the four (one kind of block, grouped-query attention, every exchange on the critical path)",
}
