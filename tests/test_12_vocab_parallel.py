"""Module 12 vocabulary parallelism: the padded vocabulary, the cross-entropy of logits sharded over
the vocabulary against F.cross_entropy (and autograd) on the gathered, unpadded logits, and the
embedding against a lookup of the whole table.

Tolerance: float64, the only difference is the order of the sums over the vocabulary (measured
within 2.2e-16 relative on the loss); we allow 1e-12 relative. The float32 test is explained where it is.
"""
import pytest
import torch
import torch.nn.functional as F

from course.impl import load
from course.launch import run_ranks
from course.mesh import world_group

vocab = load("m12_vocab_parallel")
f64 = torch.float64
VOCAB, N = 50, 24


@pytest.mark.given
@pytest.mark.parametrize("vocab_size, t, divisible_by, padded", [
    (50, 4, 1, 52), (256, 4, 1, 256), (50, 4, 8, 64), (50, 3, 1, 51), (1, 2, 128, 256)])
def test_the_vocabulary_is_padded_to_a_multiple_of_t(vocab_size, t, divisible_by, padded):
    got = vocab.padded_vocab_size(vocab_size, t, divisible_by)
    assert got == padded, f"vocabulary {vocab_size} on t={t} (divisible_by={divisible_by}): got {got}, expected {padded}"


def logits_with_padding(t, dtype=f64, scale=1.0, seed=0):
    """Whole logits (N, VOCAB), and the same padded to a multiple of t with columns that would win
    everything if counted: +1000, so a max taken before they are masked is theirs, and every real
    logit's exponential then underflows to 0."""
    g = torch.Generator().manual_seed(seed)
    logits = (scale * torch.randn(N, VOCAB, generator=g, dtype=f64)).to(dtype)
    targets = torch.randint(0, VOCAB, (N,), generator=g)
    padded = -(-VOCAB // t) * t
    garbage = torch.full((N, padded - VOCAB), 1000.0, dtype=dtype)
    return logits, targets, torch.cat([logits, garbage], dim=1)


def _loss_on_ranks(padded_logits, targets, n_tokens=None):
    tp = world_group("t")
    loss, dlogits = vocab.vocab_parallel_cross_entropy(padded_logits.chunk(tp.size, dim=1)[tp.index].clone(), targets,
                                                       VOCAB, tp, n_tokens)
    return loss, dlogits, [(c.op, c.payload_bytes) for c in tp.collectives.log]


@pytest.mark.exercises("vocab_parallel_cross_entropy")
@pytest.mark.parametrize("world_size", [3, 4])
def test_the_loss_equals_cross_entropy_of_the_gathered_unpadded_logits(world_size):
    # The loss of this piece of a step of 2 N tokens: summed over its N real targets, divided by 2 N (module
    # 06's convention: every piece divides by the step's count); against F.cross_entropy's mean, halved.
    logits, targets, padded = logits_with_padding(world_size)
    results = run_ranks(_loss_on_ranks, world_size, padded, targets, 2 * N, timeout=30)
    leaf = logits.clone().requires_grad_(True)
    expected = 0.5 * F.cross_entropy(leaf, targets)
    expected.backward()
    dlogits = torch.cat([r[1] for r in results], dim=1)
    for rank, (loss, _, log) in enumerate(results):
        assert loss.dtype == f64 and abs(loss.item() - expected.item()) <= 1e-12 * expected.item(), \
            (f"rank {rank}: loss {loss.item()!r}, F.cross_entropy gives {expected.item()!r}"
             + (" (the padding columns were counted: what must their logits be for exp to ignore them?)" if loss.item() > 30 else ""))
        assert log == [("all_reduce", N * 8)] * 3, \
            f"rank {rank}: expected 3 all-reduces of {N} float64 statistics (max, sum of exponentials, target), got {log}"
    assert not dlogits[:, VOCAB:].any(), "the padding columns must get no gradient"
    torch.testing.assert_close(dlogits[:, :VOCAB], leaf.grad, rtol=1e-12, atol=1e-14,
                               msg=lambda m: f"dlogits against autograd (of the loss divided by n_tokens = 2 N): {m}")


@pytest.mark.exercises("vocab_parallel_cross_entropy")
def test_ignored_targets_add_no_loss_and_get_no_gradient():
    # Module 06's convention: a target of -100 is no token, and the default count is the real targets':
    # F.cross_entropy(ignore_index=-100, reduction="sum") / count on the gathered, unpadded logits.
    logits, targets, padded = logits_with_padding(3)
    targets[:5], targets[-1] = -100, -100
    results = run_ranks(_loss_on_ranks, 3, padded, targets, timeout=30)
    leaf = logits.clone().requires_grad_(True)
    expected = F.cross_entropy(leaf, targets, ignore_index=-100, reduction="sum") / int((targets != -100).sum())
    expected.backward()
    for rank, (loss, _, _) in enumerate(results):
        assert abs(loss.item() - expected.item()) <= 1e-12 * expected.item(), \
            (f"rank {rank}: loss {loss.item()!r}, F.cross_entropy(ignore_index=-100, reduction='sum') / count gives "
             f"{expected.item()!r}: an ignored target adds no loss, and the count is of the real ones")
    dlogits = torch.cat([r[1] for r in results], dim=1)
    assert not dlogits[:5].any() and not dlogits[-1].any(), "the rows of ignored targets must get no gradient"
    torch.testing.assert_close(dlogits[:, :VOCAB], leaf.grad, rtol=1e-12, atol=1e-14,
                               msg=lambda m: f"dlogits against autograd, with ignored targets: {m}")


@pytest.mark.exercises("vocab_parallel_cross_entropy")
def test_large_float32_logits_do_not_overflow():
    # Logits of size ~300 in float32: exp overflows beyond 88, so the max must be subtracted first.
    # Reference: F.cross_entropy in float64 on the same float32 logits. Ours computes in float32:
    # each exp and sum is rounded at 6e-8 relative; measured 9.0e-8 relative on the loss (~600) and
    # 1.3e-9 absolute on dlogits (entries at most 1/N = 0.04). We allow 1e-6 for both.
    logits, targets, padded = logits_with_padding(2, torch.float32, scale=300.0)
    results = run_ranks(_loss_on_ranks, 2, padded, targets, timeout=30)
    leaf = logits.double().requires_grad_(True)
    expected = F.cross_entropy(leaf, targets)
    expected.backward()
    loss = results[0][0]
    why = ("every exponential underflowed to 0 (log Z = -inf): the shift is larger than every logit; is z_max the "
           "largest logit over the group, all-reduced with op=\"max\" (a sum of the ranks' maxima is too large)?"
           if loss.item() == float("-inf") else
           "exp overflowed: is the largest logit over the group subtracted before exp?" if not torch.isfinite(loss)
           else "off by more than float32's rounding")
    assert torch.isfinite(loss) and abs(loss.item() - expected.item()) <= 1e-6 * expected.item(), \
        f"float32 loss {loss.item()} vs {expected.item()} (float64): {why}"
    dlogits = torch.cat([r[1] for r in results], dim=1)
    assert dlogits.dtype == torch.float32, f"dlogits must come back in the logits' dtype, got {dlogits.dtype}"
    torch.testing.assert_close(dlogits[:, :VOCAB].double(), leaf.grad, rtol=0, atol=1e-6,
                               msg=lambda m: f"float32 dlogits against float64 autograd: {m}")


@pytest.mark.exercises("vocab_parallel_cross_entropy")
def test_bf16_logits_give_a_float32_loss_and_a_bf16_gradient():
    # The contract's dtypes: the statistics and the loss in compute_dtype (float32 for bf16 logits), dlogits in
    # the logits' dtype (the GEMMs after it read bf16). Reference: F.cross_entropy in float64 on the same bf16
    # logits (exact in float64). Ours sums in float32 (measured ~1e-7 relative on the loss) and rounds dlogits to
    # bf16 once (2^-9 relative per entry, entries at most 1/N): we allow 1e-5 on the loss and 2^-8 / N on dlogits.
    logits, targets, padded = logits_with_padding(2, torch.bfloat16, scale=4.0, seed=3)
    results = run_ranks(_loss_on_ranks, 2, padded, targets, timeout=30)
    leaf = logits.double().requires_grad_(True)
    expected = F.cross_entropy(leaf, targets)
    expected.backward()
    loss, dlogits = results[0][0], torch.cat([r[1] for r in results], dim=1)
    assert loss.dtype == torch.float32 and abs(loss.item() - expected.item()) <= 1e-5 * expected.item(), \
        (f"your vocab_parallel_cross_entropy on bf16 logits: loss {loss.item()!r} in {loss.dtype}, expected "
         f"{expected.item()!r} in float32 (the statistics are computed in compute_dtype)")
    assert dlogits.dtype == torch.bfloat16, \
        (f"your vocab_parallel_cross_entropy returns dlogits in {dlogits.dtype} for bf16 logits: the gradient comes "
         "back in the logits' dtype")
    torch.testing.assert_close(dlogits[:, :VOCAB].double(), leaf.grad, rtol=0, atol=2 ** -8 / N,
                               msg=lambda m: f"your vocab_parallel_cross_entropy: bf16 dlogits against float64: {m}")


def _embedding_on_ranks(sequence_parallel, table, tokens, dx):
    tp = world_group("t")
    padded = vocab.padded_vocab_size(VOCAB, tp.size)
    rows = vocab.vocab_rows(table, padded, tp)
    x = vocab.embedding_forward(tokens, rows, tp, sequence_parallel)
    grad_rows = torch.zeros_like(rows)
    vocab.embedding_backward(dx.chunk(tp.size, dim=1)[tp.index] if sequence_parallel else dx, tokens, grad_rows, tp,
                             sequence_parallel)
    return x, grad_rows


@pytest.mark.exercises("embedding_forward", "embedding_backward")
@pytest.mark.parametrize("world_size, sequence_parallel", [(4, False), (4, True)])
def test_the_embedding_equals_a_lookup_of_the_whole_table(world_size, sequence_parallel):
    g = torch.Generator().manual_seed(3)
    table = torch.randn(VOCAB, 8, dtype=f64, generator=g)
    tokens = torch.randint(0, VOCAB, (2, 8), generator=g)
    tokens[0, :4] = torch.tensor([0, 12, 13, VOCAB - 1])  # first and last token, and a shard boundary (13 a rank)
    tokens[1, :2] = 7  # a token seen twice adds twice
    dx = torch.randn(2, 8, 8, dtype=f64, generator=g)
    results = run_ranks(_embedding_on_ranks, world_size, sequence_parallel, table, tokens, dx, timeout=30)
    x = torch.cat([r[0] for r in results], dim=1) if sequence_parallel else results[0][0]
    assert torch.equal(x, table[tokens]), \
        ("your embedding_forward must equal the whole table's lookup once summed over the ranks: what must this "
         "rank contribute for a token another rank owns?")
    grad = torch.cat([r[1] for r in results])
    expected = torch.zeros(grad.shape[0], 8, dtype=f64).index_add_(0, tokens.reshape(-1), dx.reshape(-1, 8))
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-14,
                               msg=lambda m: f"your embedding_backward: the rows' gradients, joined over the ranks "
                                             f"(padding rows last): {m}")
