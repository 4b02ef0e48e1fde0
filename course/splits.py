"""Which dimension each mesh axis splits, and the one check that the axes' sizes divide them (given).

A parallel model cuts some of its dimensions into equal blocks, one per rank of an axis:

    t (tensor)   the query heads H, the key/value heads K and the FFN width F (module 12), and with
                 sequence parallelism the sequence T; the vocabulary V is padded to V' instead
    d (data)     the B sequences of the global batch (modules 07 and 13), and each rank's rows again
                 into m microbatches
    p (pipeline) the L blocks, cut into S = p v stages of L/S blocks (v stages per rank; module 17)
    c (context)  the sequence T, then each rank's T/c positions over t with sequence parallelism (17)
    e (experts)  the E experts of a mixture-of-experts layer (module 17)

A model that splits more (module 13 splits its norm weights M over t and d) passes its own extra
dimensions. Modules 15 to 17 add theirs here: the sequence over c, the experts over e.

`check_splits` is called before any rank starts (by the demos' and benchmarks' argument checks)
and again by the models themselves, so a size that does not divide is one line, never a wrong
shape deep inside a collective.
"""
from __future__ import annotations

import math

from course.mesh import check_mesh


def split_dimensions(cfg, batch: int | None = None, n_microbatches: int = 1, seq_len: int | None = None,
                     sequence_parallel: bool = False, pipeline: bool = False, context: bool = False,
                     n_experts: int | None = None) -> list[tuple[str, int, tuple[str, ...]]]:
    """(dimension, its size, the axes that split it) for a Llama of `cfg`; the batch and the sequence
    only where they are given (a model's own checks may not know them yet). `pipeline` adds the blocks
    over the p v stages, `context` the sequence over c (before t with sequence parallelism), and
    `n_experts` the experts over e."""
    dims = [("n_heads H", cfg.n_heads, ("t",)), ("n_kv_heads K", cfg.n_kv_heads, ("t",)),
            ("ffn_dim F", cfg.ffn_dim, ("t",))]
    if pipeline:
        dims.insert(0, ("n_layers L", cfg.n_layers, ("p", "v")))
    if context and seq_len is not None:
        dims.append(("sequence length T", seq_len, ("c",)))
    if sequence_parallel and seq_len is not None:
        dims.append(("sequence length T", seq_len, ("c", "t") if context else ("t",)))
    if n_experts is not None:
        dims.append(("experts E", n_experts, ("e",)))
    if batch is not None:
        dims.append(("batch B", batch, ("d", "m") if n_microbatches > 1 else ("d",)))
    return dims


def check_splits(cfg, sizes: dict[str, int], batch: int | None = None, n_microbatches: int = 1,
                 seq_len: int | None = None, sequence_parallel: bool = False, also=(), pipeline: bool = False,
                 context: bool = False, stages_per_rank: int = 1, n_experts: int | None = None):
    """Raise ValueError, in one line, unless every axis of `sizes` (a mesh's sizes; an axis left out
    has size 1) divides each dimension it splits; `also` lists a model's extra (dimension, size,
    axes); `pipeline`, `context` (with v = `stages_per_rank`) and `n_experts` add the blocks over
    the stages, the sequence over c and the experts over e (split_dimensions). For a single axis
    that does not fit, the message lists the sizes that would."""
    check_mesh(sizes)
    if n_microbatches < 1:
        raise ValueError(f"the number of microbatches m must be at least 1, got {n_microbatches}")
    if stages_per_rank < 1:
        raise ValueError(f"the stages per rank v must be at least 1, got {stages_per_rank}")
    known = {**sizes, "m": n_microbatches, "v": stages_per_rank}
    dims = [*split_dimensions(cfg, batch, n_microbatches, seq_len, sequence_parallel, pipeline, context, n_experts),
            *also]
    wrong = []
    for axes in dict.fromkeys(axes for _, _, axes in dims):  # each axis (or product of axes) once, in order
        by = math.prod(known.get(axis, 1) for axis in axes)
        mine = [(name, size) for name, size, split in dims if split == axes]
        failed = [f"{name}={size}" for name, size in mine if size % by]
        if not failed:
            continue
        named = " x ".join(axes)
        if len(axes) == 1:
            common = math.gcd(*(size for _, size in mine))
            working = ", ".join(str(n) for n in range(1, common + 1) if common % n == 0)
            wrong.append(f"{named}={by} does not divide {', '.join(failed)}: {named} must divide "
                         f"{', '.join(name.split()[-1] for name, _ in mine)}; {named} in {{{working}}} would work")
        else:
            wrong.append(f"{named} = {by} does not divide {', '.join(failed)}")
    if wrong:
        raise ValueError("; ".join(wrong))
