"""Module 06 - a tiny Llama trained with a hand-written backward.

Embedding -> n_layers blocks (m06_llama_block) -> final RMSNorm -> LM head and cross-entropy.
The model loop asks a *weight source* for each layer's weights just before it needs them and
hands them back just after, so later modules can keep the weights elsewhere (sharded across
ranks in 07, in host memory in 08) without changing the loop. Here every weight is resident.

The LM head computes its loss and gradient a chunk of tokens at a time: with a real vocabulary,
the (N, V) logits are the largest tensor of the whole step, and no chunk needs another's. The loss
is a sum over the real targets (IGNORE_INDEX marks none) divided by the step's count of real tokens,
counted once (`real_tokens`), so that every later model, whatever piece of the step a rank holds,
divides by the same number.

`fit` is the Llama track's one training loop (given): modules 07, 12 and 13 plug their models into
it through `train_step`.
"""
from dataclasses import dataclass
from typing import Protocol

import torch

from course.dataset import load_text, random_batch
from .m06_llama_block import ActivationStore, BlockWeights, LlamaBlock, LlamaConfig, init_block_weights
from .m06_llama_ops import compute_dtype, rmsnorm_backward, rmsnorm_forward

LOSS_CHUNK = 1024  # tokens per LM-head chunk
IGNORE_INDEX = -100  # a target that is no token (padding): no loss, no gradient (torch's convention)


class WeightSource(Protocol):
    """Where the model loop gets each layer's weights. The loop calls, for every layer l in order:

        gather(l)   start making layer l's weights available (may return before they are);
                    called one layer ahead, so fetching l+1 overlaps computing l
        get(l)      wait until they are, and return them as a BlockWeights
        release(l)  the loop is done with them for now: their buffer may be reused

    and invalidate() after the optimizer changed the weights, so no stale copy is served.
    """

    def gather(self, layer: int) -> None: ...
    def get(self, layer: int) -> BlockWeights: ...
    def release(self, layer: int) -> None: ...
    def invalidate(self) -> None: ...


class ResidentWeights:
    """The trivial weight source: every layer's weights are always in memory."""

    def __init__(self, blocks: list[BlockWeights]):
        self.blocks = blocks

    def gather(self, layer: int) -> None:
        pass  # nothing to fetch

    def get(self, layer: int) -> BlockWeights:
        return self.blocks[layer]

    def release(self, layer: int) -> None:
        pass  # nothing to free

    def invalidate(self) -> None:
        pass  # the optimizer updated the only copy in place


def real_tokens(targets: torch.Tensor) -> int:
    """How many targets are real tokens, not IGNORE_INDEX (given): what a step's loss is divided by.

    Every model of the course divides the loss of each of its pieces (a rank's rows, a microbatch, a
    slice of the sequence) by the real tokens of the *whole step*, counted once, here: summed over
    the pieces, the losses and the gradients are then those of the step's mean."""
    return int((targets != IGNORE_INDEX).sum())


def chunked_cross_entropy(x: torch.Tensor, w_head: torch.Tensor, targets: torch.Tensor, chunk: int = LOSS_CHUNK,
                          n_tokens: int | None = None):
    """Cross-entropy of logits = x @ w_head.T against targets, summed over the real targets and
    divided by n_tokens, with its gradients.

    A target equal to IGNORE_INDEX (-100, torch's convention) is no token: it adds nothing to the
    loss and gets no gradient. n_tokens (default: the real targets given, real_tokens(targets)) is
    what the sum is divided by: the whole step's count when these tokens are only part of it.
    Returns (loss, dx, dw_head). Tokens are processed `chunk` at a time: a chunk's logits, their
    statistics and their gradient exist only while that chunk is processed.
    """
    xs, ts = x.reshape(-1, x.shape[-1]), targets.reshape(-1)
    n_rows = xs.shape[0]
    if n_tokens is None:
        n_tokens = real_tokens(targets)
    loss = torch.zeros((), dtype=compute_dtype(x.dtype), device=x.device)
    dx = torch.empty_like(xs)
    dw = torch.zeros(w_head.shape, dtype=compute_dtype(w_head.dtype), device=w_head.device)
    for start in range(0, n_rows, chunk):
        # >>> TODO(m06): the cross-entropy loss of one chunk of tokens, and its gradients
        # Contract: the chunk is the rows start .. start + chunk of xs (rows, dim) and ts (rows,), fewer in the last
        #   one. Add the chunk's summed loss to `loss` (the given code divides by n_tokens once, after the loop), write
        #   the chunk's rows of dx, and add the chunk's contribution to dw (vocab, dim). Afterwards, for any chunk size,
        #   (loss, dx, dw) are F.cross_entropy(x @ w_head.T, targets, ignore_index=-100, reduction="sum") / n_tokens and
        #   its gradients; an ignored row (target IGNORE_INDEX) adds no loss and gets a zero row of dx.
        # Precision: the logits, their statistics and the loss in loss's dtype (compute_dtype); the logits' gradient
        #   in x's dtype before it multiplies (the bf16 tests check the dtypes and bound the errors).
        # Maths: a token's loss is lse(z) - z_y, with z = its logits (a linear layer: w_head is (vocab, dim)), y its
        #   target and lse(z) = log Σ_j exp(z_j).
        # Question: what is dL/dz for one token's row, and what is every chunk's row divided by?
        # Pitfalls: divided by the chunk's size, by these rows' real tokens, or by n_tokens? What does an index of
        #   -100 pick from a row of logits? What does exp(z) give for logits near 100?
        # Hint 1: the chapter's "The loss and its gradient in one pass" works out the logistic loss: what is
        #         ∂ lse(z) / ∂z_j? From the logits' gradient, the head is a linear layer (your Matmul.backward).
        # Hint 2: dz = (softmax(z) - onehot(y)) / n_tokens per real row, 0 for an ignored one, with softmax(z) =
        #         exp(z - lse(z)); dx rows = dz W_head; dW_head += dzᵀ x.
        # Hint 3: stop = min(start + chunk, n_rows);  x_chunk, t_chunk = xs[start:stop], ts[start:stop]
        #         real = t_chunk != IGNORE_INDEX;  safe = torch.where(real, t_chunk, 0)
        #         logits = (x_chunk @ w_head.T).to(loss.dtype);  lse = torch.logsumexp(logits, dim=-1)
        #         loss += torch.where(real, lse - logits.gather(1, safe.unsqueeze(1)).squeeze(1), 0).sum()
        #         dlogits = torch.exp(logits - lse.unsqueeze(1));  dlogits[torch.arange(stop - start), safe] -= 1
        #         dlogits = (dlogits.masked_fill(~real[:, None], 0) / n_tokens).to(x.dtype)
        #         dx[start:stop] = dlogits @ w_head;  dw += dlogits.t() @ x_chunk
        stop = min(start + chunk, n_rows)
        x_chunk, t_chunk = xs[start:stop], ts[start:stop]
        real = t_chunk != IGNORE_INDEX
        safe = torch.where(real, t_chunk, 0)
        logits = (x_chunk @ w_head.t()).to(loss.dtype)
        lse = torch.logsumexp(logits, dim=-1)
        loss += torch.where(real, lse - logits.gather(1, safe.unsqueeze(1)).squeeze(1), 0).sum()
        dlogits = torch.exp(logits - lse.unsqueeze(1))
        dlogits[torch.arange(stop - start, device=x.device), safe] -= 1
        dlogits = (dlogits.masked_fill(~real.unsqueeze(1), 0) / n_tokens).to(x.dtype)
        dx[start:stop] = dlogits @ w_head
        dw += dlogits.t() @ x_chunk
        # <<<
    return loss / n_tokens, dx.reshape(x.shape), dw.to(w_head.dtype)


@dataclass
class LlamaGrads:
    """The gradients of one forward_backward. `blocks` has one entry per layer: a BlockWeights, or,
    for a model that keeps only a shard of each block (module 07), this rank's flat gradient shard."""
    embedding: torch.Tensor
    blocks: list[BlockWeights | torch.Tensor]
    final_norm: torch.Tensor
    lm_head: torch.Tensor

    def tensors(self) -> list[torch.Tensor]:
        blocks = (t for b in self.blocks for t in (b.tensors() if isinstance(b, BlockWeights) else (b,)))
        return [self.embedding, *blocks, self.final_norm, self.lm_head]


class LlamaModel:
    """Weights as plain tensors, a LlamaBlock to run them, and a weight source for the blocks."""

    def __init__(self, cfg: LlamaConfig, seed: int = 0, dtype=torch.float32, block: LlamaBlock | None = None,
                 loss_chunk: int = LOSS_CHUNK):
        generator = torch.Generator().manual_seed(seed)
        self.cfg, self.block, self.loss_chunk = cfg, block or LlamaBlock(cfg), loss_chunk
        self.embedding = torch.randn(cfg.vocab_size, cfg.dim, generator=generator, dtype=torch.float64).to(dtype)
        self.blocks = [init_block_weights(cfg, generator, dtype) for _ in range(cfg.n_layers)]
        self.final_norm = torch.ones(cfg.dim, dtype=dtype)
        self.lm_head = (torch.randn(cfg.vocab_size, cfg.dim, generator=generator, dtype=torch.float64)
                        / cfg.dim ** 0.5).to(dtype)
        self.weights: WeightSource = ResidentWeights(self.blocks)

    def parameters(self) -> list[torch.Tensor]:
        """In the same order as LlamaGrads.tensors()."""
        return [self.embedding, *(t for b in self.blocks for t in b.tensors()), self.final_norm, self.lm_head]

    def to(self, device) -> "LlamaModel":
        self.embedding, self.final_norm, self.lm_head = (t.to(device) for t in
                                                         (self.embedding, self.final_norm, self.lm_head))
        self.blocks[:] = [BlockWeights(*(t.to(device) for t in b.tensors())) for b in self.blocks]
        return self

    def forward_blocks(self, x: torch.Tensor, stores: list[ActivationStore]) -> torch.Tensor:
        """Run every block in order, each with its weights from the weight source and its own store."""
        n_layers = self.cfg.n_layers
        # >>> TODO(m06): the forward loop over the layers, weights from the weight source
        # Contract: run the blocks in order, block l with the BlockWeights self.weights.get(l) returns and its own store
        #   stores[l]; return the last block's output. The WeightSource protocol (above) is the only way to the weights,
        #   and a source may have only two buffers (modules 07 and 08), so afterwards the calls satisfy:
        #   - get(l) comes after gather(l), and gather(l + 1) (if that layer exists) before get(l): the fetch of the
        #     next layer runs while this one computes;
        #   - release(l) comes after block l has run (then its buffer may be overwritten);
        #   - at no time are more than two layers gathered and not yet released.
        #   The test records every call, the block's included: exactly one order meets all three.
        # Question: in what order must gather, get, run and release come so that every gather is as early as two
        #   buffers allow?
        # Pitfalls: a layer released before its block ran, or never released? A gather issued while two layers are
        #   still held?
        # Hint 1: the chapter's "The weight source, drawn" runs the loop with a source of three buffers: what changes
        #         when there are only two?
        # Hint 2: gather(0) before the loop; at layer l: gather(l + 1) if it exists, get(l), block l, release(l).
        # Hint 3: self.weights.gather(0)
        #         for layer in range(n_layers):
        #             if layer + 1 < n_layers: self.weights.gather(layer + 1)
        #             w = self.weights.get(layer);  x = self.block.forward(w, x, stores[layer]);  self.weights.release(layer)
        #         return x
        self.weights.gather(0)
        for layer in range(n_layers):
            if layer + 1 < n_layers:
                self.weights.gather(layer + 1)
            w = self.weights.get(layer)
            x = self.block.forward(w, x, stores[layer])
            self.weights.release(layer)
        return x
        # <<<

    def on_block_grads(self, layer: int, grads: BlockWeights) -> None:
        """Called by the backward loop as soon as a block's gradients are final (its backward has run
        and its weights are released): the moment a data-parallel model starts sending them (module
        14's buckets). Here: nothing to do."""

    def backward_blocks(self, dx: torch.Tensor, stores: list[ActivationStore]):
        """The blocks' backward in reverse order; returns (d_embedded_input, per-layer grads)."""
        n_layers = self.cfg.n_layers
        grads = [None] * n_layers
        # >>> TODO(m06): the backward loop, last layer first, weights from the weight source
        # Contract: dx is the gradient of the last block's output. Run the blocks' backwards from the last layer to the
        #   first, each with its weights and its store; return (dx, grads): the gradient of the first block's input and
        #   `grads`, one BlockWeights per layer in layer order (grads[l] is layer l's). Afterwards:
        #   - the weight source's calls obey forward_blocks' three rules with the layers in reverse order (the test
        #     records them and checks the one order they leave);
        #   - every store is empty: a layer's activations are not needed once its backward has run;
        #   - self.on_block_grads(l, grads[l]) was called for every layer, right after release(l) (module 14 starts
        #     sending a layer's gradients then, while the earlier layers' backwards still run).
        # Question: which calls mirror the forward loop, and at which point are a layer's gradients final?
        # Pitfalls: a gradient handed on after the loop, when every backward is done? A store kept until the next step?
        # Hint 1: your forward_blocks, read from the other end: what takes the place of the block's forward, and what
        #         does the backward leave behind that the forward did not?
        # Hint 2: gather(L - 1) before the loop; at layer l = L - 1 .. 0: gather(l - 1) if l > 0, get(l), block l's
        #         backward, clear its store, release(l), on_block_grads(l, grads[l]).
        # Hint 3: self.weights.gather(n_layers - 1)
        #         for layer in reversed(range(n_layers)):
        #             if layer > 0: self.weights.gather(layer - 1)
        #             w = self.weights.get(layer);  dx, grads[layer] = self.block.backward(w, dx, stores[layer])
        #             stores[layer].clear();  self.weights.release(layer);  self.on_block_grads(layer, grads[layer])
        #         return dx, grads
        self.weights.gather(n_layers - 1)
        for layer in reversed(range(n_layers)):
            if layer > 0:
                self.weights.gather(layer - 1)
            w = self.weights.get(layer)
            dx, grads[layer] = self.block.backward(w, dx, stores[layer])
            stores[layer].clear()
            self.weights.release(layer)
            self.on_block_grads(layer, grads[layer])
        return dx, grads
        # <<<

    def forward_backward(self, tokens: torch.Tensor, targets: torch.Tensor, n_tokens: int | None = None):
        """(loss, LlamaGrads) for next-token prediction on tokens (B, T) with targets (B, T): the loss
        summed over the real targets, divided by n_tokens (default: their count; a step of several
        pieces passes the whole step's, real_tokens of its targets), and its gradients."""
        self.cfg.check_seq_len(tokens.shape[1])
        stores = [self.block.new_store() for _ in range(self.cfg.n_layers)]
        x = self.forward_blocks(self.embedding[tokens], stores)
        n, r = rmsnorm_forward(x, self.final_norm, self.cfg.norm_eps)
        loss, dn, d_head = chunked_cross_entropy(n, self.lm_head, targets, self.loss_chunk, n_tokens)
        dx, d_final = rmsnorm_backward(dn, x, r, self.final_norm)
        dx, block_grads = self.backward_blocks(dx, stores)
        # The embedding is a lookup: its gradient adds each token's dx into that token's row.
        d_embedding = torch.zeros_like(self.embedding).index_add_(0, tokens.reshape(-1), dx.reshape(-1, self.cfg.dim))
        return loss, LlamaGrads(d_embedding, block_grads, d_final, d_head)

    def train_step(self, tokens: torch.Tensor, targets: torch.Tensor, n_microbatches: int, optimizer) -> float:
        """One optimizer step on the batch tokens, targets (B, T), in n_microbatches whose gradients add
        up; returns the step's mean loss over its real tokens. What `fit` calls: a parallel model
        (07, 12, 13) has its own, taking its share of the same global batch."""
        n_tokens = real_tokens(targets)  # every microbatch divides by the whole step's count
        loss, grads = 0.0, None
        for tok, tgt in microbatches(tokens, targets, n_microbatches):
            part, part_grads = self.forward_backward(tok, tgt, n_tokens)
            loss += part.item()
            grads = part_grads.tensors() if grads is None else \
                [g.add_(more) for g, more in zip(grads, part_grads.tensors(), strict=True)]
        for p, g in zip(self.parameters(), grads, strict=True):
            p.grad = g
        optimizer.step()
        self.weights.invalidate()  # the weights changed: a weight source must not serve old copies
        return loss

    @torch.no_grad()
    def next_token_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits for the token after each sequence of tokens (B, T): a forward that keeps nothing."""
        self.cfg.check_seq_len(tokens.shape[1])
        stores = [ActivationStore(keep=frozenset()) for _ in range(self.cfg.n_layers)]
        x = self.forward_blocks(self.embedding[tokens], stores)
        n, _ = rmsnorm_forward(x[:, -1], self.final_norm, self.cfg.norm_eps)
        return n @ self.lm_head.t()


# ---------------------------------------------------------------------------------------------
# Training on a byte-level text (course/dataset.py: bytes of Shakespeare, random windows)
# ---------------------------------------------------------------------------------------------
def microbatches(tokens: torch.Tensor, targets: torch.Tensor, n_microbatches: int):
    """The batch's rows cut into n_microbatches equal microbatches, as (tokens, targets) pairs (given)."""
    if n_microbatches < 1 or tokens.shape[0] % n_microbatches:
        raise ValueError(f"a batch of {tokens.shape[0]} rows cannot be cut into {n_microbatches} equal microbatches")
    return list(zip(tokens.chunk(n_microbatches), targets.chunk(n_microbatches), strict=True))


def fit(model, steps: int, batch: int = 16, lr: float = 3e-3, seed: int = 0, n_microbatches: int = 1, on_step=None):
    """The Llama track's one training loop (given): AdamW on random windows of the text; returns
    (model, losses).

    Every rank of a parallel run draws the same global batch of `batch` sequences from `seed`, and
    `model.train_step(tokens, targets, n_microbatches, optimizer)` does one optimizer step on all of
    it: each model takes its own share (module 07 its rows, module 12 all of it, module 13 its
    block of the mesh) and returns the step's mean loss over the global batch, the same on every
    rank. `on_step(step, loss)`, if given, is called after every step (the demos show progress)."""
    data, generator = load_text(), torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    for step in range(steps):
        tokens, targets = random_batch(data, batch, model.cfg.max_seq_len, generator)
        losses.append(model.train_step(tokens, targets, n_microbatches, optimizer))
        if on_step:
            on_step(step, losses[-1])
    return model, losses


def train(cfg: LlamaConfig, steps: int, batch: int = 16, lr: float = 3e-3, seed: int = 0, dtype=torch.float32,
          block: LlamaBlock | None = None, n_microbatches: int = 1, on_step=None):
    """Module 06's model trained by `fit` in one process; returns (model, losses). `block` runs the
    layers (default LlamaBlock(cfg)); the initial weights and the batches depend only on `seed`."""
    return fit(LlamaModel(cfg, seed, dtype, block=block), steps, batch, lr, seed, n_microbatches, on_step)
