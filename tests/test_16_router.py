"""Module 16 router: the top-k router's forward and backward, the per-sequence auxiliary loss and its
gradient, and the auxiliary-loss-free bias update, against autograd on the same maths (written out
here the plain way), a worked example counted by hand, and whole sequences against sequences split
over the ranks of a context group.

Tolerance: float64, and the same operations in another order (autograd's backward sums its terms
its own way): measured within 4e-17 absolute; we allow 1e-12, as the issue asks.
"""
import pytest
import torch

from course.impl import load
from course.launch import run_ranks
from course.mesh import init_mesh

router = load("m16_router")
f64 = torch.float64
TOL = dict(rtol=1e-12, atol=1e-12)


def moe_config(**fields):
    return router.MoEConfig(**{"n_experts": 6, "top_k": 2, "expert_dim": 4, **fields})


def plain_scores(n, w_router, score):
    logits = n @ w_router.t()
    return torch.softmax(logits, -1) if score == "softmax" else torch.sigmoid(logits)


@pytest.mark.exercises("route", "route_backward")
@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
@pytest.mark.parametrize("biased", [False, True], ids=["unbiased", "biased"])
def test_the_router_and_its_backward_equal_autograd(score, biased):
    g = torch.Generator().manual_seed(3)
    moe = moe_config(score=score, top_k=3)
    n = torch.randn(40, 12, generator=g, dtype=f64, requires_grad=True)
    w_router = (torch.randn(6, 12, generator=g, dtype=f64) / 2).requires_grad_(True)
    bias = 0.2 * torch.randn(6, generator=g, dtype=f64) if biased else None
    d_weights, d_scores = torch.randn(40, 3, generator=g, dtype=f64), torch.randn(40, 6, generator=g, dtype=f64)

    scores = plain_scores(n, w_router, score)
    experts = torch.topk(scores.detach() + (bias if biased else 0), 3, dim=-1).indices
    if biased:  # the test's own check: this bias changes some tokens' choice
        assert not torch.equal(experts, torch.topk(scores.detach(), 3, dim=-1).indices)
    chosen = scores.gather(1, experts)
    weights = chosen / chosen.sum(-1, keepdim=True)
    both = torch.autograd.grad((weights * d_weights).sum() + (scores * d_scores).sum(), (n, w_router),
                               retain_graph=True)
    through_weights = torch.autograd.grad((weights * d_weights).sum(), (n, w_router))

    routing = router.route(n.detach(), w_router.detach(), bias, moe)
    assert torch.equal(routing.experts, experts), \
        (f"{score}, bias {biased}: the chosen experts differ from the top-{moe.top_k} of the scores"
         f"{' plus the bias' if biased else ''} (first tokens: got {routing.experts[:3].tolist()}, "
         f"expected {experts[:3].tolist()})")
    torch.testing.assert_close(routing.scores, scores.detach(), **TOL, msg=lambda m: f"scores σ: {m}")
    torch.testing.assert_close(
        routing.weights, weights.detach(), **TOL,
        msg=lambda m: (f"combine weights: {m}\n(the chosen *unbiased* scores, normalised over the k chosen, after "
                       f"the top-k; they sum to 1 per token: got sums {routing.weights.sum(-1)[:3].tolist()})"))
    for extra, (dn_want, dw_want) in ((d_scores, both), (None, through_weights)):
        dn, dw = router.route_backward(d_weights, extra, n.detach(), w_router.detach(), routing, moe)
        which = "with" if extra is not None else "without"
        torch.testing.assert_close(dn, dn_want, **TOL, msg=lambda m: f"dn, {which} d_scores: {m}")
        torch.testing.assert_close(dw, dw_want, **TOL, msg=lambda m: f"dw_router, {which} d_scores: {m}")


def plain_aux_loss(scores, experts, seq_len, moe):
    """DeepSeek-V3's sequence-wise balance loss, one sequence at a time, by its definition."""
    losses = []
    normalised = scores / scores.sum(-1, keepdim=True)
    for start in range(0, len(scores), seq_len):
        rows = slice(start, start + seq_len)
        counts = torch.stack([(experts[rows] == j).any(-1).sum() for j in range(moe.n_experts)]).to(scores.dtype)
        share = moe.n_experts / (moe.top_k * seq_len) * counts
        losses.append(moe.aux_coef * (share * normalised[rows].mean(0)).sum())
    return torch.stack(losses)


def random_scores(score, n_tokens, generator):
    logits = 2 * torch.randn(n_tokens, 6, generator=generator, dtype=f64)
    return torch.softmax(logits, -1) if score == "softmax" else torch.sigmoid(logits)


@pytest.mark.exercises("sequence_aux_loss")
@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_the_auxiliary_loss_of_each_sequence_and_its_gradient_equal_autograd(score):
    moe = moe_config(score=score, aux_coef=0.3)
    g = torch.Generator().manual_seed(5)
    scores = random_scores(score, 3 * 8, g).requires_grad_(True)
    experts = torch.topk(scores.detach(), 2, dim=-1).indices
    expected = plain_aux_loss(scores, experts, 8, moe)
    expected.sum().backward()
    losses, d_scores = router.sequence_aux_loss(scores.detach(), experts, 8, moe)
    torch.testing.assert_close(
        losses, expected.detach(), **TOL,
        msg=lambda m: (f"per-sequence losses: {m}\n(each sequence's own counts and mean scores over its T = 8 tokens: "
                       f"not over all 24 tokens)"))
    torch.testing.assert_close(d_scores, scores.grad, **TOL, msg=lambda m: f"d_scores: {m}")


@pytest.mark.exercises("sequence_aux_loss")
def test_a_worked_example_of_the_auxiliary_loss():
    # E = 4 experts, top-2, one sequence of T = 2 tokens, λ = 0.1. Token 0 scores (0.4, 0.3, 0.2, 0.1) and
    # chooses experts 0 and 1; token 1 scores (0.1, 0.5, 0.1, 0.3) and chooses 1 and 3. The scores sum to 1.
    #   counts (1, 2, 0, 1);  φ = E / (k T) counts = counts;  π = mean scores = (0.25, 0.4, 0.15, 0.2)
    #   L = λ Σ φ π = 0.1 (0.25 + 0.8 + 0 + 0.2) = 0.125
    # Perfect balance gives φ = 1 and L = λ Σ π = λ: here the load on expert 1 pushes it above.
    moe = router.MoEConfig(n_experts=4, top_k=2, expert_dim=1, aux_coef=0.1)
    scores = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.1, 0.5, 0.1, 0.3]], dtype=f64)
    losses, d_scores = router.sequence_aux_loss(scores, torch.tensor([[0, 1], [1, 3]]), 2, moe)
    assert abs(losses.item() - 0.125) < 1e-15, f"L = {losses.item()}, expected 0.125 (φ_j = E/(kT) count_j)"
    # dL/dσ'_{t,j} = λ φ_j / T = 0.05 φ_j; through σ' = σ / Σσ (Σσ = 1): less the token's Σ_j 0.05 φ_j σ_j.
    phi = torch.tensor([1.0, 2, 0, 1], dtype=f64)
    expected = 0.05 * phi - 0.05 * (scores * phi).sum(-1, keepdim=True)
    torch.testing.assert_close(d_scores, expected, rtol=0, atol=1e-15)


def _split_sequences(scores, experts, moe):
    """Each of 2 ranks of a context group holds half of every sequence (8 tokens of 16)."""
    mesh = init_mesh({"c": 2})
    c = mesh.group("c")
    mine = lambda t: t.view(2, 16, -1)[:, 8 * c.index:8 * (c.index + 1)].reshape(16, -1)  # noqa: E731
    losses, d_scores = router.sequence_aux_loss(mine(scores), mine(experts), 8, moe, context=c)
    return losses, d_scores, [(r.op, r.axis, r.label) for r in mesh.log]


@pytest.mark.exercises("sequence_aux_loss")
def test_with_context_parallelism_the_auxiliary_loss_is_that_of_whole_sequences():
    moe = moe_config(score="sigmoid", aux_coef=0.3)
    scores = random_scores("sigmoid", 2 * 16, torch.Generator().manual_seed(6))
    experts = torch.topk(scores, 2, dim=-1).indices
    whole, d_whole = router.sequence_aux_loss(scores, experts, 16, moe)  # graded above against autograd
    for rank, (losses, d_scores, log) in enumerate(run_ranks(_split_sequences, 2, scores, experts, moe, timeout=30)):
        torch.testing.assert_close(
            losses, whole, **TOL,
            msg=lambda m: (f"rank {rank}, sequences split over c = 2: losses {m}\n(the counts and the sums of σ' "
                           f"are over the whole sequence: all-reduce them over the context group; T is c seq_len)"))
        mine = d_whole.view(2, 16, -1)[:, 8 * rank:8 * (rank + 1)].reshape(16, -1)
        torch.testing.assert_close(d_scores, mine, **TOL, msg=lambda m: f"rank {rank}: d_scores of its tokens: {m}")
        assert log == [("all_reduce", "c", "aux loss statistics")], \
            (f"rank {rank}: collectives {log}, expected one all-reduce over c labelled 'aux loss statistics' (the "
             f"counts and the sums of σ' as one tensor)")


@pytest.mark.exercises("update_biases")
def test_the_bias_moves_by_the_sign_of_each_experts_load_error():
    moe = router.MoEConfig(n_experts=4, top_k=2, expert_dim=1, bias_rate=0.5)
    biases = [torch.zeros(4, dtype=f64), torch.tensor([0.25, 0.0, -0.25, 1.0], dtype=f64)]
    tensors = [id(b) for b in biases]
    # Layer 0: 16 slots, even share 4: expert 0 overloaded, 1 underloaded, 2 and 3 exact.
    # Layer 1: 8 slots, share 2: experts 0-2 underloaded, 3 overloaded.
    router.update_biases(biases, torch.tensor([[6, 2, 4, 4], [1, 1, 1, 5]]), moe)
    assert [id(b) for b in biases] == tensors, "update the biases in place (the model holds them)"
    assert biases[0].tolist() == [-0.5, 0.5, 0.0, 0.0], f"layer 0: {biases[0].tolist()}"
    assert biases[1].tolist() == [0.75, 0.5, 0.25, 0.5], f"layer 1: {biases[1].tolist()}"


@pytest.mark.given
def test_a_bad_configuration_is_refused_in_one_line():
    for fields, message in [(dict(top_k=7), "top-k 7 must be between 1 and"), (dict(capacity_factor=0.0), "positive"),
                            (dict(balance="loss"), "unknown balancing"), (dict(score="relu"), "unknown router score")]:
        with pytest.raises(ValueError, match=message) as error:
            moe_config(**fields)
        assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="e must divide E"):
        router.check_expert_split(moe_config(), 4)
