"""Module 06 block: forward and every gradient against an nn.Module Llama block (autograd + SDPA),
each half of the block (each TODO) compared on its own before the whole."""
import dataclasses

import pytest
import torch

from course.catalog import MODULES
from course.compare import assert_all_close
from course.hints import module_todos
from course.impl import load
from course.reference_llama import ReferenceBlock

block_module = load("m06_llama_block")
ops = load("m06_llama_ops")
f64 = torch.float64
CONFIGS = {  # grouped-query, multi-head (kv_heads == heads) and multi-query (one kv head)
    "gqa": dict(dim=32, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=48),
    "mha": dict(dim=24, n_heads=3, n_kv_heads=3, head_dim=8, ffn_dim=40),
    "mqa": dict(dim=32, n_heads=4, n_kv_heads=1, head_dim=8, ffn_dim=24),
}
# LlamaBlock.backward holds two TODOs: a message that names one by its title sends the learner to it.
FFN_BACKWARD, ATTENTION_BACKWARD = [todo.title for todo in module_todos(MODULES["06"])
                                    if todo.function == "LlamaBlock.backward"]
FFN_WEIGHTS, ATTENTION_WEIGHTS = ("w_down", "w_gate", "w_up", "ln2"), ("wo", "wq", "wk", "wv", "ln1")


def make(name, **extra):
    cfg = block_module.LlamaConfig(**CONFIGS[name], rope_theta=1000.0, max_seq_len=16, **extra)
    weights = block_module.init_block_weights(cfg, torch.Generator().manual_seed(1), f64)
    weights.ln1 = weights.ln1 + 0.1 * torch.randn(cfg.dim, dtype=f64)  # norms not all-ones, to see their gradients
    weights.ln2 = weights.ln2 + 0.1 * torch.randn(cfg.dim, dtype=f64)
    reference = ReferenceBlock(cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim, cfg.rope_theta,
                               cfg.norm_eps).load(weights)
    return cfg, weights, reference


def reference_run(reference, x, dy=None):
    """The reference block's output and its intermediates: o (the o projection's input), h (the residual
    stream after attention), s (the down projection's input) and, given dy, every gradient and dh."""
    seen = {}

    def keep(name):
        def hook(module, inputs, output):
            seen[name + " in"] = inputs[0].detach()
            if output.requires_grad:
                output.register_hook(lambda grad: seen.__setitem__(name + " grad", grad))
        return hook
    handles = [getattr(reference, name).register_forward_hook(keep(name)) for name in ("wo", "w_down")]
    x = x.clone().requires_grad_(dy is not None)
    y = reference(x)
    for handle in handles:
        handle.remove()
    # h = x + o W_o^T: the o projection's output is the residual branch, and dh is its gradient.
    ref = {"o": seen["wo in"], "s": seen["w_down in"], "y": y.detach()}
    ref["h"] = x.detach() + reference.wo(ref["o"]).detach()
    if dy is not None:
        y.backward(dy)
        ref.update(dh=seen["wo grad"], dx=x.grad, **reference.grads())
    return ref


def close(got, want, what):
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10, msg=lambda m: f"{what}: {m}")


@pytest.mark.exercises("LlamaBlock.attention_half", "LlamaBlock.ffn_half")
@pytest.mark.parametrize("name", CONFIGS)
def test_block_forward_matches_the_reference_block_half_by_half(name):
    # Each half on its own first (the FFN half fed the reference's o), then the whole forward.
    cfg, weights, reference = make(name)
    x = torch.randn(2, 13, cfg.dim, dtype=f64)
    ref = reference_run(reference, x)
    block = block_module.LlamaBlock(cfg, attention_chunk=5)
    o = block.attention_half(weights, x, block_module.ActivationStore())
    close(o, ref["o"], "your LlamaBlock.attention_half's o (attention's output, before the o projection)")
    h, s = block.ffn_half(weights, x, ref["o"], block_module.ActivationStore())
    close(h, ref["h"], "your LlamaBlock.ffn_half's h (the residual stream after attention)")
    close(s, ref["s"], "your LlamaBlock.ffn_half's s (SwiGLU's output)")
    y = block.forward(weights, x, block_module.ActivationStore())
    close(y, ref["y"], "the block's output y")


class RecordingMatmul(ops.Matmul):
    """Module 06's policy, remembering the gradient dy each weight's backward was given."""

    def __init__(self):
        self.dy_of = {}

    def backward(self, dy, x, w):
        self.dy_of[id(w)] = dy
        return super().backward(dy, x, w)


@pytest.mark.exercises("LlamaBlock.backward", "LlamaBlock.attention_half", "LlamaBlock.ffn_half")
@pytest.mark.parametrize("name", CONFIGS)
def test_block_backward_gives_every_gradient_of_the_reference_block(name):
    # In the order the backward makes them: the FFN half's weight gradients and the dh it hands on (read
    # where the o projection's backward receives it), then the attention half's gradients and dx.
    cfg, weights, reference = make(name)
    x, dy = torch.randn(2, 13, cfg.dim, dtype=f64), torch.randn(2, 13, cfg.dim, dtype=f64)
    ref = reference_run(reference, x, dy)
    matmul = RecordingMatmul()
    block, store = block_module.LlamaBlock(cfg, matmul=matmul, attention_chunk=5), block_module.ActivationStore()
    block.forward(weights, x, store)
    dx, grads = block.backward(weights, dy, store)
    try:
        assert_all_close([(f"d{n}", getattr(grads, n), ref[n]) for n in FFN_WEIGHTS], rtol=1e-9, atol=1e-10)
    except AssertionError as error:
        raise AssertionError(f"{FFN_BACKWARD}: {error}") from None
    dh = matmul.dy_of.get(id(weights.wo))
    assert dh is not None, \
        f"{ATTENTION_BACKWARD}: the o projection's backward never went through self.matmul with w.wo"
    try:
        close(dh.reshape(ref["dh"].shape), ref["dh"], "dh, the gradient of the residual stream after attention")
    except AssertionError as error:
        raise AssertionError(f"{FFN_BACKWARD}: {error}") from None
    try:
        assert_all_close([*((f"d{n}", getattr(grads, n), ref[n]) for n in ATTENTION_WEIGHTS), ("dx", dx, ref["dx"])],
                         rtol=1e-9, atol=1e-10)
    except AssertionError as error:
        raise AssertionError(f"{ATTENTION_BACKWARD}: {error}") from None


class CountingMatmul(ops.Matmul):
    """The policy's prepare hands back a *copy* here, so a linear that multiplies what prepare returned
    can be told from one that multiplies the unprepared tensor (module 09's FP8 policy returns the e4m3
    input: a linear fed the unprepared one would quantize it again, and a second prepare of the same input
    would quantize it twice)."""

    def __init__(self, weights):
        self.names = {id(getattr(weights, f.name)): f.name for f in dataclasses.fields(weights)}
        self.calls, self.prepared, self.prepared_storage = [], [], set()

    def prepare(self, x, store, name):
        self.prepared.append(name)
        copy = x.clone()
        self.prepared_storage.add(copy.untyped_storage().data_ptr())
        store.save(name, copy)
        return copy

    def record(self, which, x, w):
        prepared = x.untyped_storage().data_ptr() in self.prepared_storage
        self.calls.append((which, self.names.get(id(w), "another tensor"), prepared))

    def forward(self, x, w):
        self.record("forward", x, w)
        return super().forward(x, w)

    def backward(self, dy, x, w):
        self.record("backward", x, w)
        return super().backward(dy, x, w)

    def take(self):
        calls, prepared = self.calls, self.prepared
        self.calls, self.prepared = [], []
        return sorted(calls), prepared


@pytest.mark.exercises("LlamaBlock.attention_half", "LlamaBlock.ffn_half", "LlamaBlock.backward")
def test_every_linear_goes_through_the_matmul_policy():
    # Each piece's calls on their own: (forward or backward, weight, whether x came from prepare).
    cfg, weights, _ = make("gqa")
    matmul = CountingMatmul(weights)
    block, store = block_module.LlamaBlock(cfg, matmul=matmul), block_module.ActivationStore()
    x = torch.randn(1, 6, cfg.dim, dtype=f64)
    block.attention_half(weights, x, store)
    calls, prepared = matmul.take()
    assert prepared == ["n1"], f"your LlamaBlock.attention_half prepared {prepared}, expected ['n1'] (once)"
    expected = [("forward", name, True) for name in ("wk", "wq", "wv")]
    assert calls == expected, (f"your LlamaBlock.attention_half: the policy saw {calls}, expected {expected}: q, k "
                               f"and v multiply the one n1 that prepare returned")
    block.ffn_half(weights, x, store["o"], store)
    calls, prepared = matmul.take()
    assert prepared == ["n2", "s"], \
        f"your LlamaBlock.ffn_half prepared {prepared}, expected ['n2', 's'] (each once, in that order)"
    expected = [("forward", "w_gate", True), ("forward", "w_up", True), ("forward", "wo", False)]
    assert calls == expected, (f"your LlamaBlock.ffn_half: the policy saw {calls}, expected {expected}: gate and up "
                               f"multiply the one n2 prepare returned; the o projection takes o as it is")
    block.backward(weights, torch.ones(1, 6, cfg.dim, dtype=f64), store)
    calls, _ = matmul.take()
    ffn = [("backward", name, True) for name in ("w_down", "w_gate", "w_up")]
    mine = [call for call in calls if call[1] in ("w_down", "w_gate", "w_up")]
    assert mine == ffn, (f"{FFN_BACKWARD}: the policy's backward calls for the FFN's linears were {mine}, expected "
                         f"{ffn}: every linear's backward goes through linear_backward with self.matmul, and reads "
                         f"the prepared input from the store")
    attention = sorted([("backward", "wo", False)] + [("backward", name, True) for name in ("wq", "wk", "wv")])
    rest = [call for call in calls if call not in mine]
    assert rest == attention, \
        f"{ATTENTION_BACKWARD}: the policy's backward calls for the attention half's linears were {rest}, expected {attention}"


@pytest.mark.exercises("LlamaBlock.attention_half", "LlamaBlock.backward")
def test_attention_goes_through_the_blocks_attention_object():
    # The benchmarks swap in PyTorch's fused kernel with LlamaBlock(cfg, attention=FusedAttention()):
    # a block that calls attention_forward / attention_backward directly would ignore it.
    class CountingAttention(ops.ChunkedAttention):
        forwards = backwards = 0

        def forward(self, q, k, v):
            self.forwards += 1
            return super().forward(q, k, v)

        def backward(self, do, q, k, v, o, lse):
            self.backwards += 1
            return super().backward(do, q, k, v, o, lse)

    cfg, weights, _ = make("gqa")
    attention = CountingAttention(chunk=4)
    block, store = block_module.LlamaBlock(cfg, attention=attention), block_module.ActivationStore()
    y = block.forward(weights, torch.randn(1, 6, cfg.dim, dtype=f64), store)
    assert attention.forwards == 1, \
        (f"your LlamaBlock.attention_half called the block's attention object {attention.forwards} times, expected "
         f"once: self.attention.forward(q, k, v), not attention_forward")
    block.backward(weights, torch.ones_like(y), store)
    assert attention.backwards == 1, \
        (f"{ATTENTION_BACKWARD}: the block's attention object saw {attention.backwards} backward calls, expected "
         f"1: self.attention.backward(do, q, k, v, o, lse), not attention_backward")


@pytest.mark.exercises("LlamaBlock.attention_half", "LlamaBlock.ffn_half")
def test_the_store_holds_what_the_backward_reads_and_nothing_else():
    cfg, weights, _ = make("gqa")
    block, store = block_module.LlamaBlock(cfg), block_module.ActivationStore()
    x = torch.randn(2, 7, cfg.dim, dtype=f64)
    for what, run, expected in (
            ("your LlamaBlock.attention_half", lambda: block.attention_half(weights, x, store),
             {"x", "n1", "r1", "q", "k", "v", "o", "lse"}),
            ("your LlamaBlock.ffn_half", lambda: block.ffn_half(weights, x, store["o"], store),
             {"h", "n2", "r2", "g", "u", "s"})):
        before = set(store.tensors)
        run()
        saved = set(store.tensors) - before
        assert saved == expected, f"{what} saved {sorted(saved)}; expected {sorted(expected)}"


@pytest.mark.given
@pytest.mark.parametrize("change, message", [
    (dict(n_kv_heads=3), "n_heads=4 is not divisible by n_kv_heads=3"),
    (dict(head_dim=7, dim=28), "head_dim=7 must be even"),
    (dict(dim=30), "must equal dim=30"),
    (dict(ffn_dim=0), "ffn_dim must be a positive integer"),
])
def test_bad_configs_are_rejected_with_a_clear_message(change, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(block_module.LlamaConfig(dim=32, n_heads=4, n_kv_heads=2, head_dim=8), **change)


@pytest.mark.given
def test_a_sequence_longer_than_max_seq_len_is_rejected():
    with pytest.raises(ValueError, match="sequence length 65 is outside 1..max_seq_len=64"):
        block_module.LlamaConfig(max_seq_len=64).check_seq_len(65)
