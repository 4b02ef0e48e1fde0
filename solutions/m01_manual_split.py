"""Module 01 - a manual split.

The monolith cut in two: part one holds layers 0-7, part two holds layers 8-15 and the head. Both
live in one process, but we drive them as if they were on two devices: the activation that leaves
part one is handed over as a fresh leaf tensor (what a receiving device would get), and its
gradient is handed back by hand. The loss curve must equal the monolith's bit for bit.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from .m00_monolith import MLPConfig, make_batch


class PartOne(nn.Module):
    """The first half of the layers."""

    def __init__(self, cfg: MLPConfig):
        super().__init__()
        # >>> TODO(m01): give part one the first half of the monolith's hidden layers
        # Contract: self.layers holds the monolith's layers 0 .. k-1, where k is half of cfg.layers
        # rounded down (part two takes the rest), each mapping cfg.hidden features to cfg.hidden, in
        # index order; forward (given) applies them with a ReLU after each.
        # Invariant: build_parts seeds once, then builds part one, then part two. Every layer draws
        # its initial weights from that one random stream as it is created, so the halves start from
        # the monolith's weights only if they create the same layers, with the same shapes, in the
        # same order as MonolithMLP.__init__ (solutions/m00_monolith.py) and draw nothing else.
        # Pitfalls: a layer too many or too few, or any other random draw here, shifts every later
        # weight: the grader compares each layer with the monolith's and names the first that
        # differs. Layers kept in a plain Python list are invisible to .parameters(): the optimizer
        # never updates them and the loss curve leaves the monolith's from step 1.
        # Hint 1: Do what the monolith's constructor does, for the first half of its layers only.
        # Hint 2: nn.Linear(in_features, out_features) draws its weights when it is created;
        #         nn.ModuleList registers a sequence of modules as parameters of this one; the
        #         count is cfg.layers // 2 (integer division).
        # Hint 3: self.layers <- a ModuleList of (cfg.layers // 2) square Linear layers of width
        #         cfg.hidden, created one after the other (a generator or a loop).
        self.layers = nn.ModuleList(nn.Linear(cfg.hidden, cfg.hidden) for _ in range(cfg.layers // 2))
        # <<<

    def forward(self, x):
        for layer in self.layers:
            x = F.relu(layer(x))
        return x


class PartTwo(nn.Module):
    """The second half of the layers, then the classification head."""

    def __init__(self, cfg: MLPConfig):
        super().__init__()
        # >>> TODO(m01): give part two the remaining hidden layers, then the classification head
        # Contract: self.layers holds the monolith's layers k .. cfg.layers-1 (k as in PartOne: all
        # the layers part one did not take), hidden to hidden, in index order; self.head maps
        # cfg.hidden features to cfg.classes logits. Together the parts hold exactly the monolith's
        # parameters.
        # Invariant: part two continues the random stream where part one stopped, so it must create
        # what the monolith creates after its first k layers, in the same order: the monolith
        # creates its head last.
        # Pitfalls: creating the head before the layers shifts every draw: the grader reports the
        # first layer whose weight differs (layer 8). Counting "half" again instead of "the rest"
        # goes wrong for an odd number of layers (the course's 16 would hide it).
        # Hint 1: Continue the monolith's construction where part one stopped: its other layers,
        #         then its head.
        # Hint 2: the count is cfg.layers minus what PartOne took; the head is an nn.Linear from
        #         cfg.hidden to cfg.classes, created after the ModuleList.
        # Hint 3: self.layers <- a ModuleList of (cfg.layers - cfg.layers // 2) Linear layers of
        #         width cfg.hidden
        #         self.head <- one Linear layer, hidden in, classes out (created second)
        self.layers = nn.ModuleList(
            nn.Linear(cfg.hidden, cfg.hidden) for _ in range(cfg.layers - cfg.layers // 2))
        self.head = nn.Linear(cfg.hidden, cfg.classes)
        # <<<

    def forward(self, x):
        for layer in self.layers:
            x = F.relu(layer(x))
        return self.head(x)


def build_parts(cfg: MLPConfig = MLPConfig()):
    # One seed, then part one before part two: the same random stream, in the same order, as the
    # monolith's construction, so both halves start from the monolith's weights.
    torch.manual_seed(cfg.seed)
    return PartOne(cfg), PartTwo(cfg)


def train_step(part_one: PartOne, part_two: PartTwo, optimizer, x, y) -> float:
    """One training step across the boundary between the parts; returns the loss."""
    optimizer.zero_grad()
    # >>> TODO(m01): forward and backward through both parts, handing the gradient back across the cut
    # Contract: x is the batch (batch, hidden), y its class labels (batch,). Leave in every
    # parameter's .grad, in both parts, exactly what one backward pass through the monolith would
    # leave there, and bind `loss` to the scalar loss tensor: the cross-entropy of part two's
    # logits against y (the given lines below step the optimizer and return its value).
    # The cut: part two must receive the activation as another device would, a tensor with the
    # same values but no autograd history (a leaf) that still collects the gradient reaching it.
    # The backward then runs in two pieces. Part two's stops at that leaf, whose gradient is
    # dloss/dhidden; part one's must be started by hand from it. The chain rule says that is
    # enough: dloss/dtheta = dloss/dhidden . dhidden/dtheta for every parameter theta of part one.
    # Pitfalls: handing part two the activation itself builds one big graph: the grader checks
    # what part two receives and says it must be a leaf that requires grad. A leaf that does not
    # require grad never gets a .grad (it stays None), so there is nothing to start part one's
    # backward from. Not starting it leaves part one without gradients: the grader names the
    # first parameter that "got no gradient". Gradients equal to the monolith's only bit for bit
    # if the arithmetic is the same: no extra scaling or reordering.
    # Hint 1: Make the hand-off explicit: run part one; make a history-free copy of its output
    #         that collects its gradient; run part two and the loss on that copy; backpropagate
    #         the loss (part two only); then backpropagate part one's output, seeded with the
    #         gradient that landed on the copy.
    # Hint 2: Tensor.detach() (same values, no history), Tensor.requires_grad_() (a leaf whose
    #         .grad autograd fills), F.cross_entropy(logits, labels), Tensor.backward() on the
    #         scalar loss, and Tensor.backward(gradient) on a non-scalar tensor: the
    #         vector-Jacobian product of that gradient through the tensor's graph.
    # Hint 3: hidden   <- part one of x
    #         received <- hidden, detached, made to require grad
    #         loss     <- cross-entropy of (part two of received) against y
    #         backward from loss                      (fills received.grad and part two's grads)
    #         backward from hidden, with received's .grad as its gradient   (part one's grads)
    hidden = part_one(x)
    received = hidden.detach().requires_grad_()
    loss = F.cross_entropy(part_two(received), y)
    loss.backward()
    hidden.backward(received.grad)
    # <<<
    optimizer.step()
    return loss.item()


def train(cfg: MLPConfig = MLPConfig()) -> tuple[nn.Sequential, list[float]]:
    """Train the two parts; return (the trained model, the loss of every step). The model is the
    two parts in a row: the same function as the monolith, cut in two."""
    part_one, part_two = build_parts(cfg)
    optimizer = torch.optim.Adam([*part_one.parameters(), *part_two.parameters()], lr=cfg.lr)
    x, y = make_batch(cfg)
    losses = [train_step(part_one, part_two, optimizer, x, y) for _ in range(cfg.steps)]
    return nn.Sequential(part_one, part_two), losses
