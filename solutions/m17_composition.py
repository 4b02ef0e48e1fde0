"""Module 17, part 1 - one mesh, five parallelisms: which group each piece of a step talks over.

The capstone composes the course's parallelisms on one mesh of R = p d c t ranks (course/mesh.py):

    p  pipeline   the blocks cut into S = p v stages (module 11's executor and schedules); a stage's
                  activations and their gradients go to the neighbouring place along p
    d  data       the B sequences of the global batch; each rank takes B/d of them
    c  context    the T positions of each sequence; attention passes keys and values round the c
                  ranks (module 15), every other op runs on the rank's own T/c positions
    t  tensor     heads, FFN units and the vocabulary (module 12), the residual stream between the
                  halves of a block split along the sequence (sequence parallelism)
    e  experts    carved out of d x c (module 16): the mixture-of-experts layer's all-to-all

and the weights are sharded once more: every block's tensor-parallel slice is one flat buffer
(module 07) cut over all the ranks that hold that same slice (FSDP): which ranks those are is this
part's question.

A rank's place on every axis decides which ranks it talks to for each kind of message. `Groups`
names them once, so no piece of the trainer ever reads the world to find a peer.
"""
from __future__ import annotations

from dataclasses import dataclass

from course.mesh import Group, Mesh
from course.splits import check_splits
from .m06_llama_block import LlamaConfig

# The module's model for the tests: 8 query and 4 key/value heads (t up to 4), FFN 64, 4 blocks (p v up to 4),
# sequences of 16 (c = 2 zig-zag and t = 2 sequence-parallel: 16 = 2 c x 2 x 2). Module 06's byte vocabulary.
CONFIG = LlamaConfig(dim=32, n_heads=8, n_kv_heads=4, head_dim=4, ffn_dim=64, n_layers=4, max_seq_len=16)


@dataclass(frozen=True)
class Groups:
    """This rank's group for each kind of message of a composed training step."""
    pp: Group            # pipeline neighbours: module 11's StageComms(pp, ...)
    data: Group          # the ranks that split the batch's rows (which B/d rows are this rank's)
    cp: Group            # the ranks that split each sequence's positions (module 15's attention)
    tp: Group            # module 12's tensor (and sequence) parallelism
    fsdp: Group          # the ranks that share one tensor-parallel slice of a block (or of the outer weights:
                         # the embedding's and LM head's vocabulary rows, the final norm): its shards, gathered
                         # before use and its gradient reduce-scattered (module 07)
    replicas: Group      # the ranks that hold the same copy of a replicated weight (a MoE model's router and
                         # shared expert) and saw different tokens: its gradient's sum
    experts: Group | None = None      # the members of an expert group (module 16's all-to-all)
    expert_data: Group | None = None  # the ranks that hold the same experts: their gradients' sum


def compose_groups(mesh: Mesh) -> Groups:
    """This rank's groups on `mesh` (course/mesh.py's, every axis present or of size 1)."""
    # >>> TODO(m17): which group each kind of message of the step runs over
    # Contract: return Groups(pp=..., data=..., cp=..., tp=..., fsdp=..., replicas=..., experts=..., expert_data=...),
    #   each a group of `mesh` (course/mesh.py's mesh.group, along one axis or two); experts and expert_data only when
    #   the mesh has an "e" axis (mesh.sizes), else None. The tests compare every field's ranks with the rank formula on
    #   four meshes of 4 ranks.
    # The question for each field (the Groups docstring says what each is for): along which axes may its members differ,
    #   and along which must they agree? The members of a group differ in exactly what its message combines and agree on
    #   everything else.
    # Pitfalls: are the pipeline's neighbours ranks r - 1 and r + 1 of the world when d, c or t > 1? A group one axis
    #   too small leaves some ranks' gradients unsummed; what does a group one axis too large mix?
    # Hint 1: write down a rank's place (i_p, i_d, i_c, i_t). For two ranks that hold the same t slice of the same
    #         stage's blocks, which coordinates can differ, and did those ranks see the same tokens? (docs/17, "The mesh
    #         and its groups": the table's first two rows are worked on rank 5.)
    # Hint 2: pp: only i_p free; data: only i_d; cp: only i_c; tp: only i_t. fsdp and replicas: i_d and i_c free, i_p
    #         and i_t fixed (the same stage, the same slice; other rows, other positions). experts and expert_data:
    #         module 16's "e" and "ed" groups, carved out of d x c.
    # Hint 3: moe = "e" in mesh.sizes
    #         Groups(pp=mesh.group("p"), data=mesh.group("d"), cp=mesh.group("c"), tp=mesh.group("t"),
    #                fsdp=mesh.group("d", "c"), replicas=mesh.group("d", "c"),
    #                experts=mesh.group("e") if moe else None, expert_data=mesh.group("ed") if moe else None)
    moe = "e" in mesh.sizes
    return Groups(pp=mesh.group("p"), data=mesh.group("d"), cp=mesh.group("c"), tp=mesh.group("t"),
                  fsdp=mesh.group("d", "c"), replicas=mesh.group("d", "c"),
                  experts=mesh.group("e") if moe else None, expert_data=mesh.group("ed") if moe else None)
    # <<<


def full_sizes(sizes: dict[str, int]) -> dict[str, int]:
    """Every grid axis of a mesh, those left out with size 1 (and "e" if given), so that every group
    exists: init_mesh(full_sizes({"p": 2, "t": 2})) has groups p, d, c, t and dc (given)."""
    return {"p": sizes.get("p", 1), "d": sizes.get("d", 1), "c": sizes.get("c", 1), "t": sizes.get("t", 1),
            **({"e": sizes["e"]} if "e" in sizes else {})}


def check_fp8(cfg: LlamaConfig, sizes: dict[str, int], batch: int, n_microbatches: int):
    """One line unless every block linear's slice can run in FP8 (given): module 09's _scaled_mm rules want
    its tokens (a microbatch's B/(d m) rows of T/c positions), in and out features multiples of 16."""
    t = sizes.get("t", 1)
    tokens = batch // (sizes.get("d", 1) * n_microbatches) * (cfg.max_seq_len // sizes.get("c", 1))
    sizes_of = {"tokens B/(d m) x T/c": tokens, "dim": cfg.dim, "H head_dim / t": cfg.n_heads * cfg.head_dim // t,
                "K head_dim / t": cfg.n_kv_heads * cfg.head_dim // t, "ffn_dim / t": cfg.ffn_dim // t}
    wrong = [f"{name} = {size}" for name, size in sizes_of.items() if size % 16]
    if wrong:
        raise ValueError(f"--fp8 multiplies FP8 matrices whose sizes are multiples of 16: {', '.join(wrong)}; "
                         f"change --dim, --seq-len, --batch, --microbatches or the mesh")


def check_composition(cfg: LlamaConfig, sizes: dict[str, int], batch: int, n_microbatches: int,
                      stages_per_rank: int = 1, n_experts: int | None = None):
    """One line for a mesh this model cannot be cut over (given; course/splits.py's check): the blocks L
    over the p v stages, the heads H, K and the FFN width F over t, the sequence T over c and then over t
    (sequence parallelism), the batch B over d and the microbatches, the experts E over e."""
    check_splits(cfg, sizes, batch, n_microbatches, seq_len=cfg.max_seq_len, sequence_parallel=True,
                 pipeline=True, context=True, stages_per_rank=stages_per_rank, n_experts=n_experts)
