"""Module 16 expert parallelism: the exchange of rows between the members of an expert group, on 4
ranks with e = 4 and e = 2, every rank sending an uneven number of rows to each expert (none to
some, many to one): the split sizes of every pair of members agree (checked before any rows move);
each local expert receives exactly the rows sent to it, from member 0 first, each member's in the
order sent; the way back returns every row to the slot it came from; every all-to-all goes through
the group's collectives. Rows are labelled with where they come from, so the checks are exact."""
import pytest
import torch

from course.impl import load, reference
from course.launch import run_ranks
from course.mesh import init_mesh

parallel = load("m16_expert_parallel")
trusted = reference("m16_expert_parallel")   # check_exchange (given code)
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


def _exchanges():
    return {e: _exchange(e) for e in (4, 2)}


def _exchange(e):
    mesh = init_mesh({"d": 4, "e": e})
    group = mesh.group("e")
    rank = mesh.rank
    rows = rows_of(rank)
    exchange = parallel.plan_exchange(counts_of(rank), group)
    trusted.check_exchange(exchange, group)   # splits that disagree would abort gloo in the rows' all-to-all
    arrived = parallel.send_to_experts(rows, exchange, group)
    processed = arrived.clone()
    processed[:, 3] = 100 * arrived[:, 1] + arrived[:, 2]   # each "expert" writes what it saw in the last column
    back = parallel.return_from_experts(processed, exchange, group)
    log = [(c.op, c.axis, c.label) for c in mesh.log]
    return (group.ranks, exchange.send_splits, exchange.recv_splits, exchange.received, exchange.expert_counts,
            arrived, back, log)


@pytest.mark.exercises("plan_exchange", "send_to_experts", "return_from_experts")
def test_each_expert_receives_its_rows_and_every_row_comes_home():
    results = run_ranks(_exchanges, 4, timeout=30)
    for e in (4, 2):
        for rank, (members, send, recv, received, expert_counts, arrived, back, log) in enumerate(
                r[e] for r in results):
            per_rank = N_EXPERTS // e
            mine = range(members.index(rank) * per_rank, (members.index(rank) + 1) * per_rank)
            want_received = torch.stack([counts_of(s)[mine.start:mine.stop] for s in members])
            where = f"e={e}, rank {rank} (experts {mine.start}..{mine.stop - 1})"
            assert torch.equal(received, want_received), \
                f"{where}: counts received {received.tolist()}, expected {want_received.tolist()} (row s: member s's)"
            want_send = [int(counts_of(rank)[k * per_rank:(k + 1) * per_rank].sum()) for k in range(e)]
            want_recv = [int(c.sum()) for c in want_received]
            assert (send, recv) == (want_send, want_recv), \
                (f"{where}: split sizes (send, receive) = {(send, recv)}, expected {(want_send, want_recv)}: what a "
                 f"rank receives comes from the counts it received, not from its own")
            assert expert_counts.tolist() == want_received.sum(0).tolist()
            want = torch.cat([rows_of(s)[rows_of(s)[:, 1] == j] for j in mine for s in members])
            assert torch.equal(arrived, want), \
                (f"{where}: the rows its experts receive, as (source, expert, index) labels: got "
                 f"{arrived[:, :3].long().tolist()}, expected {want[:, :3].long().tolist()} (local-expert-major, "
                 f"then by source)")
            rows = rows_of(rank)
            home = rows.clone()
            home[:, 3] = 100 * rows[:, 1] + rows[:, 2]
            assert torch.equal(back, home), \
                (f"{where}: rows back from the experts do not match the rows sent (expert, index seen by the expert "
                 f"vs sent): {torch.stack([back[:, 3], home[:, 3]], 1).long().tolist()}: undo the regroup with its "
                 f"inverse, then send the rows home")
            assert log == [("all_to_all", "e", "counts"), ("all_to_all", "e", "dispatch"),
                           ("all_to_all", "e", "combine")], \
                f"{where}: collectives {log}: the counts, then the rows out and back, all through group.collectives"
