"""The two byte counters the benchmarks print: course/collectives.py's log of our collectives, and
course/reference_2d.py's TorchCollectiveLog of PyTorch's (FSDP2 calls c10d's ops, DTensor the
functional ones). Both must count a collective by the ring formulas, and agree on the same calls."""
import torch
import torch.distributed as dist

from course.collectives import Collectives
from course.launch import run_ranks
from course.reference_2d import TorchCollectiveLog


def _ours_and_torchs_counts():
    collectives = Collectives()
    counter = TorchCollectiveLog()
    rank = dist.get_rank()
    with counter:  # 16 floats: 64 bytes
        collectives.all_reduce(torch.full((16,), float(rank)))
        collectives.all_gather(torch.empty(32), torch.ones(16))
        collectives.reduce_scatter(torch.empty(16), torch.ones(32), async_op=True).wait()
    return [c.sent_bytes for c in collectives.log], [c.sent_bytes for c in counter.log], counter.unknown


def test_torchs_collectives_are_counted_as_ours_are():
    # Over 2 ranks the ring sends one shard of an all-gather or a reduce-scatter, and 2 (n-1)/n of
    # an all-reduce's tensor: 64 bytes each here.
    for ours, theirs, unknown in run_ranks(_ours_and_torchs_counts, 2, timeout=30):
        assert ours == theirs == [64, 64, 64] and not unknown, (ours, theirs, unknown)


def _dtensor_counts():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    mesh = init_device_mesh("cpu", (2,))
    local = torch.ones(4, 4)  # 64 bytes on each rank
    counter = TorchCollectiveLog()
    with counter:
        DTensor.from_local(local, mesh, [Partial()]).redistribute(mesh, [Replicate()]).to_local()  # all-reduce of 64 B
        DTensor.from_local(local, mesh, [Shard(0)]).redistribute(mesh, [Replicate()]).to_local()  # all-gather of 64 B shards
        DTensor.from_local(local, mesh, [Partial()]).redistribute(mesh, [Shard(0)]).to_local()  # reduce-scatter to 32 B
    return sorted((c.op, c.sent_bytes) for c in counter.log), counter.unknown


def test_dtensors_functional_collectives_are_counted_by_the_ring_formulas():
    for counted, unknown in run_ranks(_dtensor_counts, 2, timeout=30):
        assert counted == [("all_gather", 64), ("all_reduce", 64), ("reduce_scatter", 32)] and not unknown, \
            (counted, unknown)


def _cross_entropy_counts():
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import loss_parallel

    mesh = init_device_mesh("cpu", (2,))
    g = torch.Generator().manual_seed(dist.get_rank())
    logits = DTensor.from_local(torch.randn(6, 5, generator=g), mesh, [Shard(1)])  # 6 tokens, 5 of 10 classes here
    counter = TorchCollectiveLog()
    with counter, loss_parallel():
        F.cross_entropy(logits, torch.tensor([0, 9, 3, 5, 7, 2])).to_local()
    return [(c.op, c.payload_bytes) for c in counter.log], counter.unknown


def test_collectives_issued_inside_dtensors_ops_are_counted():
    # loss_parallel's cross-entropy runs inside DTensor's dispatch and all-reduces three statistics of
    # the 6 tokens (the max, the sum of exponentials, the target logits): 24 bytes each. A dispatch mode
    # that ran the op itself, with the mode off, would count none of them.
    for counted, unknown in run_ranks(_cross_entropy_counts, 2, timeout=30):
        assert counted == [("all_reduce", 24)] * 3 and not unknown, (counted, unknown)


def _group_of_one():
    counter, collectives = TorchCollectiveLog(), Collectives()
    x = torch.arange(12.0).reshape(2, 6)
    gathered, scattered, reduced = torch.empty(2, 6), torch.empty(2, 6), x.clone()
    with counter:
        collectives.all_gather(gathered, x, dim=1)
        collectives.reduce_scatter(scattered, x, async_op=True, dim=1).wait()
        collectives.all_reduce(reduced, async_op=True).wait()
    return (torch.equal(gathered, x), torch.equal(scattered, x), torch.equal(reduced, x),
            [c.sent_bytes for c in collectives.log], len(counter.log))


def test_over_a_group_of_one_the_result_is_the_ranks_own_and_nothing_is_issued():
    # Each call is logged (sending 0 bytes), so the counts of the modules' tests hold on any mesh,
    # but none reaches torch.distributed.
    assert run_ranks(_group_of_one, 1, timeout=30) == [(True, True, True, [0, 0, 0], 0)]


def _mismatched_blocks():
    # On 2 ranks: an output that is not the group's blocks side by side, and a reduce-scatter cut along the wrong
    # dimension (a learner run: gloo aborted the rank with "Check failed: outputShape[0] * worldSize == ...").
    group = dist.new_group([0, 1])
    collectives = Collectives(group, "t", (0, 1))
    errors = []
    for call in (lambda: collectives.all_gather(torch.empty(3, 4), torch.ones(2, 2), label="M/t -> M", dim=1),
                 lambda: collectives.reduce_scatter(torch.empty(2, 4), torch.ones(2, 4), label="M {U_t} -> M/t", dim=0)):
        try:
            call()
        except ValueError as error:
            errors.append(str(error))
    return errors, collectives.log


def test_blocks_that_do_not_fit_are_refused_in_one_line_before_anything_is_sent():
    errors, log = run_ranks(_mismatched_blocks, 2, timeout=30)[0]
    assert errors == [
        "all_gather 'M/t -> M' over 2 ranks along dim 1: its output is (3, 4), but 2 blocks of (2, 2) side by side "
        "along dim 1 are (2, 4)",
        "reduce_scatter 'M {U_t} -> M/t' over 2 ranks along dim 0: its input is (2, 4), but 2 blocks of (2, 4) side "
        "by side along dim 0 are (4, 4)"], errors
    assert log == [], log
