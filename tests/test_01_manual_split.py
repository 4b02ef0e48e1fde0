"""Module 01: two hand-driven halves must train exactly like the monolith."""
import pytest
import torch
import torch.nn.functional as F

from course.impl import load, reference

m01 = load("m01_manual_split")
m00 = reference("m00_monolith")
cfg = m00.MLPConfig()


@pytest.mark.exercises("PartOne.__init__", "PartTwo.__init__")
def test_parts_start_from_the_monolith_weights():
    part_one, part_two = m01.build_parts(cfg)
    monolith = m00.build_model(cfg)
    half = cfg.layers // 2
    assert len(part_one.layers) == half and len(part_two.layers) == cfg.layers - half, \
        f"PartOne holds {len(part_one.layers)} layers and PartTwo {len(part_two.layers)}, expected {half} and {cfg.layers - half}"
    for i, layer in enumerate([*part_one.layers, *part_two.layers]):
        assert torch.equal(layer.weight, monolith.layers[i].weight), f"layer {i} weight differs"
        assert torch.equal(layer.bias, monolith.layers[i].bias), f"layer {i} bias differs"
    assert torch.equal(part_two.head.weight, monolith.head.weight), "head weight differs"
    assert torch.equal(part_two.head.bias, monolith.head.bias), "head bias differs"


@pytest.mark.exercises("PartOne.__init__", "PartTwo.__init__", "train_step")
def test_gradients_cross_the_boundary_exactly():
    part_one, part_two = m01.build_parts(cfg)
    received = []

    def check_boundary(module, args):  # before part two runs, so the message comes before any crash
        assert args[0].grad_fn is None and args[0].requires_grad, \
            "part two must receive a leaf (no autograd history) that requires grad, as a tensor arriving from another device would be"
        received.append(args[0])
    part_two.register_forward_pre_hook(check_boundary)
    frozen = torch.optim.SGD([*part_one.parameters(), *part_two.parameters()], lr=0.0)
    x, y = m00.make_batch(cfg)
    m01.train_step(part_one, part_two, frozen, x, y)

    # Reference: one autograd graph through the monolith, keeping the boundary's gradient.
    monolith = m00.build_model(cfg)
    hidden = x
    for layer in monolith.layers[: cfg.layers // 2]:
        hidden = F.relu(layer(hidden))
    hidden.retain_grad()
    out = hidden
    for layer in monolith.layers[cfg.layers // 2:]:
        out = F.relu(layer(out))
    F.cross_entropy(monolith.head(out), y).backward()

    (boundary,) = received
    assert torch.equal(boundary.grad, hidden.grad), "gradient at the boundary differs from the monolith's"
    mine = [*(("part_one." + n, p) for n, p in part_one.named_parameters()),
            *(("part_two." + n, p) for n, p in part_two.named_parameters())]
    for (name, p), q in zip(mine, monolith.parameters(), strict=True):
        assert p.grad is not None, f"{name} got no gradient: did part one's backward run?"
        assert torch.equal(p.grad, q.grad), f"the gradient of {name} differs from the monolith's"


@pytest.mark.exercises("PartOne.__init__", "PartTwo.__init__", "train_step")
def test_loss_curve_equals_the_monolith_bit_for_bit():
    (model, ours), (monolith_model, monolith) = m01.train(cfg), m00.train(cfg)
    first_bad = next((i for i, (a, b) in enumerate(zip(ours, monolith)) if a != b), None)
    assert first_bad is None, \
        f"step {first_bad}: expected loss {monolith[first_bad]!r}, got {ours[first_bad]!r}"
    x, y = m00.make_batch(cfg)
    assert torch.equal(model(x), monolith_model(x)), "the trained parts, in a row, are the trained monolith"
