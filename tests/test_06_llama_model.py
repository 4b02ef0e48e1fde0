"""Module 06 model: the chunked LM head against full cross-entropy, the whole model against an
nn.Module Llama, the weight-source protocol as the model loop uses it, and a short training run."""
import pytest
import torch
import torch.nn.functional as F

from course.compare import assert_all_close
from course.dataset import load_text
from course.impl import load
from course.reference_llama import ReferenceLlama

model_module = load("m06_llama_model")
LlamaConfig = load("m06_llama_block").LlamaConfig
f64 = torch.float64
CFG = LlamaConfig(dim=32, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=48, vocab_size=50, n_layers=3, max_seq_len=12)


@pytest.mark.exercises("chunked_cross_entropy")
@pytest.mark.parametrize("chunk", [1, 7, 1000])
def test_chunked_cross_entropy_matches_full_cross_entropy(chunk):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 10, 16, dtype=f64, generator=g), torch.randn(50, 16, dtype=f64, generator=g)
    targets = torch.randint(0, 50, (3, 10), generator=g)
    loss, dx, dw = model_module.chunked_cross_entropy(x, w, targets, chunk)
    x_ref, w_ref = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    expected = F.cross_entropy((x_ref @ w_ref.t()).reshape(-1, 50), targets.reshape(-1))
    expected.backward()
    check_loss_and_gradients((loss, dx, dw), (expected.detach(), x_ref.grad, w_ref.grad), f"chunks of {chunk}")


def check_loss_and_gradients(got, want, case):
    """(loss, dx, dw_head) against F.cross_entropy's, in float64; a gradient off by a constant factor says so."""
    loss, dx, dw = got
    torch.testing.assert_close(loss, want[0], rtol=1e-12, atol=1e-12,
                               msg=lambda m: f"your chunked_cross_entropy's loss ({case}): {m}")
    for name, g, w in (("dx", dx, want[1]), ("dw_head", dw, want[2])):
        ratio = (g * w).sum() / (w * w).sum()
        if not torch.allclose(g, w, rtol=1e-10, atol=1e-12) and torch.allclose(g, ratio * w, rtol=1e-8, atol=1e-12):
            raise AssertionError(f"your chunked_cross_entropy's {name} ({case}) is {ratio.item():.4g} times "
                                 f"autograd's, while the loss is right: what is each row's gradient divided by?")
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12,
                                   msg=lambda m: f"your chunked_cross_entropy's {name} ({case}): {m}")


@pytest.mark.exercises("chunked_cross_entropy")
@pytest.mark.parametrize("chunk", [1, 7, 1000])
def test_ignored_targets_add_no_loss_and_get_no_gradient(chunk):
    # torch's convention: a target of -100 (IGNORE_INDEX) is no token. The loss is the sum over the real
    # targets divided by their count: F.cross_entropy(ignore_index=-100, reduction="sum") / count. Whole
    # rows and single tokens are ignored, in several chunks, so a mask applied to one chunk only shows.
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 10, 16, dtype=f64, generator=g), torch.randn(50, 16, dtype=f64, generator=g)
    targets = torch.randint(0, 50, (3, 10), generator=g)
    targets[0, 3], targets[1, 9], targets[2, :6] = -100, -100, -100
    count = int((targets != -100).sum())
    assert model_module.IGNORE_INDEX == -100 and model_module.real_tokens(targets) == count == 22
    loss, dx, dw = model_module.chunked_cross_entropy(x, w, targets, chunk)
    x_ref, w_ref = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    expected = F.cross_entropy((x_ref @ w_ref.t()).reshape(-1, 50), targets.reshape(-1), ignore_index=-100,
                               reduction="sum") / count
    expected.backward()
    assert not dx[2, :6].any(), \
        "your chunked_cross_entropy: the rows of ignored targets must get no gradient (dx rows of zeros)"
    check_loss_and_gradients((loss, dx, dw), (expected.detach(), x_ref.grad, w_ref.grad),
                             f"7 of 30 targets ignored, chunks of {chunk}")


@pytest.mark.exercises("chunked_cross_entropy")
def test_pieces_divided_by_the_whole_count_add_up_to_the_whole():
    # A parallel run hands each rank (or microbatch) a piece of the step and the step's count of real tokens,
    # n_tokens: the pieces' losses and gradients must add up to those of the whole batch.
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(4, 6, 16, dtype=f64, generator=g), torch.randn(50, 16, dtype=f64, generator=g)
    targets = torch.randint(0, 50, (4, 6), generator=g)
    targets[3, 2:] = -100  # the pieces hold different counts of real tokens
    whole = model_module.chunked_cross_entropy(x, w, targets, 5)
    n_tokens = model_module.real_tokens(targets)
    pieces = [model_module.chunked_cross_entropy(x[rows], w, targets[rows], 5, n_tokens)
              for rows in (slice(0, 2), slice(2, 4))]
    torch.testing.assert_close(pieces[0][0] + pieces[1][0], whole[0], rtol=1e-12, atol=1e-12,
                               msg=lambda m: f"your chunked_cross_entropy: the pieces' losses (each divided by "
                                             f"n_tokens) do not add up: {m}")
    torch.testing.assert_close(torch.cat([pieces[0][1], pieces[1][1]]), whole[1], rtol=1e-12, atol=1e-14,
                               msg=lambda m: f"your chunked_cross_entropy's dx, in pieces: {m}")
    torch.testing.assert_close(pieces[0][2] + pieces[1][2], whole[2], rtol=1e-12, atol=1e-14,
                               msg=lambda m: f"your chunked_cross_entropy's dw_head, summed over the pieces: {m}")


@pytest.mark.exercises("chunked_cross_entropy")
def test_chunked_cross_entropy_keeps_bf16_inputs_in_bf16():
    # The GPU benchmarks train in bf16: the loss is summed in float32, the gradients come back in
    # the inputs' dtypes, and they stay close to autograd's in float64 on the same bf16 inputs.
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 8, 16, generator=g).bfloat16(), torch.randn(50, 16, generator=g).bfloat16()
    targets = torch.randint(0, 50, (2, 8), generator=g)
    loss, dx, dw = model_module.chunked_cross_entropy(x, w, targets, 5)
    assert (loss.dtype, dx.dtype, dw.dtype) == (torch.float32, torch.bfloat16, torch.bfloat16), \
        (f"your chunked_cross_entropy's loss, dx, dw dtypes: {loss.dtype}, {dx.dtype}, {dw.dtype}; expected float32, "
         f"bfloat16, bfloat16")
    x_ref, w_ref = x.double().requires_grad_(True), w.double().requires_grad_(True)
    expected = F.cross_entropy((x_ref @ w_ref.t()).reshape(-1, 50), targets.reshape(-1))
    expected.backward()
    # Tolerances in units of bf16's roundoff u = 2^-8 (8 significant bits: rounding moves a value
    # by at most u of itself). Both sides start from the same bf16 numbers, so only the bf16
    # arithmetic differs. A gradient is rounded twice (dlogits to bf16, then the product with x or
    # w), each time by up to u, so we allow 2u of relative error in norm; the logits' own rounding
    # moves the float32 softmax much less here. Measured on these inputs: about u (a softmax computed
    # in bf16 instead of float32 gives about 3u). The loss, a mean over 16 tokens whose rounding
    # errors have random signs, is much closer: we allow u/4 (measured: below u/100).
    u = 2.0 ** -8
    assert abs(loss.item() - expected.item()) <= u / 4 * expected.item(), \
        f"your chunked_cross_entropy's bf16 loss {loss.item()} vs {expected.item()}"
    for name, got, want in (("dx", dx, x_ref.grad), ("dw_head", dw, w_ref.grad)):
        error = ((got.double() - want).norm() / want.norm()).item()
        assert error <= 2 * u, (f"your chunked_cross_entropy's {name}: relative error {error:.2e} against autograd in "
                                f"float64, allowed 2u = {2 * u:.2e}")


@pytest.mark.exercises("chunked_cross_entropy")
def test_chunked_cross_entropy_of_bf16_logits_near_100_keeps_its_statistics_in_float32():
    # A second, independent check of the precision rule. Every logit is 96 plus a multiple of 1/2 in
    # [-15, 15]: exactly representable in bf16 (its spacing is 1/2 from 64 to 128), so the bf16 product
    # x @ w_head.T rounds nothing, and the only rounding left is the statistics'. The log-sum-exp is about
    # 100: bf16 rounds it by up to 1/4, which moves a loss of about 6 by percents and every softmax entry
    # by up to e^(1/4); float32 rounds it by at most half its spacing 2^-17 there, 3.8e-6, under 1e-6 of the
    # loss. We allow 1e-5 on the loss (measured: 5e-8; a bf16 log-sum-exp gives 5e-3), and 2u on the head's
    # gradient as above (measured: 2.7e-3; with a bf16 log-sum-exp 6e-2).
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.ones(40, 1), torch.randint(-1, 2, (40, 15), generator=g).float()], dim=1).bfloat16()
    w = torch.cat([torch.full((50, 1), 96.0), torch.randint(-2, 3, (50, 15), generator=g) / 2], dim=1).bfloat16()
    targets = torch.randint(0, 50, (40,), generator=g)
    loss, _, dw = model_module.chunked_cross_entropy(x, w, targets, 7)
    w_ref = w.double().requires_grad_(True)
    expected = F.cross_entropy(x.double() @ w_ref.t(), targets)
    expected.backward()
    error = abs(loss.item() - expected.item()) / expected.item()
    assert error <= 1e-5, (f"your chunked_cross_entropy, bf16 logits near 100: loss {loss.item():.6f}, float64 gives {expected.item():.6f} (relative "
                           f"error {error:.1e}, allowed 1e-5): the log-sum-exp and the loss are statistics, computed "
                           f"in float32 (loss's dtype) even for bf16 inputs")
    u = 2.0 ** -8
    error = ((dw.double() - w_ref.grad).norm() / w_ref.grad.norm()).item()
    assert error <= 2 * u, (f"your chunked_cross_entropy, bf16 logits near 100: dw_head relative error {error:.1e} against float64, allowed 2u = "
                            f"{2 * u:.1e}: the softmax must come from the float32 log-sum-exp")


def reference_for(model):
    reference = ReferenceLlama(model.cfg)
    with torch.no_grad():
        reference.embedding.copy_(model.embedding)
        reference.final_norm.copy_(model.final_norm)
        reference.lm_head.copy_(model.lm_head)
    for ref_block, weights in zip(reference.blocks, model.blocks):
        ref_block.load(weights)
    return reference


@pytest.mark.exercises("LlamaModel.forward_blocks", "LlamaModel.backward_blocks", "chunked_cross_entropy")
def test_model_loss_and_every_gradient_match_an_nn_module_llama():
    # The chunked loss and the block have passed their own checks above: a wrong loss here points at the
    # forward loop, a wrong gradient with the right loss at the backward loop.
    model = model_module.LlamaModel(CFG, seed=3, dtype=f64, loss_chunk=7)
    g = torch.Generator().manual_seed(1)
    tokens, targets = torch.randint(0, 50, (2, 12), generator=g), torch.randint(0, 50, (2, 12), generator=g)
    loss, grads = model.forward_backward(tokens, targets)
    reference = reference_for(model)
    expected = reference.loss(tokens, targets)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-10, atol=1e-12,
                               msg=lambda m: f"your LlamaModel.forward_blocks: the model's loss: {m}")
    in_backward_order = [("d lm_head", grads.lm_head, reference.lm_head.grad),
                         ("d final_norm", grads.final_norm, reference.final_norm.grad)]
    for layer in reversed(range(CFG.n_layers)):
        in_backward_order += [(f"layer {layer} d{name}", getattr(grads.blocks[layer], name), want)
                              for name, want in reference.blocks[layer].grads().items()]
    in_backward_order.append(("d embedding", grads.embedding, reference.embedding.grad))
    try:
        assert_all_close(in_backward_order, rtol=1e-9, atol=1e-11)
    except AssertionError as error:
        raise AssertionError(f"your LlamaModel.backward_blocks, with the loss right: {error}") from None


class RecordingWeights:
    """A weight source that checks the protocol: get(l) only after gather(l), release after get,
    and at most two layers gathered and not yet released (double buffering). `record_compute` adds
    the block's forward and backward calls to the same log, so the log shows whether a layer's
    weights were released before or after the block computed with them."""

    def __init__(self, blocks):
        self.blocks, self.calls, self.pending = blocks, [], set()
        self.loop = "LlamaModel.forward_blocks"  # the loop making the calls, for the messages

    def record_loops(self, model):
        for name in ("forward_blocks", "backward_blocks"):
            def looping(*args, run=getattr(model, name), name=name):
                self.loop = f"LlamaModel.{name}"
                return run(*args)
            setattr(model, name, looping)

    def record_compute(self, block):
        for name in ("forward", "backward"):
            def computed(w, *args, run=getattr(block, name), name=name):
                layer = next(i for i, b in enumerate(self.blocks) if b is w)
                self.calls.append((name, layer))
                return run(w, *args)
            setattr(block, name, computed)

    def gather(self, layer):
        self.calls.append(("gather", layer))
        self.pending.add(layer)
        assert len(self.pending) <= 2, \
            f"your {self.loop}: gather({layer}) with layers {sorted(self.pending - {layer})} not yet released (two buffers)"

    def get(self, layer):
        self.calls.append(("get", layer))
        assert layer in self.pending, f"your {self.loop}: get({layer}) before gather({layer})"
        return self.blocks[layer]

    def release(self, layer):
        self.calls.append(("release", layer))
        assert ("get", layer) in self.calls, f"your {self.loop}: release({layer}) before get({layer})"
        self.pending.discard(layer)

    def invalidate(self):
        self.calls.append(("invalidate", None))


@pytest.mark.exercises("LlamaModel.forward_blocks", "LlamaModel.backward_blocks")
def test_the_model_loop_follows_the_weight_source_protocol():
    model = model_module.LlamaModel(CFG, seed=0)
    model.weights = source = RecordingWeights(model.blocks)
    source.record_compute(model.block)
    source.record_loops(model)
    tokens = torch.randint(0, 50, (1, 12))
    model.forward_backward(tokens, tokens)
    gets = [layer for call, layer in source.calls if call == "get"]
    loop = "forward_blocks" if gets[:3] != [0, 1, 2] else "backward_blocks"
    assert gets == [0, 1, 2, 2, 1, 0], \
        f"your LlamaModel.{loop}: layers were fetched in the order {gets}; expected forward then reverse"
    assert not source.pending, f"your {source.loop}: layers {sorted(source.pending)} were gathered and never released"
    # Prefetch: the next layer's gather is issued before this layer's get, so the fetch of l + 1
    # (l - 1 in backward) can run while layer l computes. A layer is released only after the block
    # has computed with it: after release(l) its buffer may be overwritten (modules 07 and 08).
    forward = [("gather", 0), ("gather", 1), ("get", 0), ("forward", 0), ("release", 0), ("gather", 2),
               ("get", 1), ("forward", 1), ("release", 1), ("get", 2), ("forward", 2), ("release", 2)]
    backward = [("gather", 2), ("gather", 1), ("get", 2), ("backward", 2), ("release", 2), ("gather", 0),
                ("get", 1), ("backward", 1), ("release", 1), ("get", 0), ("backward", 0), ("release", 0)]
    expected = forward + backward
    first = next((i for i, (a, b) in enumerate(zip(source.calls, expected)) if a != b), min(len(source.calls), len(expected)))
    def last_get(layer, before):
        return max(j for j, call in enumerate(source.calls[:before]) if call == ("get", layer))
    released_early = [(call, layer) for i, (call, layer) in enumerate(source.calls) if call in ("forward", "backward")
                      and ("release", layer) in source.calls[last_get(layer, i):i]]
    assert not released_early, (f"your LlamaModel.{released_early[0][0]}_blocks: layer {released_early[0][1]} was "
                                f"released before its {released_early[0][0]} ran: after release(l) a weight source "
                                "may overwrite l's buffer (07, 08), so release a layer only once the block has "
                                "computed with it")
    loop = "forward_blocks" if first < len(forward) else "backward_blocks"
    # The message shows the learner's own calls up to the first wrong one, not the whole expected order:
    # that order is the answer to both loops.
    start = 0 if loop == "forward_blocks" else len(forward)
    assert source.calls == expected, \
        (f"your LlamaModel.{loop}, call #{first - start} of the loop: expected "
         f"{expected[first] if first < len(expected) else 'no more calls'}, got "
         f"{source.calls[first] if first < len(source.calls) else 'no more calls'} (your calls up to there: "
         f"{source.calls[start:first + 1]})")


@pytest.mark.exercises("LlamaModel.backward_blocks")
def test_activation_stores_are_emptied_by_the_backward():
    model = model_module.LlamaModel(CFG, seed=0)
    stores = []
    new_store = model.block.new_store
    model.block.new_store = lambda: stores.append(new_store()) or stores[-1]
    tokens = torch.randint(0, 50, (1, 12))
    model.forward_backward(tokens, tokens)
    assert len(stores) == CFG.n_layers and all(not s.tensors for s in stores), \
        (f"your LlamaModel.backward_blocks left layers {[i for i, s in enumerate(stores) if s.tensors]}'s stores "
         f"full: each layer's store must be cleared after its backward, so its activations are freed")


@pytest.mark.exercises("LlamaModel.backward_blocks", "LlamaModel.forward_blocks", "chunked_cross_entropy")
def test_a_step_in_two_microbatches_is_a_step_on_the_whole_batch():
    # fit's contract (given code, on the learner's model): train_step divides every microbatch by the step's
    # real tokens, so two microbatches give the whole batch's step. float64: the gradients are summed in
    # another order; measured within 1e-16 after 3 steps, we allow 1e-12.
    cfg = LlamaConfig(n_layers=1, max_seq_len=16)
    _, whole = model_module.train(cfg, 3, batch=4, dtype=f64)
    _, halves = model_module.train(cfg, 3, batch=4, dtype=f64, n_microbatches=2)
    worst = max(abs(a - b) for a, b in zip(whole, halves, strict=True))
    assert worst <= 1e-12, f"losses of whole steps {whole}, of steps in 2 microbatches {halves}: off by {worst:.1e}"


@pytest.mark.exercises("LlamaModel.forward_blocks", "LlamaModel.backward_blocks", "chunked_cross_entropy")
def test_training_on_the_text_lowers_the_loss():
    torch.manual_seed(0)
    _, losses = model_module.train(LlamaConfig(n_layers=1, max_seq_len=32), steps=40, batch=8)
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 1.5, f"mean loss of the first 5 steps {first:.3f}, of the last 5 {last:.3f}"


@pytest.mark.given
def test_the_training_text_is_small_and_present():
    data = load_text()
    assert 10_000 < len(data) <= 200_000 and int(data.max()) < 256


@pytest.mark.given
def test_a_batch_longer_than_max_seq_len_is_rejected_before_any_work():
    model = model_module.LlamaModel(CFG, seed=0)
    tokens = torch.zeros(1, CFG.max_seq_len + 1, dtype=torch.long)
    with pytest.raises(ValueError, match="sequence length 13 is outside 1..max_seq_len=12"):
        model.forward_backward(tokens, tokens)


@pytest.mark.exercises("LlamaModel.backward_blocks")
def test_each_blocks_gradients_are_handed_on_as_soon_as_its_backward_is_done():
    # Module 14 starts sending a block's gradients while the earlier blocks' backwards still run:
    # the loop must say when each block's gradients are final, right after its release.
    model = model_module.LlamaModel(CFG, seed=0)
    model.weights = source = RecordingWeights(model.blocks)
    source.record_compute(model.block)
    handed = []
    model.on_block_grads = lambda layer, grads: (source.calls.append(("grads", layer)), handed.append(grads))
    tokens = torch.randint(0, 50, (1, 12))
    _, grads = model.forward_backward(tokens, tokens)
    backward = [c for c in source.calls if c[0] in ("backward", "release", "grads")][-9:]
    expected = [(kind, layer) for layer in (2, 1, 0) for kind in ("backward", "release", "grads")]
    assert backward == expected, (f"your LlamaModel.backward_blocks: backward, release and on_block_grads calls: "
                                  f"{backward}; expected {expected} (each layer's gradients handed on right after "
                                  f"its release)")
    assert all(h is g for h, g in zip(handed, reversed(grads.blocks))), \
        ("your LlamaModel.backward_blocks: on_block_grads(layer, grads) must receive that layer's gradients (the "
         "BlockWeights backward returned)")
