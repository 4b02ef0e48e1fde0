"""Groups and the mesh: where every parallel piece of the course finds its peers (given code).

A **group** is a set of ranks that act together: the ranks that hold the same layers and split the
batch (data, d), the ranks that share every linear (tensor, t), the ranks that hold one slice of
the sequence each (context, c), the ranks that hold different experts (experts, e), the ranks
through which a microbatch flows (pipeline, p). A `Group` is one group as one of its members sees
it: its name (`axis`), this rank's place in it (`index`, 0 .. size - 1), its size, the global rank
of every member (`ranks`, so point-to-point code can name its neighbours), and a `Collectives`
over exactly those ranks, which logs every call.

A **mesh** arranges the world's ranks in a grid with one named axis per kind of parallelism,
outermost first:

    p (pipeline) x d (data) x c (context) x t (tensor)      rank = ((i_p d + i_d) c + i_c) t + i_t

An axis left out has size 1; the sizes' product is the world size. Along an axis, the ranks that
differ only in that axis's index form one group: each rank belongs to one group per axis, and
`mesh.group("t")` is its tensor group. `mesh.group("d", "c")` is the group of the d x c ranks
that share p and t (FSDP shards over data and context ranks together, as torchtitan does). The
expert axis e is carved out of those d x c ranks (torchtitan folds experts into the data ranks):
number them j = i_d c + i_c; the expert group is the e consecutive ones that share j // e, the
expert-data group ("ed") the d c / e ones that share j % e: the ranks that hold the same experts.

The groups come from torch's own `init_device_mesh` (gloo on CPU) where it has them, so the mesh
is the one FSDP2 and DTensor run on; every collective of every group writes into one log,
`mesh.log`, in call order.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import torch.distributed as dist

from course.collectives import Collectives

MESH_AXES = ("p", "d", "c", "t")  # the grid's axes, outermost first
EXPERT_AXES = ("e", "ed")         # carved out of d x c: experts, and the ranks holding the same experts


class MeshError(ValueError):
    """A mesh that cannot be built on this job (one line, said before any rank starts)."""


@dataclass(frozen=True)
class Group:
    """One group of ranks, as one of its members sees it."""
    axis: str                  # its name: "p", "d", "c", "t", "e", "ed", "dc" (d and c together), "world"
    index: int                 # this rank's place in the group, 0 .. size - 1
    ranks: tuple[int, ...]     # the global rank of each member, in group order
    collectives: Collectives = field(compare=False, repr=False)  # over exactly these ranks, logged

    @property
    def size(self) -> int:
        return len(self.ranks)


def world_group(axis: str = "world") -> Group:
    """Every rank of the job, in rank order (the default group), named `axis` (e.g. "d" when the
    whole job is one data-parallel group)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    return Group(axis, rank, tuple(range(world_size)), Collectives(None, axis, tuple(range(world_size))))


def single_group(axis: str = "world") -> Group:
    """A group of one rank: its collectives return this rank's own data and need no process group,
    so single-process code (a demo, a t = 1 test) runs the same path as a group of many."""
    return Group(axis, 0, (0,), Collectives(None, axis, (0,)))


def group_of(axis: str, index: int, ranks) -> Group:
    """Member `index` of the group of global `ranks`, made without torch.distributed: what a test
    or a notebook needs to build every member's part in one process (a pipeline stage's layers, its
    neighbours' ranks). Point-to-point messages name global ranks, so they work over any `ranks`;
    its other collectives run over the default group, right only when `ranks` is the whole job
    (init_mesh makes the process groups a sub-group's collectives need)."""
    ranks = tuple(ranks)
    return Group(axis, index, ranks, Collectives(None, axis, ranks))


@dataclass
class Mesh:
    """This rank's place in a grid of ranks with named axes, and its group along each."""
    sizes: dict[str, int]                          # the mesh's axes, outermost first (and "e", if any)
    index: dict[str, int]                          # this rank's position along each
    groups: dict[str, Group] = field(default_factory=dict)  # axis name -> this rank's group along it
    log: list = field(default_factory=list)        # every collective of every group, in call order
    device_mesh: object = None                     # torch's DeviceMesh the groups came from

    @property
    def rank(self) -> int:
        return rank_of(self.sizes, self.index)

    @property
    def collectives(self) -> dict[str, Collectives]:
        """axis -> the collectives of this rank's group along it (mesh.group(axis).collectives)."""
        return {axis: group.collectives for axis, group in self.groups.items()}

    def group(self, *axes: str) -> Group:
        """This rank's group along one axis, or along several at once (e.g. "d", "c")."""
        name = "".join(axes)
        if name not in self.groups:
            known = ", ".join(repr(a) for a in self.groups) or "none (a mesh of sizes only)"
            raise MeshError(f"this mesh has no group {name!r}; its groups: {known}")
        return self.groups[name]


def check_mesh(sizes: dict[str, int], world_size: int | None = None):
    """One-line errors for a mesh that cannot be built: unknown axis, size < 1, e not dividing d c,
    and (given `world_size`) sizes whose product is not the number of ranks."""
    for axis, size in sizes.items():
        if axis not in MESH_AXES + ("e",):
            raise MeshError(f"unknown mesh axis {axis!r}: a mesh has axes {', '.join(MESH_AXES + ('e',))}")
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise MeshError(f"mesh axis {axis} must have a size of at least 1, got {size!r}")
    grid = math.prod(size for axis, size in sizes.items() if axis != "e")
    if world_size is not None and grid != world_size:
        shown = " x ".join(f"{a}={s}" for a, s in sizes.items() if a != "e")
        raise MeshError(f"the mesh {shown} has {grid} ranks, the job has {world_size}: "
                        f"the sizes' product must be the number of ranks (--nproc)")
    expert_pool = sizes.get("d", 1) * sizes.get("c", 1)
    if expert_pool % sizes.get("e", 1):
        raise MeshError(f"e={sizes['e']} must divide d x c = {expert_pool}: the expert ranks are carved out of "
                        f"the data and context ranks")


def parse_mesh(text: str) -> dict[str, int]:
    """{axis: size} from 'p=2,d=2,t=2' (an axis left out has size 1, so it is not listed), or
    from module 13's 'DxT' ('2x2': d, then t)."""
    match = re.fullmatch(r"\s*(\d+)\s*x\s*(\d+)\s*", text)
    if match:
        sizes = {"d": int(match[1]), "t": int(match[2])}
    elif re.fullmatch(r"\s*\w+\s*=\s*-?\d+\s*(,\s*\w+\s*=\s*-?\d+\s*)*", text):
        sizes = {}
        for item in text.split(","):
            axis, size = (part.strip() for part in item.split("="))
            if axis in sizes:
                raise MeshError(f"mesh axis {axis!r} is given twice in {text!r}")
            sizes[axis] = int(size)
    else:
        raise MeshError(f"a mesh is written as axis=size pairs, e.g. d=2,t=2 (or DxT, e.g. 2x2), got {text!r}")
    check_mesh(sizes)
    order = MESH_AXES + ("e",)
    return {axis: sizes[axis] for axis in order if axis in sizes}


def rank_of(sizes: dict[str, int], index: dict[str, int]) -> int:
    """The global rank at `index` of a mesh of `sizes`: row-major over the grid's axes."""
    rank = 0
    for axis in MESH_AXES:
        if axis in sizes:
            rank = rank * sizes[axis] + index[axis]
    return rank


def index_of(sizes: dict[str, int], rank: int) -> dict[str, int]:
    """This rank's position along each axis (the inverse of rank_of), "e" included if present."""
    index = {}
    for axis in reversed([a for a in MESH_AXES if a in sizes]):
        rank, index[axis] = divmod(rank, sizes[axis])
    index = {axis: index[axis] for axis in MESH_AXES if axis in index}
    if "e" in sizes:
        index["e"] = _pool_index(sizes, index) % sizes["e"]
    return index


def mesh_of_sizes(sizes: dict[str, int], rank: int = 0) -> Mesh:
    """A mesh without process groups, for what needs only the sizes: parsing, checks, local ops."""
    check_mesh(sizes)
    sizes = {axis: sizes[axis] for axis in MESH_AXES + ("e",) if axis in sizes}
    return Mesh(sizes, index_of(sizes, rank))


def init_mesh(sizes: dict[str, int]) -> Mesh:
    """This rank's mesh over the ranks of the job (the sizes' product must be the world size), with
    a group along each axis, the d x c group "dc", and with "e", the expert and expert-data groups.

    Every rank must call it, in the same order relative to other group creations: making a group
    is itself a collective over the whole job."""
    from torch.distributed.device_mesh import init_device_mesh

    check_mesh(sizes, dist.get_world_size())
    mesh = mesh_of_sizes(sizes, dist.get_rank())
    grid = [axis for axis in MESH_AXES if axis in mesh.sizes]
    mesh.device_mesh = init_device_mesh("cpu", tuple(mesh.sizes[a] for a in grid), mesh_dim_names=tuple(grid))
    for axis in grid:
        _add(mesh, axis, [_members(mesh, {axis})], mesh.device_mesh.get_group(axis))
    extra = {"dc": _groups_along(mesh, {"d", "c"})}
    if "e" in mesh.sizes:
        extra.update(e=_expert_groups(mesh, "e"), ed=_expert_groups(mesh, "ed"))
    for name, all_groups in extra.items():
        torch_group = None
        for ranks in all_groups:  # every rank creates every group, in the same order
            created = dist.new_group(list(ranks)) if len(ranks) > 1 else None
            if dist.get_rank() in ranks:
                torch_group = created
        _add(mesh, name, all_groups, torch_group)
    return mesh


def _add(mesh: Mesh, name: str, all_groups, torch_group):
    ranks = next(tuple(g) for g in all_groups if mesh.rank in g)
    collectives = Collectives(torch_group if len(ranks) > 1 else None, name, ranks, mesh.log)
    mesh.groups[name] = Group(name, ranks.index(mesh.rank), ranks, collectives)


def _members(mesh: Mesh, axes: set[str]) -> tuple[int, ...]:
    """The global ranks that share this rank's index on every axis but `axes`, in group order."""
    return _groups_along(mesh, axes, only_mine=True)[0]


def _groups_along(mesh: Mesh, axes: set[str], only_mine: bool = False) -> list[tuple[int, ...]]:
    """Every group of ranks that differ only along `axes` (this rank's alone with only_mine), each
    in row-major order of those axes."""
    grid = {a: s for a, s in mesh.sizes.items() if a in MESH_AXES}
    fixed_axes = [a for a in grid if a not in axes]
    groups = {}
    for rank in range(math.prod(grid.values())):
        index = index_of(grid, rank)
        key = tuple(index[a] for a in fixed_axes)
        if only_mine and key != tuple(mesh.index[a] for a in fixed_axes):
            continue
        groups.setdefault(key, []).append(rank)
    return [tuple(g) for g in groups.values()]


def _pool_index(sizes: dict[str, int], index: dict[str, int]) -> int:
    """j = i_d c + i_c: this rank's place among the d x c ranks that share its p and t."""
    return index.get("d", 0) * sizes.get("c", 1) + index.get("c", 0)


def _expert_groups(mesh: Mesh, name: str) -> list[tuple[int, ...]]:
    """The expert groups (name "e": the e consecutive ranks of each d x c group that share j // e) or
    the expert-data groups ("ed": those that share j % e)."""
    e, groups = mesh.sizes["e"], []
    for pool in _groups_along(mesh, {"d", "c"}):
        if name == "e":
            groups += [pool[start:start + e] for start in range(0, len(pool), e)]
        else:
            groups += [pool[k::e] for k in range(e)]
    return groups
