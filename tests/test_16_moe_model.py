"""Module 16 model: module 06's Llama with MoE blocks, the experts over e = 2 and e = 4 of 4 data-
parallel ranks, trained by module 06's fit, against course/reference_moe.py's MoE Llama (autograd,
one process, the whole batch at once; with a capacity, applied to the same groups of tokens): the
loss curve of a few steps (also with targets padded unevenly with IGNORE_INDEX, so that ranks and
microbatches hold different numbers of real tokens), the router's and the experts' weights
afterwards, the loads and the dropped slots of the last step, the auxiliary-loss-free biases; and
the auxiliary loss and its gradient, the same with the experts on 1, 2 or 4 ranks, with data
parallelism and with gradient accumulation.

Tolerance: float64; the ranks and the microbatches sum the same terms in another order than the
reference (and PyTorch's attention and RMSNorm round their own way): measured within 1.8e-15 on the
losses of 3 steps; we allow 1e-12. A gradient summed over the wrong group is off by a factor of 2 or
more; one off by a constant factor still moves AdamW's step, and so the losses, by far more than that.
The loads and the dropped slots are integer counts, and the biases move in steps of γ by the sign of
integer load errors: compared exactly.
"""
import pytest
import torch

from course.dataset import load_text, random_batch
from course.impl import load, reference
from course.launch import run_ranks
from course.mesh import init_mesh
from course.reference_moe import ReferenceMoELlama

from moe_checks import check_every_exchange  # tests/moe_checks.py

model_module = load("m16_moe_model")
m06 = load("m06_llama_model")   # fit, the Llama track's one training loop (given code)
layer_module = load("m16_moe_layer")
trusted = reference("m16_moe_model")   # the initial weights only (given code), for the autograd reference
router = load("m16_router")
f64 = torch.float64
CFG = trusted.CONFIG
AUX = router.MoEConfig(n_experts=8, top_k=2, expert_dim=32, shared_expert=True, balance="aux", aux_coef=0.1)
BIAS = router.MoEConfig(n_experts=8, top_k=2, expert_dim=32, score="sigmoid", balance="bias", bias_rate=0.01,
                        capacity_factor=1.0)   # a capacity, so the loads must be counted before it drops slots
BATCH, STEPS, LR = 8, 3, 3e-3
# The last PADDING[i] targets of sequence i are IGNORE_INDEX: on d = 4 ranks of 2 sequences, in m = 2
# microbatches of one, the ranks hold 17, 29, 23 and 15 real tokens and the microbatches 16, 1, 13, 16, ...
PADDING = (0, 15, 3, 0, 9, 0, 12, 5)
# name: (e, configuration, microbatches, steps, padded), every run on d = 4 ranks
RUNS = {"e=2, m=2, aux": (2, AUX, 2, STEPS, False), "e=4, m=1, bias": (4, BIAS, 1, STEPS, False),
        "e=2, m=2, aux, padded": (2, AUX, 2, 2, True), "e=4, m=1, aux": (4, AUX, 1, 1, False)}


def batches(steps):
    """The global batches fit draws (from seed 0)."""
    data, generator = load_text(), torch.Generator().manual_seed(0)
    return [random_batch(data, BATCH, CFG.max_seq_len, generator) for _ in range(steps)]


def padded(targets):
    """A copy of targets with the last PADDING[i] of sequence i IGNORE_INDEX."""
    targets = targets.clone()
    for i, n in enumerate(PADDING):
        targets[i, targets.shape[1] - n:] = m06.IGNORE_INDEX
    return targets


class WithPadding:
    """The model as fit sees it, each batch's targets padded on their way to train_step."""

    def __init__(self, model):
        self.model, self.cfg, self.parameters = model, model.cfg, model.parameters

    def train_step(self, tokens, targets, n_microbatches, optimizer):
        return self.model.train_step(tokens, padded(targets), n_microbatches, optimizer)


def train_steps(model, n_microbatches, steps, pad=False):
    """Module 06's fit; returns (losses, (aux, router gradients) of the first step)."""
    first = []

    def on_step(step, loss):
        if step == 0:
            first.append((model.last_step.aux, [b.moe.router.grad.clone() for b in model.blocks]))
    _, losses = m06.fit(WithPadding(model) if pad else model, steps, BATCH, LR, 0, n_microbatches, on_step)
    return losses, first[0]


def _train(runs):
    check_every_exchange(layer_module)
    results = {}
    for name, (e, moe, n_microbatches, steps, pad) in runs.items():
        mesh = init_mesh({"d": 4, "e": e})
        model = model_module.MoELlama(CFG, moe, mesh, 0, f64)
        losses, first = train_steps(model, n_microbatches, steps, pad)
        results[name] = (mesh.group("e").index, losses, first, [b.moe.router for b in model.blocks],
                         [b.moe.experts for b in model.blocks], model.biases(), model.last_step.loads,
                         model.last_step.dropped)
    return results


def reference_run(moe, steps, n_sources, pad=False):
    """(losses, (aux, router gradients) of the first step, the model afterwards, the last step's loads and
    dropped slots), with the capacity applied per source: the batch cut into n_sources equal groups of rows."""
    ref = ReferenceMoELlama.of(trusted.MoELlama(CFG, moe, trusted.one_rank_mesh(), 0, f64))
    optimizer = torch.optim.AdamW(list(ref.weights.values()), lr=LR, weight_decay=0.0)
    losses, first = [], None
    for step, (tokens, targets) in enumerate(batches(steps)):
        total, ce, aux, loads, dropped = ref.loss(tokens, padded(targets) if pad else targets, n_sources)
        total.backward()
        if step == 0:
            first = (aux.detach().item(), [ref.weights[f"{l}.router"].grad.clone() for l in range(CFG.n_layers)])
        optimizer.step()
        optimizer.zero_grad()
        if moe.balance == "bias":
            ref.update_biases(loads)
        losses.append(ce.item())
    return losses, first, ref, loads, dropped


@pytest.fixture(scope="module")
def runs():
    return run_ranks(_train, 4, RUNS, timeout=90)


@pytest.fixture(scope="module")
def references():
    # With a capacity, one process drops by the same groups: d m sources, one per rank and microbatch.
    return {name: reference_run(moe, steps, 4 * m if moe.capacity_factor is not None else 1, pad)
            for name, (_, moe, m, steps, pad) in RUNS.items()
            if name != "e=4, m=1, aux"}   # that run's single step is the first of "e=2, m=2, aux"


def close(a, b):
    return (a - b).abs().max().item() <= 1e-12 * max(1.0, b.abs().max().item())


def _summed():
    """sum_gradients on d = 4, e = 2: rank r's dense gradients hold (r + 1) 10^i in entry i of tensor i, its
    experts' 1000 (r + 1) (i + 1)."""
    mesh = init_mesh({"d": 4, "e": 2})
    rank = mesh.rank
    dense = [torch.full((3,), float((rank + 1) * 10 ** i), dtype=f64) for i in range(3)]
    experts = [torch.full((2, 2), float(1000 * (rank + 1) * (i + 1)), dtype=f64) for i in range(2)]
    model_module.sum_gradients(dense, experts, mesh)
    return [t[0].item() / 10 ** i for i, t in enumerate(dense)], [t[0, 0].item() / (1000 * (i + 1))
                                                                  for i, t in enumerate(experts)], \
        [(c.op, c.axis, c.label) for c in mesh.log], mesh.group("ed").ranks


GROUP_SUMS = {10.0: "every data rank (d, c)", 4.0: "the expert-data group 'ed' {0, 2}", 6.0: "the expert-data group 'ed'",
              3.0: "the expert group 'e' {0, 1}", 7.0: "the expert group 'e' {2, 3}"}


@pytest.mark.exercises("sum_gradients")
def test_each_gradient_is_summed_over_the_ranks_that_hold_its_weight():
    for rank, (dense, experts, log, ed) in enumerate(run_ranks(_summed, 4, timeout=30)):
        want_experts = float(sum(r + 1 for r in ed))
        where = f"your sum_gradients, d=4 e=2, rank {rank}"
        for what, got, want in (("dense", dense, 10.0), ("expert", experts, want_experts)):
            if any(g != want for g in got):
                seen = GROUP_SUMS.get(got[0], "no group's")
                raise AssertionError(
                    f"{where}: the {what} gradients hold {got[0]:g} times one rank's unit, the sum over "
                    f"{seen}; expected {want:g}, the sum over "
                    f"{'every data rank' if what == 'dense' else f'the ranks {ed} that hold the same experts'}")
        assert [entry for entry in log if entry[0] == "all_reduce"] == \
            [("all_reduce", "dc", "dense gradients"), ("all_reduce", "ed", "expert gradients")], \
            f"{where}: collectives {log}, expected one all-reduce over dc ('dense gradients'), one over ed"


@pytest.mark.exercises("MoELlama.train_step", "sum_gradients", "update_biases", "MoELayer.backward")
@pytest.mark.parametrize("name", ["e=2, m=2, aux", "e=4, m=1, bias", "e=2, m=2, aux, padded"])
def test_training_with_experts_over_ranks_reproduces_the_single_process_loss_curve(name, runs, references):
    e, moe, n_microbatches, _, pad = RUNS[name]
    expected, _, ref, loads, dropped = references[name]
    if moe.capacity_factor is not None:
        assert dropped > 0, "the test's own check: the capacity drops slots"
    for rank, result in enumerate(r[name] for r in runs):
        index, losses, _, routers, experts, biases, last_loads, last_dropped = result
        worst = max(abs(a - b) for a, b in zip(losses, expected, strict=True))
        # the first step right and a later one wrong, with the bias: the step between them moved it
        later = moe.balance == "bias" and abs(losses[0] - expected[0]) <= 1e-12
        assert worst <= 1e-12, \
            (f"{name}, rank {rank}: losses {losses} vs one process {expected}: off by {worst:.1e}"
             f"{pad * ' (each microbatch divided by the real tokens of the whole global batch, not its own)'}"
             f"{later * ' (the first step agrees, a later one does not: what moved between them besides the weights, '}"
             f"{later * 'and from whose loads?)'}")
        wrong = [f"layer {l} router" for l, w in enumerate(routers) if not close(w, ref.weights[f"{l}.router"])]
        own = slice(index * 8 // e, (index + 1) * 8 // e)
        wrong += [f"layer {l} experts {own.start}..{own.stop - 1} {k}" for l, w in enumerate(experts)
                  for k in ("gate", "up", "down") if not close(getattr(w, k), ref.weights[f"{l}.{k}"][own])]
        assert not wrong, \
            (f"{name}, rank {rank}: after {STEPS} steps these weights differ from one process's: {wrong} (dense "
             f"gradients are summed over every data rank, the experts' over the ranks that hold the same experts)")
        assert torch.equal(last_loads, loads), \
            (f"{name}, rank {rank}: loads (layer by layer) of the last step {last_loads.tolist()} vs one process's "
             f"{loads.tolist()}: the router's choices before the capacity, over the global batch; the records come "
             f"microbatch by microbatch ({n_microbatches}), layer by layer")
        assert last_dropped == dropped, \
            (f"{name}, rank {rank}: dropped slots of the last step {last_dropped} vs one process's {dropped} "
             f"(dropping by the same groups), over every layer and rank")
        if moe.balance == "bias":
            assert all(torch.equal(b, r) for b, r in zip(biases, ref.biases, strict=True)), \
                (f"{name}, rank {rank}: biases {[b.tolist() for b in biases]} vs one process's "
                 f"{[b.tolist() for b in ref.biases]}: the loads of the whole global batch, over every data rank")


@pytest.mark.exercises("sequence_aux_loss", "MoELlama.train_step", "sum_gradients", "route_backward")
def test_the_auxiliary_loss_and_its_gradient_do_not_depend_on_the_layout(runs, references):
    _, (aux, router_grads), _, _, _ = references["e=2, m=2, aux"]
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
                            "e must divide E"), (dict(capacity_factor=0.0), r"must be positive \(or --dropless\)"),
                            (dict(world_size=3, expert_ranks=None), r"e must divide E \(e = --expert-ranks, default "
                                                                    r"--nproc\)"),
                            (dict(balance="loss"), "unknown balancing method"), (dict(expert_ranks=3), "must divide"),
                            (dict(dropless=True, capacity_factor=1.0), "exclude each other")]:
        with pytest.raises(ValueError, match=message) as error:
            check_args(argparse.Namespace(**{**good, **change}))
        assert "\n" not in str(error.value)
