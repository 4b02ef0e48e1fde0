"""Module 13 named axes: the spec parser's refusals (m13_specs and course/mesh.py, given code), the
three collectives written from their arrows on a 2x2 mesh of gloo ranks against blocks cut by hand
from a whole tensor, and einsum_unreduced against torch.einsum with the contraction written out by
hand.

The mesh is d x t = 2 x 2, rank = i_d * 2 + i_t, so the d group and the t group both have two ranks:
a collective over the wrong one has the right shapes and the wrong numbers, which every tensor here
(distinct values on every rank) shows. Collectives only copy or add two numbers per element: the
float64 results are exact, compared with torch.equal (sums) or allclose at 1e-15 (sums of two).
"""
import pytest
import torch

from course.impl import load, reference
from course.late_collectives import LateCollectives
from course.launch import RankFailed, run_ranks
from course.mesh import Group, init_mesh, mesh_of_sizes, parse_mesh

axes = load("m13_named_axes")
specs = load("m13_specs")
model_2d = reference("m13_llama_2d")  # its given mesh check only
f64 = torch.float64
D, T = 2, 2  # the mesh


def block(full: torch.Tensor, split: dict[int, list[tuple[int, int]]]) -> torch.Tensor:
    """A block of `full` cut by hand: split = {dim: [(count, index), ...]} outermost first."""
    for dim, cuts in split.items():
        for count, index in cuts:
            full = full.chunk(count, dim=dim)[index]
    return full


def sharded(mesh, spec: str, tensor: torch.Tensor):
    return specs.Sharded(tensor, specs.parse_spec(spec, mesh.sizes), mesh)


# --- the parser and its checks (given code) ---------------------------------------------------

def _refusals():
    mesh = mesh_of_sizes({"d": 2, "t": 2})
    x = sharded(mesh, "B/d T M/t", torch.zeros(2, 3, 4, dtype=f64))
    partial = sharded(mesh, "B/d T M {U_t}", torch.zeros(2, 3, 8, dtype=f64))
    ln = sharded(mesh, "M", torch.ones(8, dtype=f64))
    w = sharded(mesh, "F/t M/d", torch.zeros(3, 4, dtype=f64))
    whole = sharded(mesh, "B/d T M", torch.zeros(2, 3, 8, dtype=f64))
    return {
        "unknown mesh axis": (lambda: axes.all_gather("B/d T M/x -> B/d T M", x), "unknown mesh axis 'x'"),
        "unknown axis in {U}": (lambda: specs.parse_spec("M {U_p}", mesh.sizes), "unknown mesh axis 'p'"),
        "one axis, two dims": (lambda: specs.parse_spec("B/d M/d", mesh.sizes), "mesh axis 'd' splits both B and M"),
        "mismatched spec": (lambda: axes.all_gather("B/d T/t M -> B/d T M", x), "dimension T/t against T"),
        "not divisible": (lambda: specs.shard("V/t M/d", torch.zeros(50, 8), mesh_of_sizes({"d": 1, "t": 4})),
                          "V=50 is not divisible by t=4"),
        "all_gather with a scatter's arrow": (lambda: axes.all_gather("B/d T M {U_t} -> B/d T M/t", partial),
                                              "splits M over t: that arrow is a reduce_scatter's"),
        "reduce_scatter with a gather's arrow": (lambda: axes.reduce_scatter("B/d T M/t -> B/d T M", x),
                                                 "that arrow is an all_gather's"),
        "reduce_scatter of a reduced tensor": (lambda: axes.reduce_scatter("B/d T M -> B/d T M/t", whole),
                                               "not unreduced over t"),
        "all_reduce that moves a dimension": (lambda: axes.all_reduce("B/d T M {U_t} -> B/d T M/t", partial),
                                              "all_reduce 'B/d T M {U_t} -> B/d T M/t' changes the dimensions"),
        "gather of a partial sum": (lambda: axes.all_gather("B/d T M -> B T M", partial),
                                    "unreduced over t ({U_t}: a partial sum"),
        "partial sum in a residual add": (lambda: whole + partial, "unreduced over t ({U_t}), a partial sum"),
        "partial sum into a local op": (
            lambda: specs.local("B/d T M, M -> B/d T M, B/d T", lambda a, b: (a, a[..., 0]), partial, ln),
            "input 1: the tensor is unreduced over t"),
        "local op that drops {U}": (lambda: specs.local("B/d T M {U_t} -> B/d T M", lambda a: a, partial),
                                    "every output is too (write {U_t})"),
        "einsum with an ungathered weight": (
            lambda: axes.einsum_unreduced("B/d T M, F/t M/d -> B/d T F/t", whole, w),
            "M is whole in operand 1 but split over d in operand 2"),
        "einsum of a partial sum": (lambda: axes.einsum_unreduced("B/d T M, F/t M -> B/d T F/t", partial, w),
                                    "operand 1: the tensor is unreduced over t"),
        "an unreadable mesh": (lambda: parse_mesh("2x"), "a mesh is written as axis=size pairs"),
        "a mesh with an unknown axis": (lambda: parse_mesh("d=2,x=2"), "unknown mesh axis 'x'"),
        "a spec on an axis of another mesh": (lambda: specs.parse_spec("B/p T", mesh.sizes),
                                              "unknown mesh axis 'p' in 'B/p T': this mesh has axes d, t"),
        "a mesh that does not divide the heads": (lambda: model_2d.check_mesh_fits(model_2d.CONFIG, {"d": 1, "t": 3}),
                                                  "t=3 does not divide n_heads H=8, n_kv_heads K=4"),
        "a mesh that does not divide the batch": (
            lambda: model_2d.check_mesh_fits(model_2d.CONFIG, {"d": 4, "t": 1}, batch=6), "d=4 does not divide batch B=6"),
        "a mesh that does not divide the norms": (lambda: model_2d.check_mesh_fits(model_2d.CONFIG, {"d": 3, "t": 4}),
                                                  "t x d = 12 does not divide dim M (the norms' M/t/d)=32"),
        "a mesh with a pipeline axis": (lambda: model_2d.check_mesh_fits(model_2d.CONFIG, {"p": 2, "d": 2, "t": 1}),
                                        "module 13's model runs on a d x t mesh; this mesh also has p=2"),
    }


@pytest.mark.given
@pytest.mark.parametrize("mistake", list(_refusals()))
def test_spec_mistakes_are_refused_with_a_message_naming_the_axis(mistake):
    call, message = _refusals()[mistake]
    with pytest.raises(ValueError) as error:
        call()
    assert message in str(error.value), f"{mistake}: expected a message with {message!r}, got: {error.value}"


@pytest.mark.given
def test_a_spec_may_name_any_axis_of_its_mesh():
    # course/mesh.py's mesh has axes p, d, c, t (outermost first): a spec on a p x t mesh splits over p and
    # t, cuts this rank's block by its index along each (rank 3 of p=2 x t=2 is i_p = 1, i_t = 1), and
    # lists unreduced axes in the mesh's order.
    mesh = mesh_of_sizes({"p": 2, "t": 2}, rank=3)
    full = torch.arange(4 * 3 * 6, dtype=f64).reshape(4, 3, 6)
    x = specs.shard("B/p T M/t", full, mesh)
    assert torch.equal(x.tensor, full[2:4, :, 3:6]), f"rank 3's block of B/p T M/t: {x.tensor}"
    assert str(specs.parse_spec("M {U_t,p}", mesh.sizes)) == "M {U_p,t}"
    with pytest.raises(ValueError, match="unknown mesh axis 'd'"):
        specs.parse_spec("B/d T", mesh.sizes)


def _mesh_of_the_wrong_size():
    init_mesh({"d": 2, "t": 2})


@pytest.mark.given
def test_a_mesh_must_have_as_many_ranks_as_the_job():
    with pytest.raises(RankFailed, match="the mesh d=2 x t=2 has 4 ranks, the job has 2"):
        run_ranks(_mesh_of_the_wrong_size, 2, timeout=20)


# --- the collectives on a 2x2 mesh -------------------------------------------------------------

def whole_tensors():
    """One whole tensor per case, distinct values everywhere (the same in every rank: a seed)."""
    g = torch.Generator().manual_seed(0)
    return {"x": torch.randn(4, 3, 8, generator=g, dtype=f64), "table": torch.randn(4, 8, generator=g, dtype=f64),
            "norm": torch.randn(8, generator=g, dtype=f64), "w": torch.randn(8, 6, generator=g, dtype=f64)}


def assert_labelled(arrow, labels):
    assert all("->" in label for label in labels), \
        f"{arrow!r}: collectives labelled {labels}: label each with its arrow, so the log says what it was for"


def _gathers():
    mesh = init_mesh({"d": D, "t": T})
    i_d, i_t = mesh.index["d"], mesh.index["t"]
    full = whole_tensors()
    cases = {
        "B/d T M/t -> B/d T M": block(full["x"], {0: [(D, i_d)], 2: [(T, i_t)]}),
        "V/t M/d -> V/t M": block(full["table"], {0: [(T, i_t)], 1: [(D, i_d)]}),
        "M/t/d -> M": block(full["norm"], {0: [(T, i_t), (D, i_d)]}),
        # dimension 0, from a block that is not contiguous (a transposed copy), as an einsum may leave it
        "M/d F/t -> M F/t": block(full["w"], {0: [(D, i_d)], 1: [(T, i_t)]}).t().contiguous().t(),
    }
    results = {}
    for arrow, mine in cases.items():
        left = arrow.split("->")[0]
        before = len(mesh.log)
        out = axes.all_gather(arrow, sharded(mesh, left, mine))
        results[arrow] = (out.tensor, str(out.spec), [(c.op, c.group_size) for c in mesh.log[before:]],
                          [c.label for c in mesh.log[before:]])
    return results


@pytest.mark.exercises("all_gather")
def test_all_gather_follows_the_arrow_over_the_right_group():
    full = whole_tensors()
    for rank, results in enumerate(run_ranks(_gathers, D * T, timeout=30)):
        i_d, i_t = divmod(rank, T)
        expected = {"B/d T M/t -> B/d T M": (block(full["x"], {0: [(D, i_d)]}), 1),
                    "V/t M/d -> V/t M": (block(full["table"], {0: [(T, i_t)]}), 1),
                    "M/t/d -> M": (full["norm"], 2),
                    "M/d F/t -> M F/t": (block(full["w"], {1: [(T, i_t)]}), 1)}
        for arrow, (want, collectives) in expected.items():
            got, spec, log, labels = results[arrow]
            assert got.shape == want.shape, \
                f"rank {rank}, {arrow!r}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
            hint = (" (gathered over the other mesh axis, or along the wrong dimension? M/t/d gathers over d first, "
                    "then t)") if not torch.equal(got, want) else ""
            assert torch.equal(got, want), f"rank {rank}, {arrow!r}: wrong values{hint}"
            assert spec == arrow.split("-> ")[1], f"rank {rank}, {arrow!r}: the result's spec is {spec!r}"
            assert log == [("all_gather", 2)] * collectives, \
                f"rank {rank}, {arrow!r}: logged {log}, expected {collectives} all-gather(s) over 2 ranks"
            assert_labelled(arrow, labels)


def _partials(rank):
    """Rank `rank`'s partial sums: different on every rank."""
    g = torch.Generator().manual_seed(100 + rank)
    return {"x": torch.randn(2, 3, 8, generator=g, dtype=f64), "norm": torch.randn(8, generator=g, dtype=f64),
            "w": torch.randn(8, 3, generator=g, dtype=f64), "loss": torch.randn((), generator=g, dtype=f64)}


def _scatters():
    mesh = init_mesh({"d": D, "t": T})
    mine = _partials(mesh.rank)
    cases = {"B/d T M {U_t} -> B/d T M/t": mine["x"], "M {U_d,t} -> M/t/d": mine["norm"],
             "M F/t {U_d} -> M/d F/t": mine["w"].t().contiguous().t()}  # not contiguous, as an einsum may leave it
    results = {}
    for arrow, partial in cases.items():
        before = len(mesh.log)
        out = axes.reduce_scatter(arrow, sharded(mesh, arrow.split("->")[0], partial))
        results[arrow] = (out.tensor, str(out.spec), [(c.op, c.group_size) for c in mesh.log[before:]],
                          [c.label for c in mesh.log[before:]])
    return results


@pytest.mark.exercises("reduce_scatter")
def test_reduce_scatter_sums_over_the_arrows_axes_and_keeps_this_ranks_block():
    parts = [_partials(r) for r in range(D * T)]
    for rank, results in enumerate(run_ranks(_scatters, D * T, timeout=30)):
        i_d, i_t = divmod(rank, T)
        t_group = [i_d * T + j for j in range(T)]
        d_group = [i * T + i_t for i in range(D)]
        expected = {
            "B/d T M {U_t} -> B/d T M/t": (block(sum(parts[r]["x"] for r in t_group), {2: [(T, i_t)]}), 1),
            "M {U_d,t} -> M/t/d": (block(sum(p["norm"] for p in parts), {0: [(T, i_t), (D, i_d)]}), 2),
            "M F/t {U_d} -> M/d F/t": (block(sum(parts[r]["w"] for r in d_group), {0: [(D, i_d)]}), 1),
        }
        for arrow, (want, collectives) in expected.items():
            got, spec, log, labels = results[arrow]
            assert got.shape == want.shape, \
                f"rank {rank}, {arrow!r}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
            hint = (" (summed over the other mesh axis, along the wrong dimension, or M/t/d scattered over d before "
                    "t?)")
            assert torch.allclose(got, want, rtol=1e-15, atol=1e-15), f"rank {rank}, {arrow!r}: wrong values{hint}"
            assert spec == arrow.split("-> ")[1], f"rank {rank}, {arrow!r}: the result's spec is {spec!r}"
            assert log == [("reduce_scatter", 2)] * collectives, \
                f"rank {rank}, {arrow!r}: logged {log}, expected {collectives} reduce-scatter(s) over 2 ranks"
            assert_labelled(arrow, labels)


def _all_reduces():
    mesh = init_mesh({"d": D, "t": T})
    mine = _partials(mesh.rank)
    cases = {"B/d T M {U_t} -> B/d T M": mine["x"], "{U_d} ->": mine["loss"],
             "M {U_d,t} -> M {U_d}": mine["norm"], "M {U_d,t} -> M": mine["norm"]}
    results = {}
    for arrow, partial in cases.items():
        x = sharded(mesh, arrow.split("->")[0], partial.clone())
        before = len(mesh.log)
        out = axes.all_reduce(arrow, x)
        results[arrow] = (out.tensor, str(out.spec), len(mesh.log) - before, torch.equal(x.tensor, partial))
    return results


@pytest.mark.exercises("all_reduce")
def test_all_reduce_sums_over_the_axes_the_arrow_drops():
    parts = [_partials(r) for r in range(D * T)]
    for rank, results in enumerate(run_ranks(_all_reduces, D * T, timeout=30)):
        i_d, i_t = divmod(rank, T)
        t_group = [i_d * T + j for j in range(T)]
        d_group = [i * T + i_t for i in range(D)]
        expected = {"B/d T M {U_t} -> B/d T M": (sum(parts[r]["x"] for r in t_group), 1),
                    "{U_d} ->": (sum(parts[r]["loss"] for r in d_group), 1),
                    "M {U_d,t} -> M {U_d}": (sum(parts[r]["norm"] for r in t_group), 1),
                    "M {U_d,t} -> M": (sum(p["norm"] for p in parts), 2)}
        for arrow, (want, collectives) in expected.items():
            got, spec, count, untouched = results[arrow]
            assert torch.allclose(got, want, rtol=1e-15, atol=1e-15), \
                f"rank {rank}, {arrow!r}: wrong sum (over the other mesh axis, or over both when one was asked?)"
            assert spec == arrow.split("->")[1].strip(), f"rank {rank}, {arrow!r}: the result's spec is {spec!r}"
            assert count == collectives, f"rank {rank}, {arrow!r}: {count} collectives, expected {collectives}"
            assert untouched, f"rank {rank}, {arrow!r}: the input was changed in place; sum a copy"


# --- einsum_unreduced (local: one process, a mesh of sizes only) --------------------------------

EINSUMS = [  # (equation, hand-written torch.einsum, the axes its result is unreduced over)
    ("B/d T M, F/t M -> B/d T F/t", "btm,fm->btf", set()),            # M is whole: nothing left unreduced
    ("B/d T F/t, M F/t -> B/d T M", "btf,mf->btm", {"t"}),            # Megatron's row-split product
    ("B/d T M, B/d T F/t -> M F/t", "btm,btf->mf", {"d"}),            # a weight's gradient: over B/d
    ("B/d T F/t, B/d T F/t -> T", "btf,btf->t", {"d", "t"}),          # two contracted, two axes
    ("Batch/d Klen K/t, K/t Dh -> Batch/d Klen Dh", "bxk,kh->bxh", {"t"}),  # longer names
]


@pytest.mark.exercises("einsum_unreduced")
@pytest.mark.parametrize("equation, by_hand, unreduced", EINSUMS, ids=[e[0] for e in EINSUMS])
def test_einsum_unreduced_contracts_locally_and_reports_the_axes(equation, by_hand, unreduced):
    mesh = mesh_of_sizes({"d": 2, "t": 2})
    g = torch.Generator().manual_seed(0)
    specs = [s.strip() for s in equation.split("->")[0].split(",")]
    local_shapes = {"B": 2, "Batch": 2, "T": 3, "Klen": 3, "M": 8, "F": 3, "K": 2, "Dh": 5}
    operands = [sharded(mesh, s, torch.randn(*[local_shapes[d.split("/")[0]] for d in s.split()], generator=g,
                                              dtype=f64)) for s in specs]
    out = axes.einsum_unreduced(equation, *operands)
    want = torch.einsum(by_hand, *(x.tensor for x in operands))
    assert out.tensor.shape == want.shape and torch.allclose(out.tensor, want, rtol=1e-14, atol=1e-14), \
        f"{equation!r}: the local contraction differs from torch.einsum({by_hand!r})"
    assert set(out.spec.unreduced) == unreduced, \
        (f"{equation!r}: reported unreduced over {sorted(out.spec.unreduced)}, expected {sorted(unreduced)} "
         f"(the mesh axes of the dimensions summed over, and only those)")
    assert [str(dim) for dim in out.spec.dims] == equation.split("-> ")[1].split(), \
        f"{equation!r}: the result's dimensions are {out.spec}"


# --- grouped collectives: many arrows over one axis, one collective (2x2, delivered late) ---------

def late_mesh(sizes):
    """A mesh whose d and t groups deliver late (course/late_collectives.py): an asynchronous collective's
    output is NaN until its work is waited for, so a result read before the wait is wrong on every run."""
    mesh = init_mesh(sizes)
    for axis in ("d", "t"):
        group = mesh.group(axis)
        late = LateCollectives(group.collectives.group, axis, group.ranks)
        late.log = mesh.log  # one log for the mesh, as init_mesh's groups share
        mesh.groups[axis] = Group(axis, group.index, group.ranks, late)
    return mesh


def grouped_wholes():
    g = torch.Generator().manual_seed(7)
    return {**whole_tensors(), "wq": torch.randn(4, 2, 3, 8, generator=g, dtype=f64)}


def gather_groups(i_d, i_t):
    """axis -> [(arrow, whole tensor, this rank's block before, after)]: blocks split along the first, the last and
    a middle dimension of four; the group over t is the halves' (the stream and a norm weight)."""
    return {"d": [("V/t M/d -> V/t M", "table", {0: [(T, i_t)], 1: [(D, i_d)]}, {0: [(T, i_t)]}),
                  ("M/d F/t -> M F/t", "w", {0: [(D, i_d)], 1: [(T, i_t)]}, {1: [(T, i_t)]}),
                  ("M/t/d -> M/t", "norm", {0: [(T, i_t), (D, i_d)]}, {0: [(T, i_t)]}),
                  ("K/t Q D M/d -> K/t Q D M", "wq", {0: [(T, i_t)], 3: [(D, i_d)]}, {0: [(T, i_t)]})],
            "t": [("B/d T M/t -> B/d T M", "x", {0: [(D, i_d)], 2: [(T, i_t)]}, {0: [(D, i_d)]}),
                  ("M/t -> M", "norm", {0: [(T, i_t)]}, {})]}


def members(axis, i_d, i_t):
    """The (i_d, i_t) of each member of this rank's group along axis, in group order."""
    return [(j, i_t) for j in range(D)] if axis == "d" else [(i_d, j) for j in range(T)]


def _grouped(op, groups, inputs_of):
    """Each group's grouped collective on a mesh of late collectives: its results, its rows, its log."""
    mesh = late_mesh({"d": D, "t": T})
    start = getattr(axes, f"start_{op}")
    results = {}
    for axis, group in groups(mesh.index["d"], mesh.index["t"]).items():
        xs = [sharded(mesh, arrow.split("->")[0], tensor) for (arrow, *_), tensor in zip(group, inputs_of(mesh, group))]
        kept = [x.tensor.clone() for x in xs]
        before = len(mesh.log)
        pending = start([arrow for arrow, *_ in group], xs, f"a group over {axis}")
        started = {"dims": list(pending.dims), "shapes": [tuple(shape) for shape in pending.shapes]}
        try:
            out, raised = axes.finish(pending), None
        except Exception as error:  # noqa: BLE001  reported by the parent after the checks of start_...
            out, raised = [], f"{type(error).__name__}: {error}"
        results[axis] = {"out": [(o.tensor, str(o.spec)) for o in out], "rows": pending.rows.clone(), **started,
                         "raised": raised,
                         "log": [(c.op, c.axis, c.payload_bytes) for c in mesh.log[before:]],
                         "never waited": mesh.group(axis).collectives.never_waited(),
                         "inputs kept": all(torch.equal(a, x.tensor) for a, x in zip(kept, xs))}
    return results


def moved_dim(arrow: str) -> int:
    """The dimension an arrow's collective moves: the first whose split differs on the two sides."""
    left, right = ([token for token in side.split() if not token.startswith("{")] for side in arrow.split("->"))
    return next(i for i, (a, b) in enumerate(zip(left, right)) if a != b)


def check_grouped(rank, op, axis, group, got, rows, wanted, payload, dims, shapes):
    """A grouped collective's checks in order of blame: waited for (finish), one call (start_...), the rows it
    delivered (start_...), the results unpacked from them (finish)."""
    start, arrows = f"start_{op}", [arrow for arrow, *_ in group]
    where = f"rank {rank}, grouped {op} over {axis} of {arrows}"
    assert not got["never waited"], \
        f"{where}: the collective was never waited for, so its rows were read before they arrived: your finish"
    assert got["log"] == [(op, axis, payload)], \
        (f"{where}: logged (op, axis, payload bytes) {got['log']}, expected one collective {[(op, axis, payload)]}: "
         f"your {start}")
    assert got["inputs kept"], f"{where}: an input tensor was written: your {start}"
    assert got["dims"] == dims and got["shapes"] == shapes, \
        (f"{where}: InFlight's dims {got['dims']} and shapes {got['shapes']}, expected {dims} (each arrow's own "
         f"dimension) and {shapes} (each tensor's piece in a row): your {start}")
    assert got["raised"] is None, f"{where}: finish raised {got['raised']}: your finish"
    assert got["rows"].shape == rows.shape and torch.allclose(got["rows"], rows, rtol=1e-15, atol=1e-15), \
        (f"{where}: the rows delivered (shape {tuple(got['rows'].shape)}, expected {tuple(rows.shape)}) are not the "
         f"blocks InFlight's docstring says, in the arrows' order, each flattened: your {start}")
    for arrow, (tensor, spec), want in zip(arrows, got["out"], wanted, strict=True):
        assert spec == arrow.split("-> ")[1], f"{where}: {arrow!r} gives the spec {spec!r}: your finish"
        assert tensor.shape == want.shape and torch.allclose(tensor, want, rtol=1e-15, atol=1e-15), \
            (f"{where}: {arrow!r} unpacked wrong (shape {tuple(tensor.shape)}, expected {tuple(want.shape)}) from rows "
             f"that are right: where each piece starts in a row, or the dimension the pieces are joined along: "
             f"your finish")


def _gather_inputs(mesh, group):
    full = grouped_wholes()
    blocks = [block(full[name], mine).clone() for _, name, mine, _ in group]
    return [b.t().contiguous().t() if b.dim() == 2 else b for b in blocks]  # some not contiguous, as an einsum leaves them


@pytest.mark.exercises("finish", "start_all_gather")
def test_a_grouped_all_gather_gives_what_each_arrow_would():
    full = grouped_wholes()
    for rank, results in enumerate(run_ranks(_grouped, D * T, "all_gather", gather_groups, _gather_inputs,
                                             timeout=30)):
        i_d, i_t = divmod(rank, T)
        for axis, group in gather_groups(i_d, i_t).items():
            rows = torch.stack([torch.cat([block(full[name], gather_groups(*m)[axis][n][2]).reshape(-1)
                                           for n, (_, name, _, _) in enumerate(group)])
                                for m in members(axis, i_d, i_t)])
            wanted = [block(full[name], after) for _, name, _, after in group]
            payload = sum(block(full[name], mine).nbytes for _, name, mine, _ in group)
            dims = [moved_dim(arrow) for arrow, *_ in group]
            shapes = [tuple(block(full[name], mine).shape) for _, name, mine, _ in group]
            check_grouped(rank, "all_gather", axis, group, results[axis], rows, wanted, payload, dims, shapes)


def scatter_groups(i_d, i_t):
    """axis -> [(arrow, partial sum's name, this rank's block of the sum)]: the units' gradients over d, the
    halves' over t (the stream's and a norm weight's, still unreduced over d)."""
    return {"d": [("M F/t {U_d} -> M/d F/t", "w", {0: [(D, i_d)]}),
                  ("F/t M {U_d} -> F/t M/d", "wt", {1: [(D, i_d)]}),
                  ("M/t {U_d} -> M/t/d", "norm_t", {0: [(D, i_d)]}),
                  ("K/t Q D M {U_d} -> K/t Q D M/d", "wq", {3: [(D, i_d)]})],
            "t": [("B/d T M {U_t} -> B/d T M/t", "x", {2: [(T, i_t)]}),
                  ("M {U_d,t} -> M/t {U_d}", "norm", {0: [(T, i_t)]})]}


def grouped_partials(rank):
    g = torch.Generator().manual_seed(200 + rank)
    return {**_partials(rank), "wt": torch.randn(3, 8, generator=g, dtype=f64),
            "norm_t": torch.randn(4, generator=g, dtype=f64), "wq": torch.randn(2, 2, 3, 8, generator=g, dtype=f64)}


def _scatter_inputs(mesh, group):
    mine = grouped_partials(mesh.rank)
    return [mine[name].t().contiguous().t() if mine[name].dim() == 2 else mine[name].clone() for _, name, _ in group]


@pytest.mark.exercises("start_reduce_scatter", "finish")
def test_a_grouped_reduce_scatter_gives_what_each_arrow_would():
    parts = [grouped_partials(r) for r in range(D * T)]
    for rank, results in enumerate(run_ranks(_grouped, D * T, "reduce_scatter", scatter_groups, _scatter_inputs,
                                             timeout=30)):
        i_d, i_t = divmod(rank, T)
        for axis, group in scatter_groups(i_d, i_t).items():
            ranks = [m_d * T + m_t for m_d, m_t in members(axis, i_d, i_t)]
            wanted = [block(sum(parts[r][name] for r in ranks), mine) for _, name, mine in group]
            rows = torch.cat([w.reshape(-1) for w in wanted]).unsqueeze(0)
            dims = [moved_dim(arrow) for arrow, *_ in group]
            check_grouped(rank, "reduce_scatter", axis, group, results[axis], rows, wanted, rows.nbytes, dims,
                          [tuple(w.shape) for w in wanted])
