# Generated from solutions/m13_named_axes.py by `python -m course.skeleton`: fill in the TODOs.
# Grade your work with `python main.py grade 13`. (skeleton 3a27b27b25c9)
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

from dataclasses import dataclass
from math import prod

import torch

from course.mesh import Mesh
from .m13_specs import (Sharded, Spec, SpecError, check_all_gather, check_all_reduce, check_einsum, check_grouped,
                        check_matches, check_reduce_scatter, parse_arrow, parse_one_to_one)


def all_gather(arrow: str, x: Sharded) -> Sharded:
    """'B/d T M/t -> B/d T M': every rank of the group along each removed axis contributes its block."""
    left, right = parse_one_to_one(arrow, x.mesh.sizes, "all_gather")
    check_matches(left, x, f"all_gather {arrow!r}")
    move = check_all_gather(left, right, arrow)
    # TODO(m13): the all-gather the arrow asks for, one mesh axis at a time
    # Contract: return Sharded(tensor, right, x.mesh), where tensor is this rank's block as `right` describes it:
    #   dimension move.dim made larger by the size of every axis in move.axes. Each axis's collective goes through
    #   x.mesh.group(axis).collectives (all_gather(output, shard, label, dim=...), which puts the group's blocks side by
    #   side in group order), labelled with the arrow so the log says what it was for. x.tensor is read, never written.
    # Layout: move.axes are listed outermost first ('M/t/d -> M' gives ('t', 'd')), and block i_t d + i_d of M/t/d sits
    #   inside block i_t of M/t (the 2x2 tests use distinct values).
    # The question: with two axes, which gather comes first, so that the blocks land in the order the spec says?
    # Pitfalls: which group gathers over t? Along which dimension, and is it always 0?
    raise NotImplementedError('TODO(m13): the all-gather the arrow asks for, one mesh axis at a time')


def reduce_scatter(arrow: str, x: Sharded) -> Sharded:
    """'B/d T M {U_t} -> B/d T M/t': sum over t, each rank keeping its block of M."""
    left, right = parse_one_to_one(arrow, x.mesh.sizes, "reduce_scatter")
    check_matches(left, x, f"reduce_scatter {arrow!r}")
    move = check_reduce_scatter(left, right, arrow)
    # TODO(m13): the reduce-scatter the arrow asks for, one mesh axis at a time
    # Contract: return Sharded(tensor, right, x.mesh): tensor is this rank's block of the sum over the ranks of every
    #   axis in move.axes, dimension move.dim cut into blocks as `right` says. Each axis goes through
    #   x.mesh.group(axis).collectives.reduce_scatter(shard, full, label, dim=...), which sums `full` over the group and
    #   leaves group member j with block j of it along dim. The input is read, never written.
    # Layout: move.axes are the axes appended to the dimension, outermost first ('M {U_t,d} -> M/t/d' gives ('t', 'd'));
    #   M/t/d's block i_t d + i_d is block i_d of block i_t (the 2x2 test uses distinct values).
    # The question: with two axes, which scatter comes first, so that each rank is left its own block of the spec?
    # Pitfalls: which group, and along which dimension?
    raise NotImplementedError('TODO(m13): the reduce-scatter the arrow asks for, one mesh axis at a time')


def all_reduce(arrow: str, x: Sharded) -> Sharded:
    """'B/d T M {U_t} -> B/d T M' (a scalar's spec lists no dimension: '{U_d}' before the sum): the
    sum over the mesh axes the right side no longer lists as unreduced."""
    left, right = parse_one_to_one(arrow, x.mesh.sizes, "all_reduce")
    check_matches(left, x, f"all_reduce {arrow!r}")
    axes = check_all_reduce(left, right, arrow)
    # TODO(m13): the all-reduce the arrow asks for, over each of its mesh axes
    # Contract: return Sharded(tensor, right, x.mesh), tensor the sum of x over the ranks of every axis in `axes`, each
    #   axis's sum through that axis's group's collectives (course/collectives.py), labelled with the arrow as your
    #   all_gather labels its own. Afterwards the caller's x still holds what it held: the test reads it again.
    # The question: how does a sum over two mesh axes decompose into the collectives one group can run, and where do
    #   those collectives leave their result?
    # Pitfall: which tensors does a sum over a group write into?
    raise NotImplementedError('TODO(m13): the all-reduce the arrow asks for, over each of its mesh axes')


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
    # TODO(m13): the local contraction, and the mesh axes over which its result is unreduced
    # Contract: return Sharded(result, Spec(output.dims, unreduced), mesh). result = torch.einsum on the operands'
    #   blocks, with one letter per dimension name (names may be longer than a letter). unreduced = the mesh axes over
    #   which the result is a partial sum (`contracted`, the given check's list, holds the contracted dimensions). The
    #   tests compare both the values and the reported axes.
    # The question: when a rank contracts only its block of a dimension, over which ranks must its result still be
    #   summed?
    # Pitfalls: what does a contracted dimension that is whole (M in 'B/d T M, E/t M -> B/d T E/t') leave unreduced? And
    #   B/d contracted? Two contracted dimensions?
    raise NotImplementedError('TODO(m13): the local contraction, and the mesh axes over which its result is unreduced')


# ---------------------------------------------------------------------------------------------
# Grouped collectives: many arrows over one mesh axis, one collective
# ---------------------------------------------------------------------------------------------
@dataclass
class InFlight:
    """A grouped collective started and not yet finished (`finish` waits for it and unpacks).

    `rows` is the buffer the collective fills, one row per block it delivers: (n, S) for an
    all-gather over n ranks (row j: rank j's blocks), (1, S) for a reduce-scatter (this rank's
    blocks, summed). Every row holds the group's tensors in the same places: tensor i from
    sum(numels of the tensors before it), a piece of shape `shapes[i]`. Tensor i's result is its
    pieces, one per row in row order, side by side along dimension `dims[i]`, in spec `specs[i]`."""
    work: object                    # the collective's work: rows hold the result once work.wait() returned
    rows: torch.Tensor
    shapes: list[tuple[int, ...]]
    dims: list[int]
    specs: list[Spec]
    mesh: Mesh


def _grouped(arrows, xs, collective, check):
    """(axis, moves, right specs) of a grouped collective's arrows, each checked against its tensor (given)."""
    if len(arrows) != len(xs):
        raise SpecError(f"grouped {collective}: {len(arrows)} arrows for {len(xs)} tensors")
    moves, rights = [], []
    for arrow, x in zip(arrows, xs):
        left, right = parse_one_to_one(arrow, x.mesh.sizes, collective)
        check_matches(left, x, f"{collective} {arrow!r}")
        moves.append(check(left, right, arrow))
        rights.append(right)
    return check_grouped(moves, arrows, [x.tensor for x in xs], collective), moves, rights


def start_all_gather(arrows: list[str], xs: list[Sharded], label: str) -> InFlight:
    """Starts one all-gather for many arrows over one mesh axis ('K/t Q D M/d -> K/t Q D M', 'M/t/d -> M/t',
    ...: a unit of weights, gathered over d together); `finish` returns the gathered tensors."""
    axis, moves, rights = _grouped(arrows, xs, "all_gather", check_all_gather)
    mesh = xs[0].mesh
    # TODO(m13): copy-in: this rank's blocks in one buffer, and the one all-gather that carries them all
    # Contract: return InFlight(work, rows, shapes, dims, rights, mesh) from which `finish` gives, for each arrow, the
    #   tensor the arrow's own all_gather would give (the tests cut the blocks by hand). One collective over
    #   mesh.group(axis), labelled `label`, started without waiting: its work is returned, not waited for. The
    #   inputs are read, never written.
    # The question: the collective moves one contiguous block per rank and lays the n blocks out side by side in
    #   group order. What must this rank's block hold, so that every row of the result is one rank's blocks, each
    #   tensor's piece at the same place in every row (InFlight's docstring)?
    # Maths: a rank's block of tensor i has numel_i values; S = sum of numel_i over the group's tensors.
    # Pitfalls: are the blocks contiguous (an einsum leaves them as it likes)? Is there one dimension per tensor,
    #   or one for the group?
    raise NotImplementedError("TODO(m13): copy-in: this rank's blocks in one buffer, and the one all-gather that carries them all")


def start_reduce_scatter(arrows: list[str], xs: list[Sharded], label: str) -> InFlight:
    """Starts one reduce-scatter for many arrows over one mesh axis ('K/t Q D M {U_d} -> K/t Q D M/d', ...:
    a unit's gradients); `finish` returns this rank's block of each sum."""
    axis, moves, rights = _grouped(arrows, xs, "reduce_scatter", check_reduce_scatter)
    mesh = xs[0].mesh
    # TODO(m13): copy-in: every tensor cut along its own dimension, the cuts in one buffer, one reduce-scatter
    # Contract: return InFlight(work, rows, shapes, dims, rights, mesh) from which `finish` gives, for each arrow, the
    #   tensor the arrow's own reduce_scatter would: this rank's block (along the arrow's dimension) of the sum over
    #   the axis's ranks. One collective over mesh.group(axis), labelled `label`, started without waiting. The inputs
    #   are read, never written.
    # The question: a reduce-scatter sums the group's buffers and hands rank j the j-th of n equal contiguous parts.
    #   Where must each tensor's block j (along its own dimension) sit in this rank's buffer, so that part j holds
    #   exactly rank j's blocks, in the places finish reads them from?
    # Maths: block j of a tensor along dimension k: positions [j s, (j + 1) s) of that dimension, s = its size / n,
    #   every position of the others; it holds numel / n values.
    # Pitfalls: along which dimension is each tensor cut (M/d is the last dimension of wq's gradient, the first of
    #   wo's)? Is a block along a dimension other than the first contiguous in its tensor?
    raise NotImplementedError('TODO(m13): copy-in: every tensor cut along its own dimension, the cuts in one buffer, one reduce-scatter')


def finish(pending: InFlight) -> list[Sharded]:
    """The results of a grouped collective, in the order of its arrows: copy-out, once it has arrived."""
    # TODO(m13): copy-out: each tensor's pieces from every row, side by side along its own dimension
    # Contract: return [Sharded(tensor_i, pending.specs[i], pending.mesh)] in the arrows' order, tensor_i built from
    #   pending.rows as InFlight's docstring says, once the collective has delivered them; the same for an
    #   all-gather's n rows and a reduce-scatter's one. New tensors: a later collective may reuse the rows.
    # The question: where does tensor i's piece start in a row, where does row j's piece go in tensor i, and from
    #   when on may the rows be read?
    # Maths: a piece of tensor i holds prod(shapes[i]) values; tensor i is n pieces long along dimension dims[i].
    # Pitfalls: does the offset of tensor i count values of one row or of all rows? Along which dimension do a
    #   tensor's pieces join (M/d is the last of wq's, the first of wo's)? What is in the rows before the work is
    #   waited for (the tests' collectives deliver late: NaN)?
    raise NotImplementedError("TODO(m13): copy-out: each tensor's pieces from every row, side by side along its own dimension")
