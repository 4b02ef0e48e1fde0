"""Module 16 expert parallelism: the exchange of rows between the members of an expert group, on 4
ranks with e = 4 and e = 2, every rank sending an uneven number of rows to each expert (none to
some, many to one). The plan first (the counts received, both sides' split sizes, the regroup, all
worked out by the test from every member's counts), then the two moves on the test's own plan: each
local expert receives exactly the rows sent to it, from member 0 first, each member's in the order
sent; the way back, from the rows the experts should have received, returns every row to the slot
it came from; every all-to-all goes through the group's collectives. Rows are labelled with where
they come from, so the checks are exact."""
import pytest
import torch

from course.impl import load
from course.launch import run_ranks
from course.mesh import init_mesh
from moe_checks import first_difference  # tests/moe_checks.py

parallel = load("m16_expert_parallel")
N_EXPERTS = 8


def counts_of(rank):
    """Rows rank `rank` sends each expert: uneven, zero for some experts, different on every rank. Expert 0
    is crowded (33 + rank rows from each rank): the member that holds it receives 67 or more rows of one
    local expert, equal keys for the regroup's sort, enough that an unstable sort reorders them (torch's
    CPU sort keeps the order of equal keys on a few rows: an unstable regroup would pass with few)."""
    counts = torch.randint(0, 4, (N_EXPERTS,), generator=torch.Generator().manual_seed(10 + rank))
    counts[0] = 33 + rank
    return counts


def rows_of(rank):
    """Expert-major rows, each labelled (source rank, expert, its index among that expert's rows, 0)."""
    counts = counts_of(rank)
    labels = [(rank, j, i, 0) for j in range(N_EXPERTS) for i in range(int(counts[j]))]
    return torch.tensor(labels, dtype=torch.float64).view(-1, 4)


def expected_exchange(rank, e):
    """The exchange member `rank` of its expert group must plan, worked out by the test from every member's
    counts: (received, send_splits, recv_splits, regroup, arrived rows in local-expert-major order)."""
    members = [r for r in range(4) if r // e == rank // e]
    per_rank, me = N_EXPERTS // e, members.index(rank)
    mine = range(me * per_rank, (me + 1) * per_rank)
    received = torch.stack([counts_of(s)[mine.start:mine.stop] for s in members])
    send = [int(counts_of(rank)[k * per_rank:(k + 1) * per_rank].sum()) for k in range(e)]
    recv = [int(c.sum()) for c in received]
    source_major = torch.cat([rows_of(s)[(rows_of(s)[:, 1] >= mine.start) & (rows_of(s)[:, 1] < mine.stop)]
                              for s in members])
    arrived = torch.cat([rows_of(s)[rows_of(s)[:, 1] == j] for j in mine for s in members])
    # where each expert-major row sits among the source-major ones: grouped = source_major[regroup]
    position = {tuple(row[:3].tolist()): i for i, row in enumerate(source_major)}
    regroup = torch.tensor([position[tuple(row[:3].tolist())] for row in arrived], dtype=torch.long)
    return received, send, recv, regroup, arrived


def _plans():
    results = {}
    for e in (4, 2):
        mesh = init_mesh({"d": 4, "e": e})
        exchange = parallel.plan_exchange(counts_of(mesh.rank), mesh.group("e"))
        results[e] = (exchange, [(c.op, c.axis, c.label) for c in mesh.log])
    return results


def _moves():
    """send_to_experts and return_from_experts on the test's own Exchange (so plan_exchange is not graded
    here); the way back starts from the rows the experts should have received, not from send_to_experts'."""
    results = {}
    for e in (4, 2):
        mesh = init_mesh({"d": 4, "e": e})
        group = mesh.group("e")
        received, send, recv, regroup, want = expected_exchange(mesh.rank, e)
        exchange = parallel.Exchange(send, recv, received, regroup)
        arrived = parallel.send_to_experts(rows_of(mesh.rank), exchange, group)
        processed = want.clone()
        processed[:, 3] = 100 * want[:, 1] + want[:, 2]   # each "expert" writes what it saw in the last column
        back = parallel.return_from_experts(processed, exchange, group)
        results[e] = (arrived, back, [(c.op, c.axis, c.label) for c in mesh.log])
    return results


def labels(rows):
    return rows[:, :3].long().tolist()


@pytest.mark.exercises("plan_exchange")
def test_the_plan_has_both_sides_split_sizes_and_a_stable_regroup():
    for rank, result in enumerate(run_ranks(_plans, 4, timeout=30)):
        for e, (exchange, log) in result.items():
            received, send, recv, regroup, _ = expected_exchange(rank, e)
            where = f"your plan_exchange, e={e}, rank {rank}"
            assert log == [("all_to_all", "e", "counts")], \
                f"{where}: collectives {log}, expected one all-to-all over e labelled 'counts'"
            assert torch.equal(torch.as_tensor(exchange.received), received), \
                f"{where}: counts received {exchange.received.tolist()}, expected {received.tolist()} (row s: member s's)"
            assert list(exchange.send_splits) == send, \
                f"{where}: send_splits {list(exchange.send_splits)}, expected {send} (rows for each member's experts)"
            assert list(exchange.recv_splits) == recv, \
                (f"{where}: recv_splits {list(exchange.recv_splits)}, expected {recv}; its own send sizes are "
                 f"{send} (whose counts say what arrives here?)")
            assert torch.equal(exchange.regroup, regroup), \
                (f"{where}: regroup differs {first_difference(exchange.regroup, regroup)}: grouped = "
                 f"arrived[regroup] puts each local expert's rows side by side, member 0's first, each member's "
                 f"in the order it sent them")


@pytest.mark.exercises("return_from_experts")
def test_each_expert_receives_its_rows_and_every_row_comes_home():
    for rank, result in enumerate(run_ranks(_moves, 4, timeout=30)):
        for e, (arrived, back, log) in result.items():
            _, _, _, _, want = expected_exchange(rank, e)
            where = f"e={e}, rank {rank}"
            assert torch.equal(arrived, want), \
                (f"send_to_experts (given), {where}: the rows its experts receive, as (source, expert, index) labels: "
                 f"got {labels(arrived)}, expected {labels(want)} (local-expert-major, then by source)")
            rows = rows_of(rank)
            home = rows.clone()
            home[:, 3] = 100 * rows[:, 1] + rows[:, 2]
            assert torch.equal(back, home), \
                (f"your return_from_experts, {where}: rows back from the experts do not match the rows sent "
                 f"(expert, index seen by the expert vs sent): {torch.stack([back[:, 3], home[:, 3]], 1).long().tolist()}")
            assert log == [("all_to_all", "e", "dispatch"), ("all_to_all", "e", "combine")], \
                f"{where}: collectives {log}: the rows out and back, both through group.collectives"
