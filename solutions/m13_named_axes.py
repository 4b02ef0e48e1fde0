"""Module 13, part 2 - the collectives, each written from its arrow between two specs.

m13_specs (given) parses a spec such as "B/d T M/t" (B split over the mesh axis d, M over t) and
checks that an arrow is the collective's: "B/d T M/t -> B/d T M" is an all-gather over t along M.
Here each collective does what its arrow says, one mesh axis at a time, through the logged
collectives of this rank's group along that axis (`mesh.group(axis).collectives`, course/mesh.py):
every group of one mesh writes into the one log `mesh.log`, in call order.

    all_gather       "M/t/d -> M"                  one dimension loses its innermost mesh axes
    reduce_scatter   "M {U_t,d} -> M/t/d"          sums over mesh axes, splitting one dimension over them
    all_reduce       "B/d T M {U_t} -> B/d T M"    sums over mesh axes, nothing split
    einsum_unreduced "B/d T E/t, M E/t -> B/d T M" no communication: torch.einsum on this rank's blocks,
                                                   the result unreduced ({U_t}) over the mesh axes of
                                                   the dimensions it sums over
"""
from __future__ import annotations

import torch

from .m13_specs import (Sharded, Spec, SpecError, check_all_gather, check_all_reduce, check_einsum, check_matches,
                        check_reduce_scatter, parse_arrow, parse_one_to_one)


def all_gather(arrow: str, x: Sharded) -> Sharded:
    """'B/d T M/t -> B/d T M': every rank of the group along each removed axis contributes its block."""
    left, right = parse_one_to_one(arrow, x.mesh.sizes, "all_gather")
    check_matches(left, x, f"all_gather {arrow!r}")
    move = check_all_gather(left, right, arrow)
    # >>> TODO(m13): the all-gather the arrow asks for, one mesh axis at a time
    # Contract: return Sharded(tensor, right, x.mesh), where tensor is this rank's block as `right` describes
    #   it: dimension move.dim made larger by the size of every axis in move.axes. Each axis's collective goes
    #   through x.mesh.group(axis).collectives (all_gather(output, shard, label, dim=...), which puts the group's
    #   blocks side by side in group order), labelled with the arrow so the log says what it was for.
    # Layout: move.axes are listed outermost first ('M/t/d -> M' gives ('t', 'd')), and block i_t d + i_d of
    #   M/t/d sits inside block i_t of M/t. Gathering over d first joins the d blocks of one M/t block; over t
    #   first would interleave blocks of different M/t pieces (the 2x2 tests use distinct values).
    # Pitfalls: the group is the axis's (the t group gathers over t); the dimension is move.dim, not 0. Never
    #   write into x.tensor.
    # Hint 1: walk move.axes from the innermost to the outermost; each step multiplies the size of move.dim by
    #         that axis's size and calls that axis's collectives.
    # Hint 2: reversed(move.axes); x.mesh.sizes[axis]; block.new_empty(shape); collectives.all_gather(out, block,
    #         label=..., dim=move.dim).
    # Hint 3: block = x.tensor
    #         for axis from the innermost: shape = block's shape with move.dim times the axis size
    #             out = empty of that shape; the axis's collectives all-gather block into out along move.dim
    #             block = out
    #         return Sharded(block, right, x.mesh)
    block = x.tensor
    for axis in reversed(move.axes):
        shape = list(block.shape)
        shape[move.dim] *= x.mesh.sizes[axis]
        out = block.new_empty(shape)
        x.mesh.group(axis).collectives.all_gather(out, block, label=f"all_gather_{axis} {arrow}", dim=move.dim)
        block = out
    return Sharded(block, right, x.mesh)
    # <<<


def reduce_scatter(arrow: str, x: Sharded) -> Sharded:
    """'B/d T M {U_t} -> B/d T M/t': sum over t, each rank keeping its block of M."""
    left, right = parse_one_to_one(arrow, x.mesh.sizes, "reduce_scatter")
    check_matches(left, x, f"reduce_scatter {arrow!r}")
    move = check_reduce_scatter(left, right, arrow)
    # >>> TODO(m13): the reduce-scatter the arrow asks for, one mesh axis at a time
    # Contract: return Sharded(tensor, right, x.mesh): tensor is this rank's block of the sum over the ranks of
    #   every axis in move.axes, dimension move.dim cut into blocks as `right` says. Each axis goes through
    #   x.mesh.group(axis).collectives.reduce_scatter(shard, full, label, dim=...), which sums `full` over the group and
    #   leaves group member j with block j of it along dim.
    # Layout: move.axes are the axes appended to the dimension, outermost first ('M {U_t,d} -> M/t/d' gives
    #   ('t', 'd')); M/t/d's block i_t d + i_d is block i_d of block i_t. Scatter over the outermost axis first.
    # Pitfalls: the other order leaves every rank a wrong block (the 2x2 test catches it); the group must be
    #   the axis's; the dimension is move.dim. The input is read, never written.
    # Hint 1: the mirror image of your all_gather: walk move.axes from the outermost, each step dividing the size
    #         of move.dim by that axis's size.
    # Hint 2: move.axes in order; block.new_empty(shape); collectives.reduce_scatter(out, block, label=...,
    #         dim=move.dim).
    # Hint 3: block = x.tensor
    #         for axis in move.axes: shape = block's shape with move.dim divided by the axis size
    #             out = empty of that shape; the axis's collectives reduce-scatter block into out along move.dim
    #             block = out
    #         return Sharded(block, right, x.mesh)
    block = x.tensor
    for axis in move.axes:
        shape = list(block.shape)
        shape[move.dim] //= x.mesh.sizes[axis]
        out = block.new_empty(shape)
        x.mesh.group(axis).collectives.reduce_scatter(out, block, label=f"reduce_scatter_{axis} {arrow}", dim=move.dim)
        block = out
    return Sharded(block, right, x.mesh)
    # <<<


def all_reduce(arrow: str, x: Sharded) -> Sharded:
    """'B/d T M {U_t} -> B/d T M' (a scalar's spec lists no dimension: '{U_d}' before the sum): the
    sum over the mesh axes the right side no longer lists as unreduced."""
    left, right = parse_one_to_one(arrow, x.mesh.sizes, "all_reduce")
    check_matches(left, x, f"all_reduce {arrow!r}")
    axes = check_all_reduce(left, right, arrow)
    # >>> TODO(m13): the all-reduce the arrow asks for, over each of its mesh axes
    # Contract: return Sharded(tensor, right, x.mesh), tensor the sum of x over the ranks of every axis in
    #   `axes` (one all-reduce per axis, through x.mesh.group(axis).collectives.all_reduce(tensor, label), which sums
    #   in place). x itself is left as it was: the caller may still read it.
    # Pitfalls: summing in place into x.tensor changes x behind the caller's back (the test checks x afterwards);
    #   each axis is its own group (a sum over d and t is a sum over d, then over t).
    # Hint 1: copy x's block once, then sum the copy over each axis in turn.
    # Hint 2: x.tensor.clone(); x.mesh.group(axis).collectives.all_reduce(tensor, label=...).
    # Hint 3: total = a copy of x.tensor
    #         for each axis in axes: that axis's collectives all-reduce total (in place), labelled with the arrow
    #         return Sharded(total, right, x.mesh)
    total = x.tensor.clone()
    for axis in axes:
        x.mesh.group(axis).collectives.all_reduce(total, label=f"all_reduce_{axis} {arrow}")
    return Sharded(total, right, x.mesh)
    # <<<


def einsum_unreduced(equation: str, *operands: Sharded) -> Sharded:
    """'B/d T M, E/t M -> B/d T E/t': torch.einsum on this rank's blocks, the result marked unreduced
    over the mesh axes that split a dimension it sums over ('B/d T E/t, M E/t -> B/d T M' is {U_t})."""
    mesh = operands[0].mesh
    inputs, (output, *more) = parse_arrow(equation, mesh.sizes)
    if more or len(inputs) != len(operands):
        raise SpecError(f"einsum_unreduced {equation!r}: {len(inputs)} input specs and one output, for "
                        f"{len(operands)} operands")
    for n, (spec, x) in enumerate(zip(inputs, operands), start=1):
        check_matches(spec, x, f"einsum_unreduced {equation!r}, operand {n}")
    contracted = check_einsum(inputs, output, equation)
    # >>> TODO(m13): the local contraction, and the mesh axes over which its result is unreduced
    # Contract: return Sharded(result, Spec(output.dims, unreduced), mesh). result = torch.einsum on the operands'
    #   blocks, with one letter per dimension name (names may be longer than a letter). unreduced = the mesh axes
    #   that split a contracted dimension (`contracted`, the given check's list): each rank summed only its block
    #   of that dimension, so the true result is the sum over those axes' ranks.
    # Pitfalls: a contracted dimension that is whole (M in 'B/d T M, E/t M -> B/d T E/t') leaves nothing
    #   unreduced; B/d contracted gives {U_d}, not {U_t}; two contracted dimensions give the union of their axes.
    #   The tests compare both the values and the reported axes.
    # Hint 1: name every dimension with a letter, write the einsum string from the specs, and collect the axes of
    #         the contracted dimensions.
    # Hint 2: {name: letter} over all names (string.ascii_letters); ",".join of the inputs' letter strings, "->",
    #         the output's; torch.einsum(text, *tensors); frozenset of the axes of the dims in `contracted`.
    # Hint 3: letters = a letter for each name, in order of first appearance
    #         text = the inputs' letters joined by commas, '->', the output's letters
    #         unreduced = every axis of every contracted dimension
    #         return Sharded(einsum of text over the operands' tensors, Spec(output.dims, unreduced), mesh)
    letters: dict[str, str] = {}
    for spec in inputs:
        for name in spec.names():
            letters.setdefault(name, chr(ord("a") + len(letters)))
    text = ",".join("".join(letters[n] for n in spec.names()) for spec in inputs)
    text += "->" + "".join(letters[n] for n in output.names())
    unreduced = frozenset(axis for dim in contracted for axis in dim.axes)
    return Sharded(torch.einsum(text, *(x.tensor for x in operands)), Spec(output.dims, unreduced), mesh)
    # <<<
