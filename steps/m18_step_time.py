# Generated from solutions/m18_step_time.py by `python -m course.skeleton`: fill in the TODOs.
# Grade your work with `python main.py grade 18`. (skeleton 8f94e1228903)
"""Module 18, part 4 - how long a step takes: a stated model, not a measurement.

Bytes and memory (m18_costs) are what the modules measured equal to their formulas; time is not,
because it depends on the kernels and the network of a real cluster. So the planner predicts it
from a model whose every assumption is written here, and the chapter sets it beside published
runs (`python main.py plan --published`).

Compute. A rank runs, for each of its m microbatches of N = B T / (d c m) tokens, the kernels of
its ⌈L/p⌉ blocks and of the LM head, forward once, backward (twice the forward's products), and
forward again what the recompute option rebuilds (module 10's docstring):

    a block's GEMMs    q, k, v and o; the feed-forward's (SwiGLU: gate, up, down; GELU: up, down;
                       an MoE block: the router and its E/e experts, k N e / E rows each): N rows
                       (sequence parallelism gathers the t ranks' positions first), H/t, K/t, F/t wide
    attention          per query, 4 T D H / t products' worth over half the keys (causal): a flash
                       kernel (module 06's chunked attention, FlashAttention) reads q, k, v and writes o,
                       its backward recomputes the scores (5 products against the forward's 2, Dao et
                       al. 2022); a "materialized" kernel (attention before 2022: Megatron-LM's) writes
                       the T x T scores of every head, computes all of them (the mask after), and its
                       softmax and GPT's attention dropout read and write them (`Layout.attention`)
    the LM head        (N, M) x (M, V/t), on the last rank, which holds as many blocks fewer as the
                       p v stages have to spare (the slowest rank sets a pipeline's pace)

Each kernel takes what the roofline gives it (`gemm_time`): its FLOPs at η Φ (η =
`TimeModel.efficiency`: the fraction of the peak a compute-bound kernel reaches; the fp8 peak for
the linears with fp8) or the bytes it moves at the memory's bandwidth β_mem, whichever is longer.
So a GEMM's shape decides its speed: wide ones are compute-bound, thin ones (few rows, or a small
t-slice) wait on memory.

Communication. Over each axis x a rank sends Y_x bytes in ν_x collectives (the plan's StepCost):
τ_x = ν_x α + Y_x / (link_efficiency · bandwidth), on NVLink if the axis's groups lie within a
node (a group of axis x spans its own size times the sizes of the axes inside it: t, c t, e t,
d c t, p d c t consecutive ranks), on the node's network otherwise.

Overlap. The model's axes (t, c, e, p) wait on the compute and the compute on them; the pipeline
idles a fraction of the step (module 11's closed form for the schedule, `bubble_formula`, with
τ_B = 2 τ_F). The weights' traffic (over d, dc, ed) runs beside the compute that is under way while
it is in flight, and no more than a fraction `TimeModel.hidden` of it hides (module 14's benchmark
measured about 80 % hidden behind a long backward: the last bucket leaves when the backward ends):

    a gradient's reduction     behind the backward of the micro-step that made it: every
                               micro-step's for module 14's ZeRO-2, the last one's otherwise
                               (gradients accumulated over the micro-steps are whole only then)
    a weight's gather          FSDP (ZeRO 3) behind the first micro-step's forward (prefetched);
                               module 14's ZeRO 1 and 2 gather after the optimizer step: exposed

    step = (τ_compute + τ_t + τ_c + τ_e + τ_p) / (1 - bubble) + exposed weights' traffic
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from . import m11_generators
import torch

from .m07_payload import block_matrix_params
from .m12_tp_costs import STREAM_NAMES
from .m18_costs import layer_activations
from .m18_layout import DROPPED, Layout, stages_per_rank
from .m18_presets import GPU, Model

# Module 11's closed forms, remembered: a search asks for the same few (schedule, p, m) thousands of times
bubble_formula = functools.lru_cache(maxsize=None)(m11_generators.bubble_formula)

EXPOSED_AXES = ("t", "c", "e", "p")    # on the critical path
HIDDEN_AXES = ("d", "dc", "ed")        # beside the compute, as far as it hides


@dataclass(frozen=True)
class TimeModel:
    # η: the fraction of Φ a compute-bound kernel reaches (its launches, its tails, what the roofline leaves out:
    # the optimizer, the loss, the gaps between kernels). One calibration point (docs/18-planning.md): the value
    # at which Narayanan et al. 2021's 1T row (Table 1, 163 TFLOP/s a GPU) is predicted on its own layout.
    efficiency: float = 0.65
    hidden: float = 0.8            # the most of the weights' traffic that hides (module 14's bench: about 80 %)
    link_efficiency: float = 0.8   # of a link's bandwidth, what a collective reaches
    latency_intra: float = 10e-6   # α, seconds per collective within a node
    latency_inter: float = 25e-6   # α, seconds per collective between nodes


@dataclass(frozen=True)
class StepTime:
    step: float                # seconds, one optimizer step
    compute: float             # τ_compute: forward, backward and recompute of the m microbatches
    comm: dict                 # axis -> τ_x
    bubble: float              # the pipeline's idle fraction
    exposed: float = 0.0       # seconds of the weights' traffic that do not hide behind the compute


def group_span(axis: str, layout: Layout) -> int:
    """Consecutive ranks one group of `axis` spans (rank = ((i_p d + i_d) c + i_c) t + i_t; e is
    carved out of d c in blocks of e, course/mesh.py)."""
    if axis == "t":
        return layout.t
    if axis in ("c", "e"):
        return getattr(layout, axis) * layout.t
    return layout.gpus if axis == "p" else layout.d * layout.c * layout.t   # d, dc, ed


def link(axis: str, layout: Layout, gpu: GPU, time_model: TimeModel) -> tuple[float, float]:
    """(bandwidth in bytes/s, α in s) of the links a group of `axis` talks over."""
    if gpu.per_node % group_span(axis, layout) == 0:
        return gpu.intra * time_model.link_efficiency, time_model.latency_intra
    return gpu.inter * time_model.link_efficiency, time_model.latency_inter


def roofline(flops: float, moved: float, peak: float, gpu: GPU, time_model: TimeModel) -> float:
    """Seconds of a kernel of `flops` FLOPs that reads and writes `moved` bytes (given): compute-bound at
    η of `peak`, or memory-bound at the memory's bandwidth, whichever takes longer."""
    return max(flops / (time_model.efficiency * peak), moved / gpu.bandwidth)


def gemm_time(rows: int, inner: int, cols: int, gpu: GPU, time_model: TimeModel, fp8: bool = False) -> float:
    """Seconds of one matrix product (rows x inner) @ (inner x cols) on `gpu`, by the roofline: bf16
    operands and result (2 bytes a value), or with fp8 its operands in e4m3 (1 byte) at the fp8 peak."""
    # TODO(m18): one GEMM's time from its shape: its FLOPs or the bytes it moves, whichever takes longer
    # Contract: a float, seconds: the roofline's time (roofline) of a (rows x inner) @ (inner x cols) product whose
    #   operands are bf16, or e4m3 with fp8, and whose result is bf16, at its dtype's peak. The tests compare with a
    #   hand count on a GEMM that is compute-bound and one that is memory-bound, in bf16 and fp8.
    # Question: a GEMM multiplies and adds once per (row, inner, column); how many values does it touch? Which of
    #   its three sizes can shrink until the memory, not the tensor cores, sets the pace?
    # Pitfalls: how many FLOPs is a multiply-add? Which of the three matrices does the GEMM write, and in which dtype?
    #   How many bytes is an e4m3 value?
    raise NotImplementedError("TODO(m18): one GEMM's time from its shape: its FLOPs or the bytes it moves, whichever takes longer")


def block_gemms(model: Model, t: int, e: int, rows: int) -> dict[str, list[tuple[int, int, int]]]:
    """One block's forward GEMMs on one rank, (rows, inner, cols) each, by part: "qkv", "o", and the
    feed-forward's "in" (gate and up, or up) and "out" (down) products; an MoE block's router and its E/e
    experts (k N e / E rows each, evenly routed) (given)."""
    cfg, moe = model.cfg, model.moe
    M, D = cfg.dim, cfg.head_dim
    gemms = {"qkv": [(rows, M, (cfg.n_heads + 2 * cfg.n_kv_heads) * D // t)], "o": [(rows, cfg.n_heads * D // t, M)]}
    if moe is None:
        ins = 1 if model.mlp == "gelu" else 2
        gemms.update({"in": [(rows, M, cfg.ffn_dim // t)] * ins, "out": [(rows, cfg.ffn_dim // t, M)]})
        return gemms
    routed = moe.top_k * rows * e // moe.n_experts                 # rows an expert receives from its e sources
    if moe.capacity(rows) is not None:
        routed = min(routed, moe.capacity(rows) * e)
    local, F = moe.n_experts // e, moe.expert_dim
    gemms.update({"router": [(rows, M, moe.n_experts)], "in": [(routed, M, F)] * (2 * local),
                  "out": [(routed, F, M)] * local})
    return gemms


# What each recompute option rebuilds before the backward, forward (module 10): the GEMMs of these parts,
# and the attention's forward where "attention" is listed
REBUILT = {"none": (), "swiglu": (), "norms": (), "ffn": ("router", "in"), "attention": ("qkv", "attention"),
           "block": ("qkv", "attention", "o", "router", "in"), "full": ("qkv", "attention", "o", "router", "in", "out")}


def attention_times(model: Model, layout: Layout, rows: int, gpu: GPU, time_model: TimeModel) -> tuple[float, float]:
    """(forward, backward) seconds of one block's attention on one rank for a microbatch of `rows` tokens
    (given; the module docstring's two kernels). With c > 1 each query still sees its whole sequence."""
    cfg = model.cfg
    H, K, D, T, c = cfg.n_heads // layout.t, max(cfg.n_kv_heads // layout.t, 1), cfg.head_dim, cfg.max_seq_len, layout.c
    if layout.attention == "flash":
        flops = 2 * rows * T * D * H                     # 2 products of 2 T D a query's head, over half the keys
        moved = 2 * rows * (2 * H + 2 * K) * D            # q, k, v read, o written (bf16)
        return (roofline(flops, moved, gpu.bf16, gpu, time_model),
                roofline(2.5 * flops, 2 * moved, gpu.bf16, gpu, time_model))
    sequences, queries = rows // (T // c), T // c       # every head's scores: queries x T, all computed
    scores = queries * T / gpu.bandwidth                 # seconds per byte a score moves, one head
    qk, pv = gemm_time(queries, D, T, gpu, time_model), gemm_time(queries, T, D, gpu, time_model)
    # forward: the softmax reads the scores and writes the probabilities (2 + 2 bytes a score), the dropout
    # (GPT's, 0.1) reads them and writes them with a 1-byte mask (2 + 2 + 1); backward: the dropout's gradient
    # (1 + 2 + 2), the softmax's (reads the probabilities and their gradient, writes the scores': 2 + 2 + 2)
    return sequences * H * (qk + pv + 9 * scores), sequences * H * (2 * qk + 2 * pv + 11 * scores)


def compute_times(model: Model, layout: Layout, batch: int, gpu: GPU, time_model: TimeModel) -> tuple[float, float]:
    """(forward, backward) seconds of one rank's compute in a step (given): the module docstring's kernels
    for its m microbatches, the recompute's forward counted in the backward (it runs there). Remembered for
    the layouts that compute alike (a search asks for the same ones many times)."""
    L = layout
    return _compute_times(model, Layout(L.p, L.d, L.c, L.t, L.e, m=L.m, recompute=L.recompute, fp8=L.fp8,
                                        attention=L.attention, sequence_parallel=L.sequence_parallel),
                          batch, gpu, time_model)


@functools.lru_cache(maxsize=4096)
def _compute_times(model: Model, layout: Layout, batch: int, gpu: GPU, time_model: TimeModel) -> tuple[float, float]:
    cfg = model.cfg
    rows = batch // (layout.d * layout.m) * (cfg.max_seq_len // layout.c)
    gemms = block_gemms(model, layout.t, layout.e, rows)
    time = {part: sum(gemm_time(*shape, gpu, time_model, layout.fp8 and part != "router") for shape in shapes)
            for part, shapes in gemms.items()}
    time["attention"], attention_backward = attention_times(model, layout, rows, gpu, time_model)
    # the element-wise kernels between them (norms, activation, residual adds, RoPE): each activation module 10
    # counts written once and read once forward, twice that backward; the recompute rewrites what it dropped
    by_name = layer_activations(model, batch // (layout.d * layout.m), cfg.max_seq_len // layout.c, torch.bfloat16)
    # (without sequence parallelism every t rank runs the residual stream's kernels on the whole stream)
    split = {name: 1 if name in STREAM_NAMES and not layout.sequence_parallel else layout.t for name in by_name}
    written = 2 * sum(size / split[name] for name, size in by_name.items()) / gpu.bandwidth
    rewritten = 2 * sum(by_name[name] / split[name] for name in DROPPED[layout.recompute] if name in by_name) / \
        gpu.bandwidth
    head = gemm_time(rows, cfg.dim, cfg.vocab_size // layout.t, gpu, time_model)
    forward = sum(time.values()) + written
    backward = 2 * (forward - time["attention"]) + attention_backward + \
        sum(time.get(part, 0.0) for part in REBUILT[layout.recompute]) + rewritten
    # The busiest rank: v stages of ⌈L/(p v)⌉ blocks, or the last one, which also runs the LM head, but holds
    # as many blocks fewer as the p v stages have to spare (Llama 3's 126 blocks on 16 ranks: 7 on the last)
    blocks = stages_per_rank(layout) * -(-cfg.n_layers // (layout.p * stages_per_rank(layout)))
    spare = min(layout.p * blocks - cfg.n_layers, blocks)
    return tuple(layout.m * max(blocks * block, (blocks - spare) * block + k * head)
                 for block, k in ((forward, 1), (backward, 2)))


def compute_time(model: Model, layout: Layout, batch: int, gpu: GPU, time_model: TimeModel) -> float:
    """τ_compute: one rank's forward, backward and recompute in a step (given)."""
    return sum(compute_times(model, layout, batch, gpu, time_model))


def model_flops(model: Model, batch: int, full_attention: bool = False, recomputed_forward: bool = False) -> float:
    """The FLOPs one step of the whole model needs (for MFU): every block's linears and its attention and the
    LM head, forward and backward (twice the forward), for all B T tokens. Conventions differ, so both
    switches: attention over all T keys (full_attention, torchtitan's count: "we do not account for sparsity
    in causal attention") or over half of them (causal, what a causal kernel computes); and
    recomputed_forward, one more forward of every block (Narayanan et al. 2021's Eq. 3 counts it)."""
    cfg, tokens = model.cfg, model.moe.n_experts if model.moe else 1   # tokens enough for whole routed rows
    linear = sum(2 * r * i * c for shapes in block_gemms(model, 1, 1, tokens).values() for r, i, c in shapes) / tokens
    attention = (2 if full_attention else 1) * 2 * cfg.max_seq_len * cfg.head_dim * cfg.n_heads
    block = (4 if recomputed_forward else 3) * (linear + attention)
    return batch * cfg.max_seq_len * (cfg.n_layers * block + 3 * 2 * cfg.vocab_size * cfg.dim)


def dense_parameters(model: Model) -> int:
    """Ψ of a dense model (module 07's P per block, less a GELU's missing gate; the norms, the embedding,
    the LM head)."""
    cfg = model.cfg
    gate = cfg.ffn_dim * cfg.dim if model.mlp == "gelu" else 0
    return cfg.n_layers * (block_matrix_params(cfg) - gate + 2 * cfg.dim) + 2 * cfg.vocab_size * cfg.dim + cfg.dim


def hiding_window(op: str, layout: Layout, forward: float, backward: float) -> float:
    """Seconds of compute that the weights' collectives of kind `op` run beside (given; the module
    docstring's overlap table)."""
    if op == "all_gather":
        return forward / layout.m if layout.zero == 3 else 0.0
    if op == "reduce_scatter" and layout.zero == 2 and not layout.reduce_once:
        return backward
    return backward / layout.m


def step_time(model: Model, layout: Layout, batch: int, gpu: GPU, cost, time_model: TimeModel = TimeModel()
              ) -> StepTime:
    """The predicted time of one step of `layout`, from the rank's StepCost `cost` (m18_costs.rank_cost)
    and the stated model of the module docstring."""
    forward, backward = compute_times(model, layout, batch, gpu, time_model)
    compute = forward + backward
    # TODO(m18): the step time: compute, each axis's links, the bubble, and what overlaps
    # Contract: a StepTime(step, compute, comm, bubble, exposed): comm maps every axis with traffic in `cost` to its
    #   seconds τ_x over the links link() gives that axis, ν_x collectives each waiting α and Y_x bytes at the link's
    #   bandwidth; bubble = module 11's closed form for layout.schedule on this layout's p, m and v (0.0 without a
    #   pipeline); exposed = the seconds of the weights' traffic (HIDDEN_AXES) that do not hide; step = the module
    #   docstring's sum.
    # Question: the weights' traffic runs beside the compute, but which compute? A collective can only hide
    #   behind what runs while it is in flight (hiding_window), and never all of it (time_model.hidden).
    # Maths: the exposed axes' times add to the compute, the pipeline stretches their sum by 1 / (1 - bubble); the
    #   weights' collectives of one kind take τ seconds beside a window of w seconds of compute, of which no more
    #   than the fraction `hidden` can hide: what is left adds to the step.
    # Pitfalls: how many times does an axis pay α in a step? Which schedule's bubble is this layout's? At whose
    #   bandwidth does an axis's traffic run? Can a step's reduction start before its last micro-step's gradients
    #   exist?
    raise NotImplementedError("TODO(m18): the step time: compute, each axis's links, the bubble, and what overlaps")
