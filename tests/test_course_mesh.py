"""The mesh every parallel module stands on (course/mesh.py), its logged collectives
(course/collectives.py) and the one cost shape (course/costs.py): groups against the rank
arithmetic and torch's own DeviceMesh, every collective kind logged with its axis and ring bytes,
bad meshes refused in one line."""
import pytest
import torch
import torch.distributed as dist

from course.costs import StepCost, measured_cost
from course.launch import run_ranks
from course.mesh import MeshError, check_mesh, init_mesh, mesh_of_sizes, parse_mesh, rank_of, single_group


def _groups_and_collectives():
    rank = dist.get_rank()
    experts = init_mesh({"d": 2, "c": 2, "e": 2})   # 4 ranks: j = i_d c + i_c = rank
    grid = init_mesh({"p": 2, "t": 2})              # the same 4 ranks, another mesh
    groups = {name: (mesh.group(name).index, mesh.group(name).ranks)
              for mesh, names in ((experts, ("d", "c", "dc", "e", "ed")), (grid, ("p", "t"))) for name in names}
    torch_ranks = {axis: tuple(dist.get_process_group_ranks(grid.device_mesh.get_group(axis))) for axis in "pt"}

    # Every collective kind over the tensor group of `grid`, logged in call order with its axis.
    t = grid.group("t")
    x = torch.full((4, 3), float(rank))
    summed = x.clone()
    t.collectives.all_reduce(summed, label="sum")
    gathered = torch.empty(8, 3)
    t.collectives.all_gather(gathered, x, label="gather")
    # Uneven all-to-all: member i sends i + 1 rows to member 0 and 3 - i rows to member 1.
    splits = [t.index + 1, 3 - t.index]
    out_splits = [1, 2] if t.index == 0 else [3, 2]
    received = torch.empty(sum(out_splits), 3)
    t.collectives.all_to_all(received, torch.full((4, 3), float(rank)), out_splits, splits, label="a2a")
    # A ring step along p: send to the next member, receive from the previous one.
    p = grid.group("p")
    if p.index == 0:
        p.collectives.send(torch.ones(5), 1, label="ring")
    else:
        p.collectives.recv(torch.empty(5), 0, label="ring")
    log = [(c.op, c.axis, c.label, c.sent_bytes) for c in grid.log]
    return groups, torch_ranks, summed[0, 0].item(), gathered[:, 0].tolist(), received[:, 0].tolist(), log


def test_groups_follow_the_rank_arithmetic_and_log_every_collective_with_its_axis():
    results = run_ranks(_groups_and_collectives, 4, timeout=60)
    for rank, (groups, torch_ranks, summed, gathered, received, log) in enumerate(results):
        i_d, i_c = divmod(rank, 2)
        assert groups["d"] == (i_d, (i_c, 2 + i_c)) and groups["c"] == (i_c, (2 * i_d, 2 * i_d + 1))
        assert groups["dc"] == (rank, (0, 1, 2, 3))
        # experts: the e = 2 consecutive ranks j // 2; expert-data: those that share j % 2
        assert groups["e"] == (rank % 2, (2 * (rank // 2), 2 * (rank // 2) + 1)), groups["e"]
        assert groups["ed"] == (rank // 2, (rank % 2, rank % 2 + 2)), groups["ed"]
        i_p, i_t = divmod(rank, 2)
        assert groups["p"] == (i_p, (i_t, 2 + i_t)) and groups["t"] == (i_t, (2 * i_p, 2 * i_p + 1))
        assert torch_ranks == {"p": groups["p"][1], "t": groups["t"][1]}, "ours and DeviceMesh's groups differ"
        assert summed == sum(groups["t"][1]) and gathered == [groups["t"][1][0]] * 4 + [groups["t"][1][1]] * 4
        first, second = groups["t"][1]
        assert received == ([first] + [second] * 2 if i_t == 0 else [first] * 3 + [second] * 2), received
        row = 3 * 4
        sent_a2a = (3 - i_t) * row if i_t == 0 else (i_t + 1) * row  # the rows that leave this rank
        assert log[:3] == [("all_reduce", "t", "sum", 2 * 1 / 2 * 48), ("all_gather", "t", "gather", 48),
                           ("all_to_all", "t", "a2a", sent_a2a)], log
        assert log[3] == (("send", "p", "ring", 20) if i_p == 0 else ("recv", "p", "ring", 0)), log


@pytest.mark.parametrize("sizes, world_size, message", [
    ({"d": 2, "t": 3}, 4, "has 6 ranks, the job has 4"),
    ({"x": 2}, None, "unknown mesh axis 'x'"),
    ({"d": 0}, None, "at least 1"),
    ({"d": 2, "c": 1, "e": 4}, None, "e=4 must divide d x c = 2"),
])
def test_a_bad_mesh_is_refused_in_one_line(sizes, world_size, message):
    with pytest.raises(MeshError, match=message) as error:
        check_mesh(sizes, world_size)
    assert "\n" not in str(error.value)


def test_parse_mesh_reads_named_axes_and_refuses_the_rest():
    assert parse_mesh("t=2,p=2") == {"p": 2, "t": 2}  # outermost first, whatever the order written
    assert parse_mesh("2x4") == {"d": 2, "t": 4}
    for text, message in [("d=2,d=2", "given twice"), ("q=2", "unknown mesh axis"), ("2,2", "axis=size"),
                          ("d=-1", "at least 1")]:
        with pytest.raises(MeshError, match=message):
            parse_mesh(text)


def test_ranks_are_row_major_over_p_d_c_t():
    sizes = {"p": 2, "d": 3, "c": 2, "t": 2}
    for rank in range(24):
        mesh = mesh_of_sizes(sizes, rank)
        assert rank_of(sizes, mesh.index) == rank
        assert rank == ((mesh.index["p"] * 3 + mesh.index["d"]) * 2 + mesh.index["c"]) * 2 + mesh.index["t"]


def test_a_group_of_one_needs_no_process_group():
    alone = single_group("t")
    x = torch.arange(6.0).reshape(2, 3)
    out = torch.empty(2, 3)
    alone.collectives.all_gather(out, x, dim=1)
    alone.collectives.all_reduce(x)
    assert torch.equal(out, torch.arange(6.0).reshape(2, 3)) and alone.size == 1
    assert [c.sent_bytes for c in alone.collectives.log] == [0, 0]


def test_step_costs_add_up_across_axes_and_read_off_a_log():
    from course.collectives import Collective

    fsdp = StepCost({("d", "all_gather"): 300.0}, {("d", "all_gather"): 3}, {"parameters": 10})
    tp = StepCost({("t", "all_reduce"): 50.0}, {("t", "all_reduce"): 1}, {"parameters": 5, "activations": 7})
    both = fsdp + tp
    assert both.sent_bytes() == 350 and both.sent_bytes(axis="d") == 300 and both.n_calls(op="all_reduce") == 1
    assert both.memory == {"parameters": 15, "activations": 7} and both.state_bytes == 15
    log = [Collective("all_gather", 100, "", 2, "d")] * 3 + [Collective("recv", 8, "", 2, "p")]
    assert measured_cost(log, {"parameters": 10}) == fsdp
    with pytest.raises(ValueError, match="unknown collective kind"):
        StepCost({("d", "gather"): 1})
