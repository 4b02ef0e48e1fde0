# Generated from solutions/m18_step_time.py by `python -m course.skeleton`: fill in the TODOs.
# Grade your work with `python main.py grade 18`. (skeleton 75a2c99fc19c)
"""Module 18, part 4 - how long a step takes: a stated model, not a measurement.

Bytes and memory (m18_costs) are what the modules measured equal to their formulas; time is not,
because it depends on the kernels and the network of a real cluster. So the planner predicts it
from a model whose every assumption is written here, and the chapter compares it with published
runs.

Compute. A rank computes, per step, for each of its B T / (d c) tokens (all its microbatches):

    a block's linears    2 P / t FLOPs forward (P: its matrices; an MoE block: attention, router
                         and k experts), twice that backward
    causal attention     2 T D H / t FLOPs forward (Q Kᵀ and P V, 2 T D each per head, over half
                         the keys on average: what a causal kernel computes), twice that backward
    the LM head          2 V M / t forward, twice that backward (on every stage, the slowest's)
    recompute            the forward FLOPs of what the option rebuilds (module 10's docstring)

at a fraction η of the peak Φ (`TimeModel.efficiency`): the linears at the FP8 peak with fp8,
the rest in bf16.

Communication. Over each axis x a rank sends Y_x bytes in ν_x collectives (the plan's StepCost):
τ_x = ν_x α + Y_x / (link_efficiency · bandwidth), on NVLink if the axis's groups lie within a
node (a group of axis x spans its own size times the sizes of the axes inside it: t, c t, e t,
d c t, p d c t consecutive ranks), on the node's network otherwise.

Overlap. The weights' traffic (over d, dc, ed) runs behind the compute (module 07's prefetch,
module 14's buckets); the model's axes (t, c, e, p) wait on the compute and the compute on them;
the pipeline idles a fraction of the step (module 11's closed form for the schedule, `bubble_formula`,
with τ_B = 2 τ_F):

    step = max((τ_compute + τ_t + τ_c + τ_e + τ_p) / (1 - bubble), τ_d + τ_dc + τ_ed)
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from . import m11_generators
from .m07_payload import block_matrix_params
from .m18_layout import Layout, stages_per_rank
from .m18_presets import GPU, Model

# Module 11's closed forms, remembered: a search asks for the same few (schedule, p, m) thousands of times
bubble_formula = functools.lru_cache(maxsize=None)(m11_generators.bubble_formula)

EXPOSED_AXES = ("t", "c", "e", "p")    # on the critical path
HIDDEN_AXES = ("d", "dc", "ed")        # behind the compute


@dataclass(frozen=True)
class TimeModel:
    efficiency: float = 0.5        # η: the fraction of Φ a step's FLOPs reach (kernels, launches, imbalance)
    link_efficiency: float = 0.8   # of a link's bandwidth, what a collective reaches
    latency_intra: float = 10e-6   # α, seconds per collective within a node
    latency_inter: float = 25e-6   # α, seconds per collective between nodes


@dataclass(frozen=True)
class StepTime:
    step: float                # seconds, one optimizer step
    compute: float             # τ_compute
    comm: dict                 # axis -> τ_x
    bubble: float              # the pipeline's idle fraction


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


def flops_per_token(model: Model, layout: Layout, recomputed: bool = True) -> tuple[float, float]:
    """(linear FLOPs, other FLOPs) for one token of one block on one rank, forward and backward,
    and the recompute's forward FLOPs if `recomputed` (see the module docstring)."""
    cfg, t, moe = model.cfg, layout.t, model.moe
    attention_weights = 2 * cfg.n_heads * cfg.head_dim * cfg.dim + 2 * cfg.n_kv_heads * cfg.head_dim * cfg.dim
    if moe is None:
        ffn = 3 * cfg.ffn_dim * cfg.dim
    else:
        ffn = moe.top_k * 3 * moe.expert_dim * cfg.dim + moe.n_experts * cfg.dim
    core = 2 * cfg.max_seq_len * cfg.head_dim * cfg.n_heads   # causal: half the keys
    linear, other = 3 * 2 * (attention_weights + ffn) / t, 3 * core / t
    if recomputed:
        qkv = 2 * (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim * cfg.dim
        gate_up = 2 * (2 / 3) * ffn if moe is None else 2 * moe.top_k * 2 * moe.expert_dim * cfg.dim
        down = 2 * ffn / 3 if moe is None else 2 * moe.top_k * moe.expert_dim * cfg.dim
        extra_linear, extra_other = {"ffn": (gate_up, 0), "attention": (qkv, core),
                                     "block": (2 * (attention_weights + ffn) - down, core)}.get(layout.recompute, (0, 0))
        linear, other = linear + extra_linear / t, other + extra_other / t
    return linear, other


def compute_time(model: Model, layout: Layout, batch: int, gpu: GPU, time_model: TimeModel) -> float:
    """τ_compute: one rank's FLOPs of a step at η of the peak (given)."""
    cfg = model.cfg
    tokens = batch * cfg.max_seq_len / (layout.d * layout.c)
    linear, other = flops_per_token(model, layout)
    blocks = -(-cfg.n_layers // layout.p)
    head = 3 * 2 * cfg.vocab_size * cfg.dim / layout.t
    fast = gpu.fp8 if layout.fp8 else gpu.bf16
    return tokens * (blocks * linear / fast + (blocks * other + head) / gpu.bf16) / time_model.efficiency


def model_flops(model: Model, batch: int) -> float:
    """The FLOPs one step of the whole model needs, without recompute (for MFU): every block's
    linears and causal attention and the LM head, forward and backward, for all B T tokens."""
    linear, other = flops_per_token(model, Layout(), recomputed=False)
    head = 3 * 2 * model.cfg.vocab_size * model.cfg.dim
    return batch * model.cfg.max_seq_len * (model.cfg.n_layers * (linear + other) + head)


def dense_parameters(model: Model) -> int:
    """Ψ of a dense model (module 07's P per block, the norms, the embedding, the LM head)."""
    cfg = model.cfg
    return cfg.n_layers * (block_matrix_params(cfg) + 2 * cfg.dim) + 2 * cfg.vocab_size * cfg.dim + cfg.dim


def step_time(model: Model, layout: Layout, batch: int, gpu: GPU, cost, time_model: TimeModel = TimeModel()
              ) -> StepTime:
    """The predicted time of one step of `layout`, from the rank's StepCost `cost` (m18_costs.rank_cost)
    and the stated model of the module docstring."""
    compute = compute_time(model, layout, batch, gpu, time_model)
    # TODO(m18): the step time: compute, each axis's links, the bubble, and what overlaps
    # Contract: a StepTime(step, compute, comm, bubble): comm maps every axis with traffic in `cost` to τ_x = ν_x α +
    #   Y_x / bandwidth, with (bandwidth, α) = link(axis, layout, gpu, time_model), Y_x = cost.sent_bytes(axis) and
    #   ν_x = cost.n_calls(axis); bubble = module 11's bubble_formula for layout.schedule on p ranks and m
    #   microbatches, with v = stages_per_rank(layout) (0.0 without a pipeline); step = the module docstring's max.
    # Maths: the exposed axes' times add to the compute, the pipeline stretches their sum by 1 / (1 - bubble), and
    #   the weights' traffic hides behind all of it unless it takes longer.
    # Pitfalls: the bubble of another schedule than the layout's (interleaved divides 1F1B's by v, the zero-bubble
    #   ones do better still: the tests compare with course/simulate.py's timelines); an axis's bytes at another
    #   axis's bandwidth; the weights' traffic added to the step instead of overlapped.
    raise NotImplementedError("TODO(m18): the step time: compute, each axis's links, the bubble, and what overlaps")
