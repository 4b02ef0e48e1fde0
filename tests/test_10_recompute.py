"""Module 10: every recompute option gives the no-recompute gradients bit for bit, keeps exactly the
bytes its formula says (and frees the rest), and agrees with torch.utils.checkpoint."""
import weakref
from dataclasses import fields

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from course.impl import load, reference
from course.reference_llama import ReferenceBlock

m10 = load("m10_recompute")
m06_block = load("m06_llama_block")
m06_model = load("m06_llama_model")
m06_ops = load("m06_llama_ops")
fp8_matmul = reference("m09_fp8_matmul")  # module 09's FP8 policy, a trusted helper here
reference_block = reference("m06_llama_block")  # what a block really saves, to size activation_bytes
CFG = m06_block.LlamaConfig(dim=32, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=48, vocab_size=64, n_layers=3,
                            max_seq_len=16)


def block_weights(seed: int, dtype=torch.float32):
    """A block's weights with norm weights away from 1 (they start at 1), so a recompute that uses
    the wrong norm weight, or none, cannot give the same numbers by luck."""
    weights = m06_block.init_block_weights(CFG, torch.Generator().manual_seed(seed), dtype)
    g = torch.Generator().manual_seed(seed + 100)
    for norm in (weights.ln1, weights.ln2):
        norm.copy_(1 + 0.1 * torch.randn(norm.shape, generator=g))
    return weights


def kept_names_message(kept, expected) -> str:
    extra, missing = sorted(set(kept) - set(expected)), sorted(set(expected) - set(kept))
    return f"the store keeps {extra or 'nothing'} it should drop and misses {missing or 'nothing'} it should keep"


def hand_counted_bytes(cfg, tokens, act, stat):
    """Bytes of all fourteen saved activations, counted by hand from the block's equations."""
    wide = 5 * cfg.dim + cfg.n_heads * cfg.head_dim + 2 * cfg.n_kv_heads * cfg.head_dim + 3 * cfg.ffn_dim
    return tokens * (wide * act + (2 + cfg.n_heads) * stat)


@pytest.mark.exercises("activation_bytes")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_activation_has_the_bytes_the_block_saves_for_it(dtype):
    # Name by name, against what the reference block (module 06's solution, not the code graded
    # here) really saves: a swap of two sizes (q and k, say) leaves every total below unchanged. First,
    # so that a wrong size is named before a total says only how far off the sum is (a learner run).
    store = reference_block.ActivationStore()
    weights = reference_block.init_block_weights(CFG, torch.Generator().manual_seed(0), dtype)
    reference_block.LlamaBlock(CFG).forward(weights, torch.randn(2, 9, CFG.dim).to(dtype), store)
    saved = {name: t.untyped_storage().nbytes() for name, t in store.tensors.items()}
    got = m10.activation_bytes(CFG, 2, 9, dtype)
    assert set(got) == set(saved), f"names: your activation_bytes gives {sorted(got)}, the block saves {sorted(saved)}"
    wrong = {name: f"formula {got[name]}, saved {saved[name]} ({got[name] / saved[name]:.3g} times)"
             for name in saved if got[name] != saved[name]}
    assert not wrong, f"{dtype}: your activation_bytes differ from what the block saves, by name: {wrong}"


@pytest.mark.exercises("activation_bytes")
@pytest.mark.parametrize("dtype, act, stat", [(torch.float32, 4, 4), (torch.bfloat16, 2, 4), (torch.float64, 8, 8)])
def test_keeping_everything_costs_the_hand_counted_bytes(dtype, act, stat):
    got = m10.kept_bytes(CFG, 3, 10, dtype, "none")
    want = hand_counted_bytes(CFG, 30, act, stat)
    assert got == want, (f"{dtype}: your activation_bytes sum to {got} bytes for 30 tokens, the block keeps {want}"
                         + (f" ({got / want:.3g} times as many)" if want and got else ""))
    assert m10.kept_bytes(CFG, 3, 10, dtype, "block") == 30 * CFG.dim * act, \
        "your activation_bytes: 'block' keeps only the block input x, 30 tokens of dim values"


@pytest.mark.exercises("activation_bytes")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("option", ["none", "swiglu", "norms", "ffn", "attention", "block"])
def test_the_store_holds_exactly_the_bytes_of_the_formula(option, dtype):
    block, x = m10.RecomputeBlock(CFG, option), torch.randn(2, 9, CFG.dim).to(dtype)
    weights = m06_block.init_block_weights(CFG, torch.Generator().manual_seed(0), dtype)
    store = block.new_store()
    block.forward(weights, x, store)
    expected = m10.kept_bytes(CFG, 2, 9, dtype, option)
    expected_names = m10.ACTIVATIONS - m10.DROPPED[option]
    assert set(store.tensors) == expected_names, f"{option}: " + kept_names_message(store.tensors, expected_names)
    assert store.nbytes() == expected, \
        f"{option}: the store holds {store.nbytes()} bytes, kept_bytes (from your activation_bytes) says {expected}"


@pytest.mark.exercises("activation_bytes")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("option", ["none", "ffn", "block"])
def test_with_fp8_linears_the_store_holds_the_bytes_of_the_formula(option, dtype):
    # FP8Matmul keeps n1, n2 and s as e4m3 with a scale, and their abs-maxes whatever the option.
    block = m10.RecomputeBlock(CFG, option, matmul=fp8_matmul.FP8Matmul(min_dim=0))
    weights = m06_block.init_block_weights(CFG, torch.Generator().manual_seed(0), dtype)
    store = block.new_store()
    block.forward(weights, torch.randn(2, 8, CFG.dim).to(dtype), store)
    expected = m10.kept_bytes(CFG, 2, 8, dtype, option, fp8=True)
    expected_names = (m10.ACTIVATIONS - m10.DROPPED[option]) | m10.ABS_MAXES
    assert set(store.tensors) == expected_names, f"{option}: " + kept_names_message(store.tensors, expected_names)
    assert store.nbytes() == expected, \
        f"{option}: the store holds {store.nbytes()} bytes, kept_bytes (from your activation_bytes) says {expected}"


@pytest.mark.exercises("RecomputeBlock.recompute")
@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "fp8"])
@pytest.mark.parametrize("option", ["swiglu", "norms", "ffn", "attention", "block"])
def test_gradients_equal_the_no_recompute_gradients_bit_for_bit(option, fp8):
    # With FP8 linears the recompute must quantize n1, n2 and s exactly as the forward did.
    g = torch.Generator().manual_seed(1)
    tokens, targets = torch.randint(0, 64, (2, 16), generator=g), torch.randint(0, 64, (2, 16), generator=g)
    policy = {"matmul": fp8_matmul.FP8Matmul(min_dim=0)} if fp8 else {}
    plain = m06_model.LlamaModel(CFG, seed=2, block=m06_block.LlamaBlock(CFG, attention_chunk=5, **policy))
    recomputing = m06_model.LlamaModel(CFG, seed=2,
                                       block=m10.RecomputeBlock(CFG, option, attention_chunk=5, **policy))
    for layer, (a, b) in enumerate(zip(plain.blocks, recomputing.blocks)):
        a.ln1.copy_(block_weights(layer).ln1), a.ln2.copy_(block_weights(layer).ln2)
        b.ln1.copy_(a.ln1), b.ln2.copy_(a.ln2)
    loss, grads = plain.forward_backward(tokens, targets)
    loss_r, grads_r = recomputing.forward_backward(tokens, targets)
    assert torch.equal(loss, loss_r), f"loss {loss_r.item()!r} != {loss.item()!r}"
    names = ["embedding", *(f"layer {layer} {f.name}" for layer in range(CFG.n_layers) for f in fields(m06_block.BlockWeights)),
             "final_norm", "lm_head"]  # the order of LlamaGrads.tensors()
    wrong = [f"{name} (max |diff| {(a - b).abs().max().item():.3e})"
             for name, a, b in zip(names, grads.tensors(), grads_r.tensors(), strict=True) if not torch.equal(a, b)]
    assert not wrong, \
        f"{option}: your RecomputeBlock.recompute gives gradients that differ from no recompute's: {', '.join(wrong)}"


def same(a, b) -> bool:
    if isinstance(a, fp8_matmul.Quantized) or isinstance(b, fp8_matmul.Quantized):
        return type(a) is type(b) and torch.equal(a.data.float(), b.data.float()) and torch.equal(a.scale, b.scale)
    return torch.equal(a, b)


@pytest.mark.exercises("RecomputeBlock.recompute")
@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "fp8"])
@pytest.mark.parametrize("option", ["swiglu", "norms", "ffn", "attention", "block"])
def test_recompute_restores_exactly_what_the_forward_kept(option, fp8):
    policy = {"matmul": fp8_matmul.FP8Matmul(min_dim=0)} if fp8 else {}
    weights, x = block_weights(0), torch.randn(2, 16, CFG.dim, generator=torch.Generator().manual_seed(1))
    everything = m06_block.ActivationStore()
    m06_block.LlamaBlock(CFG, **policy).forward(weights, x, everything)
    block = m10.RecomputeBlock(CFG, option, **policy)
    store = block.new_store()
    block.forward(weights, x, store)
    block.recompute(weights, store)
    wrong = sorted(name for name in m10.ACTIVATIONS if name not in store.tensors
                   or not same(store[name], everything[name]))
    assert not wrong, (f"{option}: after your RecomputeBlock.recompute {wrong} differ from the forward's values (or are "
                       f"missing); "
                       f"rebuild each from what was kept, with the forward's own ops, inputs and norm weights, and "
                       f"hand linear inputs to matmul.prepare as the forward does (FP8 keeps them quantized)")


@pytest.mark.exercises("RecomputeBlock.recompute")
@pytest.mark.parametrize("option", ["swiglu", "norms", "ffn", "attention", "block"])
def test_fp8_recompute_quantizes_with_the_kept_abs_maxes(option):
    # The store keeps each FP8 linear input's abs-max so the recompute quantizes with it, skipping
    # an abs-max pass. An exact recompute would find the same abs-max, so to see which one was used
    # we plant doubled ones: each recomputed input's scale must be the planted abs-max's.
    policy = fp8_matmul.FP8Matmul(min_dim=0)
    block, weights = m10.RecomputeBlock(CFG, option, matmul=policy), block_weights(0)
    store = block.new_store()
    block.forward(weights, torch.randn(2, 16, CFG.dim, generator=torch.Generator().manual_seed(1)), store)
    recomputed = [name for name in m10.LINEAR_INPUTS if name in m10.DROPPED[option]]
    planted = {}
    for name in recomputed:
        planted[name] = store[fp8_matmul.abs_max_name(name)] * 2
        store.restore(fp8_matmul.abs_max_name(name), planted[name])
    block.recompute(weights, store)
    for name in recomputed:
        assert hasattr(store[name], "scale"), \
            (f"{option}: your RecomputeBlock.recompute put {name} back as a {type(store[name]).__name__}, not the FP8 "
             f"copy the forward kept: how does the forward turn a linear input into what the store keeps?")
        want = fp8_matmul.quantize(torch.zeros(1), fp8_matmul.E4M3, planted[name]).scale  # depends on amax only
        assert torch.equal(store[name].scale, want), \
            (f"{option}: your RecomputeBlock.recompute's {name} has scale {store[name].scale.item()!r}, expected {want.item()!r} from the "
             f"abs-max kept in the store: prepare the recomputed input into `fresh`, which starts with the kept "
             f"abs-maxes, not into a new store (that computes the abs-max again)")


class CountingMatmul(m06_ops.Matmul):
    def __init__(self):
        self.forwards = 0

    def forward(self, x, w):
        self.forwards += 1
        return super().forward(x, w)


@pytest.mark.exercises("RecomputeBlock.recompute")
@pytest.mark.parametrize("option, matmuls", [("swiglu", 0), ("norms", 0), ("ffn", 2), ("attention", 3), ("block", 6)])
def test_recompute_reruns_only_the_matmuls_it_needs(option, matmuls):
    # ffn: gate and up; attention: q, k, v; block: all but down (its input s is recomputed, its
    # output is not needed by the backward).
    counting = CountingMatmul()
    block = m10.RecomputeBlock(CFG, option, matmul=counting)
    weights, store = block_weights(0), block.new_store()
    block.forward(weights, torch.randn(2, 8, CFG.dim), store)
    counting.forwards = 0
    block.recompute(weights, store)
    assert counting.forwards == matmuls, \
        f"{option}: your RecomputeBlock.recompute ran {counting.forwards} linear layers, it needs {matmuls}"


@pytest.mark.exercises("RecomputeBlock.recompute")
@pytest.mark.parametrize("option, norms", [("swiglu", 0), ("norms", 2), ("ffn", 1), ("attention", 1), ("block", 2)])
def test_recompute_reruns_each_norm_it_needs_once(option, norms, monkeypatch):
    # ffn needs n2 again; attention n1 (the attention half rebuilds it: running the norm a second time
    # after it is forward work done twice); block both; norms both, and nothing else.
    calls = []
    original = m06_ops.rmsnorm_forward

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)
    block = m10.RecomputeBlock(CFG, option)
    weights, store = block_weights(0), block.new_store()
    block.forward(weights, torch.randn(2, 8, CFG.dim), store)
    for module in (m10, m06_block, m06_ops):  # wherever the name was imported
        if hasattr(module, "rmsnorm_forward"):
            monkeypatch.setattr(module, "rmsnorm_forward", counting)
    block.recompute(weights, store)
    assert len(calls) == norms, \
        f"{option}: your RecomputeBlock.recompute ran RMSNorm {len(calls)} times, it needs {norms}"


@pytest.mark.given  # new_store is given: no projection output of the forward may outlive it
def test_dropped_activations_are_really_freed():
    class WatchingMatmul(m06_ops.Matmul):
        outputs = []

        def forward(self, x, w):
            y = super().forward(x, w)
            self.outputs.append(weakref.ref(y))
            return y

    matmul = WatchingMatmul()
    block = m10.RecomputeBlock(CFG, "block", matmul=matmul)
    weights = m06_block.init_block_weights(CFG, torch.Generator().manual_seed(0))
    store = block.new_store()
    block.forward(weights, torch.randn(2, 9, CFG.dim), store)
    alive = sum(ref() is not None for ref in matmul.outputs)
    assert len(matmul.outputs) == 7 and alive == 0, \
        f"with whole-block recompute no projection output may outlive the forward; {alive} of 7 still alive"


@pytest.mark.exercises("RecomputeBlock.recompute")
def test_whole_block_recompute_matches_torch_utils_checkpoint():
    f64 = torch.float64
    weights = m06_block.init_block_weights(CFG, torch.Generator().manual_seed(3), f64)
    reference = ReferenceBlock(CFG.dim, CFG.n_heads, CFG.n_kv_heads, CFG.head_dim, CFG.ffn_dim, CFG.rope_theta,
                               CFG.norm_eps).load(weights)
    x, dy = torch.randn(2, 11, CFG.dim, dtype=f64), torch.randn(2, 11, CFG.dim, dtype=f64)
    x_ref = x.clone().requires_grad_(True)
    checkpoint(reference, x_ref, use_reentrant=False).backward(dy)
    block = m10.RecomputeBlock(CFG, "block", attention_chunk=4)
    store = block.new_store()
    block.forward(weights, x, store)
    dx, grads = block.backward(weights, dy, store)
    torch.testing.assert_close(dx, x_ref.grad, rtol=1e-9, atol=1e-10,
                               msg=lambda m: f"dx after your RecomputeBlock.recompute: {m}")
    for name, expected in reference.grads().items():
        torch.testing.assert_close(getattr(grads, name), expected, rtol=1e-9, atol=1e-10,
                                   msg=lambda m: f"gradient of {name} after your RecomputeBlock.recompute: {m}")


@pytest.mark.given
def test_an_unknown_option_is_rejected():
    with pytest.raises(ValueError, match="unknown recompute option 'everything'; choose one of none, swiglu"):
        m10.RecomputeBlock(CFG, "everything")


@pytest.mark.given
def test_the_benchmark_runs_on_cpu(tmp_path, monkeypatch):
    import course.bench as bench
    from course.bench import m10 as bench_m10
    monkeypatch.setenv("COURSE_IMPL", "solutions")  # given code: it must run whatever is being graded
    monkeypatch.setattr(bench, "RESULTS", tmp_path)
    bench_m10.main(["--dim", "32", "--heads", "4", "--kv-heads", "2", "--ffn", "48", "--layers", "2",
                    "--seq-len", "16", "--batch", "2", "--vocab", "64", "--steps", "1"])
    assert (tmp_path / "bench-10.json").exists()
