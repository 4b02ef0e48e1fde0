"""Module 02: neighbours, the process-group setup, and the two operations behind the send/receive verbs.

A pipeline is a group of ranks (course/mesh.py's `Group`): every rank of the job by default, or
one axis of a bigger mesh, whose members are not consecutive ranks."""
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from course.impl import load
from course.launch import run_ranks
from course.mesh import group_of, init_mesh

m02 = load("m02_comms")


def pipeline(ranks, index):
    """PipelineComms for member `index` of a pipeline over the global `ranks` (no process group needed)."""
    return m02.PipelineComms(group_of("p", index, ranks))


def expected_neighbours(ranks, index):
    return (ranks[index - 1] if index > 0 else None, ranks[index + 1] if index < len(ranks) - 1 else None)


# Every rank of 1, 2 or 4 (the default group), and pipelines along one axis of a bigger mesh, whose
# members are not consecutive: the "d" groups of a d=2 x t=2 mesh, (0, 2) and (1, 3), and a pipeline
# over four ranks of eight in a shuffled order.
GROUPS = [(0,), (0, 1), (0, 1, 2, 3), (0, 2), (1, 3), (6, 1, 7, 4)]


@pytest.mark.exercises("PipelineComms.__init__")
@pytest.mark.parametrize("ranks", GROUPS, ids=[str(g) for g in GROUPS])
def test_neighbours(ranks):
    for index, rank in enumerate(ranks):
        comms = pipeline(ranks, index)
        want = expected_neighbours(ranks, index)
        assert (comms.prev, comms.next) == want, \
            (f"your PipelineComms.__init__: member {index} (rank {rank}) of the pipeline group of ranks {ranks} has "
             f"(prev, next) = ({comms.prev}, {comms.next}), expected the global ranks of the members before and "
             f"after it, {want}")


def _init_in_existing_group():
    # The launcher's group is gloo. Pretend this machine has a GPU for each local rank (nothing
    # here may touch CUDA: set_device is a recorder): the device must still follow the group's
    # backend, gloo, so the CPU, whatever backend this machine would have chosen for a new group.
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 2
    set_device = []
    torch.cuda.set_device = lambda device: set_device.append(str(device))
    rank, world_size, device = m02.init_distributed()
    assert isinstance(device, torch.device), f"init_distributed returned the device {device!r}, expected a torch.device"
    return rank, world_size, str(device), dist.get_rank(), dist.get_world_size(), set_device


def returned(rank, world_size) -> str:
    """'rank '0' (a str), world size '2' (a str)': repr and type, so a str that prints like an int shows."""
    return ", ".join(f"{what} {value!r}" + ("" if type(value) is int else f" (a {type(value).__name__})")
                     for what, value in (("rank", rank), ("world size", world_size)))


@pytest.mark.exercises("init_distributed")
def test_init_distributed_reports_rank_world_size_and_device():
    results = run_ranks(_init_in_existing_group, 2, timeout=20)
    for rank, (got_rank, got_world, device, group_rank, group_world, set_device) in enumerate(results):
        assert (got_rank, got_world) == (group_rank, group_world) == (rank, 2) and \
            type(got_rank) is int and type(got_world) is int, \
            (f"rank {rank} of 2: your init_distributed returned {returned(got_rank, got_world)}; expected rank {rank} "
             "and world size 2, both ints")
        assert device == "cpu" and set_device == [], \
            (f"rank {rank}: the existing group is gloo, so the device must be the CPU (and no CUDA device set), "
             f"got {device} (set_device calls {set_device}), on a machine with a GPU per rank: derive the device "
             "from the group's backend (dist.get_backend()), not from what this machine would choose")


def _init_from_environment(gpus, local_world_size):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="0", LOCAL_WORLD_SIZE=str(local_world_size))
    # Pretend to have `gpus` GPUs (forked ranks cannot really use CUDA): too few for one per rank
    # means gloo on CPU.
    torch.cuda.is_available = lambda: gpus > 0
    torch.cuda.device_count = lambda: gpus
    rank, world_size, device = m02.init_distributed()
    return rank, world_size, str(device), dist.get_backend()


@pytest.mark.exercises("init_distributed")
def test_init_distributed_creates_the_group_from_torchrun_variables():
    [(rank, world_size, device, backend)] = run_ranks(_init_from_environment, 1, 0, 1, timeout=20,
                                                      init_process_group=False)
    assert (rank, world_size, device, backend) == (0, 1, "cpu", "gloo") and type(rank) is int and type(world_size) is int, \
        (f"RANK=0, WORLD_SIZE=1, no GPU: your init_distributed returned {returned(rank, world_size)}, device {device}, "
         f"in a group of backend {backend!r}; expected rank 0 and world size 1 (ints), the CPU, gloo")


def _init_with_a_gpu_per_local_rank(backend=None, local=True, timeout_s=None, gpus=2, existing=None):
    # Rank 3 of 4, the second of 2 ranks on this machine, with 2 GPUs: one GPU per local rank, so
    # nccl, on this rank's local GPU cuda:1 (not cuda:3, its global rank). Nothing here may touch
    # CUDA (this is a forked rank, maybe on a machine without it): the GPUs are pretended, and the
    # group and set_device are recorders, so the choice is checked on any machine (a real nccl group
    # on a CPU build would only fail with "NCCL not built in"). With local=False, LOCAL_RANK and
    # LOCAL_WORLD_SIZE are missing, which means local rank 0 of 1. With existing="nccl", a group of that
    # backend exists before the call (created by someone else): init_distributed must only join it.
    os.environ.update(RANK="3", WORLD_SIZE="4", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2")
    if not local:
        del os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"]
    torch.cuda.is_available = lambda: gpus > 0
    torch.cuda.device_count = lambda: gpus
    group, set_device, created = {}, [], []
    if existing is not None:
        group.update(backend=existing, timeout=None, rank=3, world_size=4)

    def init_process_group(backend=None, init_method=None, timeout=None, world_size=-1, rank=-1, **kwargs):
        # torch's own signature and defaults, so positional and keyword calls are both recorded
        created.append(backend)
        group.update(backend=backend, timeout=timeout, rank=None if rank == -1 else rank,
                     world_size=None if world_size == -1 else world_size)

    def record_set_device(device):
        set_device.append(str(torch.device("cuda", device) if isinstance(device, int) else torch.device(device)))
    dist.init_process_group, torch.cuda.set_device = init_process_group, record_set_device
    # The recorded group answers the questions a real one would (None where init did not say).
    dist.is_initialized = lambda: bool(group)
    dist.get_backend = lambda *args, **kwargs: group["backend"]
    dist.get_rank = lambda *args, **kwargs: group["rank"] if group.get("rank") is not None else int(os.environ["RANK"])
    dist.get_world_size = lambda *args, **kwargs: (group["world_size"] if group.get("world_size") is not None
                                                   else int(os.environ["WORLD_SIZE"]))
    kwargs = {} if timeout_s is None else {"timeout_s": timeout_s}
    rank, world_size, device = m02.init_distributed(backend=backend, **kwargs)
    dist.is_initialized = lambda: False  # the recorded group is no real one: nothing for the launcher to destroy
    return rank, world_size, str(device), group.get("backend"), set_device, group.get("timeout"), created


@pytest.mark.exercises("init_distributed")
def test_init_distributed_picks_nccl_and_the_local_gpu_when_every_local_rank_has_one():
    [(rank, world_size, device, backend, set_device, _, _)] = run_ranks(
        _init_with_a_gpu_per_local_rank, 1, timeout=20, init_process_group=False)
    assert (rank, world_size) == (3, 4) and type(rank) is int and type(world_size) is int, \
        f"RANK=3, WORLD_SIZE=4 but your init_distributed returned {returned(rank, world_size)}"
    assert backend == "nccl", f"2 GPUs for 2 local ranks: the group must use nccl, got {backend!r}"
    assert device == "cuda:1" and set_device == ["cuda:1"], \
        (f"RANK=3, LOCAL_RANK=1 (the second rank on a machine with 2 GPUs): expected device cuda:1 and "
         f"set_device(cuda:1), got {device} and set_device calls {set_device}{global_numbering(device, 3)}")


@pytest.mark.exercises("init_distributed")
def test_init_distributed_picks_gloo_when_local_ranks_would_share_a_gpu():
    [(_, _, device, backend, set_device, _, _)] = run_ranks(
        _init_with_a_gpu_per_local_rank, 1, None, True, None, 1, timeout=20, init_process_group=False)
    assert (backend, device, set_device) == ("gloo", "cpu", []), \
        (f"1 GPU for LOCAL_WORLD_SIZE=2 ranks: expected gloo on the CPU and no CUDA device set, got {backend!r} on "
         f"{device} (set_device calls {set_device}): nccl needs a GPU of its own for every rank on the machine")


@pytest.mark.exercises("init_distributed")
def test_init_distributed_uses_the_backend_asked_for():
    # Module 07 keeps its tensors in CPU memory and asks for gloo, even where nccl would be chosen.
    [(_, _, device, backend, set_device, _, _)] = run_ranks(
        _init_with_a_gpu_per_local_rank, 1, "gloo", timeout=20, init_process_group=False)
    assert backend == "gloo" and device == "cpu" and set_device == [], \
        f"init_distributed(backend='gloo'): expected gloo on the CPU, got {backend!r} on {device} (set_device {set_device})"


@pytest.mark.exercises("init_distributed")
def test_init_distributed_without_local_variables_and_with_its_timeout():
    # LOCAL_RANK and LOCAL_WORLD_SIZE missing mean local rank 0 of 1: with 2 GPUs, nccl on cuda:0.
    # The timeout must reach the group, or a hung collective waits for torch's default (minutes).
    [(rank, world_size, device, backend, set_device, timeout, _)] = run_ranks(
        _init_with_a_gpu_per_local_rank, 1, None, False, 7.0, timeout=20, init_process_group=False)
    assert (backend, device, set_device) == ("nccl", "cuda:0", ["cuda:0"]), \
        (f"RANK=3 with LOCAL_RANK and LOCAL_WORLD_SIZE missing from the environment (which means local rank 0 of 1), "
         f"2 GPUs: expected nccl on cuda:0, got {backend!r} on {device} (set_device calls {set_device})"
         f"{global_numbering(device, 3)}")
    assert timeout == timedelta(seconds=7), \
        (f"init_distributed(timeout_s=7.0) created the group with timeout={timeout!r}, expected "
         "timedelta(seconds=7): pass the timeout on to dist.init_process_group")


@pytest.mark.exercises("init_distributed")
@pytest.mark.parametrize("asked", [None, "gloo"], ids=["no backend asked", "gloo asked"])
def test_init_distributed_follows_the_backend_of_a_group_that_already_exists(asked):
    # A launcher (or module 02 called twice) already created an nccl group: init_distributed joins it,
    # and its device follows that group's backend, not the argument it was given (None, or a module
    # such as 07 asking for gloo: the group it joins is still nccl, so its tensors live on the GPU).
    [(rank, world_size, device, backend, set_device, _, created)] = run_ranks(
        _init_with_a_gpu_per_local_rank, 1, asked, True, None, 2, "nccl", timeout=20, init_process_group=False)
    called = "init_distributed()" if asked is None else f"init_distributed(backend={asked!r})"
    assert created == [], \
        f"an nccl group already existed, but your {called} created another (backends {created})"
    assert device == "cuda:1" and set_device == ["cuda:1"], \
        (f"an nccl group already existed (LOCAL_RANK=1, 2 GPUs) and your {called} joined it: expected this rank's "
         f"GPU, cuda:1, made current (set_device(cuda:1)), got {device} (set_device calls {set_device}): which "
         "backend does the group this rank ends up in use?")


def global_numbering(device: str, rank: int) -> str:
    """What a device numbered by the global rank says, when it is one (GPUs are numbered per machine)."""
    return (f": cuda:{rank} is numbered by the global rank, RANK={rank}; a machine numbers its own GPUs from 0"
            if device == f"cuda:{rank}" else "")


class _RecordedWork:
    """The handle a recorded non-blocking call returns: it only notes whether it was waited for."""

    def __init__(self):
        self.waited = False

    def wait(self, *args, **kwargs):
        self.waited = True
        return True

    def is_completed(self):
        return self.waited


def _record_point_to_point(monkeypatch):
    """Replace torch.distributed's point-to-point calls with recorders (no process group needed):
    each call is recorded as (kind, peer, tensor, handle)."""
    calls = []

    def recorder(kind, non_blocking):
        def call(tensor, peer=None, *args, **kwargs):
            peer = kwargs.get("dst", kwargs.get("src", peer))
            handle = _RecordedWork() if non_blocking else None
            calls.append((kind, peer, tensor, handle))
            return handle
        return call
    for name, kind, non_blocking in [("send", "send", False), ("isend", "send", True),
                                     ("recv", "recv", False), ("irecv", "recv", True)]:
        monkeypatch.setattr(dist, name, recorder(kind, non_blocking))
    return calls


# Rank 1 of 3 has a neighbour on each side, so a direction that picks the wrong side is seen here.
# The comms' device is "meta" (tensors with a shape and dtype but no data), a stand-in for a GPU
# that these checks need no GPU for: a receive buffer left on the CPU shows as "cpu".
PEERS = {"forward": (2, 0), "backward": (0, 2)}  # direction -> (rank 1's peer of a send, of a receive)


def _middle_of_three(monkeypatch):
    calls = _record_point_to_point(monkeypatch)
    return calls, m02.PipelineComms(group_of("p", 1, (0, 1, 2)), device="meta", dtype=torch.float16)


@pytest.mark.exercises("PipelineComms.start_send")
@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_start_send_starts_one_send_of_contiguous_bytes_to_its_neighbour_and_returns_the_handle(direction, monkeypatch):
    calls, comms = _middle_of_three(monkeypatch)
    verb = f"isend_{direction}"
    result = comms.start_send(torch.empty(3, 2, dtype=torch.float16, device="meta").t(), direction, verb)
    peer = PEERS[direction][0]
    where = f"rank 1 of 3, your PipelineComms.start_send(tensor, {direction!r}, {verb!r})"
    assert [(k, p) for k, p, _, _ in calls] == [("send", peer)], \
        (f"{where}: expected one send to rank {peer} (the {'next' if peer == 2 else 'previous'} stage), got these "
         f"point-to-point calls (kind, peer): {[(k, p) for k, p, _, _ in calls]}")
    (_, _, sent, handle) = calls[0]
    assert sent.is_contiguous(), \
        f"{where} handed torch.distributed a non-contiguous tensor (a transposed view): its bytes are not its values in order"
    assert hasattr(result, "wait"), \
        (f"{where} returned {result!r}: it must return the handle of a send that goes on in the background, for the "
         "caller to wait on")
    assert handle is not None and not handle.waited, \
        (f"{where} {'blocked in its send' if handle is None else 'waited for its own send'}: it starts the send and "
         "returns at once; the caller waits later (a send that waits for its receiver can deadlock two neighbours "
         "that both send first)")
    result.wait()
    assert handle.waited, f"{where}: waiting on the handle it returned did not wait for the send it started"


@pytest.mark.given
@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_receive_fills_a_new_buffer_from_its_neighbour(direction, monkeypatch):
    calls, comms = _middle_of_three(monkeypatch)
    verb = f"recv_{direction}"
    got = [comms.receive((2, 3), None, direction, verb), comms.receive((4,), torch.float64, direction, verb)]
    peer = PEERS[direction][1]
    where = f"rank 1 of 3, your PipelineComms.receive(shape, dtype, {direction!r}, {verb!r})"
    assert [(k, p) for k, p, _, _ in calls] == [("recv", peer)] * 2, \
        (f"{where}, called twice: expected two receives from rank {peer} (the "
         f"{'next' if peer == 2 else 'previous'} stage), got these point-to-point calls (kind, peer): "
         f"{[(k, p) for k, p, _, _ in calls]}")
    for (_, _, buffer, _), returned, shape, dtype in zip(calls, got, [(2, 3), (4,)], [torch.float16, torch.float64]):
        described = (tuple(buffer.shape), buffer.dtype, buffer.device.type)
        assert described == (shape, dtype, "meta"), \
            (f"{where} with shape {shape} and dtype {None if dtype == torch.float16 else dtype} received into a "
             f"buffer of (shape, dtype, device) {described}, expected {(shape, dtype, 'meta')}: the shape asked for, "
             "the dtype asked for or else the comms' dtype (float16 here), on the comms' device")
        assert isinstance(returned, torch.Tensor) and (tuple(returned.shape), returned.dtype, returned.device) == \
            (shape, dtype, buffer.device), f"{where} must return the buffer it received into, got {returned!r}"


@pytest.mark.exercises("PipelineComms.start_send")
@pytest.mark.parametrize("rank, operation, direction, end", [
    (1, "start_send", "forward", "last"), (0, "start_send", "backward", "first"),
], ids=["start_send forward from the last", "start_send backward from the first"])
def test_talking_past_either_end_is_a_clear_error_before_any_message(rank, operation, direction, end, monkeypatch):
    # The error must come before any message (a receive from "None" would otherwise accept a message
    # from any rank): _peer (given) raises it.
    calls = _record_point_to_point(monkeypatch)
    comms = pipeline((0, 1), rank)
    verb = f"{'isend' if operation == 'start_send' else 'recv'}_{direction}"
    args = (torch.zeros(1), direction, verb) if operation == "start_send" else ((1,), None, direction, verb)
    try:
        getattr(comms, operation)(*args)
    except RuntimeError as error:
        assert f"rank {rank} is the {end} stage" in str(error), \
            f"your PipelineComms.{operation} on the {end} stage raised {error!r}, expected _peer's clear error"
    else:
        raise AssertionError(f"your PipelineComms.{operation}(..., {direction!r}, ...) on rank {rank}, the {end} stage "
                             f"of 2, raised nothing and made the calls {[(k, p) for k, p, _, _ in calls]}: there is no "
                             f"neighbour that way, so _peer's error (\"rank {rank} is the {end} stage\") is expected")
    assert not calls, f"your PipelineComms.{operation} made the calls {calls} before its error"


def neighbours_first(world_size):
    """The checks below relay through prev and next. Check them here first, in this process: a wrong
    neighbour then fails in a line, instead of a rank waiting for a message from a rank that does not
    exist (until the timeout), or gloo crashing on it."""
    wrong = []
    ranks = tuple(range(world_size))
    for rank in ranks:
        comms = pipeline(ranks, rank)
        expected = expected_neighbours(ranks, rank)
        if (comms.prev, comms.next) != expected:
            wrong.append(f"rank {rank}: (prev, next) = ({comms.prev}, {comms.next}), expected {expected}")
    assert not wrong, (f"{world_size} ranks, before any message: your PipelineComms.__init__ gives wrong neighbours, so "
                       f"this check could only hang or crash (test_neighbours says more): " + "; ".join(wrong))


def _relay(world_size):
    """Down the pipeline adding the rank, back up multiplying by 2; float64 to check the dtype."""
    comms = m02.PipelineComms()  # every rank of the job, in rank order
    shape = (3, 5)
    x = torch.arange(15, dtype=torch.float64).reshape(shape) if comms.prev is None \
        else comms.recv_forward(shape, torch.float64)
    seen = [(tuple(x.shape), x.dtype, x.device.type)]
    x = x + comms.rank
    if comms.next is not None:
        comms.send_forward(x)
        x = comms.recv_backward(shape, torch.float64)
        seen.append((tuple(x.shape), x.dtype, x.device.type))
    x = x * 2
    if comms.prev is not None:
        comms.send_backward(x)
    return x, seen


@pytest.mark.exercises("PipelineComms.start_send", "PipelineComms.__init__")
@pytest.mark.parametrize("world_size", [2, 4])
def test_forward_and_backward_relays_deliver_every_value(world_size):
    neighbours_first(world_size)
    results = run_ranks(_relay, world_size, world_size, timeout=20)
    start = torch.arange(15, dtype=torch.float64).reshape(3, 5)
    after_forward = start + sum(range(world_size))
    for rank, (value, seen) in enumerate(results):
        # rank r ends with the forward sum doubled once by each rank from the last down to r
        expected = after_forward * 2 ** (world_size - rank)
        assert torch.equal(value, expected), f"rank {rank}: expected {expected[0].tolist()}..., got {value[0].tolist()}..."
        assert all(s == ((3, 5), torch.float64, "cpu") for s in seen), f"rank {rank} receive buffers: {seen}"


def _relay_default_dtype(direction):
    comms = m02.PipelineComms(dtype=torch.float16)
    sender = 0 if direction == "forward" else 1
    if comms.rank == sender:
        getattr(comms, f"send_{direction}")(torch.full((2,), 1.5, dtype=torch.float16))
        return None
    return getattr(comms, f"recv_{direction}")((2,))


@pytest.mark.exercises("PipelineComms.start_send", "PipelineComms.__init__")
@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_receive_uses_the_comms_default_dtype(direction):
    neighbours_first(2)
    got = next(r for r in run_ranks(_relay_default_dtype, 2, direction, timeout=20) if r is not None)
    assert got.dtype == torch.float16 and got.tolist() == [1.5, 1.5], \
        f"recv_{direction} without a dtype: expected the comms' float16 buffer holding [1.5, 1.5], got {got.dtype} {got.tolist()}"


def _send_transposed(verb):
    """Rank `sender` sends a transposed (non-contiguous) view with `verb`; the other rank receives it."""
    comms = m02.PipelineComms(dtype=torch.float64)
    sent = torch.arange(12, dtype=torch.float64).reshape(3, 4).t()
    sender = 0 if verb.endswith("forward") else 1
    if comms.rank == sender:
        handle = getattr(comms, verb)(sent)
        if verb.startswith("isend"):
            handle.wait()
        return None
    return comms.recv_forward((4, 3)) if sender == 0 else comms.recv_backward((4, 3))


@pytest.mark.exercises("PipelineComms.start_send", "PipelineComms.__init__")
@pytest.mark.parametrize("verb", ["send_forward", "isend_forward", "send_backward", "isend_backward"])
def test_a_non_contiguous_tensor_arrives_with_its_values(verb):
    # A transposed view's bytes are not in its logical order; gloo refuses such a tensor, so every
    # sending verb, forward and backward, blocking or not, must hand over a contiguous copy.
    neighbours_first(2)
    got = next(r for r in run_ranks(_send_transposed, 2, verb, timeout=20) if r is not None)
    expected = torch.arange(12, dtype=torch.float64).reshape(3, 4).t()
    assert torch.equal(got, expected), f"{verb} of a transposed tensor delivered {got.tolist()}, expected {expected.tolist()}"


@pytest.mark.exercises("PipelineComms.__init__")
@pytest.mark.parametrize("verb", ["send_forward", "isend_forward", "send_backward", "isend_backward"])
def test_sending_none_is_a_clear_error(verb):
    # What a schedule sends when a gradient was never computed (a received activation that is not a
    # leaf requiring grad leaves .grad None): the error must say so, not fail inside torch.distributed.
    with pytest.raises(TypeError, match=f"{verb} got NoneType, not a tensor .a gradient that was never computed"):
        getattr(pipeline((0, 1), 0 if verb.endswith("forward") else 1), verb)(None)


def _exchange_both_ways():
    """Every rank sends forward and backward at once, without blocking, then receives both."""
    comms = m02.PipelineComms()
    mine = torch.full((4,), float(comms.rank))
    handles = []
    if comms.next is not None:
        handles.append(comms.isend_forward(mine))
    if comms.prev is not None:
        handles.append(comms.isend_backward(mine))
    from_prev = comms.recv_forward((4,)) if comms.prev is not None else None
    from_next = comms.recv_backward((4,)) if comms.next is not None else None
    for handle in handles:
        handle.wait()
    return [None if t is None else t.tolist() for t in (from_prev, from_next)]


@pytest.mark.exercises("PipelineComms.start_send", "PipelineComms.__init__")
def test_non_blocking_sends_in_both_directions():
    neighbours_first(3)
    results = run_ranks(_exchange_both_ways, 3, timeout=20)
    assert results == [[None, [1.0] * 4], [[0.0] * 4, [2.0] * 4], [[1.0] * 4, None]]


def _relay_along_one_axis():
    """Two pipelines at once, each along the d axis of a d=2 x t=2 mesh: ranks (0, 2) and (1, 3). A
    value goes down each pipeline (the last stage adds its rank) and comes back (the first doubles it)."""
    pp = init_mesh({"d": 2, "t": 2}).group("d")
    comms = m02.PipelineComms(pp, dtype=torch.float64)
    if comms.prev is None:
        comms.send_forward(torch.full((2, 3), float(comms.rank), dtype=torch.float64))
        handle = comms.isend_forward(torch.full((2, 3), 10.0 + comms.rank, dtype=torch.float64))
        back = comms.recv_backward((2, 3))
        handle.wait()
        return pp.ranks, (comms.prev, comms.next), back[0].tolist()
    first = comms.recv_forward((2, 3))
    second = comms.recv_forward((2, 3))
    comms.send_backward(first + second + comms.rank)
    return pp.ranks, (comms.prev, comms.next), (first[0] + second[0]).tolist()


@pytest.mark.exercises("PipelineComms.start_send", "PipelineComms.__init__")
def test_a_pipeline_along_one_axis_of_a_mesh_talks_to_its_own_members():
    # Checked first in this process, so that a wrong neighbour fails in a line instead of a hang.
    for ranks in ((0, 2), (1, 3)):
        for index in (0, 1):
            got, want = (pipeline(ranks, index).prev, pipeline(ranks, index).next), expected_neighbours(ranks, index)
            assert got == want, \
                (f"member {index} of the pipeline group of ranks {ranks}: (prev, next) = {got}, expected {want}: the "
                 "neighbours are the group's members before and after this one (pp.ranks), not rank - 1 and rank + 1")
    results = run_ranks(_relay_along_one_axis, 4, timeout=30)
    for rank, (members, neighbours, values) in enumerate(results):
        first, last = members
        assert neighbours == expected_neighbours(members, members.index(rank)), (rank, members, neighbours)
        if rank == first:  # its own activations, from its last stage, plus that stage's rank
            want = [2 * first + 10.0 + last] * 3
        else:  # what its own first stage sent: its rank, then 10 + its rank
            want = [2 * first + 10.0] * 3
        assert values == want, \
            (f"rank {rank} (pipeline {members}) holds {values}, expected {want}: each pipeline's messages must stay "
             "between its own two members")
