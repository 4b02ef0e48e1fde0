"""Module 16 model: module 06's Llama with MoE blocks, the experts over e = 2 and e = 4 of 4 data-
parallel ranks, against course/reference_moe.py's MoE Llama (autograd, one process, the whole batch
at once; with a capacity, applied to the same groups of tokens): the loss curve of a few steps, the
router's and the experts' weights afterwards, the auxiliary-loss-free biases; and the auxiliary loss
and its gradient, the same with the experts on 1, 2 or 4 ranks, with data parallelism and with
gradient accumulation.

Tolerance: float64; the ranks and the microbatches sum the same terms in another order than the
reference (and PyTorch's attention and RMSNorm round their own way): measured within 1.8e-15 on the
losses of 3 steps; we allow 1e-12. A gradient summed over the wrong group is off by a factor of 2 or
more; one off by a constant factor still moves AdamW's step, and so the losses, by far more than that.
The biases move in steps of γ by the sign of integer load errors: compared exactly.
"""
import pytest
import torch

from course.dataset import load_text, random_batch
from course.impl import load, reference
from course.launch import run_ranks
from course.mesh import init_mesh
from course.reference_moe import ReferenceMoELlama

model_module = load("m16_moe_model")
trusted = reference("m16_moe_model")   # the initial weights only (given code), for the autograd reference
router = load("m16_router")
f64 = torch.float64
CFG = trusted.CONFIG
AUX = router.MoEConfig(n_experts=8, top_k=2, expert_dim=32, shared_expert=True, balance="aux", aux_coef=0.1)
BIAS = router.MoEConfig(n_experts=8, top_k=2, expert_dim=32, score="sigmoid", balance="bias", bias_rate=0.01,
                        capacity_factor=1.0)   # a capacity, so the loads must be counted before it drops slots
BATCH, STEPS, LR = 8, 3, 3e-3
# name: (e, configuration, microbatches, steps), every run on d = 4 ranks
RUNS = {"e=2, m=2, aux": (2, AUX, 2, STEPS), "e=4, m=1, bias": (4, BIAS, 1, STEPS), "e=4, m=1, aux": (4, AUX, 1, 1)}


def batches(steps):
    data, generator = load_text(), torch.Generator().manual_seed(0)
    return [random_batch(data, BATCH, CFG.max_seq_len, generator) for _ in range(steps)]


def train_steps(model, n_microbatches, steps):
    """The training loop module 06's fit will run: train_step on the whole global batch."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses, first = [], None
    for step, (tokens, targets) in enumerate(batches(steps)):
        losses.append(model.train_step(tokens, targets, n_microbatches, optimizer))
        if step == 0:
            first = (model.last_step.aux, [b.moe.router.grad.clone() for b in model.blocks])
    return losses, first


def _train(runs):
    results = {}
    for name, (e, moe, n_microbatches, steps) in runs.items():
        mesh = init_mesh({"d": 4, "e": e})
        model = model_module.MoELlama(CFG, moe, mesh, 0, f64)
        losses, first = train_steps(model, n_microbatches, steps)
        results[name] = (mesh.group("e").index, losses, first, [b.moe.router for b in model.blocks],
                         [b.moe.experts for b in model.blocks], model.biases(), model.last_step.loads)
    return results


def reference_run(moe, steps, n_sources):
    """(losses, (aux, router gradients) of the first step, the model afterwards, its last loads), with the
    capacity applied per source: the batch cut into n_sources equal groups of rows."""
    ref = ReferenceMoELlama.of(trusted.MoELlama(CFG, moe, trusted.one_rank_mesh(), 0, f64))
    optimizer = torch.optim.AdamW(list(ref.weights.values()), lr=LR, weight_decay=0.0)
    losses, first = [], None
    for step, (tokens, targets) in enumerate(batches(steps)):
        total, ce, aux, loads, _ = ref.loss(tokens, targets, n_sources)
        total.backward()
        if step == 0:
            first = (aux.detach().item(), [ref.weights[f"{l}.router"].grad.clone() for l in range(CFG.n_layers)])
        optimizer.step()
        optimizer.zero_grad()
        if moe.balance == "bias":
            ref.update_biases(loads)
        losses.append(ce.item())
    return losses, first, ref, loads


@pytest.fixture(scope="module")
def runs():
    return run_ranks(_train, 4, RUNS, timeout=90)


@pytest.fixture(scope="module")
def references():
    # The capacity drops per source: each rank's microbatch (d m = 4 of them in the run with the capacity).
    return {"aux": reference_run(AUX, STEPS, 1), "bias": reference_run(BIAS, STEPS, 4)}


def close(a, b):
    return (a - b).abs().max().item() <= 1e-12 * max(1.0, b.abs().max().item())


@pytest.mark.exercises("MoELlama.train_step", "sum_gradients", "update_biases", "MoELayer.backward")
@pytest.mark.parametrize("name", ["e=2, m=2, aux", "e=4, m=1, bias"])
def test_training_with_experts_over_ranks_reproduces_the_single_process_loss_curve(name, runs, references):
    e, moe, _, _ = RUNS[name]
    expected, _, ref, loads = references[moe.balance]
    for rank, result in enumerate(r[name] for r in runs):
        index, losses, _, routers, experts, biases, last_loads = result
        worst = max(abs(a - b) for a, b in zip(losses, expected, strict=True))
        assert worst <= 1e-12, f"{name}, rank {rank}: losses {losses} vs one process {expected}: off by {worst:.1e}"
        wrong = [f"layer {l} router" for l, w in enumerate(routers) if not close(w, ref.weights[f"{l}.router"])]
        own = slice(index * 8 // e, (index + 1) * 8 // e)
        wrong += [f"layer {l} experts {own.start}..{own.stop - 1} {k}" for l, w in enumerate(experts)
                  for k in ("gate", "up", "down") if not close(getattr(w, k), ref.weights[f"{l}.{k}"][own])]
        assert not wrong, \
            (f"{name}, rank {rank}: after {STEPS} steps these weights differ from one process's: {wrong} (dense "
             f"gradients are summed over every data rank, the experts' over the ranks that hold the same experts)")
        if moe.balance == "bias":
            assert torch.equal(last_loads, loads), \
                f"{name}, rank {rank}: loads of the last step {last_loads.tolist()} vs one process's {loads.tolist()}"
            assert all(torch.equal(b, r) for b, r in zip(biases, ref.biases, strict=True)), \
                (f"{name}, rank {rank}: biases {[b.tolist() for b in biases]} vs one process's "
                 f"{[b.tolist() for b in ref.biases]}: the loads of the whole global batch, over every data rank")


@pytest.mark.exercises("sequence_aux_loss", "MoELlama.train_step", "sum_gradients", "route_backward")
def test_the_auxiliary_loss_and_its_gradient_do_not_depend_on_the_layout(runs, references):
    _, (aux, router_grads), _, _ = references["aux"]
    one_rank = model_module.MoELlama(CFG, AUX, model_module.one_rank_mesh(), 0, f64)
    layouts = {"experts on 1 rank, m=2": train_steps(one_rank, 2, 1)[1]}
    for name in ("e=2, m=2, aux", "e=4, m=1, aux"):
        layouts.update({f"d=4, {name}, rank {rank}": r[name][2] for rank, r in enumerate(runs)})
    for layout, (got_aux, got_grads) in layouts.items():
        assert abs(got_aux - aux) <= 1e-12, \
            (f"{layout}: auxiliary loss {got_aux} vs {aux} on the whole batch in one process (per sequence: each "
             f"sequence's own counts and means, weighted 1/B; not over the tokens a rank or microbatch holds)")
        wrong = [l for l, (a, b) in enumerate(zip(got_grads, router_grads, strict=True)) if not close(a, b)]
        assert not wrong, f"{layout}: the router's gradient (cross-entropy and auxiliary loss) differs, layers {wrong}"


@pytest.mark.given
def test_bad_run_options_are_refused_in_one_line_before_any_rank_starts():
    import argparse

    from course.demos.m16 import check_args
    good = dict(world_size=4, experts=8, top_k=2, capacity_factor=None, dropless=False, balance="aux", score="softmax",
                shared_expert=False, expert_ranks=2, steps=2, batch=8, microbatches=1, layers=2)
    check_args(argparse.Namespace(**good))
    for change, message in [(dict(top_k=9), "top-k 9 must be between 1 and"), (dict(experts=6, expert_ranks=4),
                            "e must divide E"), (dict(capacity_factor=0.0), "must be positive"),
                            (dict(balance="loss"), "unknown balancing method"), (dict(expert_ranks=3), "must divide"),
                            (dict(dropless=True, capacity_factor=1.0), "exclude each other")]:
        with pytest.raises(ValueError, match=message) as error:
            check_args(argparse.Namespace(**{**good, **change}))
        assert "\n" not in str(error.value)
