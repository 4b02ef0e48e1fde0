"""Module 01: two hand-driven halves must train exactly like the monolith."""
import pytest
import torch
import torch.nn.functional as F

from course.impl import load, reference

m01 = load("m01_manual_split")
m00 = reference("m00_monolith")
cfg = m00.MLPConfig()
# The course's model, and a small one with an odd number of layers (part one takes 5 // 2 = 2, part
# two the other 3: "half" twice would lose one) and widths that differ from the course's 128 and 2.
CONFIGS = [cfg, m00.MLPConfig(layers=5, hidden=8, classes=3)]
CONFIG_IDS = ["16 layers", "5 layers, width 8, 3 classes"]


@pytest.mark.exercises("PartOne.__init__", "PartTwo.__init__")
@pytest.mark.parametrize("cfg", CONFIGS, ids=CONFIG_IDS)
def test_parts_start_from_the_monolith_weights(cfg):
    part_one, part_two = m01.build_parts(cfg)
    monolith = m00.build_model(cfg)
    half = cfg.layers // 2
    assert len(part_one.layers) == half and len(part_two.layers) == cfg.layers - half, \
        (f"cfg.layers = {cfg.layers}: PartOne holds {len(part_one.layers)} layers and PartTwo {len(part_two.layers)}, "
         f"expected {half} (cfg.layers // 2) and {cfg.layers - half} (the rest)")
    for name, part, expected in [("PartOne", part_one, 2 * half), ("PartTwo", part_two, 2 * (cfg.layers - half) + 2)]:
        registered = len(list(part.parameters()))
        assert registered == expected, \
            (f"{name} registers {registered} parameter tensors, expected {expected} (a weight and a bias per Linear): "
             "layers kept in a plain Python list are invisible to .parameters(); use nn.ModuleList")
    for i, layer in enumerate([*part_one.layers, *part_two.layers]):
        assert torch.equal(layer.weight, monolith.layers[i].weight), \
            (f"layer {i} weight differs from the monolith's (shape {tuple(layer.weight.shape)}, expected "
             f"{tuple(monolith.layers[i].weight.shape)}): same layers, same order, nothing else drawn?")
        assert torch.equal(layer.bias, monolith.layers[i].bias), f"layer {i} bias differs from the monolith's"
    for name in ("weight", "bias"):
        got, expected = getattr(part_two.head, name), getattr(monolith.head, name)
        assert torch.equal(got, expected), \
            (f"head {name} differs from the monolith's (shape {tuple(got.shape)}, expected {tuple(expected.shape)}): "
             "the head maps cfg.hidden to cfg.classes and is created after part two's layers")


@pytest.mark.exercises("PartOne.__init__", "PartTwo.__init__", "train_step")
@pytest.mark.parametrize("cfg", CONFIGS, ids=CONFIG_IDS)
def test_gradients_cross_the_boundary_exactly(cfg):
    part_one, part_two = m01.build_parts(cfg)
    assert len(part_one.layers) == cfg.layers // 2, \
        f"cfg.layers = {cfg.layers}: PartOne holds {len(part_one.layers)} layers, expected {cfg.layers // 2}"
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
    assert boundary.grad is not None, "the tensor part two received has no .grad after train_step: was the loss backpropagated?"
    same_weights = all(torch.equal(p, q) for p, q in zip([*part_one.parameters(), *part_two.parameters()],
                                                          monolith.parameters()))
    assert torch.equal(boundary.grad, hidden.grad), \
        (f"gradient at the boundary differs from the monolith's: |got| / |expected| = "
         f"{(boundary.grad.norm() / hidden.grad.norm()).item():.4g} (expected 1): " +
         ("the loss must be F.cross_entropy's mean over the batch, backpropagated once, with no extra scaling"
          if same_weights else "the parts do not start from the monolith's weights (see "
                               "test_parts_start_from_the_monolith_weights)"))
    mine = [*(("part_one." + n, p) for n, p in part_one.named_parameters()),
            *(("part_two." + n, p) for n, p in part_two.named_parameters())]
    assert len(mine) == len(list(monolith.parameters())), \
        (f"the parts register {len(mine)} parameter tensors, the monolith {len(list(monolith.parameters()))}: "
         "layers kept in a plain Python list are invisible to .parameters(); use nn.ModuleList")
    for (name, p), q in zip(mine, monolith.parameters(), strict=True):
        assert p.grad is not None, f"{name} got no gradient: did part one's backward run?"
        assert torch.equal(p.grad, q.grad), \
            (f"the gradient of {name} differs from the monolith's (max |difference| "
             f"{(p.grad - q.grad).abs().max().item():.3e}): is part one's backward seeded with the received tensor's .grad?")


@pytest.mark.exercises("PartOne.__init__", "PartTwo.__init__", "train_step")
def test_loss_curve_equals_the_monolith_bit_for_bit():
    (model, ours), (monolith_model, monolith) = m01.train(cfg), m00.train(cfg)
    first_bad = next((i for i, (a, b) in enumerate(zip(ours, monolith)) if a != b), None)
    assert first_bad is None, \
        f"step {first_bad}: expected loss {monolith[first_bad]!r}, got {ours[first_bad]!r}"
    x, y = m00.make_batch(cfg)
    assert torch.equal(model(x), monolith_model(x)), "the trained parts, in a row, are the trained monolith"
