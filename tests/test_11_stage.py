"""Module 11: the stage's backward in two halves, I and W, against autograd on the monolith.

Every operation of SplitStage is the one autograd runs for the monolith (the same matmuls, the same
ReLU backward, the loss gradient from autograd itself), and the gradients of the M microbatches are
added in microbatch order, as autograd adds them into .grad over M backward calls. So the reference,
the monolith with gradient accumulation over the same microbatches, must be matched bit for bit.
"""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from course.impl import load, reference

m11 = load("m11_stage")
m00 = reference("m00_monolith")
CFG = m00.MLPConfig()


def _monolith_accumulated(n_microbatches):
    """Autograd's gradients of sum_m cross_entropy(microbatch m) / M, added over M backward calls."""
    model = m00.build_model(CFG)
    x, y = m00.make_batch(CFG)
    shares = []
    for xm, ym in zip(x.chunk(n_microbatches), y.chunk(n_microbatches)):
        share = F.cross_entropy(model(xm), ym) / n_microbatches
        share.backward()
        shares.append(share.detach())
    return model, shares


def _monolith_linears(model, stage, n_stages):
    per_stage = CFG.layers // n_stages
    layers = list(model.layers[stage * per_stage:(stage + 1) * per_stage])
    return layers + ([model.head] if stage == n_stages - 1 else [])


@pytest.mark.exercises("SplitStage.backward_input", "SplitStage.backward_weight")
@pytest.mark.parametrize("n_stages, n_microbatches", [(1, 1), (4, 2), (8, 4)])
def test_i_then_w_gives_autograds_gradients_bit_for_bit(n_stages, n_microbatches):
    model, want_shares = _monolith_accumulated(n_microbatches)
    stages = [m11.SplitStage(CFG, s, n_stages) for s in range(n_stages)]
    x, y = m00.make_batch(CFG)
    xs, ys = x.chunk(n_microbatches), y.chunk(n_microbatches)
    for m in range(n_microbatches):  # every forward first, every I next, the W's last (ZB-style)
        h = xs[m]
        for stage in stages:
            h = stage(h, m, ys[m], n_microbatches)
        assert torch.equal(h, want_shares[m]), f"microbatch {m}: loss share {h.item()}, autograd's {want_shares[m].item()}"
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
                    pytest.fail(f"{n_stages} stages, M={n_microbatches}: stage {s} linear {i} {what} gradient differs "
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


class _CountMatmuls(TorchDispatchMode):
    MATMULS = {"mm", "addmm", "bmm", "matmul", "linear", "baddbmm"}

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in self.MATMULS:
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.exercises("SplitStage.backward_input", "SplitStage.backward_weight")
@pytest.mark.parametrize("n_stages", [1, 4])
def test_no_matmul_is_done_twice(n_stages):
    # Autograd on the monolith does, per microbatch, one matmul per linear forward, one per weight
    # gradient and one per input gradient except the first layer's (the batch needs none).
    n_microbatches = 2
    with _CountMatmuls() as theirs:
        _monolith_accumulated(n_microbatches)
    stages = [m11.SplitStage(CFG, s, n_stages) for s in range(n_stages)]
    x, y = m00.make_batch(CFG)
    counts = {}
    with _CountMatmuls() as ours:
        for m, (xm, ym) in enumerate(zip(x.chunk(n_microbatches), y.chunk(n_microbatches))):
            before = ours.count
            for stage in stages:
                xm = stage(xm, m, ym, n_microbatches)
            counts["F"] = ours.count - before
            before, grad = ours.count, None
            for stage in reversed(stages):
                grad = stage.backward_input(m, grad)
            counts["I"] = ours.count - before
            before = ours.count
            for stage in stages:
                stage.backward_weight(m)
            counts["W"] = ours.count - before
    linears = CFG.layers + 1
    assert counts == {"F": linears, "I": linears - 1, "W": linears}, \
        (f"{n_stages} stages, one microbatch: matmuls per phase {counts}, expected F {linears}, I {linears - 1} "
         f"(no dx for the batch), W {linears}")
    assert ours.count == theirs.count, f"{ours.count} matmuls for {n_microbatches} microbatches, autograd does {theirs.count}"
