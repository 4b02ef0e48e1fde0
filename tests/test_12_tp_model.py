"""Module 12 model: module 06's Llama on t ranks against module 06's single-process model (the
trusted reference): the loss and every gradient of one batch, a short training run's loss curve and
weights, and PyTorch's own tensor parallelism (DTensor's parallelize_module) on the nn.Module Llama.

Tolerance. float64 throughout. One batch: the ranks sum partial products in another order, measured
within 8.9e-16 absolute on the loss and 1.7e-15 relative on the gradients (the norm weights drawn
around 1, t = 2 and 4, with and without sequence parallelism); AdamW then carries such
differences into the weights at ~1e-16 per step (measured: losses of 4 steps within 8.9e-16). We
allow 1e-12. A gradient off by a constant factor (a missing 1 / n_microbatches, a sum of norm
gradients taken twice) barely moves AdamW's update m / sqrt(v), yet still moves the losses by
~1e-8 or more: 10^4 times the tolerance.
"""
from unittest import mock

import pytest
import torch

from course.catalog import MODULES
from course.hints import module_todos
from course.impl import load, reference
from course.launch import run_ranks
from course.mesh import world_group
from course.reference_tp import dtensor_llama, dtensor_loss

model12 = load("m12_tp_model")
block12 = load("m12_tp_block")
m06 = reference("m06_llama_model")  # the single-process model: trusted code, not graded here
LlamaConfig = reference("m06_llama_block").LlamaConfig
BlockWeights = reference("m06_llama_block").BlockWeights

# forward_backward holds two TODOs: a message that knows the backward's is at fault quotes its title.
BACKWARD_TODO, FORWARD_TODO = (next(b.title for b in module_todos(MODULES["12"]) if b.function == "TPLlama.forward_backward"
                                    and ("backward" in b.title.split(": ", 1)[1]) == backward) for backward in (True, False))
f64 = torch.float64
CFG = LlamaConfig(dim=32, n_heads=8, n_kv_heads=4, head_dim=4, ffn_dim=24, n_layers=2, max_seq_len=16)
SMALL_VOCAB = LlamaConfig(**{**CFG.__dict__, "vocab_size": 50})  # 52 on 4 ranks: padding
ROWS, COLUMNS = ("wq", "wk", "wv", "w_gate", "w_up"), ("wo", "w_down")
BATCH, STEPS, LR = 8, 3, 3e-3
# The model's checks grade its own TODOs first: the block, the vocabulary and the linears have checks of their own.
PIECES = ("TPBlock.forward", "TPBlock.backward", "sum_norm_grads", "embedding_forward", "embedding_backward",
          "vocab_parallel_cross_entropy", "shard_block_weights")


def with_uneven_norms(model):
    """Module 06's model (in place) with its norm weights drawn around 1 instead of all ones: with every
    entry equal, one norm's weight used for another's, or left out of a backward, changes no number."""
    g = torch.Generator().manual_seed(4)
    for norm in [*(w for block in model.blocks for w in (block.ln1, block.ln2)), model.final_norm]:
        norm.add_(0.1 * torch.randn(norm.shape, generator=g, dtype=f64).to(norm.dtype))
    return model


def _forward_backward(sequence_parallel, tokens, targets):
    tp = world_group("t")
    model = model12.TPLlama(SMALL_VOCAB, tp, seed=3, dtype=f64, sequence_parallel=sequence_parallel, attention_chunk=5)
    whole = with_uneven_norms(m06.LlamaModel(SMALL_VOCAB, 3, f64))  # the norms are whole on every rank
    for mine, norms in zip(model.blocks, whole.blocks, strict=True):
        mine.ln1.copy_(norms.ln1), mine.ln2.copy_(norms.ln2)
    model.final_norm.copy_(whole.final_norm)
    # Two microbatches (one sequence each) into the same accumulators, each divided by the whole batch's tokens:
    # their losses and gradients add up to the whole batch's.
    n_tokens = tokens.numel()
    loss = sum(model.forward_backward(tokens[i:i + 1], targets[i:i + 1], n_tokens) for i in range(tokens.shape[0]))
    block12.sum_norm_grads(model.norm_grads(), tp, sequence_parallel)  # what train_step does after the last microbatch
    return loss, model.grads


def joined(results, name, layer=None):
    """The ranks' pieces of one gradient, put back together by the layout the chapter gives."""
    parts = [r[1].blocks[layer] if layer is not None else r[1] for r in results]
    parts = [getattr(p, name) for p in parts]
    if name in ("ln1", "ln2", "final_norm"):
        return parts[0]
    return torch.cat(parts, dim=1 if name in COLUMNS else 0)


@pytest.mark.exercises("TPLlama.forward_backward", *PIECES)
@pytest.mark.parametrize("world_size, sequence_parallel", [(2, False), (4, True)])
def test_the_loss_and_every_gradient_equal_module_06s_model(world_size, sequence_parallel):
    g = torch.Generator().manual_seed(1)
    tokens, targets = torch.randint(0, 50, (2, 12), generator=g), torch.randint(0, 50, (2, 12), generator=g)
    results = run_ranks(_forward_backward, world_size, sequence_parallel, tokens, targets, timeout=30)
    expected_loss, expected = with_uneven_norms(m06.LlamaModel(SMALL_VOCAB, 3, f64, loss_chunk=7)).forward_backward(
        tokens, targets)
    for rank, (loss, _) in enumerate(results):
        assert abs(loss.item() - expected_loss.item()) <= 1e-12, \
            (f"rank {rank}: loss {loss.item()} vs {expected_loss.item()} (the forward half of your "
             f"TPLlama.forward_backward: {FORWARD_TODO})")
    pieces = [("d lm_head", joined(results, "lm_head"), expected.lm_head),
              ("d final_norm", joined(results, "final_norm"), expected.final_norm)]
    for layer in reversed(range(CFG.n_layers)):
        pieces += [(f"layer {layer} d{name}", joined(results, name, layer), getattr(expected.blocks[layer], name))
                   for name in ("w_down", "w_gate", "w_up", "ln2", "wo", "wq", "wk", "wv", "ln1")]
    pieces.append(("d embedding", joined(results, "embedding"), expected.embedding))
    wrong, factors = [], []
    for name, got, want in pieces:  # the padding rows (embedding, LM head) must get exactly nothing
        if name in ("d lm_head", "d embedding") and got[want.shape[0]:].any():
            wrong.append(f"{name}: the padding rows got a gradient")
        error = ((got[:want.shape[0]] - want).abs().max() / want.abs().max()).item()
        if not error <= 1e-12:
            factor = ((got[:want.shape[0]] * want).sum() / (want * want).sum()).item()
            wrong.append(f"{name}: relative error {error:.1e}, {factor:.2f} times module 06's")
            factors.append(factor)
    # Norm gradients off by t (or 1/t) alone are summed once too often (or never): sum_norm_grads. Anything else
    # is the backward's.
    by_the_group = all(w.split(":")[0].endswith(("dln1", "dln2", "d final_norm")) for w in wrong) and all(
        min(abs(f - world_size), abs(f - 1 / world_size)) < 1e-9 for f in factors)
    where = (f"only the norms' gradients, {world_size} or 1/{world_size} times: your sum_norm_grads"
             + ("" if sequence_parallel else " (nothing to sum without sequence parallelism)")
             if by_the_group else f"the backward of your TPLlama.forward_backward: {BACKWARD_TODO}")
    assert not wrong, (f"t={world_size}, sequence parallel {sequence_parallel}, two microbatches accumulated: "
                       f"{len(wrong)} gradients differ from module 06's on the whole batch, first to last in backward "
                       f"order ({where}; each adds into its accumulator): " + "; ".join(wrong))


def _stores_left_full(tokens, targets):
    model = model12.TPLlama(SMALL_VOCAB, world_group("t"), seed=3, dtype=f64, sequence_parallel=True)
    stores, new_store = [], model.block.new_store
    model.block.new_store = lambda: stores.append(new_store()) or stores[-1]
    model.forward_backward(tokens, targets)
    return len(stores), [layer for layer, store in enumerate(stores) if store.tensors]


@pytest.mark.exercises("TPLlama.forward_backward", *PIECES)
def test_activation_stores_are_emptied_by_the_backward():
    tokens = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(1))
    for rank, (n_stores, full) in enumerate(run_ranks(_stores_left_full, 2, tokens, tokens, timeout=30)):
        assert n_stores == CFG.n_layers and not full, \
            (f"rank {rank}, your TPLlama.forward_backward ({BACKWARD_TODO}): the stores of layers {full} still hold "
             "activations after the backward: clear each layer's store after its block's backward, so its activations "
             "are freed as the backward goes")


class _KeepGradients:
    """An optimizer that keeps the gradients it is handed (a copy of each .grad) and changes nothing."""

    def __init__(self, parameters):
        self.parameters, self.grads = parameters, None

    def step(self):
        self.grads = [p.grad.clone() for p in self.parameters]


def _one_step(sequence_parallel, tokens, targets):
    tp = world_group("t")
    model = model12.TPLlama(SMALL_VOCAB, tp, seed=3, dtype=f64, sequence_parallel=sequence_parallel, attention_chunk=5)
    whole = with_uneven_norms(m06.LlamaModel(SMALL_VOCAB, 3, f64))
    for mine, norms in zip(model.blocks, whole.blocks, strict=True):
        mine.ln1.copy_(norms.ln1), mine.ln2.copy_(norms.ln2)
    model.final_norm.copy_(whole.final_norm)
    optimizer = _KeepGradients(model.parameters())
    calls = []  # how often the step sums the norms' gradients: once, after the last microbatch
    summed = model12.sum_norm_grads
    with mock.patch.object(model12, "sum_norm_grads", lambda *a, **k: calls.append(1) or summed(*a, **k)):
        loss = model.train_step(tokens, targets, 2, optimizer)
    g = optimizer.grads
    per_block = len(g[1:-2]) // len(model.blocks)
    blocks = [BlockWeights(*g[1 + i * per_block:1 + (i + 1) * per_block]) for i in range(len(model.blocks))]
    return loss, m06.LlamaGrads(g[0], blocks, g[-2], g[-1]), len(calls)


@pytest.mark.exercises("TPLlama.train_step", "sum_norm_grads", "TPLlama.forward_backward", *PIECES)
@pytest.mark.parametrize("world_size, sequence_parallel", [(2, False), (2, True)])
def test_one_step_hands_the_optimizer_the_gradient_of_the_batchs_mean_loss(world_size, sequence_parallel):
    # Two microbatches with different numbers of real tokens (ignored targets in the first): every microbatch
    # divides by the whole batch's real tokens, so the losses and gradients add up to module 06's on the whole batch.
    g = torch.Generator().manual_seed(5)
    tokens, targets = torch.randint(0, 50, (2, 12), generator=g), torch.randint(0, 50, (2, 12), generator=g)
    targets[0, :5] = -100
    results = run_ranks(_one_step, world_size, sequence_parallel, tokens, targets, timeout=30)
    expected_loss, expected = with_uneven_norms(m06.LlamaModel(SMALL_VOCAB, 3, f64)).forward_backward(tokens, targets)
    label = f"t={world_size}, sequence parallel {sequence_parallel}, 2 microbatches of 7 and 12 real tokens"
    loss = results[0][0]
    assert abs(loss - expected_loss.item()) <= 1e-12, \
        (f"{label}: your TPLlama.train_step returns {loss!r}, module 06's mean loss over the batch is "
         f"{expected_loss.item()!r} ({loss / expected_loss.item():.2f} times): every microbatch divides by the real "
         "tokens of the whole batch")
    names = [(f"layer {layer} d{name}", joined(results, name, layer), getattr(expected.blocks[layer], name))
             for layer in range(CFG.n_layers) for name in ("ln1", "wq", "wk", "wv", "wo", "ln2", "w_gate", "w_up", "w_down")]
    pieces = [("d embedding", joined(results, "embedding"), expected.embedding), *names,
              ("d final_norm", joined(results, "final_norm"), expected.final_norm),
              ("d lm_head", joined(results, "lm_head"), expected.lm_head)]
    wrong = [(name, ((got[:want.shape[0]] * want).sum() / (want * want).sum()).item()) for name, got, want in pieces
             if not ((got[:want.shape[0]] - want).abs().max() / want.abs().max()).item() <= 1e-12]
    # Norm gradients alone off by t (or 1/t), summed once a step: sum_norm_grads sums wrongly. Summed more or less
    # often than once a step (the first microbatch's partial sums counted t times), or anything else: train_step.
    calls = results[0][2]
    norms = all(name.endswith(("dln1", "dln2", "d final_norm")) for name, _ in wrong) and calls == 1 and all(
        min(abs(f - world_size), abs(f - 1 / world_size)) < 1e-9 for _, f in wrong)
    culprit = ("your sum_norm_grads (the norms' gradients summed over the group once per step, only with sequence "
               "parallelism)" if norms else "your TPLlama.train_step (each microbatch's gradient added into the "
               "accumulators, divided by the whole batch's real tokens; the norms' gradients summed once, after the "
               f"last microbatch: it called sum_norm_grads {calls} times; each .grad its accumulator)")
    assert not wrong, (f"{label}: {len(wrong)} of the {len(pieces)} gradients handed to the optimizer differ from "
                       "module 06's on the whole batch: " + ", ".join(f"{n} {f:.2f} times" for n, f in wrong[:4])
                       + (", ..." if len(wrong) > 4 else "") + f"; look at {culprit}")


def _train(sequence_parallel, n_microbatches):
    model = model12.TPLlama(CFG, world_group("t"), dtype=f64, sequence_parallel=sequence_parallel)
    model, losses = m06.fit(model, STEPS, BATCH, LR, n_microbatches=n_microbatches)
    return losses, torch.cat([model.embedding, model.lm_head], dim=1), model.blocks[0].wq, model.final_norm


@pytest.mark.exercises("TPLlama.train_step", "TPLlama.forward_backward", *PIECES)
@pytest.mark.parametrize("world_size, sequence_parallel, n_microbatches", [(2, True, 1), (4, False, 2), (4, True, 2)])
def test_training_reproduces_the_single_process_loss_curve(world_size, sequence_parallel, n_microbatches):
    results = run_ranks(_train, world_size, sequence_parallel, n_microbatches, timeout=60)
    reference_model, expected = m06.train(CFG, STEPS, BATCH, lr=LR, dtype=f64)
    for rank, (losses, _, _, _) in enumerate(results):
        worst = max(abs(a - b) for a, b in zip(losses, expected, strict=True))
        assert worst <= 1e-12, (f"rank {rank}: losses {losses} vs single-process {expected}: off by {worst:.2e}"
                                f"{curve_hint(losses, expected, n_microbatches, sequence_parallel)}")
    embedding_and_head = torch.cat([r[1] for r in results])[:CFG.vocab_size]
    want = torch.cat([reference_model.embedding, reference_model.lm_head], dim=1)
    worst = (embedding_and_head - want).abs().max().item()
    assert worst <= 1e-12, f"after {STEPS} steps the embedding and LM head differ by {worst:.2e}"
    worst = (torch.cat([r[2] for r in results]) - reference_model.blocks[0].wq).abs().max().item()
    assert worst <= 1e-12, f"after {STEPS} steps block 0's wq differs by {worst:.2e}"
    worst = max((r[3] - reference_model.final_norm).abs().max().item() for r in results)
    assert worst <= 1e-12, f"after {STEPS} steps the final norm differs by {worst:.2e} on some rank"


def curve_hint(losses: list[float], expected: list[float], n_microbatches: int, sequence_parallel: bool) -> str:
    """What the gap between two loss curves points at. Measured with planted mistakes (t = 4, 2 microbatches):
    each microbatch's loss divided by its own tokens makes every step's loss n_microbatches times the
    mean (a gap of 6); norm gradients summed over the group without sequence parallelism, t times too
    big, barely change AdamW's update: a gap of 1.6e-8, from the second step on; with sequence
    parallelism, summed after every microbatch instead of once per step (the first microbatch's counted
    t times): 7.5e-4, from the second step on."""
    if all(abs(a / b - n_microbatches) < 1e-6 for a, b in zip(losses, expected)) and n_microbatches > 1:
        return (f" (every loss is {n_microbatches} times the mean: does your TPLlama.train_step pass every microbatch "
                f"the real tokens of the whole batch, not let it count its own?)")
    if abs(losses[0] - expected[0]) > 1e-12:
        return ""
    worst = max(abs(a - b) for a, b in zip(losses, expected))
    gap = ("off by less than 1e-5: not rounding, but a gradient off by a constant factor, which AdamW barely notices"
           if worst < 1e-5 else f"off by up to {worst:.1e}: the first step's gradient was wrong")
    if sequence_parallel:
        culprit = (", e.g. the norms' gradients summed more than once per step (after every microbatch, or twice): "
                   "your TPLlama.train_step and sum_norm_grads")
    elif worst < 1e-5:
        culprit = ": your sum_norm_grads must leave the norms' gradients alone without sequence parallelism"
    else:
        culprit = "; the checks of one batch's gradients say which"
    return f" (the first loss is right and the later ones {gap}{culprit})"


def _train_bf16(sequence_parallel):
    model = model12.TPLlama(CFG, world_group("t"), dtype=torch.bfloat16, sequence_parallel=sequence_parallel)
    model, losses = m06.fit(model, STEPS, BATCH, LR, n_microbatches=2)
    return losses, {p.dtype for p in model.parameters()}


@pytest.mark.exercises("TPLlama.train_step", "vocab_parallel_cross_entropy", "embedding_backward",
                        "TPLlama.forward_backward", *PIECES[:3], *PIECES[3:4], *PIECES[6:])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["replicated", "sequence-parallel"])
def test_training_in_bfloat16_follows_the_single_process_bfloat16_run(sequence_parallel):
    # bf16 weights: every gradient handed back (embedding rows, logits, .grad) must come back in the
    # weights' dtype. The ranks round their partial sums at 2^-9 relative in another order than one
    # process: measured within 6.7e-4 of module 06's bf16 losses (~6) over 3 steps. We allow 1e-2.
    results = run_ranks(_train_bf16, 2, sequence_parallel, timeout=60)
    _, expected = m06.train(CFG, STEPS, BATCH, lr=LR, dtype=torch.bfloat16)
    for rank, (losses, dtypes) in enumerate(results):
        assert dtypes == {torch.bfloat16}, \
            (f"rank {rank}: the parameters became {dtypes} in training: your TPLlama.train_step hands the optimizer "
             f"float32 gradients for bf16 weights")
        worst = max(abs(a - b) for a, b in zip(losses, expected, strict=True))
        assert worst <= 1e-2, f"rank {rank}: bf16 losses {losses} vs single-process bf16 {expected}: off by {worst:.1e}"


def _train_dtensor(sequence_parallel):
    from course.dataset import load_text, random_batch
    llama = dtensor_llama(m06.LlamaModel(CFG, 0, f64), sequence_parallel)
    optimizer = torch.optim.AdamW(llama.parameters(), lr=LR, weight_decay=0.0)
    data, generator = load_text(), torch.Generator().manual_seed(0)
    losses = []
    for _ in range(2):
        tokens, targets = random_batch(data, BATCH, CFG.max_seq_len, generator)
        losses.append(dtensor_loss(llama, tokens, targets))
        optimizer.step()
        optimizer.zero_grad()
    return losses, _train(sequence_parallel, 1)[0][:2]


@pytest.mark.exercises("TPLlama.train_step", "TPLlama.forward_backward", *PIECES)
def test_losses_match_pytorch_dtensor_tensor_parallelism():
    theirs, ours = run_ranks(_train_dtensor, 2, True, timeout=90)[0]
    # DTensor runs the nn.Module reference (PyTorch's attention and RMSNorm kernels, RoPE as complex
    # numbers) with ColwiseParallel / RowwiseParallel / SequenceParallel and loss_parallel: the same
    # maths, rounded its own way. Measured on torch 2.13 CPU, float64: identical losses over 4 steps;
    # we allow 1e-10 rather than demand equality another release need not keep.
    worst = max(abs(a - b) for a, b in zip(theirs, ours, strict=True))
    assert worst <= 1e-10, f"DTensor losses {theirs}, ours {ours}: max difference {worst:.2e}"
