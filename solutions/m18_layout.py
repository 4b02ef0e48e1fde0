"""Module 18, part 2 - a layout (given): how R = p d c t GPUs train one model, and the share of the
model and of the batch that each axis leaves to one rank.

A `Layout` names everything the planner chooses:

    p, d, c, t    the mesh (course/mesh.py's order: rank = ((i_p d + i_d) c + i_c) t + i_t)
    e             the expert axis, carved out of the d c ranks (module 16); 1 for a dense model
    zero          what the d c ranks that hold the same weights shard: 0 nothing (DDP), 1 AdamW's
                  state, 2 and the gradients (module 14), 3 everything: FSDP (modules 07 and 17)
    reduce_once   ZeRO 2 only: module 14 reduce-scatters each micro-step's gradients (False); with
                  True the micro-steps accumulate whole gradients and reduce-scatter them once a
                  step (Llama 3's FSDP, Megatron's distributed optimizer). With p > 1 only the
                  second is planned: DeepSpeed refuses ZeRO-2 with a pipeline, whose every
                  microbatch's backward would otherwise reduce-scatter the stage's gradients
    schedule, m   the pipeline schedule of modules 05 and 11 (p > 1) and the microbatches of one
                  step, which are also the gradient-accumulation steps when p = 1
    v             the stages a rank holds in a looped schedule (interleaved, interleaved_zb):
                  module 11's stages_per_rank, at least 2; the other schedules fix it
    attention     the attention kernel: "flash" (module 06's) or "materialized" (below)
    sequence_parallel  module 12's sequence parallelism over t (True), or tensor parallelism without
                  it (False: Megatron-LM before 2022, which all-reduced the residual stream and kept
                  its activations whole on every t rank)
    recompute     module 10's option: which activations the forward does not keep (or "full",
                  below)
    fp8           module 09's FP8 linears (n1, n2, s kept as e4m3 by module 10's rule)
    cp            module 15's variant, when c > 1: ring or zigzag (the same bytes), allgather, ulysses

A `Precision` says how many bytes each value takes. The modules' runs keep everything in one dtype
and AdamW's two moments in it too (`COURSE`); real training (`MIXED`) keeps weights, gradients and
activations in bf16 and, beside AdamW's moments in float32, a float32 master copy of the weights:
12 bytes for every value a rank updates (the ZeRO paper's K = 12), sharded like the moments.

What one rank sees, each axis in turn (the functions below):

    p    ⌈L/p⌉ blocks; the weights a rank keeps and sums over d c are those of the rank that holds
         the most (`outer_tables`): the first rank holds the embedding, the last the LM head and
         the final norm, but as many blocks fewer as the p v stages have to spare (a V schedule's
         first rank holds both ends); module 12's t and module 15's c traffic still count the
         embedding and the head on every stage (an upper bound by one table's collectives)
    d    B/d of the sequences, cut into m microbatches of B/(d m)
    c    T/c positions of each sequence
    t    H/t query heads, K/t key/value heads, F/t FFN units, V'/t of the vocabulary and M/t of
         the norm weights: module 13's specs
    e    E/e experts of every layer, replicated over the d c / e ranks of the expert-data group

The gradients of a weight are summed over the ranks that hold the same copy of it: d c ranks
("d" when c = 1, "dc" otherwise, as course/mesh.py names the group), d c / e for an expert ("ed").
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import torch

from course.splits import check_splits
from .m06_llama_block import BlockWeights, LlamaConfig
from .m10_recompute import DROPPED as MODULE_10_DROPPED
from .m11_generators import LOOPED, SCHEDULES, check_arguments, stages_per_rank_of
from .m14_buckets import assign_buckets
from .m15_cp_model import VARIANTS as CP_VARIANTS, check_cp
from .m18_presets import Model

V_SHAPED = ("zbv", "dualpipev")   # module 11's schedules whose rank r holds stages r and 2p-1-r
BUCKET_CAP = 25 * 2**20   # C: DDP's default bucket_cap_mb = 25, which module 14's buckets follow
ZERO_STAGES = (0, 1, 2, 3)
# The recompute options: module 10's, and "full", Megatron-LM's activation checkpointing of 2021: it keeps what
# "block" keeps (the block's input) and runs the whole forward again, the down matmul too (module 10's "block"
# skips it: its output is not needed). Never faster than "block", so only planned when asked for. An option
# that recomputes the attention also drops a materialized kernel's scores (below).
DROPPED = {option: names | ({"scores"} if "lse" in names else set())
           for option, names in {**MODULE_10_DROPPED, "full": MODULE_10_DROPPED["block"]}.items()}
RECOMPUTE_OPTIONS = tuple(DROPPED)
# The attention kernel: "flash" (module 06's chunked attention, FlashAttention: the T x T scores never kept) or
# "materialized" (attention before 2022, Megatron-LM's: every head's scores written, and kept for the backward).
# Never better than flash, so only planned when asked for (the published runs of 2021 below).
ATTENTION_KERNELS = ("flash", "materialized")
# Module 15's variants the search tries: the ring sends what zigzag sends, and zigzag balances the causal work
CONTEXT_VARIANTS = tuple(variant for variant in CP_VARIANTS if variant != "ring")


@dataclass(frozen=True, eq=False)   # hashed by identity, like Model: a search looks it up often
class Precision:
    dtype: torch.dtype = torch.bfloat16   # weights, gradients and activations: b bytes a value
    master: bool = True                   # AdamW in float32 with a float32 master copy: 12 bytes a value updated


MIXED = Precision(torch.bfloat16, True)     # what real training runs (the Ultra-Scale Playbook's "16 Ψ")
COURSE = Precision(torch.float32, False)    # what the modules ran: moments in the weights' dtype


@dataclass(frozen=True)
class Layout:
    p: int = 1
    d: int = 1
    c: int = 1
    t: int = 1
    e: int = 1
    zero: int = 1
    schedule: str = "none"    # a key of module 11's SCHEDULES when p > 1
    m: int = 1
    recompute: str = "none"
    fp8: bool = False
    cp: str = "allgather"
    reduce_once: bool = False
    v: int = 2
    attention: str = "flash"
    sequence_parallel: bool = True

    @property
    def gpus(self) -> int:
        return self.p * self.d * self.c * self.t

    @property
    def family(self) -> tuple:
        """Every choice but the recompute option: layouts of one family train alike, and differ only
        in the memory they keep and the time they spend recomputing."""
        return (self.p, self.d, self.c, self.t, self.e, self.zero, self.schedule, self.m, self.fp8, self.cp,
                self.reduce_once, self.v, self.attention, self.sequence_parallel)

    @property
    def sizes(self) -> dict[str, int]:
        """The mesh's axis sizes, course/mesh.py's way (e only where there is one)."""
        return {"p": self.p, "d": self.d, "c": self.c, "t": self.t, **({"e": self.e} if self.e > 1 else {})}

    def __str__(self) -> str:
        mesh = " ".join(f"{a}={s}" for a, s in self.sizes.items() if s > 1) or "one GPU"
        pipe = f" {self.schedule}" if self.p > 1 else ""
        if self.p > 1 and self.schedule in LOOPED:
            pipe += f" v={self.v}"
        zero = f"zero{self.zero}" + ("once" if self.reduce_once else "")
        return f"{mesh} {zero}{pipe} m={self.m} rc={self.recompute}{' fp8' if self.fp8 else ''}" + \
            (f" cp={self.cp}" if self.c > 1 else "") + (f" {self.attention}" if self.attention != "flash" else "") + \
            ("" if self.sequence_parallel or self.t == 1 else " no-sp")


def data_axis(layout: Layout) -> str:
    """The group that holds the same weights and sums their gradients: "d", or "dc" when c > 1."""
    return "dc" if layout.c > 1 else "d"


def stages_per_rank(layout: Layout) -> int:
    """v: the pipeline stages one rank holds (module 11: layout.v for the looped schedules, 2 for zbv and
    dualpipev, 1 for the others)."""
    return stages_per_rank_of(layout.schedule, layout.v) if layout.p > 1 else 1


def stage_config(cfg: LlamaConfig, layout: Layout) -> LlamaConfig:
    """The model one pipeline rank holds, as a configuration the modules' formulas take: ⌈L/p⌉
    blocks (and the embedding and the LM head, see the module docstring)."""
    return dataclasses.replace(cfg, n_layers=math.ceil(cfg.n_layers / layout.p))


def sequence_config(cfg: LlamaConfig, layout: Layout) -> LlamaConfig:
    """stage_config with T/c positions a sequence: what the t and e formulas see of a sequence."""
    return dataclasses.replace(stage_config(cfg, layout), max_seq_len=cfg.max_seq_len // layout.c)


def attention_view(cfg: LlamaConfig, t: int) -> LlamaConfig:
    """The attention one tensor-parallel rank runs, as a model of its own: H/t query and K/t key/value
    heads (width H D / t). Module 15's formula takes heads from a config; this is how it sees t."""
    heads = cfg.n_heads // t
    return dataclasses.replace(cfg, dim=heads * cfg.head_dim, n_heads=heads, n_kv_heads=cfg.n_kv_heads // t,
                               ffn_dim=max(cfg.ffn_dim // t, 1))


def outer_tables(model: Model, layout: Layout) -> tuple[bool, bool, int]:
    """(holds the embedding, holds the LM head and the final norm, blocks) of the pipeline rank that holds the
    most weights: with p = 1 all of them; with a pipeline the first rank (the embedding and v stages of
    ⌈L/(p v)⌉ blocks) or the last (the head and the norm, and as many blocks fewer as the p v stages have to
    spare: Llama 3's 126 blocks on 16 ranks leave 2), and on a V schedule (zbv, dualpipev: stages r and 2p-1-r
    on rank r) the first holds both ends, or a middle rank holds more when its blocks outweigh them. The embedding and the head are equal tables, so this is the rank
    with the most blocks, the head's side on a tie (its norm)."""
    L, p = model.cfg.n_layers, layout.p
    if p == 1:
        return True, True, L
    v = stages_per_rank(layout)
    blocks = v * -(-L // (p * v))
    fewer = blocks - min(p * blocks - L, blocks)
    if layout.schedule in V_SHAPED:   # rank 0: stages 0 and p v - 1; a middle rank: v stages of ⌈L/(p v)⌉ blocks
        per_stage = -(-L // (p * v))
        ends, middle = (True, True, per_stage + max(L - (p * v - 1) * per_stage, 0)), (False, False, v * per_stage)
        return max(ends, middle, key=lambda held: sum(map(sum, _rank_parameters(model, *held, layout.t, layout.e))))
    return (True, False, blocks) if fewer < blocks else (False, True, blocks)


def rank_parameters(model: Model, layout: Layout) -> tuple[list[int], list[int]]:
    """The values of each weight one rank holds, (dense, experts), in the order module 14's
    DataParallelLlama hands them to its buckets (the LM head, final norm and embedding, then the
    blocks from the first, each block's fields in reverse): module 13's specs over t (the vocabulary
    padded to V'), the blocks and tables of the rank that holds the most (`outer_tables`), and of every
    MoE layer the router and this rank's E/e experts."""
    return _rank_parameters(model, *outer_tables(model, layout), layout.t, layout.e)


@functools.lru_cache(maxsize=256)
def _rank_parameters(model: Model, first: bool, last: bool, n_layers: int, t: int, e: int
                     ) -> tuple[list[int], list[int]]:
    cfg = model.cfg
    M, L = cfg.dim, n_layers
    vocab = -(-cfg.vocab_size // t) * t   # V', module 12's padded_vocab_size
    shapes = {"ln1": M, "wq": cfg.n_heads * cfg.head_dim * M, "wk": cfg.n_kv_heads * cfg.head_dim * M,
              "wv": cfg.n_kv_heads * cfg.head_dim * M, "wo": cfg.n_heads * cfg.head_dim * M, "ln2": M,
              "w_gate": cfg.ffn_dim * M, "w_up": cfg.ffn_dim * M, "w_down": cfg.ffn_dim * M}
    if model.mlp == "gelu":     # GPT's feed-forward: no gate
        shapes.update(w_gate=0)
    if model.moe is not None:   # module 16's block: no dense FFN, a router (E M), and the experts
        shapes.update(w_gate=0, w_up=0, w_down=0, router=model.moe.n_experts * M)
    fields = [f.name for f in dataclasses.fields(BlockWeights)] + (["router"] if model.moe else [])
    block = [shapes[name] // t for name in reversed(fields) if shapes[name]]
    dense = ([vocab * M // t, M // t] if last else []) + ([vocab * M // t] if first else []) + block * L
    experts = []
    if model.moe is not None:
        experts = [model.moe.expert_dim * M] * (3 * L * model.moe.n_experts // e)
    return dense, experts


@functools.lru_cache(maxsize=256)
def bucket_numels(numels: tuple[int, ...], dtype: torch.dtype, cap_bytes: int = BUCKET_CAP) -> list[int]:
    """ψ_g: the values of each of module 14's buckets for weights of these sizes (its assign_buckets,
    run on meta tensors: sizes without memory)."""
    if not numels:
        return []
    tensors = [torch.empty(n, dtype=dtype, device="meta") for n in numels]
    return [sum(numels[i] for i in bucket) for bucket in assign_buckets(tensors, cap_bytes)]


def check_layout(model: Model, layout: Layout, batch: int):
    """One line for a layout this model cannot run (given): what each axis must divide, and the
    combinations the course has no implementation for."""
    cfg, moe = model.cfg, model.moe
    for name, size in (("p", layout.p), ("d", layout.d), ("c", layout.c), ("t", layout.t), ("e", layout.e),
                       ("m", layout.m)):
        if size < 1:
            raise ValueError(f"{name} must be at least 1, got {size}")
    if layout.p > cfg.n_layers:
        raise ValueError(f"p={layout.p} pipeline stages for L={cfg.n_layers} blocks: a stage needs a block")
    if layout.zero not in ZERO_STAGES:
        raise ValueError(f"unknown ZeRO stage {layout.zero}: 0 (DDP), 1, 2 or 3 (FSDP)")
    if layout.reduce_once and layout.zero != 2:
        raise ValueError(f"reduce_once with ZeRO {layout.zero}: only ZeRO-2 chooses when to reduce-scatter its "
                         "gradients (ZeRO 0 and 1 accumulate them whole, ZeRO 3 reduce-scatters once a step)")
    if layout.zero == 2 and not layout.reduce_once and layout.p > 1:
        raise ValueError(f"ZeRO-2 reduce-scattering every micro-step with p={layout.p}: each microbatch's backward "
                         "would reduce-scatter the stage's whole gradients (DeepSpeed refuses ZeRO-2 with a "
                         "pipeline); accumulate them and reduce-scatter once a step (reduce_once), or use ZeRO 1")
    if layout.attention not in ATTENTION_KERNELS:
        raise ValueError(f"unknown attention kernel {layout.attention!r}: one of {', '.join(ATTENTION_KERNELS)}")
    if layout.attention == "materialized" and layout.c > 1:
        raise ValueError("the materialized attention kernel with c > 1: it is Megatron-LM's of 2021, which had no "
                         "context parallelism; plan flash attention")
    if layout.recompute not in RECOMPUTE_OPTIONS:
        raise ValueError(f"unknown recompute option {layout.recompute!r}; one of {', '.join(RECOMPUTE_OPTIONS)}")
    if moe is None and layout.e > 1:
        raise ValueError(f"e={layout.e} for {model.name}, a dense model: it has no experts to split")
    if moe is not None:
        if layout.t > 1:
            raise ValueError(f"t={layout.t} for {model.name}: the course has no tensor-parallel expert layer "
                             "(module 16 runs its experts whole); plan experts over e instead")
        if layout.zero == 3:
            raise ValueError(f"ZeRO-3 for {model.name}: module 13's FSDP formula counts a dense FFN; plan its "
                             "experts with ZeRO 0, 1 or 2")
        if moe.n_experts % layout.e or (layout.d * layout.c) % layout.e:
            raise ValueError(f"e={layout.e} must divide E={moe.n_experts} and d c = {layout.d * layout.c}")
    check_splits(cfg, {"d": layout.d, "t": layout.t}, batch, layout.m, sequence_parallel=layout.sequence_parallel)
    if layout.c > 1:
        check_cp(attention_view(cfg, layout.t), layout.cp, layout.c, cfg.max_seq_len)
    if layout.p > 1:
        if layout.schedule not in SCHEDULES:
            raise ValueError(f"p={layout.p} needs a pipeline schedule: one of {', '.join(SCHEDULES)}")
        check_arguments(layout.schedule, layout.p, layout.m, layout.v)
        if layout.p * stages_per_rank(layout) > cfg.n_layers:
            raise ValueError(f"{layout.schedule} with p={layout.p} and v={stages_per_rank(layout)}: "
                             f"{layout.p * stages_per_rank(layout)} stages for L={cfg.n_layers} blocks: a stage needs a block")
    elif layout.schedule != "none":
        raise ValueError(f"schedule {layout.schedule!r} with p=1: there is no pipeline to schedule")
