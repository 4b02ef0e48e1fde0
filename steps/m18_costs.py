# Generated from solutions/m18_costs.py by `python -m course.skeleton`: fill in the TODOs.
# Grade your work with `python main.py grade 18`. (skeleton b3a969b149a4)
"""Module 18, part 3 - what one rank keeps and sends in one step of a layout: the modules' own
formulas, each evaluated on the share of the model and of the batch that the other axes leave it,
and summed over the axes with `+` (course/costs.py's StepCost).

The trainer planned is module 17's composition: module 11's schedules over p, module 12's tensor
parallelism with sequence parallelism over t, module 15's context attention over c, module 16's
experts over e, and the weights over the d c ranks that hold the same copy:

    weights over d c   ZeRO 3: module 17's FSDP (m17_costs: each block's slice gathered once a step and
                       its gradient reduce-scattered once; the stage's whole slices and gradients held
                       during the step), and the embedding, LM head and final norm sharded the same way
                       (module 17's outer group, as FSDP2 and torchtitan shard them). ZeRO 0, 1, 2:
                       module 14's traffic and state on the buckets of the weights one (p, t, e) rank
                       holds; ZeRO 2 with reduce_once accumulates whole gradients and reduce-scatters
                       them once a step. Experts: module 14 over the d c / e ranks of "ed". With MIXED
                       precision AdamW keeps 12 bytes a value it updates (a float32 master copy and two
                       float32 moments).
    t                  module 12's tp_traffic with sequence parallelism, on the stage's ⌈L/p⌉ blocks,
                       B/d sequences of T/c positions
    c                  module 15's "c" entries, for the attention of a tensor rank (H/t and K/t heads);
                       Ulysses as DeepSpeed runs it (its backward the adjoint of its forward's all-to-alls)
    e                  module 16's "e" entries, on records of a router that spreads each source's
                       k N slots evenly over the E experts (at most κ with a capacity): module 16's
                       formula reads a real run's routing; the planner has none, so it gives it the
                       balanced one (evenly spread is what the balancing losses aim at)
    p                  `pipeline_sends`: the residual stream of each microbatch to the next stage and
                       its gradient back (module 11's StageComms, logged over "p"), on the busiest rank
    activations        module 10's bytes by name, for the rank's B/(d m) sequences of T/c positions,
                       every name split over t (sequence parallelism keeps the stream's T/t
                       positions): the names the recompute option keeps; n1, n2 and s as e4m3 with
                       fp8 (module 10's rule); one stage's worth per microbatch, times the most a rank
                       keeps at once (module 11's schedule, course/simulate.py's peak_live; 1 without
                       a pipeline)
    buffers            module 17's whole slices (ZeRO 3, above), the context attention's transient
                       buffer (module 15), the experts' selection biases (module 16)

With p > 1 every stage is costed as if it held the embedding, the LM head and the loss: an upper
bound (the last stage, usually the slowest, holds the head and the loss; the first the embedding).

A group of one rank sends nothing; the modules still log its calls (so their tests can count them),
but the plan leaves them out: `only` keeps one axis's entries of a formula, and none for a group of one.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from course.costs import StepCost
from course.simulate import peak_live
from .m06_llama_block import LlamaConfig
from .m10_recompute import ABS_MAXES, LINEAR_INPUTS, activation_bytes as layer_activation_bytes
from .m11_generators import make_schedule
from .m12_tp_costs import STREAM_NAMES, tp_traffic
from .m12_tp_linear import grad_dtype
from .m14_costs import state as zero_state, traffic as zero_traffic
from .m15_costs import attention_buffer_bytes, cp_traffic
from .m16_costs import state_bytes as moe_state, step_cost as moe_step_cost
from .m17_costs import fsdp_memory, fsdp_traffic, replicated_cost
from .m18_layout import (DROPPED, Layout, Precision, attention_view, bucket_numels, data_axis, outer_tables,
                         rank_parameters,
                         sequence_config, stage_config, stages_per_rank)
from .m18_presets import Model


def only(cost: StepCost, axis: str, size: int, name: str | None = None) -> StepCost:
    """The sent bytes and calls of `cost` over `axis`, renamed `name` (default: the same), and nothing
    for a group of one rank (size 1). Memory is left out: each formula's memory is added where it belongs."""
    if size == 1:
        return StepCost()
    name = name or axis
    return StepCost({(name, op): v for (a, op), v in cost.sent.items() if a == axis},
                    {(name, op): n for (a, op), n in cost.calls.items() if a == axis})


@dataclass(frozen=True)
class BalancedRecord:
    """One forward of an MoE layer whose router spreads every source's slots evenly: module 16's
    RoutingRecord's `sent` (E,) and `received` (e, E/e), the rows its step_cost reads."""
    sent: torch.Tensor
    received: torch.Tensor


def balanced_record(model: Model, layout: Layout, batch: int) -> BalancedRecord:
    """The record of one layer and microbatch: N = B T / (d c m) tokens a source, k N slots spread
    evenly, k N / E rows to each expert (at most κ, with a capacity)."""
    moe, e = model.moe, layout.e
    tokens = batch // (layout.d * layout.m) * (model.cfg.max_seq_len // layout.c)
    rows = moe.top_k * tokens / moe.n_experts
    if moe.capacity(tokens) is not None:
        rows = min(rows, moe.capacity(tokens))
    return BalancedRecord(torch.full((moe.n_experts,), rows, dtype=torch.float64),
                          torch.full((e, moe.n_experts // e), rows, dtype=torch.float64))


def exchange_cost(model: Model, layout: Layout, batch: int, precision: Precision) -> StepCost:
    """Module 16's step_cost for a step of balanced records (given): its exchange is a sum over the step's
    records, one per layer and microbatch, all equal here, so it is computed on one and its "e" entries
    multiplied by their number ⌈L/p⌉ m (a search would otherwise sum thousands of equal records)."""
    seq = sequence_config(model.cfg, layout)
    one = moe_step_cost(seq, model.moe, layout.sizes, 0, [balanced_record(model, layout, batch)], precision.dtype)
    n = seq.n_layers * layout.m
    return StepCost({k: n * v for k, v in one.sent.items() if k[0] == "e"},
                    {k: n * v for k, v in one.calls.items() if k[0] == "e"})


def pipeline_sends(model: Model, layout: Layout, batch: int, precision: Precision) -> StepCost:
    """What the busiest pipeline rank sends its neighbours in one step (over "p"), as module 11's StageComms
    sends it: for each microbatch, each of its stages' output to the next stage and its input's gradient
    back to the one before, when that stage is on another rank (the first stage sends no gradient back,
    the last no output on, a V's turn stays on its rank); each message the stream's share of one rank:
    B/(d m) sequences of T/c positions of M/t values (module 13's stream x[B/d T M/t]), b bytes each."""
    if layout.p == 1:
        return StepCost()
    v = stages_per_rank(layout)
    cfg, n = model.cfg, layout.m * _busiest_sends(layout.schedule, layout.p, min(layout.m, 2 * layout.p), v)
    activation = batch // (layout.d * layout.m) * (cfg.max_seq_len // layout.c) * (cfg.dim // layout.t)
    return StepCost({("p", "send"): n * activation * precision.dtype.itemsize}, {("p", "send"): n})


@functools.lru_cache(maxsize=None)
def _busiest_sends(schedule: str, p: int, m: int, v: int) -> int:
    """The most messages one rank sends per microbatch: its stages' neighbours on other ranks (2 v on a
    middle rank of a loop, 2 v - 1 on the first and last, 2 on a V's ends, 1 each on 2 ranks of one stage)."""
    placement = make_schedule(schedule, p, m, v).placement
    last = len(placement) - 1
    return max(sum((s < last and placement[s + 1] != rank) + (s > 0 and placement[s - 1] != rank)
                   for s, place in enumerate(placement) if place == rank) for rank in range(p))


@functools.lru_cache(maxsize=1024)
def _layer_activations(model: Model, rows: int, seq_len: int, dtype: torch.dtype, attention: str) -> dict[str, int]:
    cfg = model.cfg if model.moe is None else replace(model.cfg, ffn_dim=model.moe.expert_dim)
    by_name = layer_activation_bytes(cfg, rows, seq_len, dtype)
    if model.mlp == "gelu":   # GPT's feed-forward keeps u and s = gelu(u): no gate
        by_name["g"] = 0
    if attention == "materialized":   # every head's softmax output, the dropout's 1-byte mask and output
        by_name["scores"] = rows * cfg.n_heads * seq_len * seq_len * (2 * dtype.itemsize + 1)
    if model.moe is not None:
        k = model.moe.top_k
        by_name.update({name: k * by_name[name] for name in ("g", "u", "s")}, n2=(1 + k) * by_name["n2"])
    return by_name


def layer_activations(model: Model, rows: int, seq_len: int, dtype: torch.dtype, attention: str = "flash"
                      ) -> dict[str, int]:
    """Bytes of each activation one block keeps for `rows` sequences of `seq_len` positions, whole
    (before t splits anything): module 10's activation_bytes (a GELU feed-forward has no gate g). An MoE
    block (module 16) keeps the FFN's g, u and s for each of the k N rows its experts compute (k times N at
    the experts' width F) and n2 once for the router and k times as the rows sent to the experts: an
    estimate, not measured. A materialized attention kernel also keeps its "scores": every head's T x T
    softmax output, the attention dropout's mask and its output (Korthikanti et al. 2022's 5 a s / h)."""
    return dict(_layer_activations(model, rows, seq_len, dtype, attention))   # a copy: the caller may change it


def live_stages(layout: Layout) -> int:
    """The most (stage, microbatch) activations one rank keeps at once: course/simulate.py's peak_live
    of the rank orders of module 11's schedule, the largest over the ranks; 1 without a pipeline (a
    microbatch's backward frees its activations before the next forward). GPipe keeps all m; the
    others stop growing once m reaches 2p (their warm-ups are at most 2p forwards long; the tests
    check it against the simulator), so they are simulated with m at most 2p, which is fast."""
    if layout.p == 1:
        return 1
    m = layout.m if layout.schedule == "gpipe" else min(layout.m, 2 * layout.p)
    return _live_stages(layout.schedule, layout.p, m, stages_per_rank(layout))


@functools.lru_cache(maxsize=None)
def _live_stages(schedule: str, p: int, m: int, v: int) -> int:
    return max(peak_live(order) for order in make_schedule(schedule, p, m, v).orders)


def layers_per_stage(model: Model, layout: Layout) -> int:
    """Blocks in one pipeline stage: ⌈L/p⌉ blocks a rank, in v stages of ⌈L/(p v)⌉."""
    v = stages_per_rank(layout)
    return -(-model.cfg.n_layers // (layout.p * v))


def buffer_bytes(model: Model, layout: Layout, batch: int, precision: Precision) -> int:
    """Bytes a rank holds beside its state, its activations and module 17's whole slices (given): with
    c > 1 the context attention's largest transient buffer (module 15); the experts' selection biases
    (module 16)."""
    cfg, dtype, kept = stage_config(model.cfg, layout), precision.dtype, 0
    if layout.c > 1:
        kept += attention_buffer_bytes(attention_view(cfg, layout.t), batch, cfg.max_seq_len, dtype, layout.c,
                                       layout.cp, layout.d)
    if model.moe is not None:
        kept += moe_state(cfg, model.moe, layout.e, dtype).memory["buffers"]
    return kept


def data_cost(model: Model, layout: Layout, batch: int, precision: Precision) -> StepCost:
    """The weights' part of one step on one rank: the collectives that sum (and, with ZeRO, gather)
    them over the ranks that hold the same weights, and the parameters, gradients and optimizer
    state the rank keeps, by the ZeRO stage (see the module docstring)."""
    cfg, dtype, m = stage_config(model.cfg, layout), precision.dtype, layout.m
    n, axis = layout.d * layout.c, data_axis(layout)
    # TODO(m18): the weights' collectives and state by ZeRO stage: module 17's FSDP or module 14's buckets
    # Contract: a StepCost for this rank's weights (the blocks and outer tables of outer_tables, rank_parameters'
    #   values): sent/calls only over the axes that sum its gradients (`axis` for the dense weights, "ed" for an MoE
    #   model's experts), memory "parameters", "gradients", "optimizer" (with ZeRO 3 also "buffers"), each equal to
    #   what modules 17 (ZeRO 3) and 14 (ZeRO 0-2, on bucket_numels' buckets) send and keep on that mesh for the m
    #   micro-steps of a step (a step that does not clip). layout.reduce_once: ZeRO 2 whose micro-steps accumulate whole
    #   gradients and reduce-scatter them once a step. "optimizer": AdamW's moments of the values this rank updates, in
    #   the precision's dtype (with precision.master: float32 moments and a float32 master copy).
    # Question: ZeRO 2 once a step is not in module 14, but it is made of module 14's pieces: which of its formulas
    #   sends what it sends, and which keeps what it keeps, between and during the micro-steps?
    # Maths: a weight's gradient is summed over every rank that holds the same weight. The tests compare with real
    #   steps of modules 17 and 14 (bytes, calls, tensors held), the Ultra-Scale Playbook's ZeRO-1 state and the
    #   ZeRO paper's Figure 1.
    # Pitfalls: which ranks hold the same dense weights when c > 1, and the same expert? How many values does a
    #   rank update under each stage? What does a group of one send? Which ZeRO 2 sends m rounds, and which keeps
    #   d times its gradient shard?
    raise NotImplementedError("TODO(m18): the weights' collectives and state by ZeRO stage: module 17's FSDP or module 14's buckets")


def axes_cost(model: Model, layout: Layout, batch: int, precision: Precision) -> StepCost:
    """What one rank sends over the model's axes in one step: t (module 12's tensor and sequence
    parallelism), c (module 15's context attention), e (module 16's exchange), p (pipeline_sends)."""
    d, c, t, e, m, dtype = layout.d, layout.c, layout.t, layout.e, layout.m, precision.dtype
    stage, seq = stage_config(model.cfg, layout), sequence_config(model.cfg, layout)
    # TODO(m18): the bytes and calls over t, c, e and p, each module's formula on this rank's share
    # Contract: a StepCost (sent and calls; no memory) with entries over t, c, e and p only, each equal to what its
    #   module's run sends on this rank's share: module 12's tensor parallelism (with or without sequence
    #   parallelism, as layout.sequence_parallel says), module 15's context attention (layout.cp; Ulysses as
    #   DeepSpeed runs it, its backward the adjoint of its forward's all-to-alls), module 16's expert exchange on a
    #   step of balanced routing (exchange_cost, an MoE model only) and the pipeline's sends (pipeline_sends).
    # Question: each module's formula counts a whole model on its own mesh: which smaller model, which sequences
    #   and which mesh does each axis's formula see on one rank of this layout?
    # Maths: p leaves a rank ⌈L/p⌉ blocks (stage_config), c leaves T/c positions (sequence_config), t leaves H/t and
    #   K/t heads (attention_view), d leaves B/d sequences. The tests compare with module 17's composed run and with
    #   modules 12, 15 and 16's formulas on their own meshes, to the byte and the call.
    # Pitfalls: how many sequences does one t group share? Which of module 15's entries are the weights' (and so
    #   data_cost's)? Does module 15 expect T whole, or already cut by c?
    raise NotImplementedError("TODO(m18): the bytes and calls over t, c, e and p, each module's formula on this rank's share")


def activation_bytes(model: Model, layout: Layout, batch: int, precision: Precision) -> int:
    """Bytes one rank keeps for the backward at the peak of a step (see the module docstring)."""
    dtype = precision.dtype
    by_name = layer_activations(model, batch // (layout.d * layout.m), model.cfg.max_seq_len // layout.c, dtype,
                                layout.attention)
    # TODO(m18): the activations one rank keeps at the peak, by the recompute option, t, fp8 and the schedule
    # Contract: an int, bytes: what one rank keeps at the peak, equal to module 10's kept bytes for one block of
    #   this rank's rows and positions (by_name holds its fourteen tensors whole) under layout.recompute and
    #   layout.fp8, split over t as module 12's block keeps them (layout.sequence_parallel decides the residual
    #   stream's), times the blocks a stage holds (layers_per_stage) and the microbatches the schedule keeps in
    #   flight (live_stages).
    # Question: of a block's tensors, which does each t rank keep a t-th of, which whole, and what does fp8 add that
    #   every rank keeps for itself?
    # Maths: module 10's kept_bytes, each tensor cut by the axis it is split over. The tests compare with the stores
    #   of real blocks (module 10's for every option, with and without fp8; module 12's with and without sequence
    #   parallelism) and with hand counts of the schedules' live microbatches.
    # Pitfalls: does every recompute option keep the same tensors? Is an fp8 tensor's scale split over t with its
    #   values? Does a pipeline keep one microbatch or several? How many blocks does a looped schedule's stage hold?
    raise NotImplementedError('TODO(m18): the activations one rank keeps at the peak, by the recompute option, t, fp8 and the schedule')


def rank_cost(model: Model, layout: Layout, batch: int, precision: Precision) -> StepCost:
    """Everything one rank keeps and sends in one step of `layout`: the sum over the axes (given).
    Each part depends on a few of the layout's choices only (the weights' part on the schedule only
    through the blocks and tables its rank holds, outer_tables; the axes' not on the ZeRO stage, neither
    on the recompute option), so it is computed once for all the layouts that share them: a search
    evaluates hundreds of thousands."""
    L = layout
    shared = (model, batch, precision, L.p, L.d, L.c, L.t, L.e, L.m)
    weights = (*shared, L.zero, L.reduce_once, outer_tables(model, layout))
    axes = (*shared, L.schedule, L.v, L.cp, L.sequence_parallel)
    if weights not in _WEIGHTS:
        _WEIGHTS[weights] = data_cost(model, layout, batch, precision)
    if axes not in _AXES:
        _AXES[axes] = axes_cost(model, layout, batch, precision), buffer_bytes(model, layout, batch, precision)
    key = (weights, axes)
    if key not in _TRAFFIC:
        _TRAFFIC[key] = _WEIGHTS[weights] + _AXES[axes][0]
    kept = (*shared, L.schedule, L.v, L.recompute, L.fp8, L.attention, L.sequence_parallel)
    if kept not in _ACTIVATIONS:
        _ACTIVATIONS[kept] = activation_bytes(model, layout, batch, precision)
    traffic = _TRAFFIC[key]
    return StepCost(traffic.sent, traffic.calls, {**traffic.memory, "activations": _ACTIVATIONS[kept],
                                                  "buffers": traffic.memory.get("buffers", 0) + _AXES[axes][1]})


_WEIGHTS, _AXES, _TRAFFIC, _ACTIVATIONS = {}, {}, {}, {}   # computed once per key (see the docstring)


def forget():
    """Empty rank_cost's memory of the parts it computed (given): a command that plans one model after
    another keeps only what the next can use."""
    for table in (_WEIGHTS, _AXES, _TRAFFIC, _ACTIVATIONS):
        table.clear()
