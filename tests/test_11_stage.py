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
    fault = first_fault_of_i_then_w(n_stages, n_microbatches)
    if fault:
        pytest.fail(f"{n_stages} stages, m={n_microbatches}: {fault}")


def first_fault_of_i_then_w(n_stages: int, n_microbatches: int) -> str | None:
    """Run n_stages SplitStages ZB-style (every F, then every I, then every W) and compare each weight and
    bias gradient with autograd's on the monolith; None if all equal, else what differs and whose it is.
    The pieces come before the whole: W is first checked against the sums dz^T x, dz over what I kept
    (so a wrong W is named even when I is right), then the whole against autograd (then I is at fault)."""
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
        if grad is not None:
            return "the first stage's SplitStage.backward_input must return None: nothing before it needs dx"
    from_i = []  # per stage, per linear: (dz^T x, dz summed) added over the microbatches, from what I kept
    for s, stage in enumerate(stages):
        kept = [stage.saved.get(m) for m in range(n_microbatches)]
        if any(k is None or k.grads is None or len(k.grads) != len(stage.linears()) for k in kept):
            return (f"after SplitStage.backward_input, stage {s}'s saved must hold each microbatch's dz of every "
                    f"linear ({len(stage.linears())}) for W")
        from_i.append([(sum(k.grads[i].double().t() @ k.inputs[i].double() for k in kept),
                        sum(k.grads[i].double().sum(0) for k in kept)) for i in range(len(stage.linears()))])
    for m in range(n_microbatches):
        for stage in stages:
            stage.backward_weight(m)
    for s, stage in enumerate(stages):
        for i, (ours, theirs) in enumerate(zip(stage.linears(), _monolith_linears(model, s, n_stages), strict=True)):
            for what, expected in zip(("weight", "bias"), from_i[s][i]):
                got, want = getattr(ours, what).grad, getattr(theirs, what).grad
                where = f"stage {s} linear {i}'s {what} gradient"
                if got is None:
                    return f"{where} is None after SplitStage.backward_weight"
                if not torch.allclose(got.double(), expected, rtol=1e-5, atol=1e-6 * expected.abs().max().item()):
                    return (f"your SplitStage.backward_weight: {where} "
                            f"{_how_it_differs(got.double(), expected, what, n_microbatches, W_GIVEN, W_FORMULA)}")
                if not torch.equal(got, want):
                    return (f"your SplitStage.backward_input: {where} {_how_it_differs(got, want, what, n_microbatches)} "
                            "(W sums the dz's I kept as it should: those dz's are not autograd's)")
    return None


W_FORMULA = ("which of the layer's saved tensors does each weight's gradient multiply, in which order, and how do "
             "the microbatches' gradients combine? (chapter 11, one sample worked as a column vector)")
W_GIVEN = "the sum over the dz's and inputs I kept (what W is given)"


def _how_it_differs(got, want, what, n_microbatches, whose="autograd's",
                    otherwise="which tensor's sign does the ReLU's gradient read, and which side of W does dz multiply?") -> str:
    """How `got` differs from `want` (`whose`), relative to want's scale (a gradient can be 1e-8 small,
    so an absolute gap says nothing), and the likeliest cause: a transpose, a constant factor (one
    microbatch kept, or one added twice, or a mean for a sum), or else `otherwise`."""
    scale = want.abs().max().item()
    relative = (got - want).abs().max().item() / scale if scale else float("inf")
    said = f"differs from {whose} by up to {relative:.2g} of its largest entry ({scale:.2g}): "
    if got.shape != want.shape:
        return f"has shape {tuple(got.shape)}, {whose} {tuple(want.shape)}"
    if what == "weight" and got.shape[0] == got.shape[1] and torch.allclose(got.t(), want, rtol=1e-4, atol=1e-6 * scale):
        return said + "it is the transpose of it: the two factors of the product are swapped"
    factor = (got * want).sum().item() / (want * want).sum().item() if scale else 0.0
    if scale and abs(factor - 1) > 1e-3 and torch.allclose(got, factor * want, rtol=1e-3, atol=1e-6 * scale):
        causes = [(n_microbatches, f"every microbatch's gradient counted {n_microbatches} times"),
                  (1 / n_microbatches, "one microbatch's gradient kept: W adds into .grad, it does not overwrite"),
                  (2, "added twice: W run twice, or I's work counted in .grad as well")]
        cause = " or ".join(text for f, text in causes if f != 1 and abs(factor - f) < 1e-3 * max(1, f)) or \
            "a constant factor: a mean where a sum is asked (the bias sums dz over the rows), or a scale"
        return said + f"it is {factor:.4g} times that: {cause}"
    if n_microbatches > 1 and torch.allclose(got * n_microbatches, want, rtol=0.3, atol=0.3 * scale):
        return said + f"about 1/{n_microbatches} of it: the last microbatch's gradient kept, not the {n_microbatches} added"
    return said + f"not a constant factor of it: {otherwise}"


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
        ("your SplitStage.backward_input's dx differs from autograd's: which tensor's sign does the ReLU's gradient "
         "read, and which side of W does dz multiply?")
    computed = [name for name, p in stage.named_parameters() if p.grad is not None]
    assert not computed, f"your SplitStage.backward_input set the gradients of {computed[:3]}: that is W's work"
    kept = stage.saved.get(5)
    assert kept is not None, "your SplitStage.backward_input dropped the microbatch: W still needs its inputs and dz's"
    assert kept.grads is not None and len(kept.grads) == len(stage.linears()), \
        f"your SplitStage.backward_input: saved.grads must hold one dz per linear ({len(stage.linears())}), got {kept.grads if kept.grads is None else len(kept.grads)}"
    assert kept.output is None, "your SplitStage.backward_input must drop saved.output (only I needs the mask): W keeps less"
    stage.backward_weight(5)
    assert stage.saved == {}, f"after your SplitStage.backward_weight, saved still holds {list(stage.saved)}: the microbatch must be freed"
    for i, (ours, theirs) in enumerate(zip(stage.layers, autograd_layers)):
        for what in ("weight", "bias"):
            got, want = getattr(ours, what).grad, getattr(theirs, what).grad
            assert got is not None, f"layer {i}: {what}.grad is None after your SplitStage.backward_weight"
            assert torch.equal(got, want), \
                (f"layer {i}'s {what} gradient {_how_it_differs(got, want, what, 1, otherwise=W_FORMULA)} (dx is "
                 "right, so your SplitStage.backward_weight)")


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
    phases = {"I": "your SplitStage.backward_input (one matmul per linear but the batch's gradient: the first "
                    f"stage returns None without computing it, {layer} flops per microbatch less)",
              "W": "your SplitStage.backward_weight (one matmul per linear)", "F": "the given forward"}
    wrong = [f"{kind}: {got[kind]:,} counted, {want[kind]:,} expected ({got[kind] / want[kind]:.3g} times): {phases[kind]}"
             for kind in ("I", "W", "F") if got[kind] != want[kind]]
    assert not wrong, f"{n_stages} stages, {n_microbatches} microbatches, matmul flops per phase: " + "; ".join(wrong)
    autograd = _flops(lambda: accumulating_monolith(CFG, n_microbatches))
    assert sum(got.values()) == autograd, \
        f"{sum(got.values())} flops for {n_microbatches} microbatches, autograd on the monolith does {autograd}"
