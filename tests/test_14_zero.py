"""Module 14 ZeRO-1 and ZeRO-2 on forked ranks: the trained weights against one process (with and
without clipping by global norm), what each rank keeps, and what it sends, against the formulas.

References: module 00's MLP trained in one process on the whole batch with autograd, PyTorch's
AdamW and torch.nn.utils.clip_grad_norm_; the tensors each rank really holds (the storages behind
its parameters and gradients, AdamW's state); the collectives log (course/costs.py's measured_cost).
Collectives arrive late, as in test_14_data_parallel.py (a result is there only once waited for).

Tolerance. ZeRO changes where AdamW runs, not its arithmetic (it is elementwise): the weights equal
the replicated run's but for the order of the gradient sums and, with clipping, of the norm's sum of
squares. Measured (torch 2.13 CPU, d = 2 and 4, 1 and 2 micro-steps, 3 steps): within 4.4e-16 of
one process. We allow 1e-12. Bytes and counts must be equal to the formulas (floats: sums of
(d - 1) / d terms, equal to 1e-12 relative).
"""
import math

import pytest
import torch
import torch.nn.functional as F

from course.costs import measured_cost
from course.impl import load, reference
from course.launch import run_ranks
from test_14_data_parallel import check_waited, late_group  # collectives that deliver only at wait()

dp = load("m14_data_parallel")
ts = load("m14_train_step")
zero = load("m14_zero")
costs = load("m14_costs")
m00 = reference("m00_monolith")

f64 = torch.float64
MLP = m00.MLPConfig(hidden=16, layers=6, batch=8)
LR, STEPS, TOLERANCE, CAP = 1e-2, 3, 1e-12, 5000
MAX_NORM = 0.2  # the gradient norms are about 0.76, 0.11 and 0.28: clipping acts on steps 0 and 2, not 1 (checked)


def mlp_batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(MLP.batch, MLP.hidden, generator=g).to(f64), torch.randint(0, MLP.classes, (MLP.batch,), generator=g)


def one_process(max_norm):
    """The weights after STEPS steps on the whole batch, and every step's gradient norm before clipping."""
    model = m00.build_model(MLP).to(f64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    norms = []
    for step in range(STEPS):
        optimizer.zero_grad()
        F.cross_entropy(model(mlp_batch(step)[0]), mlp_batch(step)[1]).backward()
        norms.append(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item())
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()], norms


def bytes_of_storages(tensors) -> int:
    """The bytes of the distinct memory blocks behind `tensors` (a view counts its whole buffer, once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t is not None}
    return sum(storages.values())


def _stages(mesh, n_microbatches, max_norm):
    group = late_group(mesh)
    results = {}
    for stage in (0, 1, 2):
        model = m00.build_model(MLP).to(f64)
        ddp = (dp.replicate(model, group, CAP) if stage == 0 else
               dp.replicate(model, group, CAP, zero.ZeroDataParallel, stage=stage))
        optimizer = torch.optim.AdamW(ddp.parameters(), lr=LR)
        whole = []  # each parameter's .grad as the optimizer step begins (first step)
        step_of = ddp.step

        def step(optimizer, max_norm=None, step_of=step_of, whole=whole, model=model):
            if not whole:
                whole.extend(None if p.grad is None else p.grad.clone() for p in model.parameters())
            return step_of(optimizer, max_norm)
        ddp.step = step
        for s in range(STEPS):
            del group.collectives.log[:]
            ts.train_step(ddp, model, *mlp_batch(s), n_microbatches, optimizer, max_norm)
            check_waited(group)
        sent = measured_cost(group.collectives.log)  # the last step's collectives
        in_flight = group.collectives.most_in_flight.pop("reduce_scatter", 0)
        grads = [p.grad for p in model.parameters()] + [b.grads for b in ddp.buckets] + list(getattr(ddp, "grad_shards", []))
        kept = {"parameters": bytes_of_storages(model.parameters()), "gradients": bytes_of_storages(grads),
                "optimizer": sum(state[k].nbytes for state in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq"))}
        numels = [b.numel for b in ddp.buckets]
        formula = costs.traffic(numels, 8, group.size, stage, n_microbatches, max_norm is not None, group.axis)
        results[stage] = {"weights": [p.detach().clone() for p in model.parameters()], "whole grads": whole,
                          "sent": sent, "sent formula": formula, "kept": kept, "in flight": in_flight,
                          "kept formula": costs.state(numels, 8, group.size, stage).memory}
    return results


CONFIGS = [(None, 2, 1, None), (None, 4, 2, MAX_NORM), ({"d": 2, "t": 2}, 4, 2, MAX_NORM)]


@pytest.mark.exercises("shard_range",
                        "ZeroDataParallel.launch",
                        "ZeroDataParallel.step",
                        "ZeroDataParallel.clip_grad_norm_",
                        "traffic",
                        "state",
                        "DataParallel.ready",
                        "DataParallel.launch",
                        "DataParallel.finish",
                        "train_step")
@pytest.mark.parametrize("mesh, world_size, n_microbatches, max_norm", CONFIGS,
                         ids=["2-ranks", "4-ranks-2-microbatches-clipped", "mesh-d2-t2-clipped"])
def test_zero_1_and_2_equal_one_process_keep_a_shard_and_send_the_formula(mesh, world_size, n_microbatches, max_norm):
    expected, norms = one_process(max_norm)
    if max_norm is not None:
        assert min(norms) < max_norm < max(norms), \
            f"the test's clipping must act on some steps and not others: gradient norms {norms}, max_norm {max_norm}"
    for rank, results in enumerate(run_ranks(_stages, world_size, mesh, n_microbatches, max_norm, timeout=90)):
        for stage, r in results.items():
            where = f"rank {rank}, ZeRO-{stage}, m={n_microbatches}{', clipped' if max_norm else ''}"
            gap = max((a - b).abs().max().item() for a, b in zip(r["weights"], expected, strict=True))
            assert gap <= TOLERANCE, (f"{where}: the weights after {STEPS} steps differ by {gap:.2e} from one process "
                                      f"(tolerance {TOLERANCE:g})")
            if stage == 1:
                gap = max((a - b).abs().max().item() for a, b in zip(r["whole grads"], results[0]["whole grads"]))
                assert gap <= TOLERANCE, (f"{where}: every parameter's .grad must hold the whole gradient summed over "
                                          f"ranks, as DDP's does (differs by {gap:.2e}): ZeRO-1 all-reduces")
            if stage == 2:
                assert all(g is None for g in r["whole grads"]), \
                    f"{where}: ZeRO-2 keeps no parameter's whole gradient (.grad must be None after ready)"
                assert r["in flight"] == 1, (
                    f"{where}: {r['in flight']} buckets' reduce-scatters were in flight at once: each keeps its whole "
                    f"bucket alive until waited for; complete the bucket before, then send the next (one at a time)")
            for what in ("parameters", "gradients", "optimizer"):
                got, want = r["kept"][what], r["kept formula"].get(what, 0)
                assert got == want, f"{where}: keeps {got:,} bytes of {what}, the formula says {want:,}"
            got, want = r["sent"], r["sent formula"]
            assert got.calls == want.calls, f"{where}: collectives issued in a step {got.calls}, formula {want.calls}"
            for key in set(got.sent) | set(want.sent):
                assert math.isclose(got.sent.get(key, 0), want.sent.get(key, 0), rel_tol=1e-12), \
                    f"{where}: bytes sent per step {got.sent}, formula {want.sent}"
