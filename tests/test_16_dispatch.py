"""Module 16 dispatch: the capacity rule and the expert-major order against a loop over the slots
(exactly), and the combine and its backward against the same sum written row by row, with autograd
(float64, 1e-12: the same products summed in another order)."""
import pytest
import torch

from course.impl import load

from moe_checks import differs, first_difference  # tests/moe_checks.py

dispatch = load("m16_dispatch")
f64 = torch.float64


def random_choices(n_tokens, n_experts, top_k, generator):
    """Each token's k distinct experts, as a router returns them; skewed, so some experts are crowded."""
    scores = torch.rand(n_tokens, n_experts, generator=generator) + torch.linspace(0.6, 0, n_experts)
    return torch.topk(scores, top_k, dim=-1).indices


def plan_by_loop(experts, n_experts, capacity):
    """The rule spelled out: walk the slots in order (token, then choice); an expert takes a slot while it
    has taken fewer than G; then list each expert's kept slots, expert after expert."""
    n_tokens, top_k = experts.shape
    kept, taken = torch.ones(n_tokens, top_k, dtype=torch.bool), [0] * n_experts
    for slot in range(n_tokens * top_k):
        j = int(experts.view(-1)[slot])
        kept.view(-1)[slot] = capacity is None or taken[j] < capacity
        taken[j] += 1
    slots = [s for j in range(n_experts) for s in range(n_tokens * top_k)
             if int(experts.view(-1)[s]) == j and kept.view(-1)[s]]
    counts = torch.bincount(experts.view(-1)[slots], minlength=n_experts)
    return torch.tensor(slots, dtype=torch.long), counts, kept


@pytest.mark.exercises("plan_dispatch")
@pytest.mark.parametrize("capacity", [None, 1, 3, 100], ids=["dropless", "G=1", "G=3", "G=100"])
def test_the_capacity_keeps_the_first_G_slots_of_each_expert_in_expert_major_order(capacity):
    experts = random_choices(20, 6, 2, torch.Generator().manual_seed(2))
    slots, counts, kept = plan_by_loop(experts, 6, capacity)
    if capacity == 3:  # the test's own check: this capacity drops some slots, and some experts get none
        assert not kept.all() and (counts == 0).any()
    plan = dispatch.plan_dispatch(experts, 6, capacity)
    dropped = lambda k: sorted(map(tuple, torch.nonzero(~k).tolist()))  # noqa: E731
    assert torch.equal(plan.kept, kept), \
        (f"your plan_dispatch, capacity {capacity}: dropped (token, choice) slots {dropped(plan.kept)}, expected {dropped(kept)}: each "
         f"expert keeps its first G slots in token order")
    assert torch.equal(plan.counts, counts), f"your plan_dispatch: counts {plan.counts.tolist()}, expected {counts.tolist()}"
    assert torch.equal(plan.slots, slots), \
        (f"your plan_dispatch: the rows' slots differ {first_difference(plan.slots, slots)}: expert-major, each "
         f"expert's slots in slot order (a stable sort)")
    assert torch.equal(plan.tokens, slots // 2)


def made_plan(experts, n_experts, capacity):
    slots, counts, kept = plan_by_loop(experts, n_experts, capacity)
    return dispatch.DispatchPlan(slots, counts, kept, experts.shape[1])


def combine_case():
    """12 tokens, 4 experts, top-2, capacity 2 (some tokens lose every slot); the combine written row by row,
    with autograd: (plan, h, rows, weights, dy, expected y, fully dropped tokens, d_rows, d_weights)."""
    g = torch.Generator().manual_seed(4)
    experts = random_choices(12, 4, 2, g)
    plan = made_plan(experts, 4, 2)
    fully_dropped = ~plan.kept.any(1)
    assert fully_dropped.any() and not plan.kept.all(), "the test's own check: some tokens lose every slot"
    h = torch.randn(12, 5, generator=g, dtype=f64)
    rows = torch.randn(len(plan.slots), 5, generator=g, dtype=f64, requires_grad=True)
    weights = torch.rand(12, 2, generator=g, dtype=f64).softmax(-1).requires_grad_(True)
    dy = torch.randn(12, 5, generator=g, dtype=f64)
    expected = h.clone()
    for r, slot in enumerate(plan.slots.tolist()):   # row r is the output of slot (token, choice)
        token, choice = divmod(slot, 2)
        expected = expected.index_add(0, torch.tensor([token]), (weights[token, choice] * rows[r]).unsqueeze(0))
    d_rows, d_weights = torch.autograd.grad((expected * dy).sum(), (rows, weights))
    return plan, h, rows.detach(), weights.detach(), dy, expected.detach(), fully_dropped, d_rows, d_weights


@pytest.mark.exercises("combine")
def test_the_combine_equals_the_sum_row_by_row_and_dropped_tokens_pass_through():
    plan, h, rows, weights, _, expected, fully_dropped, _, _ = combine_case()
    h_before = h.clone()
    y = dispatch.combine(h, rows, plan, weights)
    assert torch.equal(h, h_before), "your combine changed h in place: the residual stream is read, not written"
    assert torch.equal(y[fully_dropped], h[fully_dropped]), \
        (f"your combine: tokens {torch.nonzero(fully_dropped).flatten().tolist()} lost every slot to the capacity: "
         f"they must pass through unchanged (y = h, the residual), got {y[fully_dropped][:, 0].tolist()} for h "
         f"{h[fully_dropped][:, 0].tolist()}")
    wrong = differs(y, expected)
    assert wrong is None, \
        (f"your combine: y, against the sum written row by row: {wrong} (which slot is row r the output of, and "
         f"with which weight?)")


@pytest.mark.exercises("combine_backward")
def test_the_combines_backward_equals_autograd():
    plan, _, rows, weights, dy, _, _, d_rows_want, d_weights_want = combine_case()
    d_rows, d_weights = dispatch.combine_backward(dy, rows, plan, weights)
    for name, got, want in (("d_rows", d_rows, d_rows_want), ("d_weights (zero at dropped slots)", d_weights,
                                                               d_weights_want)):
        wrong = differs(got, want)
        assert wrong is None, f"your combine_backward: {name}: {wrong}"
