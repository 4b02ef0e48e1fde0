"""Module 12 linears: a column-then-row pair on t ranks against autograd on the whole weights, the
order of the column-parallel backward (input-gradient collective in flight behind the weight-gradient
GEMMs), and the fused main_grad accumulation against float64.

Tolerance. In float64 the only difference from one process is the order in which the ranks'
partial products are summed (torch 2.13 CPU: differences of a few units of 1e-16); we allow
1e-12 relative (and 1e-13 absolute, for entries near zero; the tensors' entries are of order 1). A
misplaced collective is off by a factor (t, or 1/t) or by a whole term.
"""
import dataclasses
import sys
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from course.collectives import Collectives
from course.compare import assert_all_close
from course.gpu_check import needs_gpu, run_cuda_check
from course.impl import load
from course.launch import run_ranks
from course.mesh import world_group

linear = load("m12_tp_linear")
f64 = torch.float64
B, T, DIM, F = 2, 8, 16, 24  # F: the hidden width both weights of the pair split


def pair_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    x, dy = torch.randn(B, T, DIM, dtype=f64, generator=g), torch.randn(B, T, DIM, dtype=f64, generator=g)
    gate, up = torch.randn(F, DIM, dtype=f64, generator=g) / 4, torch.randn(F, DIM, dtype=f64, generator=g) / 4
    down = torch.randn(DIM, F, dtype=f64, generator=g) / 5
    return x, dy, gate, up, down


def _checked_accumulation(accumulate):
    """accumulate_weight_grad (given, checked on its own below), after checking what its caller hands it:
    a shape error inside it is the caller's, and says so."""
    def checked(main_grad, dy, x, fused=True):
        caller = sys._getframe(1).f_code.co_name
        assert dy.shape[:-1] == x.shape[:-1] and tuple(main_grad.shape) == (dy.shape[-1], x.shape[-1]), \
            (f"your {caller} hands accumulate_weight_grad dy {tuple(dy.shape)} and x {tuple(x.shape)} for main_grad "
             f"{tuple(main_grad.shape)}: the weight gradient needs dy and x at the same tokens, every position of the "
             "sequence, and main_grad is (dy's features, x's features)")
        return accumulate(main_grad, dy, x, fused)
    return checked


def _pair_on_ranks(sequence_parallel, inputs):
    """z1, z2 = x gate^T, x up^T (column-parallel, one input); y = (z1 * z2) down^T (row-parallel). Also
    each operator alone: f and g on x and dy, and the sums (g's forward, f's backward) of partials
    (rank + 1) x."""
    with mock.patch.object(linear, "accumulate_weight_grad", _checked_accumulation(linear.accumulate_weight_grad)):
        return _pair(sequence_parallel, inputs)


def _pair(sequence_parallel, inputs):
    x, dy, gate, up, down = inputs
    tp, sp = world_group("t"), sequence_parallel
    rank, t = tp.index, tp.size
    mine = (lambda a: a.chunk(t, dim=1)[rank]) if sp else (lambda a: a)
    gate_r, up_r, down_r = gate.chunk(t)[rank], up.chunk(t)[rank], down.chunk(t, dim=1)[rank].contiguous()
    log = tp.collectives.log
    start = len(log)
    operators = {"f forward": linear.enter_tp_forward(mine(x).clone(), tp, sp, "f").wait()}  # each on tensors of its
    f_calls = len(log) - start                                                              # own: a sum may be in place
    operators.update({"g forward": linear.leave_tp_forward(x * (rank + 1), tp, sp, "g"),
                      "g backward": linear.leave_tp_backward(mine(dy).clone(), tp, sp, "g"),
                      "f backward": linear.enter_tp_backward(x * (rank + 1), tp, sp, "f").wait()})
    before = len(log)
    z1, z2 = linear.column_parallel_forward(mine(x), [gate_r, up_r], tp, sp, "in")
    fetches = (len(log) - before, f_calls)  # the column-parallel forward's collectives, and one f's forward's
    features = (B, T, F // t)  # this rank's output features, at every position of the sequence
    assert z1.shape == z2.shape == features, \
        (f"your column_parallel_forward returns {tuple(z1.shape)} and {tuple(z2.shape)} from x {tuple(mine(x).shape)}, "
         f"expected {features}: this rank's features at every position of the sequence")
    y = linear.row_parallel_forward(z1 * z2, down_r, tp, sp, "out")
    grads = [torch.zeros_like(w) for w in (gate_r, up_r, down_r)]
    ds = linear.row_parallel_backward(mine(dy), z1 * z2, down_r, grads[2], tp, sp, "out")
    assert ds.shape == features, \
        (f"your row_parallel_backward returns dx {tuple(ds.shape)} from dy {tuple(mine(dy).shape)}, expected "
         f"{features}: the gradient of this rank's input features, at every position")
    dx = linear.column_parallel_backward([ds * z2, ds * z1], mine(x), [gate_r, up_r], grads[:2], tp, sp, "in")
    return y, dx, grads, operators, (z1, z2, ds), fetches


# Each piece of the pair, in the order computed, and the TODO that computes it (given the pieces before it).
PIECES = {
    "f forward": "your enter_tp_forward (f(x): the whole x on every rank)",
    "g forward": "your enter_tp_backward, which the given leave_tp_forward runs (g of the partials: their sum, "
                 "in the stream's layout)",
    "g backward": "your enter_tp_forward, which the given leave_tp_backward runs (g's backward of dy: the whole "
                  "dy on every rank)",
    "f backward": "your enter_tp_backward (f's backward of the partials: their sum, in the stream's layout)",
    "z1": "your column_parallel_forward (this rank's output features, every position)",
    "z2": "your column_parallel_forward (this rank's output features, every position)",
    "y": "your enter_tp_backward, which the given leave_tp_forward runs (g of row_parallel_forward's partial "
         "product: their sum, in the stream's layout)",
    "ds": "your row_parallel_backward's dx (the whole dy times this rank's columns of the weight)",
    "d down": "your row_parallel_backward's weight gradient (the whole dy, ^T this rank's input)",
    "d gate": "your column_parallel_backward's weight gradients (dy^T the whole x)",
    "d up": "your column_parallel_backward's weight gradients (dy^T the whole x)",
    "dx": "your column_parallel_backward's input gradient (summed over the ranks by f's backward)",
}


@pytest.mark.exercises("enter_tp_forward", "enter_tp_backward", "column_parallel_forward", "row_parallel_backward",
                        "column_parallel_backward")
@pytest.mark.parametrize("world_size, sequence_parallel", [(2, False), (4, False), (2, True), (4, True)])
def test_a_column_then_row_pair_equals_the_whole_linears(world_size, sequence_parallel):
    inputs = pair_inputs()
    x, dy, gate, up, down = (t.clone() for t in inputs)
    leaves = [t.requires_grad_(True) for t in (x, gate, up, down)]
    z1, z2 = x @ gate.t(), x @ up.t()
    expected = (z1 * z2) @ down.t()
    expected.backward(dy)
    results = run_ranks(_pair_on_ranks, world_size, sequence_parallel, inputs, timeout=30)
    stream = (lambda parts: torch.cat(parts, dim=1)) if sequence_parallel else (lambda parts: parts[0])
    features = lambda parts: torch.cat(parts, dim=-1)  # noqa: E731 - each rank's output features, joined
    y, dx = stream([r[0] for r in results]), stream([r[1] for r in results])
    d_gate, d_up = (torch.cat([r[2][i] for r in results]) for i in (0, 1))
    d_down = torch.cat([r[2][2] for r in results], dim=1)
    every_rank = lambda parts: torch.stack(parts)  # noqa: E731 - f's forward and g's backward: whole on every rank
    operators = {name: (every_rank if name in ("f forward", "g backward") else stream)([r[3][name] for r in results])
                 for name in results[0][3]}
    got_z1, got_z2, ds = (features([r[4][i] for r in results]) for i in range(3))
    partials = x.detach() * sum(range(1, world_size + 1))  # the sum of the ranks' (rank + 1) x
    layout = "each rank's sequence shard, joined" if sequence_parallel else "rank 0's"
    whole = lambda a: a.detach().expand(world_size, *a.shape)  # noqa: E731 - on every rank
    pieces = [("f forward", operators["f forward"], whole(x)), ("g forward", operators["g forward"], partials),
              ("g backward", operators["g backward"], whole(dy)), ("f backward", operators["f backward"], partials),
              ("z1", got_z1, z1.detach()), ("z2", got_z2, z2.detach()), ("y", y, expected.detach()),
              ("ds", ds, dy @ down.detach()), ("d down", d_down, leaves[3].grad), ("d gate", d_gate, leaves[1].grad),
              ("d up", d_up, leaves[2].grad), ("dx", dx, leaves[0].grad)]
    wrong = []
    for name, got, want in pieces:
        try:
            assert_all_close([(name, got, want)], rtol=1e-12, atol=1e-13)
        except AssertionError as mismatch:
            wrong.append(str(mismatch).split(": ", 1)[1])
    names = [w.split(" (")[0] for w in wrong]
    # The given g's forward runs f's backward and g's backward f's forward: when both of a pair are wrong, name
    # f's operator's own piece.
    first = ("f backward" if {"g forward", "f backward"} <= set(names) else
             "f forward" if {"f forward", "g backward"} <= set(names) else names[0]) if wrong else None
    assert not wrong, (f"t={world_size}, sequence parallel {sequence_parallel} (y, dx, g's forward, f's backward: {layout}; "
                       f"z, ds: each rank's features, joined): {len(wrong)} of {len(pieces)} pieces differ, in the order "
                       f"computed: {', '.join(names)}. {wrong[names.index(first)]} is computed by {PIECES[first]}"
                       + (" (and the given g's, which runs it)" if first != names[0] else ""))
    fetched, once = results[0][5]
    assert fetched == once, \
        (f"t={world_size}, sequence parallel {sequence_parallel}: your column_parallel_forward issued {fetched} "
         f"collectives for its 2 weights, where one f's forward issues {once}: the weights that read the same x "
         "share one fetch of it")
    if not sequence_parallel:  # replicated: every rank must hold the same whole tensors
        for rank, (y_r, dx_r, *_) in enumerate(results):
            assert torch.equal(y_r, results[0][0]) and torch.equal(dx_r, results[0][1]), \
                f"rank {rank}'s y or dx differs from rank 0's: without sequence parallelism both are replicated"


# --- the order of the column-parallel backward -------------------------------------------------

class RecordingCollectives(Collectives):
    """Collectives that also write each call, and each wait on an async one, into `events`."""

    def __init__(self, events):
        super().__init__()
        self.events = events

    def _recorded(self, op, label, async_op, work):
        self.events.append(("start" if async_op else "blocking", op, label))
        return WaitRecorded(work, self.events, op, label) if async_op else work

    def all_gather(self, output, shard, label="", async_op=False, dim=0):
        return self._recorded("all_gather", label, async_op, super().all_gather(output, shard, label, async_op, dim))

    def reduce_scatter(self, shard, full, label="", async_op=False, dim=0):
        return self._recorded("reduce_scatter", label, async_op, super().reduce_scatter(shard, full, label, async_op, dim))

    def all_reduce(self, tensor, label="", async_op=False, op="sum"):
        return self._recorded("all_reduce", label, async_op, super().all_reduce(tensor, label, async_op, op))


class WaitRecorded:
    def __init__(self, work, events, op, label):
        self.work, self.events, self.op, self.label, self.waited = work, events, op, label, False

    def wait(self):
        if not self.waited:
            self.events.append(("wait", self.op, self.label))
            self.waited = True
        return self.work.wait()


MATMULS = {"matmul", "__matmul__", "__rmatmul__", "mm", "addmm", "addmm_", "bmm", "baddbmm", "einsum", "linear",
           "tensordot", "inner", "mv", "dot"}


class RecordingMatmuls(TorchFunctionMode):
    """Writes ("gemm", result shape) into `events` for every matrix product, however it is spelled."""

    def __init__(self, events):
        super().__init__()
        self.events = events

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if getattr(func, "__name__", "") in MATMULS and isinstance(result, torch.Tensor):
            self.events.append(("gemm", tuple(result.shape)))
        return result


def _record_column_backward(sequence_parallel):
    rank, t = dist.get_rank(), dist.get_world_size()
    events = []
    tp = dataclasses.replace(world_group("t"), collectives=RecordingCollectives(events))
    x, dy, gate, up, _ = pair_inputs()
    x_mine = x.chunk(t, dim=1)[rank] if sequence_parallel else x
    weights = [gate.chunk(t)[rank], up.chunk(t)[rank]]
    dys = [torch.randn(B, T, F // t, dtype=f64) for _ in weights]
    grads = [torch.zeros_like(w) for w in weights]
    with RecordingMatmuls(events):
        linear.column_parallel_backward(dys, x_mine, weights, grads, tp, sequence_parallel, "in")
    return events


def _position(events, kind, op, what):
    """Where the first (kind, op) event is (labels are not checked)."""
    found = [i for i, e in enumerate(events) if e[:2] == (kind, op)]
    assert found, f"{what}: no {kind} of an {op} in the recorded calls {events}"
    return found[0]


@pytest.mark.exercises(
    "column_parallel_backward", "enter_tp_backward", "enter_tp_forward")
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["replicated", "sequence-parallel"])
def test_the_input_gradient_collective_is_in_flight_during_the_weight_gradient_gemms(sequence_parallel):
    events = run_ranks(_record_column_backward, 2, sequence_parallel, timeout=30)[0]
    t = 2
    op = "reduce_scatter" if sequence_parallel else "all_reduce"
    started = [i for i, e in enumerate(events) if e[0] in ("start", "blocking") and e[1] in ("all_reduce", "reduce_scatter")]
    assert len(started) <= 1, \
        (f"{len(started)} sums over the group in one column-parallel backward, where only dx is summed: "
         + ("x needs no sum: your enter_tp_forward gathers it" if sequence_parallel else
            "without sequence parallelism x is whole already, and your enter_tp_forward sends nothing")
         + f"; recorded order: {events}")
    assert not any(e[:2] == ("blocking", op) for e in events), \
        (f"the input gradient's {op} was blocking: your column_parallel_backward starts it with async_op=True and "
         f"waits after the weight-gradient GEMMs")
    start, wait = (_position(events, kind, op, "dx's collective") for kind in ("start", "wait"))
    weight_gemms = [i for i, e in enumerate(events) if e == ("gemm", (F // t, DIM))]
    assert len(weight_gemms) == 2, f"expected 2 weight-gradient GEMMs with a ({F // t}, {DIM}) result, got {events}"
    assert all(start < i < wait for i in weight_gemms), \
        (f"your column_parallel_backward: the weight-gradient GEMMs must run while dx's {op} is in flight (after its "
         f"start, before its wait); recorded order: {events}")
    input_gemms = [i for i, e in enumerate(events) if e[0] == "gemm" and e[1][-1] == DIM and i not in weight_gemms]
    assert input_gemms and max(input_gemms) < start, \
        (f"your column_parallel_backward: dx's {op} must start after the input-gradient GEMMs that compute dx; "
         f"recorded order: {events}")
    if sequence_parallel:  # the forward kept x's shard: gather it again, in flight behind dx's GEMMs
        gather, gathered = (_position(events, kind, "all_gather", "x's all-gather") for kind in ("start", "wait"))
        assert gather < min(input_gemms) and max(input_gemms) < gathered < min(weight_gemms), \
            ("your column_parallel_backward, with sequence parallelism: x's all-gather must be in flight during the "
             f"input-gradient GEMMs, which do not need it, and waited for before the weight-gradient GEMMs, which "
             f"do; recorded order: {events}")


# --- weight gradients accumulated in float32 inside the GEMM ------------------------------------

def microbatches(n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(64, 24, generator=g).to(dtype), torch.randn(64, 40, generator=g).to(dtype)) for _ in range(n)]


@pytest.mark.given  # accumulate_weight_grad is given code
def test_fused_accumulation_sums_bf16_microbatches_in_float32():
    # 32 microbatches of bf16 (dy, x). The exact sum of their dy^T x, in float64, is the reference.
    # Summed in float32 inside the GEMM, the result differs from it by float32 roundings: measured
    # 1.2e-7 relative (norm, torch 2.13 CPU). Rounding each microbatch's gradient to bf16 (8 bits)
    # costs ~2^-9 each: measured 1.7e-3 for the bf16-partials path. We allow 1e-6.
    pairs = microbatches(32, torch.bfloat16)
    exact = sum(dy.double().t() @ x.double() for dy, x in pairs)
    main_grad = torch.zeros(24, 40)
    storage = main_grad.untyped_storage().data_ptr()
    for dy, x in pairs:
        linear.accumulate_weight_grad(main_grad, dy, x)
    assert main_grad.dtype == torch.float32 and main_grad.untyped_storage().data_ptr() == storage, \
        "main_grad must be updated in place, and stay float32"
    error = ((main_grad.double() - exact).norm() / exact.norm()).item()
    assert error < 1e-6, (f"relative error {error:.2e} against float64 after 32 bf16 microbatches, allowed 1e-6: "
                          f"is each microbatch's gradient rounded to bf16 before it is added (a bf16 GEMM output)?")


@pytest.mark.given  # accumulate_weight_grad is given code
def test_fused_accumulation_is_exact_in_float64_and_reads_token_axes():
    # (B, T, features) inputs: the tokens of every leading axis are summed over.
    g = torch.Generator().manual_seed(1)
    dy, x = torch.randn(3, 5, 6, dtype=f64, generator=g), torch.randn(3, 5, 4, dtype=f64, generator=g)
    main_grad = torch.ones(6, 4, dtype=f64)
    linear.accumulate_weight_grad(main_grad, dy, x)
    expected = 1 + torch.einsum("bto,bti->oi", dy, x)
    torch.testing.assert_close(main_grad, expected, rtol=1e-12, atol=1e-12,
                               msg=lambda m: f"accumulate_weight_grad: main_grad must grow by dy^T x summed over "
                                             f"every token: {m}")
    unfused = torch.ones(6, 4, dtype=f64)
    linear.accumulate_weight_grad(unfused, dy, x, fused=False)
    torch.testing.assert_close(unfused, expected, rtol=1e-12, atol=1e-12,
                               msg=lambda m: f"accumulate_weight_grad with fused=False: main_grad must grow by "
                                             f"the same dy^T x: {m}")


@pytest.mark.given  # accumulate_weight_grad is given code
def test_the_unfused_path_rounds_the_gradient_to_the_inputs_dtype_first():
    # fused=False is the path the fused GEMM replaces, kept to compare (bench 12): the product in the inputs'
    # dtype (torch's bf16 GEMM), then added into the float32 main_grad.
    [(dy, x)] = microbatches(1, torch.bfloat16, seed=2)
    main_grad = torch.ones(24, 40)
    linear.accumulate_weight_grad(main_grad, dy, x, fused=False)
    expected = 1 + (dy.t() @ x).float()
    assert main_grad.dtype == torch.float32 and torch.equal(main_grad, expected), \
        ("accumulate_weight_grad with fused=False must add torch's bf16 product dy^T x into the float32 main_grad "
         f"(the path the fused GEMM replaces); it is off by up to {(main_grad - expected).abs().max().item():.2e}")


@pytest.mark.given
@needs_gpu
def test_the_given_gemm_accumulates_bf16_into_float32_on_cuda():
    run_cuda_check(__file__, "cuda_accumulation_check")


def cuda_accumulation_check():
    """On CUDA, addmm_into multiplies bf16 operands into a float32 accumulator in place (out_dtype
    where torch has it); the same bound as on CPU against float64."""
    pairs = [(dy.cuda(), x.cuda()) for dy, x in microbatches(32, torch.bfloat16)]
    exact = sum(dy.double().t() @ x.double() for dy, x in pairs)
    main_grad = torch.zeros(24, 40, device="cuda")
    storage = main_grad.untyped_storage().data_ptr()
    for dy, x in pairs:
        linear.addmm_into(main_grad, dy.t(), x)
    error = ((main_grad.double() - exact).norm() / exact.norm()).item()
    assert main_grad.untyped_storage().data_ptr() == storage and error < 1e-6, f"relative error {error:.2e}"
