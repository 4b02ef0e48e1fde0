"""Module 18 costs: what the planner says one rank keeps and sends, against what runs measured and what
papers wrote down.

- Module 17's composed trainer (the reference solution, trusted here: module 17 grades it) trains the
  tiny model for two steps on three 4-rank meshes; the collectives log of its last step (course/costs.py's
  measured_cost) and the tensors each rank holds are the measurement. The plan of the same layout
  must equal it on every axis, to the byte and the call, and on the parameters, gradients and whole
  slices each rank holds, the pipeline's sends included (module 11's StageComms logs them over "p").
  One exception, stated: the norm gradients' all-reduce over t carries the norm entries of the rank's
  own FSDP shard, so it differs from rank to rank: the plan counts them all, which is the most any rank
  sends (the rank that holds the blocks' norms). With p > 1 the plan counts the embedding and the LM
  head (sharded over d, as FSDP2 shards them) on every stage, so it is an upper bound there.
- The Ultra-Scale Playbook's memory per GPU for mixed precision (2 Ψ parameters, 2 Ψ gradients,
  12 Ψ of AdamW with the float32 master copy; ZeRO-1 divides the 12 Ψ by N_d, ZeRO-2 the gradients
  too), on a model whose Ψ is counted here by hand.
- Module 10's kept bytes for every recompute option with and without fp8, module 12's with sequence
  parallelism on t = 2, and the live microbatches of GPipe (all m) and 1F1B (p on the first rank).
"""

from types import SimpleNamespace

import dataclasses

import pytest
import torch

from course.costs import StepCost, measured_cost
from course.impl import load, reference
from course.launch import run_ranks
from course.mesh import init_mesh
from course.simulate import peak_live

costs = load("m18_costs")
layouts = reference("m18_layout")     # given: Layout, precisions
presets = reference("m18_presets")    # given: Model
m17 = reference("m17_trainer")
m17_given = reference("m17_composition")
m17_costs = reference("m17_costs")
m06 = reference("m06_llama_model")
m10 = reference("m10_recompute")
m12 = reference("m12_tp_costs")
m14 = reference("m14_costs")
m15 = reference("m15_costs")
m17_costs = reference("m17_costs")

CFG = m17_given.CONFIG                # dim 32, 8 / 4 heads of 4, FFN 64, 4 blocks, T = 16, V = 256
TINY = presets.Model("tiny", CFG, batch=8)
BATCH, M = 8, 2
Layout = layouts.Layout


def _run_module_17(sizes):
    """Two steps of module 17's trainer; what its last step logged and what each rank holds."""
    mesh = init_mesh(m17_given.full_sizes(sizes))
    model = m17.ComposedLlama(CFG, mesh, M, "1f1b", 1, dtype=torch.float32)
    whole = []
    for stage in model.stages.values():   # the whole slices and gradients a stage holds during the step
        gather = stage.gather

        def measured_gather(stage=stage, gather=gather):
            gather()
            outer = [t for t in (stage.outer_full, stage.outer_full_grad) if t is not None]
            whole.append(sum(t.numel() * t.element_size() for t in [*stage.full, *stage.full_grads, *outer]))
        stage.gather = measured_gather
    marks = []
    m06.fit(model, 2, BATCH, 1e-3, n_microbatches=M, on_step=lambda step, loss: marks.append(len(mesh.log)))
    held = {"parameters": sum(p.numel() * p.element_size() for p in model.parameters()),
            "gradients": sum(g.numel() * g.element_size() for g in model.grads()),
            "buffers": whole[-1]}
    return measured_cost(mesh.log[marks[-2]:marks[-1]]), held


MESHES = {"d2 t2": {"d": 2, "t": 2}, "d2 c2": {"d": 2, "c": 2}, "p2 d2": {"p": 2, "d": 2}}


@pytest.fixture(scope="module")
def measured():
    return {name: run_ranks(_run_module_17, 4, sizes, timeout=120) for name, sizes in MESHES.items()}


def layout_of(sizes) -> Layout:
    return Layout(p=sizes.get("p", 1), d=sizes.get("d", 1), c=sizes.get("c", 1), t=sizes.get("t", 1), zero=3,
                  schedule="1f1b" if sizes.get("p", 1) > 1 else "none", m=M, cp="zigzag")


def planned(sizes) -> StepCost:
    """The plan of module 17's layout; its buffers are the whole slices only (the context attention's
    transient buffer, which the plan adds on top, is not what the test measures)."""
    layout = layout_of(sizes)
    cost = costs.rank_cost(TINY, layout, BATCH, layouts.COURSE)
    slices = costs.data_cost(TINY, layout, BATCH, layouts.COURSE).memory.get("buffers", 0)
    return StepCost(cost.sent, cost.calls, {**cost.memory, "buffers": slices})


def renamed(cost: StepCost, sizes) -> dict:
    """The measured entries under the plan's names: module 17's FSDP group is "dc" even when c = 1, which
    the plan calls "d"; entries of a group of one (logged, nothing sent) left out, like the plan's."""
    out = {}
    for table in ("sent", "calls"):
        for (axis, op), value in getattr(cost, table).items():
            if axis == "dc" and sizes.get("c", 1) == 1:
                axis = "d"
            n = 1
            for a in axis:
                n *= sizes.get(a, 1)
            if n > 1:
                out[(table, axis, op)] = value
    return out


@pytest.mark.exercises("axes_cost")
@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_the_t_traffic_is_module_12s_with_and_without_sequence_parallelism(sequence_parallel):
    layout = Layout(d=2, t=2, m=M, sequence_parallel=sequence_parallel)
    got = costs.axes_cost(TINY, layout, BATCH, layouts.COURSE)
    want = m12.tp_traffic(CFG, {"t": 2}, BATCH // 2, torch.float32, M, sequence_parallel=sequence_parallel)
    got = {op: got.sent_bytes("t", op) for op in ("all_gather", "reduce_scatter", "all_reduce")}
    want = {op: want.sent_bytes("t", op) for op in ("all_gather", "reduce_scatter", "all_reduce")}
    assert got == want, (f"t = 2, sequence_parallel={sequence_parallel}: module 12's formula sends {want} over t, "
                         f"your axes_cost {got}")


@pytest.mark.exercises("data_cost", "axes_cost")
@pytest.mark.parametrize("name", ["d2 t2", "d2 c2"])
def test_the_plan_equals_what_module_17s_run_measured(measured, name):
    sizes = MESHES[name]
    plan = planned(sizes)
    want = {("sent", a, op): v for (a, op), v in plan.sent.items() if a != "p"}
    want.update({("calls", a, op): v for (a, op), v in plan.calls.items() if a != "p"})
    for rank, (cost, held) in enumerate(measured[name]):
        got = renamed(cost, sizes)
        norms = ("sent", "t", "all_reduce")
        if norms in got:   # this rank's shard's norm entries: at most all of them (see the module docstring)
            assert got[norms] <= want.get(norms, 0), f"{name}, rank {rank}: t all-reduce {got[norms]} > {want[norms]}"
            got[norms] = want[norms] = max(want[norms], 0)
        differ = sorted({key for key in {*got, *want} if got.get(key) != want.get(key)})
        # the weights' axes are data_cost's, the model's axes axes_cost's: the message names the one at fault
        culprit = " and ".join(dict.fromkeys("your data_cost" if axis in ("d", "dc", "ed") else "your axes_cost"
                                             for _, axis, _ in differ))
        assert got == want, (f"{name}, rank {rank}: module 17 measured {sorted(got.items())}, the plan says "
                             f"{sorted(want.items())}: they differ in {differ} ({culprit})")
        for kind, value in held.items():
            assert plan.memory.get(kind, 0) == value, (f"{name}, rank {rank}: module 17 holds {value} bytes of "
                                                       f"{kind}, your data_cost says {plan.memory.get(kind, 0)}")


@pytest.mark.exercises("axes_cost")
def test_the_plans_pipeline_sends_equal_what_module_17s_run_measured(measured):
    sizes = MESHES["p2 d2"]
    plan = planned(sizes)
    want = {table: getattr(plan, table).get(("p", "send"), 0) for table in ("sent", "calls")}
    for rank, (cost, _) in enumerate(measured["p2 d2"]):
        got = {table: getattr(cost, table).get(("p", "send"), 0) for table in ("sent", "calls")}
        assert got == want, (f"p2 d2, rank {rank}: module 11's StageComms sent {got} over p (bytes, calls: m = {M} "
                             f"microbatches, one message each), the plan says {want}: does axes_cost add "
                             "pipeline_sends?")


@pytest.mark.exercises("data_cost", "axes_cost")
def test_with_a_pipeline_the_plan_bounds_every_stage_from_above(measured):
    sizes = MESHES["p2 d2"]
    plan = planned(sizes)
    for rank, (cost, held) in enumerate(measured["p2 d2"]):
        for (table, axis, op), value in renamed(cost, sizes).items():
            bound = getattr(plan, table).get((axis, op), 0)
            assert value <= bound, f"p2 d2, rank {rank}: {table} {axis} {op} measured {value} > planned {bound}"
        # FSDP's blocks exactly the stage's, and the outer group of this stage only (the plan counts the stage that
        # holds the most, m18_layout.outer_tables: with an even split the last, the final norm beside the LM head):
        # ranks 0 and 1 hold the first stage (the embedding), ranks 2 and 3 the last.
        first = rank < 2
        ends = layouts.outer_tables(TINY, layout_of(sizes))[:2]
        assert ends == (False, True), f"the plan counts the outer tables {ends}, want the last stage's (False, True)"
        everywhere, here = (m17_costs.replicated_cost(CFG, sizes, torch.float32, first=f, last=l)
                            for f, l in (ends, (first, not first)))
        for op in ("all_gather", "reduce_scatter"):
            want = plan.sent_bytes("d", op) - everywhere.sent_bytes("dc", op) + here.sent_bytes("dc", op)
            assert cost.sent_bytes("dc", op) == want, f"p2 d2, rank {rank}: FSDP {op} {cost.sent_bytes('dc', op)}, want {want}"
        want = plan.memory["buffers"] - everywhere.memory["buffers"] + here.memory["buffers"]
        assert held["buffers"] == want, f"p2 d2, rank {rank}: whole slices {held['buffers']}, want {want}"


@pytest.mark.given
@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_on_a_v_schedule_the_plan_counts_the_rank_that_holds_the_most(schedule):
    """A V puts stages r and 2p-1-r on rank r: rank 0 holds both ends (the embedding, the head and the final
    norm) beside two stages' blocks; a middle rank holds two stages' blocks and no table."""
    # p = 2, 4 blocks: 4 stages of one block; rank 0 holds 2 blocks and both tables (V M = 8,192 values each,
    # more than a block): the ends
    assert layouts.outer_tables(TINY, Layout(p=2, schedule=schedule, m=4)) == (True, True, 2)
    # 6 blocks of a 4-token vocabulary: stages of ⌈6/4⌉ = 2 blocks, the last stage gets none (6 - 3 * 2), so rank
    # 0 holds 2 blocks and tables of 4 M values each; rank 1 holds 4 blocks: rank 1 holds the most
    small = presets.Model("small vocabulary", dataclasses.replace(CFG, vocab_size=4, n_layers=6), batch=8)
    assert layouts.outer_tables(small, Layout(p=2, schedule=schedule, m=4)) == (False, False, 4)
    # the same model in a loop (1F1B): 3 blocks a rank, the last holds the head and the norm
    assert layouts.outer_tables(small, Layout(p=2, schedule="1f1b", m=4)) == (False, True, 3)


def hand_psi(cfg) -> int:
    """Ψ counted here: embedding and LM head V M each, the final norm, and per block two norms, wq and wo
    (H D M each), wk and wv (K D M each), and the FFN's three F M."""
    M, D = cfg.dim, cfg.head_dim
    block = 2 * M + 2 * cfg.n_heads * D * M + 2 * cfg.n_kv_heads * D * M + 3 * cfg.ffn_dim * M
    return 2 * cfg.vocab_size * M + M + cfg.n_layers * block


@pytest.mark.exercises("data_cost")
@pytest.mark.parametrize("zero, parameters, gradients, optimizer", [
    (0, 2, 2, 12), (1, 2, 2, 12 / 8), (2, 2, 2 / 8, 12 / 8)])
def test_mixed_precision_state_is_the_playbooks_2_2_12_over_d(zero, parameters, gradients, optimizer):
    psi = hand_psi(CFG)
    assert psi % 8 == 0   # so that module 14's buckets need no padding and the figures are exact
    cost = costs.data_cost(TINY, Layout(d=8, zero=zero), BATCH, layouts.MIXED)
    want = {"parameters": parameters * psi, "gradients": gradients * psi, "optimizer": optimizer * psi}
    got = {kind: cost.memory.get(kind, 0) for kind in want}
    assert got == want, (f"ZeRO-{zero} on d = 8, Ψ = {psi}: the Ultra-Scale Playbook's 2Ψ / 2Ψ / 12Ψ (divided by "
                         f"N_d as the stage says) is {want}, the plan says {got}")


@pytest.mark.exercises("data_cost")
def test_zero3_updates_only_its_shard_of_every_weight():
    # Module 17 shards the blocks and the outer weights (embedding, final norm, LM head) over d, as FSDP2 does.
    psi = hand_psi(CFG)
    outer = 2 * CFG.vocab_size * CFG.dim + CFG.dim
    shard = (psi - outer) // 4 + -(-outer // 4)   # the blocks' slices need no padding here; the outer group may
    cost = costs.data_cost(TINY, Layout(d=4, zero=3), BATCH, layouts.COURSE)
    want = 2 * 4 * shard   # AdamW's two float32 moments of what the rank updates
    assert cost.memory.get("optimizer") == want, f"ZeRO 3 on d = 4: optimizer {cost.memory.get('optimizer')}, want {want}"
    assert cost.memory.get("parameters") == 4 * shard


@pytest.mark.exercises("data_cost")
def test_with_context_parallelism_the_weights_are_summed_over_d_and_c():
    cost = costs.data_cost(TINY, Layout(d=2, c=2, zero=1), BATCH, layouts.COURSE)
    axes = {axis for axis, _ in cost.sent}
    assert axes == {"dc"}, f"d = 2, c = 2: the gradients are summed over the 4 ranks of 'dc', the plan uses {axes}"


def module_14s_traffic(numels, d, zero, axis):
    """Module 14's bytes and calls of a step of M microbatches on d ranks, for weights of these sizes in float32
    in module 14's buckets (given code: the layout module's bucket_numels)."""
    return m14.traffic(layouts.bucket_numels(tuple(numels), torch.float32), 4, d, zero, M, axis=axis)


@pytest.mark.exercises("data_cost")
def test_zero2_reduce_scatters_the_gradients_of_every_microbatch():
    layout = Layout(d=4, zero=2, m=M)
    dense, _ = layouts.rank_parameters(TINY, layout)
    want = module_14s_traffic(dense, 4, 2, "d")
    got = costs.data_cost(TINY, layout, BATCH, layouts.COURSE)
    differ = sorted(op for _, op in {*got.calls, *want.calls, *got.sent, *want.sent}
                    if (got.calls.get(("d", op)), got.sent.get(("d", op))) != (want.calls.get(("d", op)),
                                                                              want.sent.get(("d", op))))
    question = {"reduce_scatter": "does data_cost give zero_traffic the m microbatches?",
                "all_reduce": "which small all-reduces does the planned step send (it does not clip)?"}
    assert (got.sent, got.calls) == (want.sent, want.calls), (
        f"ZeRO-2 on d = 4 with m = {M}: module 14 reduce-scatters each microbatch's gradients ({want.calls}, "
        f"{want.sent} bytes), your data_cost says {got.calls}, {got.sent}: they differ in {differ}; "
        + " ".join(question.get(op, f"what does module 14 send as {op}?") for op in dict.fromkeys(differ)))


@pytest.mark.exercises("data_cost")
def test_zero2_once_a_step_reduce_scatters_once_and_keeps_whole_gradients():
    # Module 14's pieces, counted here: the micro-steps accumulate whole gradients (Ψ' values, as ZeRO-1 keeps
    # them), one reduce-scatter a step sends (d - 1)/d of them, one all-gather the updated weights
    layout = Layout(d=4, zero=2, m=M, reduce_once=True)
    dense, _ = layouts.rank_parameters(TINY, layout)
    psi = sum(layouts.bucket_numels(tuple(dense), torch.float32))
    buckets = len(layouts.bucket_numels(tuple(dense), torch.float32))
    assert psi % 4 == 0   # no padding on d = 4
    statistics = 2 * 2 * 3 / 4 * 8   # the token count's and the loss's 8-byte all-reduces
    want_sent = {("d", "reduce_scatter"): 3 / 4 * psi * 4, ("d", "all_gather"): 3 / 4 * psi * 4,
                 ("d", "all_reduce"): statistics}
    want_calls = {("d", "reduce_scatter"): buckets, ("d", "all_gather"): buckets, ("d", "all_reduce"): 2}
    got = costs.data_cost(TINY, layout, BATCH, layouts.COURSE)
    assert (got.sent, got.calls) == (want_sent, want_calls), (
        f"ZeRO-2 once a step on d = 4, m = {M}: one reduce-scatter a step of the accumulated gradients "
        f"({want_calls}, {want_sent} bytes), got {got.calls}, {got.sent}")
    want = {"parameters": 4 * psi, "gradients": 4 * psi, "optimizer": 2 * 4 * psi // 4}
    kept = {kind: got.memory.get(kind) for kind in want}
    assert kept == want, (f"ZeRO-2 once a step keeps the whole accumulated gradients until the reduce-scatter (ZeRO-1's "
                          f"state: {want}), got {kept}")


@pytest.mark.given
def test_zero2_every_micro_step_with_a_pipeline_is_refused_in_one_line():
    with pytest.raises(ValueError, match="DeepSpeed refuses ZeRO-2 with a pipeline") as refused:
        layouts.check_layout(TINY, Layout(p=2, d=2, zero=2, schedule="1f1b", m=4), BATCH)
    assert "\n" not in str(refused.value)
    layouts.check_layout(TINY, Layout(p=2, d=2, zero=2, reduce_once=True, schedule="1f1b", m=4), BATCH)
    with pytest.raises(ValueError, match="only ZeRO-2"):
        layouts.check_layout(TINY, Layout(d=2, zero=1, reduce_once=True), BATCH)


@pytest.mark.exercises("data_cost")
@pytest.mark.parametrize("zero", [0, 1])
def test_an_moe_models_experts_are_summed_over_the_d_c_over_e_ranks_of_ed(zero):
    moe = reference("m16_router").MoEConfig(n_experts=4, top_k=2, expert_dim=16)
    model = presets.Model("tiny MoE", CFG, moe, batch=8)
    layout = Layout(d=4, e=2, m=M, zero=zero)       # "ed": the d / e = 2 ranks that hold the same experts
    _, experts = layouts.rank_parameters(model, layout)
    want = module_14s_traffic(experts, 2, zero, "ed")
    got = costs.data_cost(model, layout, BATCH, layouts.COURSE)
    got_ed = ({k: v for k, v in got.sent.items() if k[0] == "ed"}, {k: v for k, v in got.calls.items() if k[0] == "ed"})
    assert got_ed == (want.sent, want.calls), (
        f"ZeRO-{zero}, E = 4 experts on e = 2, d = 4: each expert is held by d / e = 2 ranks of 'ed', module 14's "
        f"traffic over them is {want.sent}, the plan says {got_ed[0]}")


OPTIONS = m10.OPTIONS


@pytest.mark.exercises("activation_bytes")
@pytest.mark.parametrize("fp8", [False, True])
def test_activations_are_module_10s_kept_bytes_for_every_recompute_option(fp8):
    rows, got, want = BATCH // (2 * M), {}, {}
    for option in OPTIONS:
        layout = Layout(d=2, m=M, recompute=option, fp8=fp8)
        got[option] = costs.activation_bytes(TINY, layout, BATCH, layouts.COURSE)
        want[option] = CFG.n_layers * m10.kept_bytes(CFG, rows, CFG.max_seq_len, torch.float32, option, fp8=fp8)
    assert got == want, f"fp8={fp8}: by recompute option, module 10 keeps {want}, the plan says {got}"


@pytest.mark.exercises("data_cost")
def test_rank_costs_memory_keeps_apart_layouts_whose_ranks_hold_different_blocks():
    # 4 blocks on p = 2: v = 2 gives the last rank 2 blocks and the head, a V schedule puts both tables on one
    # rank: the weights' part must be costed for each, however rank_cost's memory of earlier parts is keyed
    costs.forget()
    for schedule, v in (("interleaved", 2), ("1f1b", 2), ("zbv", 2)):
        layout = Layout(p=2, d=2, zero=1, schedule=schedule, m=4, v=v)
        got = costs.rank_cost(TINY, layout, BATCH, layouts.COURSE)
        want = costs.data_cost(TINY, layout, BATCH, layouts.COURSE)
        assert got.sent_bytes("d") == want.sent_bytes("d") and got.memory["parameters"] == want.memory["parameters"], (
            f"{layout}: rank_cost gives {got.sent_bytes('d')} bytes over d and {got.memory['parameters']} of "
            f"parameters, data_cost {want.sent_bytes('d')} and {want.memory['parameters']}")
    costs.forget()


@pytest.mark.exercises("activation_bytes")
@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_activations_over_t_are_module_12s_with_and_without_sequence_parallelism(sequence_parallel):
    layout = Layout(d=2, t=2, m=M, sequence_parallel=sequence_parallel)
    got = costs.activation_bytes(TINY, layout, BATCH, layouts.COURSE)
    want = CFG.n_layers * sum(m12.tp_activations_by_name(CFG, {"t": 2}, BATCH // 2, torch.float32, M,
                                                         sequence_parallel=sequence_parallel).values())
    ratio = "" if not want else f" ({got / want:.2f} times module 12's)"
    assert got == want, (f"t = 2, sequence_parallel={sequence_parallel}: module 12's block keeps {want}, your "
                         f"activation_bytes says {got}{ratio}: which of the block's tensors does each t rank keep whole?")


@pytest.mark.exercises("activation_bytes")
def test_with_fp8_and_t_2_every_rank_keeps_its_own_scale():
    by_name = m12.tp_activations_by_name(CFG, {"t": 2}, BATCH // 2, torch.float32, M, sequence_parallel=True)
    # module 10's fp8 rule on each rank's share: n1, n2 and s as e4m3 (a byte a value) and one float32 scale for the
    # share (each rank scales what it holds), the block's float32 abs-maxes
    block = sum(size // 4 + 4 if name in m10.LINEAR_INPUTS else size for name, size in by_name.items())
    want = CFG.n_layers * (block + 4 * len(m10.ABS_MAXES))
    got = costs.activation_bytes(TINY, Layout(d=2, t=2, m=M, fp8=True), BATCH, layouts.COURSE)
    assert got == want, (f"fp8 with t = 2: each rank keeps its share of n1, n2 and s in e4m3 and a 4-byte scale of "
                         f"its own ({want} bytes), the plan says {got}")


@pytest.mark.exercises("activation_bytes")
def test_interleaved_stages_hold_L_over_p_v_blocks():
    one = costs.activation_bytes(TINY, Layout(d=1, m=4), BATCH, layouts.COURSE) // CFG.n_layers
    order = reference("m11_generators").make_schedule("interleaved", 2, 4)
    live = max(peak_live(rank_order) for rank_order in order.orders)   # (stage, microbatch) pairs kept at once
    got = costs.activation_bytes(TINY, Layout(p=2, m=4, schedule="interleaved"), BATCH, layouts.COURSE)
    want = one * (CFG.n_layers // 4) * live
    assert got == want, (f"interleaved on p = 2 (v = 2): a stage holds L/(p v) = 1 block and a rank keeps {live} "
                         f"stage-microbatches at its peak ({want} bytes), the plan says {got}")


@pytest.mark.exercises("activation_bytes")
@pytest.mark.parametrize("schedule, live", [("gpipe", 8), ("1f1b", 2)])
def test_a_pipeline_keeps_the_microbatches_its_schedule_has_in_flight(schedule, live):
    one = costs.activation_bytes(TINY, Layout(d=1, m=8), BATCH, layouts.COURSE) // CFG.n_layers
    layout = Layout(p=2, m=8, schedule=schedule)
    got = costs.activation_bytes(TINY, layout, BATCH, layouts.COURSE)
    want = one * (CFG.n_layers // 2) * live
    assert got == want, (f"{schedule} on p = 2, m = 8: the first rank keeps {live} microbatches of its 2 blocks "
                         f"({want} bytes), the plan says {got}")


@pytest.mark.exercises("axes_cost")
def test_the_expert_exchange_is_module_16s_formula_on_a_step_of_evenly_spread_routing():
    moe = reference("m16_router").MoEConfig(n_experts=4, top_k=2, expert_dim=16)
    model = presets.Model("tiny MoE", CFG, moe, batch=8)
    layout = Layout(d=4, e=2, m=M, zero=1)
    tokens = BATCH // (4 * M) * CFG.max_seq_len          # N a source sees in a microbatch
    rows = moe.top_k * tokens / moe.n_experts            # k N slots spread evenly over E experts
    record = SimpleNamespace(sent=torch.full((4,), rows, dtype=torch.float64),
                             received=torch.full((2, 2), rows, dtype=torch.float64))
    formula = reference("m16_costs").step_cost(CFG, moe, {"d": 4, "e": 2}, 0, [record] * (CFG.n_layers * M))
    want = {key: value for key, value in formula.sent.items() if key[0] == "e"}
    got = {key: value for key, value in costs.axes_cost(model, layout, BATCH, layouts.COURSE).sent.items()}
    assert got == want, f"E = 4, e = 2, d = 4: module 16's exchange over {CFG.n_layers * M} records is {want}, got {got}"


@pytest.mark.exercises("axes_cost")
def test_context_attention_is_costed_on_a_tensor_ranks_heads():
    layout = Layout(d=2, c=2, t=2, m=M, cp="zigzag")
    t = 2   # a tensor rank's attention: H/t query and K/t key/value heads, written out by hand
    heads = dataclasses.replace(CFG, dim=CFG.n_heads // t * CFG.head_dim, n_heads=CFG.n_heads // t,
                                n_kv_heads=CFG.n_kv_heads // t, ffn_dim=CFG.ffn_dim // t)
    formula = m15.cp_traffic(heads, BATCH, CFG.max_seq_len, torch.float32, 2, "zigzag", 2, M)
    want = {key: value for key, value in formula.sent.items() if key[0] == "c"}
    got = {key: value for key, value in costs.axes_cost(TINY, layout, BATCH, layouts.COURSE).sent.items()
           if key[0] == "c"}
    assert got == want, (f"c = 2 on t = 2: module 15's formula for the {heads.n_heads} query and {heads.n_kv_heads} "
                         f"key/value heads of a tensor rank sends {want}, the plan says {got}")


@pytest.mark.exercises("axes_cost")
def test_ulysses_is_planned_as_deepspeed_runs_it():
    # DeepSpeed's backward runs its forward's all-to-alls backwards (module 15's adjoint count); module 15's own
    # UlyssesAttention re-sends q, k, v and the statistics, 13 all-to-alls where DeepSpeed's needs 8
    layout = Layout(d=2, c=2, m=M, cp="ulysses")
    formula = m15.cp_traffic(CFG, BATCH, CFG.max_seq_len, torch.float32, 2, "ulysses", 2, M, adjoint=True)
    want = {key: value for key, value in formula.sent.items() if key[0] == "c"}
    got = {key: value for key, value in costs.axes_cost(TINY, layout, BATCH, layouts.COURSE).sent.items()
           if key[0] == "c"}
    assert got == want, (f"c = 2, Ulysses: DeepSpeed's all-to-alls send {want}, the plan says {got} (module 15's "
                         "cp_traffic with adjoint=True)")
