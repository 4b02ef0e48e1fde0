"""Module 13, part 1 - the spec notation (given): each tensor says which of its dimensions is split
over which axis of the mesh it lives on, and every collective is an arrow between two such specs.

The mesh is course/mesh.py's: a grid of ranks with named axes, here d (data: the ranks that share
i_t hold different rows of the batch) and t (tensor: the ranks that share i_d hold different heads,
FFN units and vocabulary entries), rank = i_d t + i_t. Each rank talks to one group along each
axis, `mesh.group("d")` and `mesh.group("t")`. A spec may name any axis of the mesh it lives on.

A spec names the dimensions of a tensor, in order, and the mesh axes each is split over:

    "B/d T M/t"      B split over d, T whole, M split over t: this rank holds
                     x[i_d-th B/d rows, all T, i_t-th M/t columns]
    "M/t/d"          M split over t, and each of those pieces again over d: chunk i_t d + i_d of d t
    "B/d T M {U_t}"  unreduced over t: the true tensor is the sum of the t ranks' tensors (what a
                     contraction over a dimension split over t leaves behind)
    "{U_d}"          a scalar, unreduced over d

Arrows between specs are the collectives (m13_named_axes, the chapter lists them):

    all_gather     "B/d T M/t -> B/d T M"          one dimension loses its innermost mesh axes
    reduce_scatter "B/d T M {U_t} -> B/d T M/t"    a sum over t, and M split over t
    all_reduce     "B/d T M {U_t} -> B/d T M"      a sum over t, nothing split
    einsum_unreduced "B/d T M, E/t M -> B/d T E/t" a local contraction, unreduced over the mesh axes
                                                   of the dimensions it sums over

A `Sharded` is this rank's block of a tensor, with its spec and its mesh. The parser and the
checks here refuse a spec that does not describe the tensor, a mesh axis the mesh does not have,
a size the mesh does not divide, an arrow that is not the collective's, and a partial sum used as
if it were the whole: each with a message that names the axis. `shard` cuts this rank's block of
a whole tensor, and `local` runs a function on this rank's blocks, checking their specs.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from course.mesh import EXPERT_AXES, MESH_AXES, Mesh

AXIS_ORDER = MESH_AXES + EXPERT_AXES  # how {U_...} lists its axes: outermost first, as the mesh does


class SpecError(ValueError):
    """A spec or an arrow that cannot describe the tensors it is used on (given)."""

    def __init__(self, message: str):
        super().__init__(message)


# ---------------------------------------------------------------------------------------------
# Specs: the parser and its checks
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Dim:
    name: str
    axes: tuple[str, ...] = ()  # the mesh axes it is split over, outermost first

    def __str__(self) -> str:
        return "/".join((self.name, *self.axes))


@dataclass(frozen=True)
class Spec:
    dims: tuple[Dim, ...]
    unreduced: frozenset = frozenset()  # mesh axes over which the tensor is still a partial sum

    def __str__(self) -> str:
        text = " ".join(map(str, self.dims))
        if self.unreduced:
            text += (" " if text else "") + "{U_" + ",".join(a for a in AXIS_ORDER if a in self.unreduced) + "}"
        return text

    def names(self) -> list[str]:
        return [dim.name for dim in self.dims]

    def dim(self, name: str) -> Dim | None:
        return next((dim for dim in self.dims if dim.name == name), None)


_UNREDUCED = re.compile(r"\{U_([^}]*)\}\s*$")
_DIM = re.compile(r"[A-Za-z][A-Za-z0-9_]*(/[^/\s]+)*")
_COMMA = re.compile(r",(?![^{]*\})")  # a comma between specs, not one inside {U_t,d}


def parse_spec(text: str, sizes: dict[str, int]) -> Spec:
    """One spec, e.g. 'B/d T M/t' or 'M {U_t,d}', checked against the mesh's axes."""
    body, unreduced = text.strip(), frozenset()
    match = _UNREDUCED.search(body)
    if match:
        body = body[:match.start()].strip()
        unreduced = frozenset(a.strip() for a in match[1].split(","))
        for axis in sorted(unreduced):
            if axis not in sizes:
                raise SpecError(f"unknown mesh axis {axis!r} in {{U_...}} of {text.strip()!r}: "
                                f"this mesh has axes {', '.join(sizes)}")
    dims, used = [], {}
    for token in body.split():
        if not _DIM.fullmatch(token):
            raise SpecError(f"cannot read {token!r} in {text.strip()!r}: a dimension is NAME or NAME/axis/axis..., "
                            f"and {{U_axes}} comes last")
        name, *axes = token.split("/")
        for axis in axes:
            if axis not in sizes:
                raise SpecError(f"unknown mesh axis {axis!r} in {text.strip()!r}: this mesh has axes "
                                f"{', '.join(sizes)}")
            if axis in used:
                raise SpecError(f"mesh axis {axis!r} splits both {used[axis]} and {name} in {text.strip()!r}: "
                                f"one mesh axis splits at most one dimension of a tensor")
            if axis in unreduced:
                raise SpecError(f"{name} is split over {axis!r} and the tensor is unreduced over {axis!r} in "
                                f"{text.strip()!r}: a reduce-scatter takes the sum and splits, in one step")
            used[axis] = name
        if any(d.name == name for d in dims):
            raise SpecError(f"dimension {name} appears twice in {text.strip()!r}")
        dims.append(Dim(name, tuple(axes)))
    return Spec(tuple(dims), unreduced)


def parse_arrow(text: str, sizes: dict[str, int]) -> tuple[list[Spec], list[Spec]]:
    """'A, B -> C' -> ([A, B], [C]): the specs on each side of the arrow."""
    if text.count("->") != 1:
        raise SpecError(f"an arrow has one '->' between its two sides, got {text!r}")
    left, right = text.split("->")
    return [parse_spec(s, sizes) for s in _COMMA.split(left)], [parse_spec(s, sizes) for s in _COMMA.split(right)]


def parse_one_to_one(text: str, sizes: dict[str, int], collective: str) -> tuple[Spec, Spec]:
    (left, *more), (right, *more_out) = parse_arrow(text, sizes)
    if more or more_out:
        raise SpecError(f"{collective} takes one tensor to one tensor: {text!r} has more specs on a side")
    return left, right


@dataclass(frozen=True, eq=False)
class Sharded:
    """This rank's block of a tensor, the spec that says which block, and the mesh it lives on."""
    tensor: torch.Tensor
    spec: Spec
    mesh: Mesh

    def __post_init__(self):
        if self.tensor.dim() != len(self.spec.dims):
            raise SpecError(f"spec {str(self.spec)!r} names {len(self.spec.dims)} dimensions, the tensor has "
                            f"{self.tensor.dim()} (shape {tuple(self.tensor.shape)})")

    def __add__(self, other: "Sharded") -> "Sharded":
        """An elementwise sum: both operands must be described by the same spec, {U_...} included."""
        if self.spec != other.spec:
            raise SpecError(f"cannot add {describe(self.spec)} and {describe(other.spec)}"
                            + _advice(self.spec, other.spec))
        return Sharded(self.tensor + other.tensor, self.spec, self.mesh)

    def __repr__(self) -> str:
        return f"Sharded[{self.spec}]{tuple(self.tensor.shape)} {self.tensor.dtype}"


def describe(spec: Spec) -> str:
    return f"[{spec}]" if spec.dims or spec.unreduced else "[] (a scalar)"


def _advice(a: Spec, b: Spec) -> str:
    """Why two specs differ, in the words a learner needs."""
    partial = (a.unreduced ^ b.unreduced)
    if partial:
        axis = sorted(partial)[0]
        return (f": one is unreduced over {axis} ({{U_{axis}}}), a partial sum, the other is not. "
                f"Take the sum first (reduce_scatter or all_reduce over {axis})")
    for x, y in zip(a.dims, b.dims):
        if x != y:
            return f": dimension {x} against {y}"
    return ": they name different dimensions"


def check_matches(spec: Spec, x: Sharded, where: str):
    """`spec` (written in an arrow) must describe x exactly, unreduced axes included."""
    if not isinstance(x, Sharded):
        raise SpecError(f"{where}: expected a Sharded tensor, got {type(x).__name__}")
    if spec.unreduced != x.spec.unreduced:
        missing, extra = x.spec.unreduced - spec.unreduced, spec.unreduced - x.spec.unreduced
        if missing:
            axis = sorted(missing)[0]
            raise SpecError(f"{where}: the tensor is unreduced over {axis} ({{U_{axis}}}: a partial sum, {x.spec}) "
                            f"but the spec {describe(spec)} uses it as if it were reduced: take the sum first "
                            f"(reduce_scatter or all_reduce over {axis})")
        axis = sorted(extra)[0]
        raise SpecError(f"{where}: the spec {describe(spec)} says unreduced over {axis}, but the tensor is "
                        f"{describe(x.spec)}")
    if spec.dims != x.spec.dims:
        raise SpecError(f"{where}: the spec {describe(spec)} does not describe the tensor, which is "
                        f"{describe(x.spec)}" + _advice(spec, x.spec))


# ---------------------------------------------------------------------------------------------
# What each collective's arrow may say: which dimension moves, over which mesh axes
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Move:
    """What an arrow asks of a collective: which dimension (its index) and which mesh axes."""
    dim: int
    axes: tuple[str, ...]  # in the order the spec lists them: outermost first


def _changed_dim(left: Spec, right: Spec, text: str, collective: str) -> int:
    if left.names() != right.names():
        raise SpecError(f"{collective} {text!r}: the two sides name different dimensions ({' '.join(left.names())} "
                        f"against {' '.join(right.names())}); a collective moves data, it does not rename or "
                        f"reorder dimensions")
    changed = [i for i, (a, b) in enumerate(zip(left.dims, right.dims)) if a != b]
    if len(changed) != 1:
        which = " and ".join(left.dims[i].name for i in changed) or "no dimension"
        raise SpecError(f"{collective} {text!r} changes {which}: one {collective} changes how exactly one "
                        f"dimension is split")
    return changed[0]


def check_all_gather(left: Spec, right: Spec, text: str) -> Move:
    """An all-gather removes the innermost mesh axes of one dimension; nothing else changes."""
    i = _changed_dim(left, right, text, "all_gather")
    before, after = left.dims[i].axes, right.dims[i].axes
    if len(after) > len(before) and after[:len(before)] == before:
        raise SpecError(f"all_gather {text!r} splits {left.dims[i].name} over {after[len(before)]}: that arrow "
                        f"is a reduce_scatter's (a gather makes a dimension whole)")
    if before[:len(after)] != after:
        raise SpecError(f"all_gather {text!r}: only the innermost axes of {left.dims[i]} can be gathered "
                        f"({left.dims[i]} -> {Dim(left.dims[i].name, before[:-1])}, ...)")
    if left.unreduced != right.unreduced:
        raise SpecError(f"all_gather {text!r} changes what is unreduced: a gather copies blocks, only "
                        f"reduce_scatter and all_reduce take sums")
    return Move(i, before[len(after):])


def check_reduce_scatter(left: Spec, right: Spec, text: str) -> Move:
    """A reduce-scatter sums over mesh axes the left side is unreduced over, and splits one
    dimension over the same axes (appended innermost); nothing else changes."""
    i = _changed_dim(left, right, text, "reduce_scatter")
    before, after = left.dims[i].axes, right.dims[i].axes
    if len(after) < len(before) and before[:len(after)] == after:
        raise SpecError(f"reduce_scatter {text!r} makes {left.dims[i].name} whole again: that arrow is an "
                        f"all_gather's")
    if after[:len(before)] != before or len(after) == len(before):
        raise SpecError(f"reduce_scatter {text!r}: {left.dims[i]} can only gain mesh axes after the ones it has")
    added = after[len(before):]
    for axis in added:
        if axis not in left.unreduced:
            raise SpecError(f"reduce_scatter {text!r} sums over {axis}, but the left side is not unreduced over "
                            f"{axis} (no {{U_{axis}}}): the sum of n copies of a reduced tensor is n times too big; "
                            f"only a partial sum is reduce-scattered")
    if right.unreduced != left.unreduced - set(added):
        raise SpecError(f"reduce_scatter {text!r}: after summing over {', '.join(added)} the right side must be "
                        f"{describe(Spec(right.dims, left.unreduced - set(added)))}")
    return Move(i, added)


def check_grouped(moves: list[Move], arrows: list[str], tensors: list[torch.Tensor], collective: str) -> str:
    """Arrows that one grouped collective can serve: each moves one dimension over the same single mesh
    axis, and their tensors share a dtype (they travel in one buffer). Returns that axis."""
    if not arrows:
        raise SpecError(f"grouped {collective}: no arrows (a group holds at least one tensor)")
    axes = {move.axes for move in moves}
    if len(axes) != 1 or len(next(iter(axes))) != 1:
        listed = "; ".join(f"{a!r} over {'/'.join(m.axes)}" for a, m in zip(arrows, moves))
        raise SpecError(f"grouped {collective}: every arrow must move its dimension over the same one mesh axis "
                        f"(one collective over one group), got {listed}")
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1:
        raise SpecError(f"grouped {collective}: one buffer holds one dtype, the tensors have "
                        f"{', '.join(sorted(map(str, dtypes)))}")
    return next(iter(axes))[0]


def check_all_reduce(left: Spec, right: Spec, text: str) -> tuple[str, ...]:
    """An all-reduce sums over mesh axes the left side is unreduced over; the dimensions stay as they are."""
    if left.dims != right.dims:
        raise SpecError(f"all_reduce {text!r} changes the dimensions: an all-reduce keeps them; a dimension "
                        f"changes its split by all_gather or reduce_scatter")
    if not right.unreduced < left.unreduced:
        raise SpecError(f"all_reduce {text!r} must sum over at least one mesh axis the left side is unreduced "
                        f"over, and leave the rest: {describe(left)} -> e.g. "
                        f"{describe(Spec(left.dims, frozenset()))}")
    return tuple(a for a in AXIS_ORDER if a in left.unreduced - right.unreduced)


def check_einsum(inputs: list[Spec], output: Spec, text: str) -> list[Dim]:
    """Every dimension of the output comes from an input; a dimension is split the same way wherever it
    appears. Returns the contracted dimensions: in an input, not in the output."""
    if output.unreduced:
        raise SpecError(f"einsum_unreduced {text!r}: write the output without {{U_...}}: the einsum reports "
                        f"what is left unreduced")
    seen: dict[str, tuple[Dim, int]] = {}
    for n, spec in enumerate(inputs, start=1):
        for dim in spec.dims:
            if dim.name in seen and seen[dim.name][0] != dim:
                first, m = seen[dim.name]
                raise SpecError(f"einsum_unreduced {text!r}: {dim.name} is {_split(first)} in operand {m} but "
                                f"{_split(dim)} in operand {n}; both must hold the same block of it "
                                f"(all_gather the one that is split{_over(first, dim)} first)")
            seen.setdefault(dim.name, (dim, n))
    for dim in output.dims:
        if dim.name not in seen:
            raise SpecError(f"einsum_unreduced {text!r}: output dimension {dim.name} is in no operand")
        if seen[dim.name][0] != dim:
            raise SpecError(f"einsum_unreduced {text!r}: {dim.name} is {_split(seen[dim.name][0])} in the operands "
                            f"but {_split(dim)} in the output; an einsum does not move data (a collective does)")
    return [dim for dim, _ in seen.values() if output.dim(dim.name) is None]


def _split(dim: Dim) -> str:
    return f"split over {'/'.join(dim.axes)}" if dim.axes else "whole"


def _over(a: Dim, b: Dim) -> str:
    axes = set(a.axes) ^ set(b.axes)
    return f" over {', '.join(sorted(axes))}" if axes else ""


def check_local(inputs: list[Spec], outputs: list[Spec], text: str):
    """A local op moves no data: a dimension named in an input and an output is split the same way in
    both, and a partial sum stays one: every output is unreduced over every axis an input is."""
    splits = {dim.name: dim for spec in inputs for dim in spec.dims}
    partial = frozenset().union(*(spec.unreduced for spec in inputs))
    for spec in outputs:
        for dim in spec.dims:
            if dim.name in splits and splits[dim.name] != dim:
                raise SpecError(f"local op {text!r}: {dim.name} is {_split(splits[dim.name])} in an input but "
                                f"{_split(dim)} in an output; a local op moves no data (a collective does)")
        if not partial <= spec.unreduced:
            axis = sorted(partial - spec.unreduced)[0]
            raise SpecError(f"local op {text!r}: an input is unreduced over {axis}, so every output is too "
                            f"(write {{U_{axis}}}): an op on partial sums gives partial sums, and it must be linear "
                            f"in them")


# ---------------------------------------------------------------------------------------------
# Making and running sharded tensors
# ---------------------------------------------------------------------------------------------
def block_index(dim: Dim, mesh: Mesh) -> tuple[int, int]:
    """(which block, how many blocks) of a dimension this rank holds: M/t/d is cut into t d blocks,
    and this rank holds block i_t d + i_d (the outermost axis is the most significant)."""
    index, count = 0, 1
    for axis in dim.axes:
        index, count = index * mesh.sizes[axis] + mesh.index[axis], count * mesh.sizes[axis]
    return index, count


def shard(spec_text: str, full: torch.Tensor, mesh: Mesh) -> Sharded:
    """This rank's block of a whole tensor (a contiguous copy), as `spec_text` says."""
    spec = parse_spec(spec_text, mesh.sizes)
    if spec.unreduced:
        raise SpecError(f"shard {spec_text!r}: a whole tensor is not a partial sum; write it without {{U_...}}")
    if full.dim() != len(spec.dims):
        raise SpecError(f"shard {spec_text!r}: the spec names {len(spec.dims)} dimensions, the tensor has "
                        f"{full.dim()} (shape {tuple(full.shape)})")
    block = full
    for i, dim in enumerate(spec.dims):
        index, count = block_index(dim, mesh)
        if full.shape[i] % count:
            raise SpecError(f"shard {spec_text!r}: {dim.name}={full.shape[i]} is not divisible by "
                            f"{' x '.join(f'{a}={mesh.sizes[a]}' for a in dim.axes)} (pad it to a multiple of {count})")
        size = full.shape[i] // count
        block = block.narrow(i, index * size, size)
    return Sharded(block.clone(memory_format=torch.contiguous_format), spec, mesh)


def local(signature: str, fn, *inputs: Sharded, **kwargs):
    """Run `fn` on this rank's blocks, no communication: 'A, B -> C, D' gives the inputs' specs
    (checked) and the outputs' (the results are wrapped in them). Keyword arguments go to fn as they
    are. Returns one Sharded, or a tuple of them for several outputs."""
    mesh = inputs[0].mesh
    ins, outs = parse_arrow(signature, mesh.sizes)
    if len(ins) != len(inputs):
        raise SpecError(f"local op {signature!r} names {len(ins)} inputs, {len(inputs)} were given")
    for n, (spec, x) in enumerate(zip(ins, inputs), start=1):
        check_matches(spec, x, f"local op {signature!r}, input {n}")
    check_local(ins, outs, signature)
    result = fn(*(x.tensor for x in inputs), **kwargs)
    results = result if isinstance(result, tuple) else (result,)
    if len(results) != len(outs):
        raise SpecError(f"local op {signature!r} names {len(outs)} outputs, {fn.__name__} returned {len(results)}")
    known = {dim.name: n for spec, x in zip(ins, inputs) for dim, n in zip(spec.dims, x.tensor.shape)}
    wrapped = []
    for spec, tensor in zip(outs, results):
        out = Sharded(tensor, spec, mesh)
        for dim, n in zip(spec.dims, tensor.shape):
            if dim.name in known and known[dim.name] != n:
                raise SpecError(f"local op {signature!r}: {dim.name} has {known[dim.name]} entries on this rank in "
                                f"an input but {n} in the output {fn.__name__} returned")
        wrapped.append(out)
    return wrapped[0] if len(wrapped) == 1 else tuple(wrapped)
