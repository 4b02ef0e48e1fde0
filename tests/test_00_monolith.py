"""Module 00 is given code; these checks guard the baseline that every other module is graded against."""
import torch

from course.impl import reference

m00 = reference("m00_monolith")


def test_training_is_deterministic_and_learns():
    (_, first), (_, second) = m00.train(), m00.train()
    assert first == second, "two runs with the same seed must give the same loss curve"
    assert len(first) == m00.MLPConfig().steps
    assert first[-1] < 0.5 * first[0], f"the loss should fall: {first[0]:.4f} -> {first[-1]:.4f}"


def test_batch_does_not_depend_on_the_global_random_state():
    x1, y1 = m00.make_batch()
    torch.rand(1000)  # anything a rank might draw before asking for the batch
    x2, y2 = m00.make_batch()
    assert torch.equal(x1, x2) and torch.equal(y1, y2)


def test_model_layers_are_created_in_order_from_the_seed():
    cfg = m00.MLPConfig()
    model = m00.build_model(cfg)
    torch.manual_seed(cfg.seed)
    first = torch.nn.Linear(cfg.hidden, cfg.hidden)  # the first draw after seeding
    assert torch.equal(model.layers[0].weight, first.weight)


def test_train_returns_the_trained_model_and_its_losses():
    model, losses = m00.train(m00.MLPConfig(steps=2))
    x, y = m00.make_batch()
    final = torch.nn.functional.cross_entropy(model(x), y).item()
    assert final < losses[0], "the model returned is the trained one: its loss is below the first step's"
