# Generated from solutions/m11_generators.py by `python -m course.skeleton`: fill in the TODOs.
# Grade your work with `python main.py grade 11`. (skeleton 05537654087c)
"""Module 11 - the schedules, generated as data, and the bubble each one leaves.

Every generator takes the number of pipeline ranks p (`world_size`: a schedule's ranks are the
places 0 .. p - 1 of the pipeline's group) and of microbatches m (`n_microbatches`) and returns a
Schedule (m11_actions): a placement of the stages on the ranks and one list of actions per rank. The executor (m11_executor) runs any of them; none of them knows how.

    gpipe           one stage per rank; all forwards, then all backwards          (module 05)
    1f1b            one stage per rank; warm-up, one forward / one backward, cool-down  (module 05)
    interleaved     v stages per rank, looped; 1F1B over the p v stages          bubble / v
    zbh1            one stage per rank; backward split into I and W, W deferred into the cool-down
    zbh2            zbh1 with the warm-up filled with forwards and the cool-down with W's: no idle time
                    between a rank's first and last action, at 2p-1 microbatches kept
    interleaved_zb  zbh1 on interleaved's order of v stages per rank (torch's rule; given code)
    zbv             two stages per rank in a V; I/W split; warm-up filled from both ends
    dualpipev       the V, DualPipe's phases: a forward of one stage paired with a backward of the other

Arguments a schedule cannot serve are refused by `check_arguments` with a one-line ValueError that
says what would work.

The bubble of each, as a closed form, is `idle_per_rank`: with stage costs τ_F, τ_I, τ_W (the times
of one stage's F, I and W actions; τ_B = τ_I + τ_W, see course/simulate.py's Costs) and free
messages, every rank idles that long in a step (the synchronous step: from the first rank's start to
the last rank's end, the optimizer waiting for every rank). `longest_span_idle` is the zero-bubble
paper's convention: the idle time inside the longest of the ranks' own spans (first action to last),
the optimizer's synchronisation bypassed. The chapter derives them; the tests check the simulator
against them.
"""
from collections import deque
from fractions import Fraction

from course.simulate import Costs
from .m11_actions import Action, Schedule, looped_placement, one_stage_per_rank, v_placement


def check_arguments(name: str, world_size: int, n_microbatches: int, stages_per_rank: int = 2):
    """Raise a one-line ValueError, saying what would work, for arguments `name` cannot serve."""
    p, m = world_size, n_microbatches
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    if p < 1 or m < 1:
        raise ValueError(f"{name} needs at least one rank and one microbatch, got world_size={p}, n_microbatches={m}")
    if name in LOOPED:
        if stages_per_rank < 2:
            raise ValueError(f"{name} needs at least 2 stages per rank, got {stages_per_rank}; "
                             f"with one stage per rank it is {LOOPED[name]}")
        if m % max(1, m // p):
            below = next(k for k in range(m - 1, 0, -1) if k % max(1, k // p) == 0)
            above = next(k for k in range(m + 1, 2 * m + p) if k % max(1, k // p) == 0)
            raise ValueError(f"{name} sends the microbatches round the ranks in max(1, m // p) rounds of equal "
                             f"size (torch's rule): m = {m} on p = {p} makes {m // p} rounds, which {m} does not "
                             f"divide; use {below} or {above}")
    if name == "zbv" and m < 2 * p - 1:
        raise ValueError(f"zbv's warm-up runs 2p-1 = {2 * p - 1} forwards of the V's first stage on rank 0: "
                         f"it needs at least {2 * p - 1} microbatches for p = {p}, got {m}")
    if name == "dualpipev" and m < 2 * p:
        raise ValueError(f"dualpipev needs at least 2p = {2 * p} microbatches for p = {p} (its warm-up fills the "
                         f"V's {2 * p} stages), got {m}")


def microbatches_per_round(world_size: int, n_microbatches: int) -> int:
    """g: how many microbatches go round the looped ranks together (interleaved schedules). torch's
    rule (ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble): max(1, m // p) rounds of equal size,
    so g = p when p divides m, g = m when m < p, and e.g. 5 for p = 4, m = 10."""
    return n_microbatches // max(1, n_microbatches // world_size)


def gpipe(world_size: int, n_microbatches: int) -> Schedule:
    """Module 05's GPipe as data (given): every rank forwards microbatches 0..m-1, then backwards them
    in the same order. Bubble (p-1)/(m+p-1); every rank keeps all m microbatches' activations."""
    check_arguments("gpipe", world_size, n_microbatches)
    orders = [[Action(r, "F", m) for m in range(n_microbatches)] + [Action(r, "B", m) for m in range(n_microbatches)]
              for r in range(world_size)]
    return Schedule("gpipe", one_stage_per_rank(world_size), orders, n_microbatches)


def one_f_one_b(world_size: int, n_microbatches: int) -> Schedule:
    """Module 05's 1F1B as data (given; the chapter derives its warm-up from arrival times, the argument
    your interleaved order carries to the loop): min(p-r-1, m) warm-up forwards on rank r, then
    F(i + warm-up), B(i) pairs, then the backwards left. Bubble (p-1)/(m+p-1); rank r keeps at most
    min(p-r, m)."""
    check_arguments("1f1b", world_size, n_microbatches)
    orders = []
    for r in range(world_size):
        warmup = min(world_size - r - 1, n_microbatches)
        order = [Action(r, "F", m) for m in range(warmup)]
        for m in range(n_microbatches - warmup):
            order += [Action(r, "F", m + warmup), Action(r, "B", m)]
        orders.append(order + [Action(r, "B", m) for m in range(n_microbatches - warmup, n_microbatches)])
    return Schedule("1f1b", one_stage_per_rank(world_size), orders, n_microbatches)


def interleaved(world_size: int, n_microbatches: int, stages_per_rank: int = 2) -> Schedule:
    """Interleaved 1F1B (Megatron-LM): the model cut into p v stages, stage s on rank s % p. Each rank
    runs 1F1B over its v stages: microbatches go round in groups of g (microbatches_per_round: p when
    p divides m), forwards through its stages first to last, backwards last to first. Each stage is
    1/v of a rank's layers, so the bubble's time is divided by v; the warm-up is longer, so a rank
    keeps more (smaller) activations."""
    check_arguments("interleaved", world_size, n_microbatches, stages_per_rank)
    placement = looped_placement(world_size, stages_per_rank)
    # TODO(m11): interleaved 1F1B's order on every rank
    # Contract: rank r runs v*m forwards and v*m full backwards (kind "B") on its local stages (local stage j
    #   is the looped placement's stage j*p + r), in Megatron-LM's order, which torch's ScheduleInterleaved1F1B
    #   follows (the tests compare the two for every m torch accepts, and count the activations each rank keeps):
    # - its forwards, in order: round after round of g = microbatches_per_round(p, m) microbatches (given); within
    #   a round, the round's g microbatches through local stage 0 in microbatch order, then the same g through
    #   local stage 1, and so on to the last local stage;
    # - its backwards, in order: the same rounds and groups, the local stages visited from the last to the first;
    # - the two sequences woven as one_f_one_b (above) weaves its forwards and backwards, with another warm-up.
    # The questions: which (stage, microbatch) is rank r's k-th forward, and its k-th backward? How long must
    #   rank r's warm-up be for Megatron-LM's order?
    # Maths: docs/11, "1F1B's order, from arrival times" derives 1F1B's warm-up w_r from what waits for what;
    #   "Interleaved 1F1B" says what changes on the loop: where the last rank's first backward is, and the slack.
    # Pitfalls:
    # - which stage is local stage j of rank r on the looped placement (the validator names a stage not on it)?
    # - where p does not divide m (p = 4, m = 6), is a group p microbatches or g?
    # - in which order do the backwards visit a rank's stages: which of them gets the first gradient?
    # - 1F1B's own warm-up makes a rank wait for a backward before its forward has run (the validator refuses
    #   it); a warm-up without the slack passes the validator but is not Megatron-LM's order: which is it?
    raise NotImplementedError("TODO(m11): interleaved 1F1B's order on every rank")
    return Schedule("interleaved", placement, orders, n_microbatches)


def zbh1(world_size: int, n_microbatches: int) -> Schedule:
    """ZB-H1 (Qi et al., Zero Bubble Pipeline Parallelism, 2024): 1F1B with each backward split into
    I and W. I goes where 1F1B's B was (the rank before waits for it); rank r defers some of its W's
    to the cool-down, where 1F1B's rank r sat idle. Same peak activations as 1F1B's
    rank 0 (p microbatches) on every rank; idle (p-1)(τ_F+τ_I-τ_W) per rank instead of 1F1B's
    (p-1)(τ_F+τ_B) (in the zero-bubble paper's notation (p-1)(T_F+T_B-T_W), its B being our I)."""
    check_arguments("zbh1", world_size, n_microbatches)
    # TODO(m11): ZB-H1's order on every rank
    # Contract: rank r's list on stage r: one_f_one_b's order (above) with every B(k) replaced by I(k), and one
    #   W per microbatch, in microbatch order: each I is followed by the oldest W still owed, except rank r's first
    #   few I's, which are followed by none; the W's still owed after the last I end the list, where 1F1B's rank r
    #   sits idle. The tests compare small cases with orders checked by hand and with torch's
    #   (ScheduleInterleavedZeroBubble with one stage per rank), the simulated idle time with (p-1)(τ_F+τ_I-τ_W),
    #   and each rank's peak with p microbatches.
    # The question: how many of rank r's first I's go without a W?
    # Maths: docs/11, "ZB-H1": the stage before waits for I, nobody for W; the gaps of 1F1B's cool-down on rank r.
    # Pitfalls:
    # - what does the mirror image (rank r holding back what rank p-1-r should) do to rank 0's memory and the bubble?
    # - holding back none, or one more than needed: what happens to the cool-down's gaps, and to the peak?
    # - can a W come before its own I (the validator refuses it)?
    raise NotImplementedError("TODO(m11): ZB-H1's order on every rank")
    return Schedule("zbh1", one_stage_per_rank(world_size), orders, n_microbatches)


def zbh2(world_size: int, n_microbatches: int) -> Schedule:
    """ZB-H2 (the zero-bubble paper, section 2.2): ZB-H1 with the warm-up filled with forwards and the
    cool-down with W's. Rank r runs forwards until its first input gradient can have come back, and
    holds back W's for its cool-down, so that (at τ_F = τ_I = τ_W, messages free) no rank idles
    between its first and its last action: the ranks' spans form a parallelogram. Every rank keeps
    2p-1 microbatches (ZB-H1: p). Idle time (p-1)(τ_F+τ_I-2τ_W) inside the longest rank's span (the
    paper's bubble, in its notation (p-1)(T_F+T_B-2T_W), its B being our I; it needs the optimizer's
    synchronisation bypassed), (p-1)·max(τ_F+τ_I-2τ_W, τ_F) per rank in the synchronous step."""
    check_arguments("zbh2", world_size, n_microbatches)
    # TODO(m11): ZB-H2's order on every rank
    # Contract: ZB-H1's shape on stage r (warm-up forwards; for each I in turn the next forward while one is
    #   left, the I, and the oldest W still owed, except after rank r's first few I's; then the W's still owed,
    #   oldest first), one F, one I and one W per microbatch, with two of ZB-H1's numbers changed so that at
    #   τ_F = τ_I = τ_W (messages free) no rank idles between its first and its last action: the warm-up (capped
    #   at m) and how many of the first I's go without a W. The tests compare p = 3, m = 5 with an order checked
    #   by hand, every rank's span with the closed forms, and each rank's peak with 2p-1 microbatches.
    # The questions: how many forwards fit before rank r's first I, and how many more W's than rank 0 must
    #   rank r keep for after its last I?
    # Maths: count time in unit actions (τ_F = τ_I = τ_W = 1, messages free). Rank r's first forward starts at r;
    #   the last rank runs microbatch 0's I right after its forward; an input gradient comes back one rank per
    #   unit. With no idle time inside any rank's span, every rank's span is equally long.
    # Pitfalls:
    # - with ZB-H1's warm-up, does rank r wait for its first gradient (the tests compare the idle time inside
    #   the spans with the closed form)?
    # - one forward too many: how many microbatches does each rank then keep?
    # - with ZB-H1's W's held back, does the cool-down keep gaps? With one more, what does it cost?
    # - with m < 2p-1, does the warm-up ask for microbatches that do not exist?
    raise NotImplementedError("TODO(m11): ZB-H2's order on every rank")
    return Schedule("zbh2", one_stage_per_rank(world_size), orders, n_microbatches)


def interleaved_zero_bubble(world_size: int, n_microbatches: int, stages_per_rank: int = 2) -> Schedule:
    """Interleaved zero bubble (torch.distributed.pipelining's ScheduleInterleavedZeroBubble; the
    zero-bubble paper's ZB-H1 on interleaved 1F1B's loop). Given code, on top of your `interleaved`:
    its forwards and its backwards in its order, every B split into I and W, woven by ZB-H1's rules
    (the W's each rank holds back read off your `zbh1`), and its warm-up drops the slack Megatron-LM
    gives a full backward's trip back (an I travels faster), keeping 1F1B's count carried to the loop
    (torch's rule). Idle per rank, in stage costs (m >= p): (p-1)·max(τ_F+τ_I-τ_W, τ_F, τ_I),
    ZB-H1's with stages 1/v the size."""
    check_arguments("interleaved_zb", world_size, n_microbatches, stages_per_rank)
    p, total = world_size, stages_per_rank * n_microbatches
    looped = interleaved(p, n_microbatches, stages_per_rank)  # your order of forwards and of backwards
    orders = []
    for r, order in enumerate(looped.orders):
        # ZB-H1's rule, read off your zbh1: how many of rank r's first I's go without a W.
        kinds = [a.kind for a in zbh1(p, p).orders[r]]
        held = kinds[:kinds.index("W")].count("I") - 1
        forwards = [a for a in order if a.kind == "F"]
        inputs = [a._replace(kind="I") for a in order if a.kind == "B"]
        # The forwards before the one the first backward needs here, and 1F1B's one per later rank.
        warmup = min(forwards.index(inputs[0]._replace(kind="F")) + (p - r - 1), total)
        ours, weights_done = forwards[:warmup], 0
        for k in range(total):
            if k + warmup < total:
                ours.append(forwards[k + warmup])
            ours.append(inputs[k])
            if k >= held:
                ours.append(inputs[weights_done]._replace(kind="W"))
                weights_done += 1
        orders.append(ours + [a._replace(kind="W") for a in inputs[weights_done:]])
    return Schedule("interleaved_zb", looped.placement, orders, n_microbatches)


def zbv(world_size: int, n_microbatches: int) -> Schedule:
    """ZB-V (the zero-bubble paper, section 6): 2p stages in a V, rank r holding stage r (going down)
    and 2p-1-r (coming back). Rank 0 holds the first and the last stage, so it can start the
    backward of a microbatch as soon as the V has turned: the warm-up is filled from both ends. Peak
    activations 2p half-size stages per rank: 1F1B's rank-0 memory on every rank."""
    check_arguments("zbv", world_size, n_microbatches)
    placement = v_placement(world_size)
    # TODO(m11): ZB-V's order on every rank
    # Contract: with down = r and up = 2p-1-r, rank r's list is ZB-V's as torch.distributed.pipelining's
    #   ScheduleZBVZeroBubble builds it (the tests compare the two action by action, and with orders checked by
    #   hand for p = 2), microbatches taken in order for each (stage, kind), in five phases:
    #   1. forwards of down only, until microbatch 0 can have come down the V to stage up;
    #   2. forwards of up and down by turns, until up's first input gradient can have arrived;
    #   3. rounds of F(up), I(up), W(up), until phase 4's first I(down) finds its gradient there;
    #   4. the steady state, a round at a time: down's F (while it has had fewer than m), I and W, then up's F,
    #      I and W, until both stages have had m forwards;
    #   5. the cool-down: the I's left, the stage before waiting for them, then the W's left, which nobody waits
    #      for: I's of both stages by turns while up has some left, then down's last I's, each followed by the
    #      oldest W down still owes; then every W left of up, then of down.
    # The question: how many rounds does each phase have on rank r, as a function of p and r?
    # Maths: count time in unit actions (τ_F = τ_I = τ_W = 1, messages free): a phase lasts until what the next
    #   one needs can have arrived. docs/11, "ZB-V", times the phases of p = 3 this way; the tests take p = 2,
    #   4 and 8.
    # Pitfalls:
    # - which stages does rank r hold on the V (the validator names an action on another rank)?
    # - one forward more or less in phase 1: does a rank then wait (the simulated bubble grows), or run a
    #   forward twice (the validator counts them)?
    # - phase 3's rounds: the gradient of phase 4's first I(down) comes from rank r+1: how many rounds does rank
    #   r need compared with rank r+1, and how many does rank p-1 need?
    raise NotImplementedError("TODO(m11): ZB-V's order on every rank")
    return Schedule("zbv", placement, orders, n_microbatches)


def dualpipev(world_size: int, n_microbatches: int) -> Schedule:
    """DualPipeV (DeepSeek's DualPipe cut in half, as in deepseek-ai/DualPipe and torch's
    ScheduleDualPipeV): the V placement, and phases in which a forward of one stage is paired with
    a full backward of the other. DualPipe overlaps the two of a pair (one's communication hides
    behind the other's compute); our executor runs them one after the other, F first. The W's of
    the first backwards and of the last ones are split off (I now, W later) to fill the warm-up and
    the cool-down. Peak activations 2p+1 half-size stages per rank."""
    check_arguments("dualpipev", world_size, n_microbatches)
    placement = v_placement(world_size)
    # TODO(m11): DualPipeV's order on every rank
    # Contract: torch's ScheduleDualPipeV's order (the tests compare the two action by action, and with
    # orders checked by hand for p = 2). With down = r and up = 2p-1-r, microbatches are taken in order,
    # counted per stage for F and per stage for B and I together (either gives the input gradient); the W of
    # every I is queued, and "a W" below is the oldest queued one. DualPipe's eight phases, each a number of
    # rounds of the same actions:
    #   1. F(down)
    #   2. F(down), F(up)
    #   3. I(up), a W, F(up)
    #   4. F(down), B(up), F(up), B(down)         (two pairs: a forward of one stage with a backward of the other)
    #   5. B(up), F(up), B(down)
    #   6. X(up), X(down), where X is B for the first half of the phase's backwards and I for the second half
    #      (DualPipe's switch: from there on the W's are kept for the cool-down's gaps)
    #   7. a W, I(down)
    #   8. a W
    # The question: how many rounds does each phase have on rank r, as a function of p, m and r?
    # Maths: count time in unit actions (τ_F = τ_I = τ_W = 1, a B 2, messages free), as docs/11 times ZB-V's
    # phases for p = 3. Phase 1 ends so that phase 2's first F(up) starts
    # when microbatch 0 can have reached stage up; phase 2 so that up's first backward starts when its
    # gradient can have arrived; phase 3 lasts the fewest rounds after which phase 4's first B(down) finds its
    # gradient there (it comes back up the V's first leg: work it out from rank p-1 to rank 0); phase 4 ends
    # when down has had its m forwards, phase 5 when up has; phases 6 and 7 run the backwards left, phase 8
    # the W's left.
    # Pitfalls:
    # - a B is the microbatch's I and W in one: which I number does it take, and does it queue a W?
    # - popping the newest queued W instead of the oldest still gives a valid schedule: is it DualPipeV's order
    #   (the tests compare the orders with torch's)?
    # - a phase one round too long or too short still passes the validator on some ranks: the tests compare the
    #   order with torch's, and the simulated idle time with the closed form.
    raise NotImplementedError("TODO(m11): DualPipeV's order on every rank")
    return Schedule("dualpipev", placement, orders, n_microbatches)


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved, "zbh1": zbh1, "zbh2": zbh2,
             "interleaved_zb": interleaved_zero_bubble, "zbv": zbv, "dualpipev": dualpipev}
LOOPED = {"interleaved": "1f1b", "interleaved_zb": "zbh1"}  # take stages_per_rank (v); with v = 1 they are these


def make_schedule(name: str, world_size: int, n_microbatches: int, stages_per_rank: int = 2) -> Schedule:
    """The schedule called `name` (a key of SCHEDULES); stages_per_rank is the looped schedules' v."""
    check_arguments(name, world_size, n_microbatches, stages_per_rank)
    if name in LOOPED:
        return SCHEDULES[name](world_size, n_microbatches, stages_per_rank)
    return SCHEDULES[name](world_size, n_microbatches)


def stages_per_rank_of(name: str, stages_per_rank: int = 2) -> int:
    """How many stages each rank holds in schedule `name`."""
    return stages_per_rank if name in LOOPED else {"zbv": 2, "dualpipev": 2}.get(name, 1)


def idle_per_rank(name: str, world_size: int, n_microbatches: int, costs: Costs = Costs(),
                  atomic_pairs: bool = False, stages_per_rank: int = 2) -> Fraction:
    """How long each rank idles in one synchronous step of `name`, in closed form, with stage costs
    `costs` (costs.F, costs.I, costs.W are τ_F, τ_I, τ_W; costs.B is τ_B) and free messages (every rank
    idles the same). The chapter derives each; a ValueError says where a form does not hold.
    atomic_pairs: DualPipe's row, each pair started as one action of cost τ_F&B (costs.FB; see
    simulate_schedule); where τ_F&B < τ_F + τ_B the ranks idle differently, and this is the idlest
    rank's idle time, as DualPipe's table gives it. stages_per_rank: the looped schedules' v."""
    p, m, v = world_size, n_microbatches, stages_per_rank
    check_arguments(name, p, m, stages_per_rank)
    if costs.hop:
        raise ValueError("the closed forms assume free messages (τ_hop = 0); simulate a latency instead")
    if name in ("gpipe", "1f1b"):
        return (p - 1) * (costs.F + costs.B)
    if name == "interleaved":  # with m < p a round is m microbatches: each extra stage waits p - m more
        return (p - 1 + (v - 1) * max(0, p - m)) * (costs.F + costs.B)
    if name in ("zbh1", "interleaved_zb"):  # (p-1)(τ_F+τ_I-τ_W) while the W's fit in the gaps (τ_W <= τ_F, τ_I)
        if m < p:
            raise ValueError(f"{name}'s closed form needs m >= p: with fewer microbatches too few W's fill the cool-down")
        return (p - 1) * max(costs.F + costs.I - costs.W, costs.F, costs.I)
    if name == "zbh2":
        _check_zbh2_form(p, m, costs)
        return (p - 1) * max(costs.F + costs.I - 2 * costs.W, costs.F)  # the last rank starts (p-1) τ_F late
    if name == "zbv":
        if not costs.F == costs.I == costs.W:
            raise ValueError("zbv's closed form holds for τ_F = τ_I = τ_W, the costs it is designed for; simulate others")
        return (p - 1) * costs.F
    if name == "dualpipev":
        if not (costs.F == costs.I and costs.W <= costs.F):
            raise ValueError("dualpipev's closed form holds for τ_F = τ_I and τ_W <= τ_F; simulate other costs")
        # DualPipe's table, in its notation: (PP/2 - 1)(F&B + B - 3W) with PP = 2p stages; in ours,
        # (p-1)(τ_F&B + τ_B - 3 τ_W). Run one after the other (τ_F&B = τ_F + τ_B, not started together),
        # a pair's F goes ahead while its B waits for a gradient: τ_I less per hop.
        if atomic_pairs:
            if not max(costs.F, costs.B) <= costs.pair <= costs.F + costs.B:
                raise ValueError("an overlapped pair takes at least its longer half and at most both: "
                                 "max(τ_F, τ_B) <= τ_F&B <= τ_F + τ_B")
            return (p - 1) * (costs.pair + costs.B - 3 * costs.W)
        return (p - 1) * (costs.F + costs.I - costs.W)
    raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")


def longest_span_idle(name: str, world_size: int, n_microbatches: int, costs: Costs = Costs(),
                      stages_per_rank: int = 2) -> Fraction:
    """The zero-bubble paper's convention: the idle time inside the longest of the ranks' own spans
    (each rank's first action to its last), as when the optimizer's synchronisation is bypassed and
    each rank steps as soon as its own work is done. ZB-H2 and ZB-V are built so that no rank idles
    inside its span; every other schedule here keeps rank 0 busy from the step's start to its end, so
    its longest span is the step and this is idle_per_rank."""
    p, m = world_size, n_microbatches
    if name == "zbh2":
        check_arguments(name, p, m)
        _check_zbh2_form(p, m, costs)
        return (p - 1) * (costs.F + costs.I - 2 * costs.W)
    if name == "zbv":
        idle_per_rank(name, p, m, costs)  # the same conditions (τ_F = τ_I = τ_W)
        return Fraction(0)
    return idle_per_rank(name, p, m, costs, stages_per_rank=stages_per_rank)


def _check_zbh2_form(p: int, m: int, costs: Costs):
    if m < 2 * p - 1:
        raise ValueError(f"zbh2's closed form needs m >= 2p-1 = {2 * p - 1}: its warm-up runs 2p-1 forwards on rank 0")
    if costs.hop or not costs.W <= min(costs.F, costs.I):
        raise ValueError("zbh2's closed form holds for τ_W <= τ_F, τ_I and free messages; simulate other costs")


def bubble_formula(name: str, world_size: int, n_microbatches: int, costs: Costs = Costs(),
                   stages_per_rank: int = 2, atomic_pairs: bool = False) -> Fraction:
    """The idle fraction of a step: idle / (compute + idle), with compute = m v (τ_F + τ_B) per rank."""
    if atomic_pairs and costs.pair != costs.F + costs.B:
        raise ValueError("with overlapped pairs (τ_F&B < τ_F + τ_B) each rank computes and idles differently; "
                         "simulate the step, or take idle_per_rank's idlest rank")
    compute = n_microbatches * stages_per_rank_of(name, stages_per_rank) * (costs.F + costs.B)
    idle = idle_per_rank(name, world_size, n_microbatches, costs, atomic_pairs, stages_per_rank)
    return idle / (compute + idle)
