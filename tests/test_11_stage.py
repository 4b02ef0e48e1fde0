"""Module 11: the stage's backward in two halves, I and W, against autograd on the monolith.

Every operation of SplitStage is the one autograd runs for the monolith (the same matmuls, the same
ReLU backward, the loss gradient from autograd itself), and the gradients of the M microbatches are
added in microbatch order, as autograd adds them into .grad over M backward calls. So the reference,
the monolith with gradient accumulation over the same microbatches (course/reference_pipelining.py's
`accumulating_monolith`), must be matched bit for bit: no tolerance.
"""
import copy

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from course.impl import load, reference
from course.reference_pipelining import accumulating_monolith

m11 = load("m11_stage")
m00 = reference("m00_monolith")
CFG = m00.MLPConfig(steps=1)


def _monolith_linears(model, stage, n_stages):
    per_stage = CFG.layers // n_stages
    layers = list(model.layers[stage * per_stage:(stage + 1) * per_stage])
    return layers + ([model.head] if stage == n_stages - 1 else [])


@pytest.mark.exercises("SplitStage.backward_input", "SplitStage.backward_weight")
@pytest.mark.parametrize("n_stages, n_microbatches", [(1, 1), (4, 2), (8, 4)])
def test_i_then_w_gives_autograds_gradients_bit_for_bit(n_stages, n_microbatches):
    model, (want_loss,) = accumulating_monolith(CFG, n_microbatches)  # its .grad: the step's gradient
    stages = [m11.SplitStage(CFG, s, n_stages) for s in range(n_stages)]
    x, y = m00.make_batch(CFG)
    xs, ys = x.chunk(n_microbatches), y.chunk(n_microbatches)
    shares = []
    for m in range(n_microbatches):  # every forward first, every I next, the W's last (ZB-style)
        h = xs[m]
        for stage in stages:
            h = stage(h, m, ys[m], n_microbatches)
        shares.append(h)
    assert sum(shares).item() == want_loss, f"loss {sum(shares).item()}, autograd's {want_loss} (given forward)"
    for m in range(n_microbatches):
        grad = None
        for stage in reversed(stages):
            grad = stage.backward_input(m, grad)
        assert grad is None, "the first stage's backward_input must return None: nothing before it needs dx"
    for m in range(n_microbatches):
        for stage in stages:
            stage.backward_weight(m)
    for s, stage in enumerate(stages):
        for i, (ours, theirs) in enumerate(zip(stage.linears(), _monolith_linears(model, s, n_stages), strict=True)):
            for what in ("weight", "bias"):
                got, want = getattr(ours, what).grad, getattr(theirs, what).grad
                assert got is not None, f"stage {s} linear {i}: {what}.grad is None after backward_weight"
                if not torch.equal(got, want):
                    hint = ("dz^T x, not its transpose x^T dz" if what == "weight" and torch.allclose(got.t(), want)
                            else f"{n_microbatches} microbatches' gradients must be added, not the last one kept"
                            if n_microbatches > 1 and torch.allclose(got * n_microbatches, want, rtol=0.3)
                            else "the ReLU mask is the layer's output > 0; dx = dz W")
                    pytest.fail(f"{n_stages} stages, m={n_microbatches}: stage {s} linear {i} {what} gradient differs "
                                f"from autograd's by up to {(got - want).abs().max().item():.2e}; {hint}")


@pytest.mark.exercises("SplitStage.backward_input", "SplitStage.backward_weight")
def test_i_leaves_what_w_needs_and_w_frees_the_microbatch():
    stage = m11.SplitStage(CFG, 1, 4)  # a middle stage: input from a stage before, output to one after
    autograd_layers = copy.deepcopy(stage.layers)
    x = torch.randn(8, CFG.hidden)
    out = stage(x, 5)
    assert list(stage.saved) == [5], f"after the forward, saved holds microbatches {list(stage.saved)}"
    grad_output = torch.randn_like(out)
    dx = stage.backward_input(5, grad_output)
    leaf = x.clone().requires_grad_()
    h = leaf
    for layer in autograd_layers:
        h = torch.relu(layer(h))
    h.backward(grad_output)
    assert dx is not None and torch.equal(dx, leaf.grad), \
        f"backward_input's dx differs from autograd's: the mask is the output > 0, and dx = dz W"
    computed = [name for name, p in stage.named_parameters() if p.grad is not None]
    assert not computed, f"backward_input set the gradients of {computed[:3]}: that is W's work"
    kept = stage.saved.get(5)
    assert kept is not None, "backward_input dropped the microbatch: W still needs its inputs and dz's"
    assert kept.grads is not None and len(kept.grads) == len(stage.linears()), \
        f"saved.grads must hold one dz per linear ({len(stage.linears())}), got {kept.grads if kept.grads is None else len(kept.grads)}"
    assert kept.output is None, "backward_input must drop saved.output (only I needs the mask): W keeps less"
    stage.backward_weight(5)
    assert stage.saved == {}, f"after backward_weight, saved still holds {list(stage.saved)}: the microbatch must be freed"
    for i, (ours, theirs) in enumerate(zip(stage.layers, autograd_layers)):
        for what in ("weight", "bias"):
            got, want = getattr(ours, what).grad, getattr(theirs, what).grad
            assert got is not None and torch.equal(got, want), f"layer {i}: {what} gradient differs from autograd's"


@pytest.mark.exercises("SplitStage.backward_input")
def test_i_computes_no_weight_gradient_on_the_last_stage_either():
    stage = m11.SplitStage(CFG, 3, 4)  # the last stage: the head and the loss
    x, y = torch.randn(8, CFG.hidden), torch.randint(0, CFG.classes, (8,))
    stage(x, 0, y, 1)
    stage.backward_input(0)
    computed = [name for name, p in stage.named_parameters() if p.grad is not None]
    assert not computed, f"backward_input set the gradients of {computed[:3]}...: that is W's work"
    kept = stage.saved[0]
    assert kept.logits is None and kept.targets is None, "backward_input must drop the logits and targets"


def _flops(run) -> int:
    """Floating-point operations of the matrix products `run()` does (PyTorch's FlopCounterMode)."""
    with FlopCounterMode(display=False) as counter:
        run()
    return counter.get_total_flops()


@pytest.mark.exercises("SplitStage.backward_input", "SplitStage.backward_weight")
@pytest.mark.parametrize("n_stages", [1, 4])
def test_no_matmul_is_done_twice(n_stages):
    # Autograd on the monolith does, per microbatch, one matmul per linear forward, one per weight
    # gradient and one per input gradient except the first layer's (the batch needs none). Counted
    # in floating-point operations: by hand per phase, and against autograd for the whole step.
    n_microbatches, rows = 2, CFG.batch // 2
    layer, head = 2 * rows * CFG.hidden * CFG.hidden, 2 * rows * CFG.hidden * CFG.classes  # one matmul each
    forward = CFG.layers * layer + head
    want = {"F": forward * n_microbatches, "I": (forward - layer) * n_microbatches, "W": forward * n_microbatches}
    stages = [m11.SplitStage(CFG, s, n_stages) for s in range(n_stages)]
    x, y = m00.make_batch(CFG)
    xs, ys = x.chunk(n_microbatches), y.chunk(n_microbatches)

    def forwards(m):
        h = xs[m]
        for stage in stages:
            h = stage(h, m, ys[m], n_microbatches)

    def inputs(m):
        grad = None
        for stage in reversed(stages):
            grad = stage.backward_input(m, grad)

    def weights(m):
        for stage in stages:
            stage.backward_weight(m)

    got = {"F": 0, "I": 0, "W": 0}
    for m in range(n_microbatches):
        for kind, phase in (("F", forwards), ("I", inputs), ("W", weights)):
            got[kind] += _flops(lambda: phase(m))
    assert got == want, \
        (f"{n_stages} stages, {n_microbatches} microbatches: matmul flops per phase {got}, expected {want}: I does "
         f"one matmul per linear except the batch's gradient ({layer} flops per microbatch: the first stage returns "
         f"None without computing it), W one per linear")
    autograd = _flops(lambda: accumulating_monolith(CFG, n_microbatches))
    assert sum(got.values()) == autograd, \
        f"{sum(got.values())} flops for {n_microbatches} microbatches, autograd on the monolith does {autograd}"
