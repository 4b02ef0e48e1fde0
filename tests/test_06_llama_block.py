"""Module 06 block: forward and every gradient against an nn.Module Llama block (autograd + SDPA)."""
import dataclasses

import pytest
import torch

from course.compare import assert_all_close
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


def make(name, **extra):
    cfg = block_module.LlamaConfig(**CONFIGS[name], rope_theta=1000.0, max_seq_len=16, **extra)
    weights = block_module.init_block_weights(cfg, torch.Generator().manual_seed(1), f64)
    weights.ln1 = weights.ln1 + 0.1 * torch.randn(cfg.dim, dtype=f64)  # norms not all-ones, to see their gradients
    weights.ln2 = weights.ln2 + 0.1 * torch.randn(cfg.dim, dtype=f64)
    reference = ReferenceBlock(cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim, cfg.rope_theta,
                               cfg.norm_eps).load(weights)
    return cfg, weights, reference


@pytest.mark.exercises("LlamaBlock.attention_half", "LlamaBlock.ffn_half")
@pytest.mark.parametrize("name", CONFIGS)
def test_block_forward_matches_the_reference_block(name):
    cfg, weights, reference = make(name)
    x = torch.randn(2, 13, cfg.dim, dtype=f64)
    y = block_module.LlamaBlock(cfg, attention_chunk=5).forward(weights, x, block_module.ActivationStore())
    torch.testing.assert_close(y, reference(x), rtol=1e-9, atol=1e-10)


@pytest.mark.exercises("LlamaBlock.attention_half", "LlamaBlock.ffn_half", "LlamaBlock.backward")
@pytest.mark.parametrize("name", CONFIGS)
def test_block_backward_gives_every_gradient_of_the_reference_block(name):
    cfg, weights, reference = make(name)
    x, dy = torch.randn(2, 13, cfg.dim, dtype=f64), torch.randn(2, 13, cfg.dim, dtype=f64)
    block, store = block_module.LlamaBlock(cfg, attention_chunk=5), block_module.ActivationStore()
    block.forward(weights, x, store)
    dx, grads = block.backward(weights, dy, store)
    x_ref = x.clone().requires_grad_(True)
    reference(x_ref).backward(dy)
    assert_all_close([*((f"d{name}", getattr(grads, name), want) for name, want in reference.grads().items()),
                      ("dx", dx, x_ref.grad)], rtol=1e-9, atol=1e-10)


@pytest.mark.exercises("LlamaBlock.attention_half", "LlamaBlock.ffn_half", "LlamaBlock.backward")
def test_every_linear_goes_through_the_matmul_policy():
    # The policy's prepare hands back a *copy* here, so a linear that multiplies what prepare
    # returned can be told from one that multiplies the unprepared tensor (module 09's FP8 policy
    # returns the e4m3 input: a linear fed the unprepared one would quantize it again, and a second
    # prepare of the same input would quantize it twice).
    class CountingMatmul(ops.Matmul):
        def __init__(self):
            self.forwards = self.backwards = 0
            self.prepared, self.prepared_storage = [], set()
            self.unprepared = {"forward": 0, "backward": 0}

        def prepare(self, x, store, name):
            self.prepared.append(name)
            copy = x.clone()
            self.prepared_storage.add(copy.untyped_storage().data_ptr())
            store.save(name, copy)
            return copy

        def count_unprepared(self, which, x):
            self.unprepared[which] += x.untyped_storage().data_ptr() not in self.prepared_storage

        def forward(self, x, w):
            self.forwards += 1
            self.count_unprepared("forward", x)
            return super().forward(x, w)

        def backward(self, dy, x, w):
            self.backwards += 1
            self.count_unprepared("backward", x)
            return super().backward(dy, x, w)

    cfg, weights, _ = make("gqa")
    matmul = CountingMatmul()
    block, store = block_module.LlamaBlock(cfg, matmul=matmul), block_module.ActivationStore()
    x = torch.randn(1, 6, cfg.dim, dtype=f64)
    y = block.forward(weights, x, store)
    block.backward(weights, torch.ones_like(y), store)
    assert (matmul.forwards, matmul.backwards) == (7, 7), \
        f"the block has 7 linears (q, k, v, o, gate, up, down); the policy saw {matmul.forwards} forward " \
        f"and {matmul.backwards} backward calls"
    assert matmul.prepared == ["n1", "n2", "s"], \
        (f"prepare was called for {matmul.prepared}; expected once each for 'n1', 'n2' and 's', in that order "
         f"(q, k and v share one prepared n1, gate and up one prepared n2; the o projection takes o unprepared)")
    assert matmul.unprepared == {"forward": 1, "backward": 1}, \
        (f"linears fed a tensor that did not come from prepare: {matmul.unprepared}; expected 1 each (the o "
         f"projection): q, k, v, gate, up and down multiply what prepare returned, and their backwards read it "
         f"from the store")


@pytest.mark.exercises("LlamaBlock.attention_half", "LlamaBlock.ffn_half", "LlamaBlock.backward")
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
    block.backward(weights, torch.ones_like(y), store)
    assert (attention.forwards, attention.backwards) == (1, 1), \
        (f"the block's attention object saw {attention.forwards} forward and {attention.backwards} backward "
         f"calls, expected 1 and 1: call self.attention.forward(q, k, v) and self.attention.backward(do, q, k, "
         f"v, o, lse), not attention_forward / attention_backward")


@pytest.mark.exercises("LlamaBlock.attention_half", "LlamaBlock.ffn_half")
def test_the_store_holds_what_the_backward_reads_and_nothing_else():
    cfg, weights, _ = make("gqa")
    block, store = block_module.LlamaBlock(cfg), block_module.ActivationStore()
    block.forward(weights, torch.randn(2, 7, cfg.dim, dtype=f64), store)
    expected = {"x", "n1", "r1", "q", "k", "v", "o", "lse", "h", "n2", "r2", "g", "u", "s"}
    assert set(store.tensors) == expected, f"saved {sorted(store.tensors)}; expected {sorted(expected)}"


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
