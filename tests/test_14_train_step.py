"""Module 14 gradient accumulation: d ranks x m micro-steps against one process on the whole batch,
with microbatches that hold different numbers of real (not padded) tokens.

Reference: course/reference_llama.py's ModularLlama (autograd) trained in one process on the whole
global batch, its loss F.cross_entropy(..., ignore_index=-100): the mean over every real token.

Every (d, m) with d m = 4 cuts the global batch of 8 sequences into the same 4 microbatches of 2
sequences; microbatch j has 0, 5, 11 and 15 of its 16 targets padded (one sequence's tail each),
so a loss averaged per microbatch weighs their tokens 1, 16/11, 16/5 and 16 times over: a
different loss, and different weights after a step.

Collectives arrive late (course/late_collectives.py): an asynchronous one delivers only at its
wait(), so a count read before its wait is wrong on every run, and the log says when the count was
waited for: only after the step's last bucket has left, so that nothing but the buckets is waited
for while the micro-steps compute (DDP's loop waits for no count at all).

Tolerance. The ranks and micro-steps sum each gradient in another order than one process: in
float64 (measured, torch 2.13 CPU, 3 AdamW steps) the weights stay within 2.4e-16 of one process
and the losses within 4.5e-16. We allow 1e-12. The per-microbatch mean misses by about 1e-3.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from course.impl import load, reference
from course.late_collectives import check_count_in_flight, check_waited, late_group, token_counts
from course.launch import run_ranks
from course.reference_llama import ModularLlama

dp = load("m14_data_parallel")
ts = load("m14_train_step")
LlamaConfig = reference("m06_llama_block").LlamaConfig

f64 = torch.float64
CFG = LlamaConfig(dim=16, n_heads=2, n_kv_heads=1, head_dim=8, ffn_dim=32, vocab_size=32, n_layers=2, max_seq_len=8)
BATCH, STEPS, LR, TOLERANCE = 8, 3, 1e-2, 1e-12
CAP = 2000  # about one bucket per linear layer pair: several buckets
PADDED = [0, 5, 11, 15]  # padded targets in each pair of sequences (microbatch j: sequences 2j, 2j + 1)


def build() -> ModularLlama:
    torch.manual_seed(0)
    return ModularLlama(CFG, f64)


def global_batch(step: int):
    """8 sequences of 8 tokens; the last PADDED[j] targets of the pair 2j, 2j + 1 (read end to end) are
    IGNORE_INDEX: sequence 2j + 1's tail, and sequence 2j's too when PADDED[j] > 8."""
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, CFG.vocab_size, (BATCH, CFG.max_seq_len), generator=g)
    targets = torch.randint(0, CFG.vocab_size, (BATCH, CFG.max_seq_len), generator=g)
    pairs = targets.view(BATCH // 2, 2 * CFG.max_seq_len)  # the 2 sequences of each pair end to end
    for j, n in enumerate(PADDED):
        if n:
            pairs[j, -n:] = ts.IGNORE_INDEX
    return tokens, targets


def one_process():
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        tokens, targets = global_batch(step)
        optimizer.zero_grad()
        logits = model(tokens)
        loss = F.cross_entropy(logits.reshape(-1, CFG.vocab_size), targets.reshape(-1), ignore_index=-100)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return [p.detach().clone() for p in model.parameters()], losses


def check_finish_follows_a_send(ddp, group):
    """On the rank: each finish() ends a backward that sent buckets; one that ran under no_sync() sent none."""
    finish, sent_before = ddp.finish, [0]

    def checked_finish():
        sent = sum(record.label.startswith("bucket") for record in group.collectives.log)
        assert sent > sent_before[0], (
            "your train_step called finish() after a micro-step whose backward sent no bucket (it ran under "
            "no_sync()): finish() ends a backward that sent")
        sent_before[0] = sent
        return finish()
    ddp.finish = checked_finish


def _accumulate(n_microbatches):
    group = late_group()
    in_flight = ts.global_token_count(global_batch(0)[1][ts.my_rows(BATCH, group)], group)
    count = in_flight.wait() if hasattr(in_flight, "wait") else in_flight  # an InFlight is asked for: the test says
    model = build()
    ddp = dp.replicate(model, group, CAP)
    check_finish_follows_a_send(ddp, group)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=LR)
    forwards = []  # collectives issued before each micro-step's forward
    model.register_forward_pre_hook(lambda module, args: forwards.append(len(group.collectives.log)))
    del group.collectives.log[:], group.collectives.waited_at[:]
    losses = []
    for step in range(STEPS):
        losses.append(ts.train_step(ddp, model, *global_batch(step), n_microbatches, optimizer))
        check_waited(group)
    buckets = [i for i, record in enumerate(group.collectives.log) if record.label.startswith("bucket")]
    return ([p.detach().clone() for p in model.parameters()], losses, forwards, buckets, len(ddp.buckets), count,
            token_counts(group))


@pytest.mark.exercises("train_step",
                        "DataParallel.ready",
                        "DataParallel.finish",
                        "broadcast_from_first",
                        "assign_buckets")
@pytest.mark.parametrize("world_size, n_microbatches", [(1, 4), (2, 2), (4, 1)])
def test_accumulation_over_uneven_microbatches_equals_one_process(world_size, n_microbatches):
    expected, expected_losses = one_process()
    real = int((global_batch(0)[1] != -100).sum())
    for rank, (weights, losses, forwards, buckets, n_buckets, count, counts) in enumerate(
            run_ranks(_accumulate, world_size, n_microbatches, timeout=60)):
        where = f"rank {rank} of d={world_size}, m={n_microbatches}"
        assert isinstance(count, torch.Tensor) and count.dtype == torch.int64 and count.dim() == 0, (
            f"{where}: the given global_token_count's wait() gave {count!r}: an InFlight (m12_tp_linear) whose wait() "
            f"gives a 0-d int64 tensor is asked for (an int64 sum is exact at any size, and the count is 8 bytes on "
            f"the wire as the formulas say)")
        assert count.item() == real, \
            (f"{where}: the given global_token_count gave {count.item()}, the global batch holds {real} real tokens "
             f"(every rank's targets that are not IGNORE_INDEX, summed over the group)")
        assert all(loss > 0 for loss in losses), (
            f"{where}: losses {losses}: a loss below zero comes from a count read before its wait() (here a "
            f"collective delivers only then, and an unfinished count reads as a huge negative number): your "
            f"train_step")
        gap = max(abs(a - b) for a, b in zip(losses, expected_losses, strict=True))
        assert gap <= TOLERANCE, (f"{where}: your train_step's losses {losses}, one process's {expected_losses}: the "
                                  f"step's loss is the mean over every real token of the global batch (train_step's "
                                  f"loss_sum holds this rank's summed token losses, n_tokens the step's count)")
        gap = max((a - b).abs().max().item() for a, b in zip(weights, expected, strict=True))
        assert gap <= TOLERANCE, (
            f"{where}: the weights after {STEPS} steps differ by {gap:.2e} from one process on the whole batch "
            f"(tolerance {TOLERANCE:g}), the losses do not; microbatches hold 16, 11, 5 and 1 real tokens: what do "
            f"your train_step's backwards differentiate, and are the gradients ddp keeps those of the step's mean "
            f"once the buckets' sums and the count have both arrived?")
        assert len(forwards) == STEPS * n_microbatches and len(buckets) == STEPS * n_buckets, \
            (f"{where}: {len(buckets)} buckets sent in {STEPS} steps of {n_buckets} buckets: each once a step (your "
             f"train_step)")
        for position in buckets:
            micro_step = sum(start <= position for start in forwards) - 1
            assert micro_step % n_microbatches == n_microbatches - 1, (
                f"{where}: a bucket was sent during micro-step {micro_step % n_microbatches}; gradient accumulation "
                f"sends only during the last one, {n_microbatches - 1} (your train_step: no_sync() around the others)")
        check_count_in_flight(where, counts, buckets, n_buckets, "your train_step")



# --- the loss sum in float64 whatever the model's dtype ---------------------------------------------------

class TokenLogits(torch.nn.Module):
    """A float32 model whose every token's loss is a whole number: token t's logits are (0, -K_t), its target
    is 1, so its cross-entropy is log(1 + exp(-K_t)) + K_t = K_t exactly in float32 (exp(-K_t) underflows to 0)."""

    def __init__(self, costs: torch.Tensor):
        super().__init__()
        self.table = torch.nn.Parameter(torch.stack([torch.zeros_like(costs), -costs], dim=1))

    def forward(self, tokens):
        return self.table[tokens]


# 4 microbatches of one sequence of 11 tokens, each token's loss an odd whole number near 1.4 million: each
# microbatch's summed loss is odd and under 2^24, so float32 holds it exactly (it is a sum of whole numbers,
# every partial sum under 2^24, in any order); from the second micro-step on, the rank's sum passes 2^24, where
# float32 holds only even numbers, and a float32 sum rounds. Float64 adds them exactly.
WHOLE_BATCH, WHOLE_SEQ = 4, 11
COSTS = 1_400_001 + 2 * torch.arange(WHOLE_BATCH * WHOLE_SEQ, dtype=torch.float32)  # odd, exact in float32


def _float32_losses():
    group = late_group()
    model = TokenLogits(COSTS)
    ddp = dp.replicate(model, group, CAP)
    tokens = torch.arange(WHOLE_BATCH * WHOLE_SEQ).view(WHOLE_BATCH, WHOLE_SEQ)
    targets = torch.ones_like(tokens)
    loss = ts.train_step(ddp, model, tokens, targets, WHOLE_BATCH, torch.optim.SGD(ddp.parameters(), lr=0.0))
    check_waited(group)
    return loss


@pytest.mark.exercises("train_step")
def test_the_loss_of_a_float32_model_is_summed_in_float64():
    # Each micro-step's loss is exact in float32 here, and so is a float64 sum of them: the step's loss is
    # sum(COSTS) / 44 to float64's last bit or two (we allow 1e-12 relative). A float32 running sum of the
    # micro-steps' losses rounds to an even number past 2^24: off by about 1e-8 relative.
    expected = sum(int(k) for k in COSTS) / COSTS.numel()
    [loss] = run_ranks(_float32_losses, 1, timeout=60)
    assert math.isclose(loss, expected, rel_tol=1e-12), (
        f"a float32 model whose micro-steps' summed losses are whole numbers over 2^24 together: your train_step "
        f"returned {loss!r}, the step's mean loss is {expected!r} (relative error {abs(loss / expected - 1):.1e}): "
        f"loss_sum adds the micro-steps' losses in float64 whatever the model's dtype (a float32 sum past 2^24 "
        f"keeps only even whole numbers)")
