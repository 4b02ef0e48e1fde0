"""Module 16 router: the top-k router's forward and backward, the per-sequence auxiliary loss and its
gradient, and the auxiliary-loss-free bias update, against autograd on the same maths (written out
here the plain way), a worked example counted by hand, and whole sequences against sequences split
over the ranks of a context group.

Tolerance: float64, and the same operations in another order (autograd's backward sums its terms
its own way): measured within 4e-17 absolute; we allow 1e-12, as the issue asks. bf16 tokens: the
router computes in float32 (the contract), within 1e-5 of float64 on the same inputs; its gradients
are rounded to bf16 once, within two bf16 roundings (2^-7) of the largest entry.
"""
import pytest
import torch

from course.impl import load
from course.launch import run_ranks
from course.mesh import init_mesh

from moe_checks import differs  # tests/moe_checks.py

router = load("m16_router")
f64 = torch.float64


def moe_config(**fields):
    return router.MoEConfig(**{"n_experts": 6, "top_k": 2, "expert_dim": 4, **fields})


def plain_scores(n, w_router, score):
    logits = n @ w_router.t()
    return torch.softmax(logits, -1) if score == "softmax" else torch.sigmoid(logits)


def router_case(score, biased, dtype=f64, seed=3):
    """40 tokens of width 12, E = 6, top-3, and the gradients that reach the weights and the scores."""
    g = torch.Generator().manual_seed(seed)
    n = torch.randn(40, 12, generator=g, dtype=f64).to(dtype)
    w_router = (torch.randn(6, 12, generator=g, dtype=f64) / 2).to(dtype)
    bias = 0.2 * torch.randn(6, generator=g, dtype=f64) if biased else None
    d_weights, d_scores = torch.randn(40, 3, generator=g, dtype=f64), torch.randn(40, 6, generator=g, dtype=f64)
    return n, w_router, bias, d_weights, d_scores


def plain_routing(n, w_router, bias, score):
    """The router's maths the plain way, in float64 on the same (possibly rounded) inputs, with autograd:
    (scores, experts, weights, n and w_router as leaves)."""
    n, w_router = n.double().requires_grad_(True), w_router.double().requires_grad_(True)
    scores = plain_scores(n, w_router, score)
    experts = torch.topk(scores.detach() + (bias if bias is not None else 0), 3, dim=-1).indices
    chosen = scores.gather(1, experts)
    return scores, experts, chosen / chosen.sum(-1, keepdim=True), n, w_router


@pytest.mark.exercises("route")
@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
@pytest.mark.parametrize("biased", [False, True], ids=["unbiased", "biased"])
def test_the_router_chooses_and_weighs_as_the_maths_says(score, biased):
    n, w_router, bias, _, _ = router_case(score, biased)
    scores, experts, weights, _, _ = plain_routing(n, w_router, bias, score)
    if biased:  # the test's own check: this bias changes some tokens' choice
        assert not torch.equal(experts, torch.topk(scores.detach(), 3, dim=-1).indices)
    routing = router.route(n, w_router, bias, router.MoEConfig(n_experts=6, top_k=3, expert_dim=4, score=score))
    assert torch.equal(routing.experts, experts), \
        (f"your route, {score}, bias {biased}: the chosen experts differ from the top-3 of the scores"
         f"{' plus the bias' if biased else ''} (first tokens: got {routing.experts[:3].tolist()}, "
         f"expected {experts[:3].tolist()})")
    wrong = differs(routing.scores, scores.detach())
    assert wrong is None, f"your route, {score}: the scores σ: {wrong}"
    wrong = differs(routing.weights, weights.detach())
    assert wrong is None, \
        (f"your route, {score}, bias {biased}: the combine weights: {wrong}; they sum to "
         f"{[round(x, 4) for x in routing.weights.sum(-1)[:3].tolist()]} on the first tokens (the weights of the "
         f"chosen experts, what must they sum to, and does the bias belong in them?)")


@pytest.mark.exercises("route_backward")
@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
@pytest.mark.parametrize("biased", [False, True], ids=["unbiased", "biased"])
def test_the_routers_backward_equals_autograd(score, biased):
    # The routing handed to route_backward is the test's own (the maths above), so only the backward is graded.
    n, w_router, bias, d_weights, d_scores = router_case(score, biased)
    scores, experts, weights, n_leaf, w_leaf = plain_routing(n, w_router, bias, score)
    both = torch.autograd.grad((weights * d_weights).sum() + (scores * d_scores).sum(), (n_leaf, w_leaf),
                               retain_graph=True)
    through_weights = torch.autograd.grad((weights * d_weights).sum(), (n_leaf, w_leaf))
    routing = router.Routing(scores.detach(), experts, weights.detach())
    moe = router.MoEConfig(n_experts=6, top_k=3, expert_dim=4, score=score)
    for extra, (dn_want, dw_want) in ((None, through_weights), (d_scores, both)):
        dn, dw = router.route_backward(d_weights, extra, n, w_router, routing, moe)
        which = "with d_scores" if extra is not None else "d_weights alone (d_scores None)"
        for name, got, want in (("dn", dn, dn_want), ("dw_router", dw, dw_want)):
            wrong = differs(got, want)
            assert wrong is None, f"your route_backward, {score}, {which}: {name}: {wrong}"


@pytest.mark.exercises("route", "route_backward")
@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_bf16_tokens_are_routed_in_float32(score):
    # The contract's dtypes: σ and w in compute_dtype (float32 for bf16 tokens), dn and dw_router in the
    # inputs' bf16. Against float64 on the same bf16 inputs: float32 scores are within 1e-6 of it (we allow
    # 1e-5 of the largest); the gradients are rounded once to bf16 at the end (2^-9 relative), we allow two
    # bf16 roundings of the largest entry (2^-7), as module 15's bf16 checks do.
    n, w_router, bias, d_weights, d_scores = router_case(score, True, torch.bfloat16)
    scores, experts, weights, n_leaf, w_leaf = plain_routing(n, w_router, bias, score)
    gaps = (scores.detach() + bias).sort(-1, descending=True).values
    assert (gaps[:, 2] - gaps[:, 3]).min() > 1e-4, "the test's own check: no near tie at the k-th choice"
    moe = router.MoEConfig(n_experts=6, top_k=3, expert_dim=4, score=score)
    routing = router.route(n, w_router, bias, moe)
    assert (routing.scores.dtype, routing.weights.dtype) == (torch.float32, torch.float32), \
        (f"your route, bf16 tokens: scores {routing.scores.dtype} and weights {routing.weights.dtype}, expected "
         f"float32 both (compute_dtype of the tokens' dtype)")
    assert torch.equal(routing.experts, experts), f"your route, bf16 tokens: the chosen experts differ"
    for name, got, want in (("scores", routing.scores, scores), ("weights", routing.weights, weights)):
        wrong = differs(got.double(), want.detach(), rtol=1e-5)
        assert wrong is None, f"your route, bf16 tokens: {name}, against float64 on the same inputs: {wrong}"
    dn_want, dw_want = torch.autograd.grad((weights * d_weights).sum() + (scores * d_scores).sum(), (n_leaf, w_leaf))
    plain = router.Routing(scores.detach().float(), experts, weights.detach().float())
    dn, dw = router.route_backward(d_weights.float(), d_scores.float(), n, w_router, plain, moe)
    for name, got, want in (("dn", dn, dn_want), ("dw_router", dw, dw_want)):
        assert got.dtype == torch.bfloat16, f"your route_backward, bf16 tokens: {name} is {got.dtype}, expected bf16"
        wrong = differs(got.double(), want, rtol=2 ** -7)
        assert wrong is None, f"your route_backward, bf16 tokens: {name}, against float64 on the same inputs: {wrong}"


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
    wrong = differs(losses, expected.detach())
    assert wrong is None, \
        (f"your sequence_aux_loss, {score}: the losses of 3 sequences of T = 8 tokens: {wrong}; got "
         f"{losses.tolist()}, expected {expected.tolist()}")
    wrong = differs(d_scores, scores.grad)
    assert wrong is None, f"your sequence_aux_loss, {score}: d_scores: {wrong}"


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
    assert abs(losses.item() - 0.125) < 1e-15, f"your sequence_aux_loss: L = {losses.item()} for the worked example, expected 0.125"
    # dL/dσ'_{t,j} = λ φ_j / T = 0.05 φ_j; through σ' = σ / Σσ (Σσ = 1): less the token's Σ_j 0.05 φ_j σ_j.
    phi = torch.tensor([1.0, 2, 0, 1], dtype=f64)
    expected = 0.05 * phi - 0.05 * (scores * phi).sum(-1, keepdim=True)
    wrong = differs(d_scores, expected)
    assert wrong is None, f"your sequence_aux_loss: d_scores of the worked example: {wrong}"


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
        wrong = differs(losses, whole)
        assert wrong is None, \
            (f"your sequence_aux_loss, rank {rank}, each sequence split over c = 2 ranks: the losses {losses.tolist()}, "
             f"those of the whole sequences {whole.tolist()}: {wrong} (what does half a sequence know of the whole?)")
        mine = d_whole.view(2, 16, -1)[:, 8 * rank:8 * (rank + 1)].reshape(16, -1)
        wrong = differs(d_scores, mine)
        assert wrong is None, f"your sequence_aux_loss, rank {rank}: d_scores of its tokens: {wrong}"
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
    assert [id(b) for b in biases] == tensors, "your update_biases replaced the bias tensors: the model holds them, so update them in place"
    assert biases[0].tolist() == [-0.5, 0.5, 0.0, 0.0], f"your update_biases, layer 0 (loads 6, 2, 4, 4, γ 0.5): {biases[0].tolist()}, expected [-0.5, 0.5, 0.0, 0.0]"
    assert biases[1].tolist() == [0.75, 0.5, 0.25, 0.5], f"your update_biases, layer 1 (loads 1, 1, 1, 5): {biases[1].tolist()}, expected [0.75, 0.5, 0.25, 0.5]"


@pytest.mark.given
def test_a_bad_configuration_is_refused_in_one_line():
    for fields, message in [(dict(top_k=7), "top-k 7 must be between 1 and"), (dict(capacity_factor=0.0), "positive"),
                            (dict(balance="loss"), "unknown balancing"), (dict(score="relu"), "unknown router score")]:
        with pytest.raises(ValueError, match=message) as error:
            moe_config(**fields)
        assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="e must divide E"):
        router.check_expert_split(moe_config(), 4)
