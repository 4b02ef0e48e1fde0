"""Module 11 - a pipeline stage whose backward comes in two halves: I and W.

A layer y = relu(x W^T + b) has two gradients to compute in its backward, both from dz, the
gradient at its pre-activation:

    I  the gradient of its input x     what the stage before is waiting for: on the critical path
    W  the gradients of W and b        needed only by the optimizer step

Autograd computes both at once (module 05's B). Written by hand, they can run at different times:
I as soon as the gradient arrives, W later, in a gap where the rank would otherwise wait. Between
the two, the stage keeps what W needs: each layer's input x (kept since the forward) and its dz
(computed by I). That is the whole trick of the zero-bubble schedules.

A stage is a run of the monolith's Linear+ReLU layers; the last one also holds the head and
computes the loss. Its weights are the monolith's (replayed from the seed, as module 04 does), and
every operation is the one autograd runs in the monolith, so gradients match it bit for bit.
"""
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .m00_monolith import MLPConfig
from .m04_sharded import layer_range


@dataclass
class Saved:
    """What one microbatch's forward keeps on a stage until its backward has used it."""
    inputs: list[torch.Tensor]                # each layer's input, in order (the head's last, on the last stage)
    output: torch.Tensor | None = None        # the stage's output (its ReLU mask, for I); not on the last stage
    logits: torch.Tensor | None = None        # last stage: what the loss gradient is computed from (for I)
    targets: torch.Tensor | None = None
    n_microbatches: int = 1                   # the loss share is divided by it
    grads: list[torch.Tensor] | None = None   # set by I: dz of each layer (head last), what W needs with inputs


class SplitStage(nn.Module):
    """Stage `stage` of `n_stages`: its block of the monolith's layers (module 04's layer_range)."""

    def __init__(self, cfg: MLPConfig, stage: int, n_stages: int):
        super().__init__()
        mine = layer_range(cfg, stage, n_stages)  # refuses stages of unequal length
        self.stage, self.hidden = stage, cfg.hidden
        self.is_first, self.is_last = stage == 0, stage == n_stages - 1
        torch.manual_seed(cfg.seed)  # every stage draws every layer, so the weights are the monolith's
        self.layers = nn.ModuleList(_keep(cfg, mine))
        self.head = nn.Linear(cfg.hidden, cfg.classes) if self.is_last else None
        self.saved: dict[int, Saved] = {}  # microbatch -> what its backward still needs

    def linears(self) -> list[nn.Linear]:
        """The stage's linear layers in order, the head last on the last stage."""
        return [*self.layers, *([self.head] if self.is_last else [])]

    @torch.no_grad()
    def forward(self, x, microbatch: int, targets=None, n_microbatches: int = 1):
        """The stage's output for `x`, or on the last stage this microbatch's share of the loss:
        cross-entropy / n_microbatches. Keeps in self.saved[microbatch] what the backward needs."""
        inputs = []
        for layer in self.layers:
            inputs.append(x)
            x = F.relu(F.linear(x, layer.weight, layer.bias))  # the monolith's ops, in its order
        if not self.is_last:
            self.saved[microbatch] = Saved(inputs, output=x)
            return x
        inputs.append(x)
        logits = F.linear(x, self.head.weight, self.head.bias)
        self.saved[microbatch] = Saved(inputs, logits=logits, targets=targets, n_microbatches=n_microbatches)
        return F.cross_entropy(logits, targets) / n_microbatches

    @torch.no_grad()
    def backward_input(self, microbatch: int, grad_output=None):
        """I: the gradient of the stage's input for `microbatch` (None on the first stage, whose input
        is the batch), from the gradient of its output (`grad_output`; on the last stage, from the
        loss). Keeps in saved.grads each layer's dz for backward_weight, and drops what only I needed."""
        saved = self.saved[microbatch]
        # >>> TODO(m11): I: backpropagate through the layers to the input, keeping each layer's dz
        # Contract: returns dx, shape (rows, hidden), or None on the first stage; sets saved.grads to the dz of
        #   every linear, in self.linears() order (the head last on the last stage); then sets saved.output,
        #   saved.logits and saved.targets to None (W does not need them). Computes no weight gradient: every .grad
        #   is as it was. The tests compare dx and, after W, every .grad with autograd's on the monolith, bit for
        #   bit, and count the matmuls.
        # The question: from what the forward kept, which gradients must I compute, in which order, and which
        #   matmul is never needed?
        # Maths: a layer is y = relu(z), z = x Wᵀ + b; dz is the gradient at z. A layer's y is the next layer's input
        #   (saved.inputs[l + 1]); the last ReLU layer's is saved.output. On the last stage the head has no ReLU:
        #   its dz is loss_gradient(logits, targets, n_microbatches).
        # Pitfalls:
        # - is ReLU's mask read off the layer's input or its output?
        # - the weights are square (hidden x hidden): would the transposed product run, and would it be right?
        # - the first stage's dx is never used: is it computed anyway (a test counts the matmuls)?
        # Hint 1: walk the linears from the last to the first, as autograd would (docs/11, "The stage"): what
        #         arrives at each layer, and what does it hand to the layer before?
        # Hint 2: dz = dy where y > 0, else 0 (y the layer's output); dx = dz W, the dy of the layer before. On the
        #         last stage the head's dz is the loss gradient and its dx = dz_head W_head is the last ReLU layer's
        #         dy. Stage 0's layer 0 computes no dx.
        # Hint 3: dy = grad_output (last stage: dz_head = loss_gradient(...); grads = [dz_head]; dy = dz_head @ head.weight)
        #         for each ReLU layer l from the last: dz = torch.where(y_l > 0, dy, 0.0); keep dz;
        #             dy = None if l == 0 and self.is_first else dz @ layer_l.weight
        #         saved.grads = the kept dz's in layer order; output, logits, targets = None; return dy
        linears = self.linears()
        outputs = saved.inputs[1:] + ([] if self.is_last else [saved.output])  # each ReLU layer's output
        if self.is_last:
            dy = loss_gradient(saved.logits, saved.targets, saved.n_microbatches)
            grads = [dy]
            dy = dy @ self.head.weight
        else:
            dy, grads = grad_output, []
        for index in reversed(range(len(self.layers))):
            dz = torch.where(outputs[index] > 0, dy, 0.0)
            grads.append(dz)
            dy = None if index == 0 and self.is_first else dz @ linears[index].weight
        saved.grads = grads[::-1]  # collected from the last layer back
        saved.output = saved.logits = saved.targets = None
        return dy
        # <<<

    @torch.no_grad()
    def backward_weight(self, microbatch: int):
        """W: add this microbatch's weight and bias gradients to each parameter's .grad, from what I
        kept; then forget the microbatch."""
        # >>> TODO(m11): W: the weight gradients from saved inputs and I's dz's, accumulated into .grad
        # Contract: afterwards every linear's weight.grad and bias.grad (self.linears() order, None before a step's
        #   first W) hold the gradient of the loss summed over every microbatch whose W has run, from what the stage
        #   kept: each layer's input x since the forward and its dz since I (saved.grads). self.saved has no entry for
        #   the microbatch any more: its activations are freed. The tests compare every .grad with autograd's on the
        #   monolith, bit for bit, and count the matmuls.
        # The question: what are a linear's weight and bias gradients for a whole microbatch of rows, in terms of
        #   its x and dz, and how do m microbatches' gradients end up in one .grad?
        # Pitfalls:
        # - the hidden layers are square: would the transposed product run, and would it be right?
        # - does a later microbatch's W keep what an earlier one added?
        # - an entry left in self.saved keeps every microbatch alive: the measured peak memory then exceeds the
        #   simulator's, and the tests say so.
        # Hint 1: docs/11, "The stage", works one sample: what does each row of x and of dz add to dW and db, and
        #         which single product adds them all?
        # Hint 2: dW = dzᵀ x (out x in, like W) and db = Σ_rows dz, added to the .grad (set if None).
        # Hint 3: saved = self.saved.pop(microbatch)
        #         for layer, x, dz in zip(self.linears(), saved.inputs, saved.grads):
        #             for (param, grad) in (layer.weight, dz.t() @ x) and (layer.bias, dz.sum(0)):
        #                 param.grad = grad if param.grad is None else param.grad + grad (in place)
        saved = self.saved.pop(microbatch)
        for layer, x, dz in zip(self.linears(), saved.inputs, saved.grads, strict=True):
            for param, grad in ((layer.weight, dz.t() @ x), (layer.bias, dz.sum(0))):
                if param.grad is None:
                    param.grad = grad
                else:
                    param.grad += grad
        # <<<

    def backward(self, microbatch: int, grad_output=None):
        """B: the full backward, I then W; returns I's input gradient."""
        grad_input = self.backward_input(microbatch, grad_output)
        self.backward_weight(microbatch)
        return grad_input


def _keep(cfg: MLPConfig, mine: range) -> list[nn.Linear]:
    """Draw every layer of the monolith in order from the (already seeded) stream; keep those in `mine`."""
    kept = []
    for index in range(cfg.layers):
        layer = nn.Linear(cfg.hidden, cfg.hidden)
        if index in mine:
            kept.append(layer)
    return kept


def loss_gradient(logits, targets, n_microbatches: int):
    """d(loss share)/d(logits) for the share cross_entropy(logits, targets) / n_microbatches, computed
    by autograd on this small graph alone, so it is the monolith's to the last bit."""
    with torch.enable_grad():
        leaf = logits.detach().requires_grad_()
        return torch.autograd.grad(F.cross_entropy(leaf, targets) / n_microbatches, leaf)[0]
