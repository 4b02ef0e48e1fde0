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


@pytest.mark.exercises("PartTwo.__init__")
@pytest.mark.parametrize("cfg", CONFIGS, ids=CONFIG_IDS)
def test_parts_start_from_the_monolith_weights(cfg):
    # Each part is checked on its own, part one first (part two's draws come after part one's): the
    # message names the constructor whose layers, registration or order is off.
    part_one, part_two = m01.build_parts(cfg)
    monolith = m00.build_model(cfg)
    half = cfg.layers // 2
    for name, part, count in [("PartOne", part_one, half), ("PartTwo", part_two, cfg.layers - half)]:
        what = "cfg.layers // 2" if name == "PartOne" else "the rest: cfg.layers minus what PartOne took"
        assert len(part.layers) == count, \
            (f"cfg.layers = {cfg.layers}: your {name}.__init__ made {len(part.layers)} hidden layers, expected "
             f"{count} ({what})")
        expected = 2 * count + 2 * (name == "PartTwo")
        registered = len(list(part.parameters()))
        assert registered == expected, \
            (f"your {name}.__init__ registers {registered} parameter tensors, expected {expected} (a weight and a "
             f"bias per Linear): it holds {len(part.layers)} layers, but {name}.parameters() does not list all their "
             "tensors, so an optimizer given them would never update those layers")
    for i, layer in enumerate([*part_one.layers, *part_two.layers]):
        owner = "PartOne.__init__" if i < half else "PartTwo.__init__"
        for name in ("weight", "bias"):
            got, expected = getattr(layer, name), getattr(monolith.layers[i], name)
            assert got.shape == expected.shape and torch.equal(got, expected), \
                (f"layer {i} {name} differs from the monolith's (shape {tuple(got.shape)}, expected "
                 f"{tuple(expected.shape)}){f'; layers 0-{i - 1} are equal' if i else ''}: your {owner} makes other "
                 "random draws, or in another order, than the monolith's constructor up to this layer")
    for name in ("weight", "bias"):
        got, expected = getattr(part_two.head, name), getattr(monolith.head, name)
        assert got.shape == expected.shape and torch.equal(got, expected), \
            (f"head {name} differs from the monolith's (shape {tuple(got.shape)}, expected {tuple(expected.shape)}) "
             "while every layer is equal: your PartTwo.__init__ makes the head's draws in another place of the "
             "stream than the monolith, or another shape")


def parts_first(cfg):
    """The checks below train the parts, to grade train_step. Check first what the constructors must
    give them (their layers, registered, with the monolith's weights), naming the constructor at fault:
    a part built wrong would otherwise show as a wrong gradient or loss, blamed on train_step."""
    part_one, part_two = m01.build_parts(cfg)
    monolith = m00.build_model(cfg)
    half = cfg.layers // 2
    for name, part, count in [("PartOne", part_one, half), ("PartTwo", part_two, cfg.layers - half)]:
        registered, expected = len(list(part.parameters())), 2 * count + 2 * (name == "PartTwo")
        assert len(part.layers) == count and registered == expected, \
            (f"before training, cfg.layers = {cfg.layers}: your {name}.__init__ holds {len(part.layers)} layers and "
             f"registers {registered} parameter tensors, expected {count} layers and {expected} tensors (the optimizer "
             "updates only what .parameters() lists; test_parts_start_from_the_monolith_weights says more)")
    mine = [*part_one.parameters(), *part_two.parameters()]
    differs = next((i for i, (p, q) in enumerate(zip(mine, monolith.parameters())) if not torch.equal(p, q)), None)
    assert differs is None, \
        (f"before training: your {'PartOne' if differs < 2 * half else 'PartTwo'}.__init__ builds parameter tensors "
         "that differ from the monolith's initial ones (test_parts_start_from_the_monolith_weights says which)")
    return part_one, part_two


@pytest.mark.exercises("train_step", "PartTwo.__init__")
@pytest.mark.parametrize("cfg", CONFIGS, ids=CONFIG_IDS)
def test_gradients_cross_the_boundary_exactly(cfg):
    part_one, part_two = parts_first(cfg)
    received = []

    def check_boundary(module, args):  # before part two runs, so the message comes before any crash
        assert args[0].grad_fn is None, \
            ("your train_step hands part two a tensor with autograd history: part two must receive a leaf, as a tensor "
             "arriving from another device would be (its history stays on the sender's side)")
        assert args[0].requires_grad, \
            ("your train_step hands part two a leaf that does not require grad: where would the gradient that must "
             "cross the cut back to part one be left?")
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
    assert boundary.grad is not None, \
        "the tensor part two received has no .grad after your train_step: was the loss backpropagated?"
    ratio = (boundary.grad.norm() / hidden.grad.norm()).item()
    factor = (f" (the batch size: is the loss summed over the batch, not averaged?)"
              if abs(ratio - cfg.batch) < 1e-3 * cfg.batch else "")
    assert torch.equal(boundary.grad, hidden.grad), \
        (f"the gradient your train_step leaves at the boundary differs from the monolith's: |got| / |expected| = "
         f"{ratio:.4g}, expected 1{factor}. The loss is F.cross_entropy's mean over the batch, backpropagated once, "
         "with no extra scaling")
    mine = [*(("part_one." + n, p) for n, p in part_one.named_parameters()),
            *(("part_two." + n, p) for n, p in part_two.named_parameters())]
    for (name, p), q in zip(mine, monolith.parameters(), strict=True):
        assert p.grad is not None, f"{name} got no gradient from your train_step: did a backward run on part one's side?"
        assert torch.equal(p.grad, q.grad), \
            (f"the gradient your train_step leaves in {name} differs from the monolith's (max |difference| "
             f"{(p.grad - q.grad).abs().max().item():.3e}), while the boundary's is right: what is part one's "
             "backward started from?")


@pytest.mark.exercises("train_step", "PartTwo.__init__")
def test_loss_curve_equals_the_monolith_bit_for_bit():
    parts_first(cfg)
    (model, ours), (monolith_model, monolith) = m01.train(cfg), m00.train(cfg)
    first_bad = next((i for i, (a, b) in enumerate(zip(ours, monolith)) if a != b), None)
    assert first_bad is None, \
        f"step {first_bad}: expected loss {monolith[first_bad]!r}, got {ours[first_bad]!r} (your train_step, in train)"
    x, y = m00.make_batch(cfg)
    assert torch.equal(model(x), monolith_model(x)), "the trained parts, in a row, are the trained monolith"
