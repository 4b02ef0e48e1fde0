"""Module 08: weights streamed from host memory on a side stream.

On CPU the weight source runs against course/streams.py's recorder: copies happen at once (so the
numbers are real) and every stream operation is recorded in an event graph. The rules checked:
no compute reads a buffer before the copy into it has finished, no copy overwrites a buffer before
the compute reading it has finished, and no host write to the weights before the copies reading
them have finished (`find_hazards`). The reference is module 06's all-resident model.

On a GPU (skipped without one; run in a child process, because the pytest process must never touch
CUDA) copies are slowed down and poison the buffer with NaN first, so a missing wait shows up as a
wrong or NaN result.
"""
import argparse
import re

import pytest
import torch

from course.gpu_check import needs_gpu, run_cuda_check
from course.impl import load, reference
from course.streams import FakeRuntime, address, find_hazards, record_compute, schedule

m08 = load("m08_host_weights")
m06 = reference("m06_llama_model")
LlamaConfig = reference("m06_llama_block").LlamaConfig
CFG = LlamaConfig(dim=32, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=48, n_layers=4, max_seq_len=16)


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, CFG.vocab_size, (2, CFG.max_seq_len), generator=g), \
        torch.randint(0, CFG.vocab_size, (2, CFG.max_seq_len), generator=g)


class AllocatingRuntime(FakeRuntime):
    """The recorder, also remembering the device memory it handed out (rt.empty)."""

    def __init__(self):
        super().__init__()
        self.device_memory = set()

    def empty(self, n, dtype):
        buffer = super().empty(n, dtype)
        self.device_memory.add(address(buffer))
        return buffer


def streamed_model(source_class=None, dtype=torch.float32):
    """Module 06's model with its blocks moved into a HostWeights on a recording runtime."""
    model, runtime = m06.LlamaModel(CFG, 0, dtype), AllocatingRuntime()
    source = (source_class or m08.HostWeights)(model.blocks, runtime)
    model.weights, model.blocks = source, []
    return record_compute(model, runtime), runtime


def run_steps(model, runtime, steps=2):
    """forward_backward, then what an optimizer step does: invalidate, and the host writes the weights."""
    for step in range(steps):
        model.forward_backward(*batch(step))
        model.weights.invalidate()
        runtime.host_writes(model.weights.host, "optimizer step")


def describe(hazards):
    a, b = hazards[0]
    found = (f"{len(hazards)} hazards; first: '{a.label}' on {a.stream} (op {a.index}) and '{b.label}' on "
             f"{b.stream} (op {b.index}) touch the same memory in no fixed order")
    if a.label.startswith("block") and b.label == "copy":
        why = ("a copy may overwrite a buffer that compute still reads: your HostWeights.gather must order the copy "
               "after the buffer's released event, which release() records after the compute")
    elif a.label == "copy" and b.label.startswith("block"):
        why = ("compute may read a buffer before the copy into it has finished: your HostWeights.get must order the "
               "compute stream after the buffer's ready event, which gather() records after the copy")
    elif a.label == "copy":
        why = ("the host may write weights that a copy is still reading: your HostWeights.invalidate must wait for "
               "the copies before the optimizer writes")
    else:
        why = "two operations on the same memory need an event between them"
    return f"{found}: {why}"


# --- each method on its own first: the recorder's event graph after a few calls -------------------------------

def fresh_source(dtype=torch.float32):
    runtime = AllocatingRuntime()
    return m08.HostWeights(m06.LlamaModel(CFG, 0, dtype).blocks, runtime), runtime


def ordered(before, after) -> bool:
    """Whether the event graph makes node `after` wait for node `before` (directly or not)."""
    return bool((after.before >> before.index) & 1)


@pytest.mark.exercises("HostWeights.__init__")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_init_pins_every_block_and_makes_a_side_stream_and_two_buffers(dtype):
    model = m06.LlamaModel(CFG, 0, dtype)
    runtime = AllocatingRuntime()
    source = m08.HostWeights(model.blocks, runtime)
    layout = source.layout
    assert len(source.host) == CFG.n_layers and all(address(h) in runtime.pinned for h in source.host), \
        ("your HostWeights.__init__: self.host must hold every block in memory a copy can read without the host "
         "waiting for it (the chapter's 'Streams and events': which host memory is that?)")
    for layer, (host, block) in enumerate(zip(source.host, model.blocks)):
        assert torch.equal(host, layout.flatten(block)), \
            f"your HostWeights.__init__: self.host[{layer}] is not block {layer} flattened by self.layout"
    assert source.copy_stream is not runtime.compute and getattr(source.copy_stream, "name", "").startswith("side"), \
        "your HostWeights.__init__: self.copy_stream must be a stream of its own, not the compute stream"
    buffers = source.buffers
    assert len(buffers) == 2, f"your HostWeights.__init__ made {len(buffers)} device buffers, expected 2"
    for i, buf in enumerate(buffers):
        assert address(buf.flat) in runtime.device_memory and buf.flat.numel() == layout.padded_numel, \
            (f"your HostWeights.__init__: buffer {i} must be device memory from the runtime (runtime.empty) with room "
             f"for one padded block ({layout.padded_numel} values), got {buf.flat.numel()}")
        assert buf.flat.dtype == dtype, \
            (f"your HostWeights.__init__: a {dtype} model got a buffer of {buf.flat.dtype}: allocate it in the "
             f"blocks' dtype (the copy would convert every weight)")
    events = [buf.ready for buf in buffers] + [buf.released for buf in buffers]
    assert len({id(e) for e in events}) == 4, \
        ("your HostWeights.__init__: the two buffers need four distinct events (a ready and a released each); with "
         "an event shared, a copy into one buffer waits for work on the other")


@pytest.mark.exercises("HostWeights.gather")
def test_gather_queues_the_copy_on_the_side_stream_and_marks_it_ready():
    source, runtime = fresh_source()
    source.gather(0)
    copies = [n for n in runtime.nodes if n.label == "copy"]
    assert len(copies) == 1, f"your HostWeights.gather: gather(0) queued {len(copies)} copies, expected 1"
    copy = copies[0]
    assert copy.stream == source.copy_stream.name, \
        (f"your HostWeights.gather: the copy ran on the {copy.stream} stream, not the copy stream: which stream does "
         f"a copy's work go to when it is queued?")
    ready = source.buffers[0].ready.node
    assert ready is not None and ready.stream == copy.stream and ordered(copy, ready), \
        ("your HostWeights.gather: buf.ready must be recorded on the copy stream after the copy, so that it completes "
         "only once the copy has")
    assert not runtime.host.waits, "your HostWeights.gather made the host wait: it must only queue work"


def compute_with(source, runtime, layer):
    """get(layer), a compute node reading the block, release(layer), as the model loop does; the compute node."""
    w = source.get(layer)
    runtime.compute_reads(w.wq, f"block {layer}")
    node = runtime.nodes[-1]
    source.release(layer)
    return node


@pytest.mark.exercises("HostWeights.get")
def test_get_orders_compute_after_the_copy_and_hands_out_views_of_the_buffer():
    source, runtime = fresh_source()
    source.gather(0)
    copy = next(n for n in runtime.nodes if n.label == "copy")
    w = source.get(0)
    runtime.compute_reads(w.wq, "block 0")
    assert not runtime.host.waits, \
        "your HostWeights.get made the host wait for the copy: the compute stream waits, the host only queues work"
    assert ordered(copy, runtime.nodes[-1]), \
        ("your HostWeights.get: the compute after get(0) is not ordered after the copy into the buffer, so it may "
         "read the buffer before the copy has written it")
    buf = source.buffers[0]
    assert buf.state == m08.IN_USE, f"your HostWeights.get left the buffer {buf.state!r}, expected IN_USE"
    assert address(w.wq) == address(buf.flat), "your HostWeights.get must return views into buf.flat (the layout's views)"


@pytest.mark.exercises("HostWeights.release")
def test_release_records_released_after_the_compute_that_read_the_buffer():
    source, runtime = fresh_source()
    source.gather(0)
    compute = compute_with(source, runtime, 0)
    buf = source.buffers[0]
    released = buf.released.node
    assert released is not None and released.stream == "compute" and ordered(compute, released), \
        ("your HostWeights.release: buf.released must be recorded on the compute stream after the compute that read "
         f"the buffer (recorded on {released.stream if released else 'no stream'})")
    assert buf.state == m08.FREE and (buf.layer, buf.version) == (0, source.version), \
        (f"your HostWeights.release left the buffer {buf.state!r} with layer {buf.layer}, version {buf.version}: "
         f"expected FREE, still holding layer 0 at version {source.version} (a later gather(0) is then a hit)")


@pytest.mark.exercises("HostWeights.gather", "HostWeights.release")
def test_a_copy_into_a_reused_buffer_waits_for_the_compute_that_read_it():
    # Layers 0 and 2 share buffer 0: the copy of layer 2 must come after layer 0's compute (release is right:
    # the check above passed).
    source, runtime = fresh_source()
    source.gather(0), source.gather(1)
    first = compute_with(source, runtime, 0)
    source.gather(2)
    copy = [n for n in runtime.nodes if n.label == "copy"][-1]
    assert ordered(first, copy), \
        ("your HostWeights.gather: the copy of layer 2 into buffer 0 is not ordered after layer 0's compute, which "
         "read that buffer: the copy stream must wait for the buffer's released event before the copy")


@pytest.mark.exercises("HostWeights.invalidate")
def test_invalidate_waits_for_the_copies_and_makes_every_buffer_stale():
    source, runtime = fresh_source()
    source.gather(0), source.gather(1)
    copies = [n for n in runtime.nodes if n.label == "copy"]
    for layer in (0, 1):
        compute_with(source, runtime, layer)
    source.invalidate()
    runtime.host_writes(source.host, "optimizer step")
    write = runtime.nodes[-1]
    waited = [copy.index for copy in copies if not ordered(copy, write)]
    assert not waited, \
        (f"your HostWeights.invalidate: the host may write the weights while copies {waited} still read them: the "
         f"host must wait for the copy stream's work first")
    before = sum(n.label == "copy" for n in runtime.nodes)
    source.gather(0)
    assert sum(n.label == "copy" for n in runtime.nodes) == before + 1, \
        ("your HostWeights.invalidate: gather(0) after it copied nothing, so buffer 0 still counted as holding the "
         "current layer 0: after invalidate() no buffer may (the version)")


@pytest.mark.exercises("HostWeights.invalidate")
def test_invalidate_waits_also_for_a_copy_that_no_compute_waited_for():
    # A block gathered and never fetched before the optimizer step (a prefetch the loop did not use): no compute
    # waits for its copy, so only the stream that runs the copies can say it is done.
    source, runtime = fresh_source()
    source.gather(0)
    copy = next(n for n in runtime.nodes if n.label == "copy")
    source.invalidate()
    runtime.host_writes(source.host, "optimizer step")
    assert ordered(copy, runtime.nodes[-1]), \
        ("your HostWeights.invalidate: the host may write the weights while a copy that no compute has waited for "
         "still reads them: which stream runs the work that reads the host weights?")


# --- the whole step ------------------------------------------------------------------------------------------

@pytest.mark.exercises(
    "HostWeights.__init__", "HostWeights.gather", "HostWeights.get", "HostWeights.release")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_streamed_step_equals_the_resident_step_bit_for_bit(dtype):
    # bf16 too: the GPU benchmark streams a bf16 model. The buffers must be device memory (on CPU
    # nothing else tells torch.empty from the runtime's empty) in the blocks' dtype.
    tokens, targets = batch()
    loss, grads = m06.LlamaModel(CFG, 0, dtype).forward_backward(tokens, targets)
    model, runtime = streamed_model(dtype=dtype)
    buffers = [buf.flat for buf in model.weights.buffers]
    assert all(address(flat) in runtime.device_memory for flat in buffers), \
        ("the two buffers must be allocated by the runtime (runtime.empty(n, dtype)): on a GPU that is device "
         "memory, while torch.empty(...) is host memory the block's kernels cannot read")
    assert all(flat.dtype == dtype for flat in buffers), \
        (f"a {dtype} model got buffers of {[flat.dtype for flat in buffers]}: allocate them in the blocks' dtype "
         f"(the copy would convert every weight, and the block would multiply bf16 activations by them)")
    for _ in range(2):  # the second step reuses the buffers
        got_loss, got = model.forward_backward(tokens, targets)
        assert torch.equal(got_loss, loss), f"loss {got_loss.item()} vs resident {loss.item()}"
        for i, (a, b) in enumerate(zip(got.tensors(), grads.tensors())):
            assert torch.equal(a, b), f"gradient tensor {i} differs from the all-resident model's"
    read = {storage for node in runtime.nodes if node.label.startswith("block") for storage in node.reads}
    assert read <= {address(flat) for flat in buffers}, \
        "the blocks computed with weights outside the two device buffers: get() hands out views into buf.flat"


@pytest.mark.exercises("HostWeights.__init__",
                        "HostWeights.gather",
                        "HostWeights.get",
                        "HostWeights.release",
                        "HostWeights.invalidate")
def test_the_event_graph_has_no_hazards():
    model, runtime = streamed_model()
    run_steps(model, runtime)
    hazards = find_hazards(runtime.nodes)
    assert not hazards, describe(hazards)


@pytest.mark.exercises(
    "HostWeights.__init__", "HostWeights.gather", "HostWeights.get", "HostWeights.release")
def test_copies_run_on_a_side_stream_and_the_host_never_waits_inside_a_step():
    model, runtime = streamed_model()
    model.forward_backward(*batch())
    copies = [n for n in runtime.nodes if n.label == "copy"]
    assert copies and all(n.stream != "compute" for n in copies), \
        f"your HostWeights.gather: copies ran on {sorted({n.stream for n in copies})}; they belong on a side stream"
    assert len(copies) == 2 * CFG.n_layers - 2, \
        (f"{len(copies)} copies in a step; expected {2 * CFG.n_layers - 2} (the last two blocks stay for the "
         f"backward: your HostWeights.release keeps the buffer's layer and version, so gather finds them)")
    assert not runtime.host.waits, \
        "the host waited for a stream during the step: your HostWeights.get and gather must only queue work"


@pytest.mark.exercises("HostWeights.invalidate",
                        "HostWeights.__init__",
                        "HostWeights.gather",
                        "HostWeights.get",
                        "HostWeights.release")
def test_after_invalidate_every_block_is_copied_again():
    # The optimizer changed the host weights: a block still in a buffer is stale and must not be reused.
    model, runtime = streamed_model()
    run_steps(model, runtime, steps=2)
    copies = sum(n.label == "copy" for n in runtime.nodes)
    assert copies == 2 * (2 * CFG.n_layers - 2), \
        (f"{copies} copies in 2 steps; expected {2 * (2 * CFG.n_layers - 2)}: after your HostWeights.invalidate no "
         f"buffer may count as holding a current block")


def step_time(source_wrapper=None) -> float:
    """The step's length if the recorded graph ran on a GPU where a block copy takes 1, a block's
    forward 1 and its backward 2 (about the notebook's proportions)."""
    model, runtime = streamed_model()
    if source_wrapper:
        model.weights = source_wrapper(model.weights)
    model.forward_backward(*batch())

    def seconds(node):  # recording an event takes no time
        return {"copy": 1.0, "block forward": 1.0, "block backward": 2.0}.get(node.label, 0.0)
    return max(end for _, _, end in schedule(runtime.nodes, seconds))


@pytest.mark.exercises(
    "HostWeights.__init__", "HostWeights.gather", "HostWeights.get", "HostWeights.release")
def test_prefetch_hides_the_copies_under_compute():
    # Compute alone is 3 units a block; only the first block's copy cannot hide under compute.
    # Without prefetch every copy waits for the compute before it: 3L + (2L - 2).
    compute, copies = 3 * CFG.n_layers, 2 * CFG.n_layers - 2
    prefetch, serial = step_time(), step_time(m08.NoPrefetch)
    assert serial >= compute + copies, \
        (f"without prefetch (every copy after the compute before it) the step takes {serial} units, less than "
         f"compute + copies = {compute + copies}: so compute did not wait for the copies it reads. Your "
         f"HostWeights.get must order the compute stream after buf.ready")
    assert serial == compute + copies, f"without prefetch the step takes {serial}, expected {compute + copies}"
    assert prefetch <= compute + 1, \
        (f"with prefetch the step takes {prefetch} units, expected at most {compute + 1} (compute {compute} + the "
         f"first copy): a copy waits for more than the buffer it overwrites (your HostWeights.__init__ gives each "
         f"buffer its own `ready` and `released` event; each is recorded where its work is queued)")


@pytest.mark.exercises("HostWeights.__init__")
@pytest.mark.parametrize("mistake, message", [("forgotten release", "release(0)"),
                                              ("get without gather", "get(1) without a gather(1)")])
def test_misuse_raises_a_clear_error(mistake, message):
    source = m08.HostWeights(m06.LlamaModel(CFG, 0).blocks, FakeRuntime())
    with pytest.raises(RuntimeError, match=message.replace("(", r"\(").replace(")", r"\)")):
        if mistake == "forgotten release":
            source.gather(0), source.get(0), source.gather(1), source.get(1), source.gather(2)
        else:
            source.gather(0), source.get(0), source.release(0), source.get(1)


# --- the checker catches each missing wait (given: it checks course/streams.py) -----------------

Solution = reference("m08_host_weights").HostWeights


class NoWaitForRelease(Solution):
    def gather(self, layer):
        self.copy_stream.wait_event = lambda event: None  # forget: the copy may overwrite a buffer in use
        super().gather(layer)


class NoWaitForCopy(Solution):
    def get(self, layer):
        self.compute_stream.wait_event = lambda event: None  # forget: compute may read before the copy
        return super().get(layer)


class NoSynchronize(Solution):
    def invalidate(self):
        self.version += 1  # forget: the optimizer may write host weights a copy is still reading


@pytest.mark.given
@pytest.mark.parametrize("broken", [NoWaitForRelease, NoWaitForCopy, NoSynchronize], ids=lambda c: c.__name__)
def test_the_hazard_checker_catches_a_missing_wait(broken):
    model, runtime = streamed_model(broken)
    run_steps(model, runtime)
    assert find_hazards(runtime.nodes), f"{broken.__name__} should leave a hazard in the event graph"


# --- on a GPU (skipped without one) -----------------------------------------------------------

def cuda_poisoned_buffers_check():
    """Run in a child process: streamed on CUDA with slow, poisoning copies == all resident."""
    from course.streams import CudaRuntime

    class SlowPoisoningRuntime(CudaRuntime):
        def copy(self, dst, src):
            torch.cuda._sleep(2_000_000)  # ~1 ms: a missing wait now reads or overwrites too early
            dst.fill_(float("nan"))
            super().copy(dst, src)

    cfg = LlamaConfig(dim=256, n_heads=4, n_kv_heads=2, head_dim=64, ffn_dim=704, n_layers=4, max_seq_len=128)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (4, cfg.max_seq_len), generator=g).cuda()
    loss, grads = m06.LlamaModel(cfg, 0).to("cuda").forward_backward(tokens, tokens)
    model = m06.LlamaModel(cfg, 0)
    model.weights = m08.HostWeights(model.blocks, SlowPoisoningRuntime())
    model.blocks = []
    model.to("cuda")
    for step in range(3):
        got_loss, got = model.forward_backward(tokens, tokens)
        torch.cuda.synchronize()
        # Not bit for bit: views into a flat buffer may be aligned differently from separate tensors,
        # and cuBLAS may pick another kernel for them. A NaN or a stale block fails by far.
        torch.testing.assert_close(got_loss, loss, rtol=1e-5, atol=1e-6, msg=lambda m: f"step {step}, loss: {m}")
        for i, (a, b) in enumerate(zip(got.tensors(), grads.tensors())):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=lambda m: f"step {step}, gradient {i}: {m}")
        model.weights.invalidate()


# Given (not graded), like module 09's GPU check: most learners have no GPU.
@pytest.mark.given
@needs_gpu
def test_streamed_weights_on_cuda_survive_poisoned_buffers():
    run_cuda_check(__file__, "cuda_poisoned_buffers_check")


@pytest.mark.given
def test_the_demo_shows_the_hazard_of_an_invalidate_that_does_not_wait(monkeypatch, capsys):
    # `run 08` steps an "optimizer" between two steps, so an invalidate() without its synchronize
    # (the host may then write weights a copy still reads) is a hazard the demo reports.
    from course.demos import m08 as demo

    def invalidate_without_waiting(self):
        self.version += 1
    monkeypatch.setattr(load("m08_host_weights").HostWeights, "invalidate", invalidate_without_waiting)
    demo.demo(argparse.Namespace(layers=2))
    out = capsys.readouterr().out
    assert "0 hazards" not in out and re.search(r"[1-9]\d* hazards", out), out
