# Generated from solutions/m11_generators.py by `python -m course.skeleton`: fill in the TODOs.
# Grade your work with `python main.py grade 11`. (skeleton 199e8c6e36b2)
"""Module 11 - the schedules, generated as data, and the bubble each one leaves.

Every generator takes the number of ranks P (`world_size`) and of microbatches M (`n_microbatches`)
and returns a Schedule (m11_actions): a placement of the stages on the ranks and one list of
actions per rank. The executor (m11_executor) runs any of them; none of them knows how.

    gpipe        one stage per rank; all forwards, then all backwards          (module 05)
    1f1b         one stage per rank; warm-up, one forward / one backward, cool-down  (module 05)
    interleaved  v stages per rank, looped; 1F1B over the P*v stages          bubble / v
    zbh1         one stage per rank; backward split into I and W, W deferred into the cool-down
    zbv          two stages per rank in a V; I/W split; warm-up filled from both ends
    dualpipev    the V, DualPipe's phases: a forward of one stage paired with a backward of the other

Arguments a schedule cannot serve are refused by `check_arguments` with a one-line ValueError that
says what would work.

The bubble of each, as a closed form, is `idle_per_rank`: with stage costs F, I, W (B = I + W, see
course/simulate.py's Costs) and free messages, every rank idles that long in a step. The chapter
derives them; the tests check the simulator against them.
"""
from collections import deque
from fractions import Fraction

from course.simulate import Costs
from .m11_actions import Action, Schedule, looped_placement, one_stage_per_rank, v_placement


def check_arguments(name: str, world_size: int, n_microbatches: int, stages_per_rank: int = 2):
    """Raise a one-line ValueError, saying what would work, for arguments `name` cannot serve."""
    P, M = world_size, n_microbatches
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    if P < 1 or M < 1:
        raise ValueError(f"{name} needs at least one rank and one microbatch, got world_size={P}, n_microbatches={M}")
    if name == "interleaved":
        if stages_per_rank < 2:
            raise ValueError(f"interleaved needs at least 2 stages per rank, got {stages_per_rank}; "
                             "with one stage per rank it is 1f1b")
        if M % P:
            raise ValueError(f"interleaved sends the microbatches round the ranks in groups of P = {P}: "
                             f"n_microbatches must be a multiple of {P}, got {M}; use {P * (M // P + 1)}, say")
    if name == "zbv" and M < 2 * P - 1:
        raise ValueError(f"zbv's warm-up runs 2P-1 = {2 * P - 1} forwards of the V's first stage on rank 0: "
                         f"it needs at least {2 * P - 1} microbatches for P = {P}, got {M}")
    if name == "dualpipev" and M < 2 * P:
        raise ValueError(f"dualpipev needs at least 2P = {2 * P} microbatches for P = {P} (its warm-up fills the "
                         f"V's {2 * P} stages), got {M}")


def gpipe(world_size: int, n_microbatches: int) -> Schedule:
    """Module 05's GPipe as data: every rank forwards microbatches 0..M-1, then backwards them in
    the same order. Bubble (P-1)/(M+P-1); every rank keeps all M microbatches' activations."""
    check_arguments("gpipe", world_size, n_microbatches)
    # TODO(m11): GPipe's order on every rank
    # Contract: orders[r] is rank r's list of Actions, all on its stage r: the M forwards, then the M
    # full backwards (kind "B"), each in microbatch order 0..M-1: what module 05's gpipe ran.
    # Pitfalls:
    # - rank r's stage is r (one_stage_per_rank), not 0 on every rank: the validator then says "rank 1
    #   runs 0F0, but stage 0 is on rank 0".
    raise NotImplementedError("TODO(m11): GPipe's order on every rank")
    return Schedule("gpipe", one_stage_per_rank(world_size), orders, n_microbatches)


def one_f_one_b(world_size: int, n_microbatches: int) -> Schedule:
    """Module 05's 1F1B as data: min(P-r-1, M) warm-up forwards on rank r, then F(m + warm-up), B(m)
    pairs, then the backwards left. Bubble (P-1)/(M+P-1); rank r keeps at most min(P-r, M)."""
    check_arguments("1f1b", world_size, n_microbatches)
    # TODO(m11): 1F1B's order on every rank
    # Contract: module 05's one_f_one_b order exactly, as Actions on stage r: min(P-r-1, M) warm-up
    # forwards; then pairs of one forward (the next microbatch) and one full backward (the oldest in
    # flight); then the backwards left. Each microbatch gets one F and one B, each kind in microbatch order.
    # Pitfalls:
    # - a warm-up not capped at M asks for microbatches that do not exist (M < P-r-1);
    # - one warm-up forward too few and rank r waits for a backward in every pair (the simulated bubble
    #   grows); one too many and it keeps P-r+1 microbatches (the tests count both).
    raise NotImplementedError("TODO(m11): 1F1B's order on every rank")
    return Schedule("1f1b", one_stage_per_rank(world_size), orders, n_microbatches)


def interleaved(world_size: int, n_microbatches: int, stages_per_rank: int = 2) -> Schedule:
    """Interleaved 1F1B (Megatron-LM): the model cut into P*v stages, stage s on rank s % P. Each rank
    runs 1F1B over its v stages: microbatches go round in groups of P, forwards through its stages
    first to last, backwards last to first. Each stage is 1/v of a rank's layers, so the bubble's
    time is divided by v; the warm-up is longer, so a rank keeps more (smaller) activations."""
    check_arguments("interleaved", world_size, n_microbatches, stages_per_rank)
    placement = looped_placement(world_size, stages_per_rank)
    # TODO(m11): interleaved 1F1B's order on every rank
    # Contract: rank r runs v*M forwards and v*M full backwards (kind "B") on its stages r, r+P, r+2P...
    # Its k-th forward (k from 0) is microbatch (k // (P*v)) * P + k % P on its local stage (k // P) % v;
    # its k-th backward is the same microbatch on local stage v-1 - (k // P) % v. Warm-up: (v-1)*P +
    # 2*(P-r-1) forwards, capped at v*M; then pairs F(k + warm-up), B(k); then the backwards left.
    # Pitfalls:
    # - local stage j of rank r is stage j*P + r (the looped placement), not r*v + j: the validator says
    #   the rank runs a stage that is not on it;
    # - backwards go through the local stages in reverse (the last stage's backward comes first);
    # - 1F1B's warm-up of P-r-1 is too short here: a rank would run a backward before its own forward
    #   (the validator refuses it). (v-1)P + (P-r-1) runs, and with free messages even has the same
    #   bubble; the P-r-1 more (Megatron-LM's choice, which torch follows and the tests compare with)
    #   keep a rank computing while the first gradients travel back.
    raise NotImplementedError("TODO(m11): interleaved 1F1B's order on every rank")
    return Schedule("interleaved", placement, orders, n_microbatches)


def zbh1(world_size: int, n_microbatches: int) -> Schedule:
    """ZB-H1 (Qi et al., Zero Bubble Pipeline Parallelism, 2024): 1F1B with each backward split into
    I and W. I goes where 1F1B's B was (the rank before waits for it); rank r defers its first r W's
    and runs them in the cool-down, where 1F1B's rank r sat idle. Same peak activations as 1F1B's
    rank 0 (P microbatches) on every rank; bubble (P-1)(F+I-W) instead of (P-1)(F+B)."""
    check_arguments("zbh1", world_size, n_microbatches)
    # TODO(m11): ZB-H1's order on every rank
    # Contract: 1F1B's order with every B(k) replaced by I(k). After the k-th I (k from 0), rank r runs
    # the W of the oldest microbatch whose W is pending, except for its first r I's: rank r lets r W's
    # wait, and runs them at the very end, oldest first. One F, one I, one W per microbatch.
    # The maths: rank r has r forwards' worth of idle time in 1F1B's cool-down; the deferred W's fill it,
    # so its last I comes earlier and the ranks before it finish earlier too: the bubble drops from
    # (P-1)(F+B) to (P-1)(F+I-W) while the W's fit in the gaps (W <= F, I).
    # Pitfalls:
    # - deferring P-1-r W's (the mirror image): rank 0 keeps nearly 2P microbatches, and the bubble is
    #   1F1B's, (P-1)(F+I+W);
    # - deferring none: the I's still go out early, but the cool-down's gaps stay empty: (P-1)(F+I);
    # - deferring r+1: one more microbatch kept on every rank (the tests count it) for no smaller bubble
    #   (at M = P, a bigger one);
    # - a W before its own I is refused by the validator.
    raise NotImplementedError("TODO(m11): ZB-H1's order on every rank")
    return Schedule("zbh1", one_stage_per_rank(world_size), orders, n_microbatches)


def zbv(world_size: int, n_microbatches: int) -> Schedule:
    """ZB-V (the zero-bubble paper, section 6): 2P stages in a V, rank r holding stage r (going down)
    and 2P-1-r (coming back). Rank 0 holds the first and the last stage, so it can start the
    backward of a microbatch as soon as the V has turned: the warm-up is filled from both ends. Peak
    activations 2P half-size stages per rank: 1F1B's rank-0 memory on every rank."""
    check_arguments("zbv", world_size, n_microbatches)
    placement = v_placement(world_size)
    # TODO(m11): ZB-V's order on every rank
    # Contract: with down = r and up = 2P-1-r, rank r's list is ZB-V's as torch.distributed.pipelining's
    # ScheduleZBVZeroBubble builds it (the tests compare the two action by action, and with orders checked
    # by hand for P = 2), microbatches taken in order for each (stage, kind), in five phases:
    #   1. forwards of down only, until microbatch 0 can have come back up the V to stage up;
    #   2. forwards of up and down by turns, until up's first input gradient can have arrived;
    #   3. up's first backwards, each I followed at once by its W, a forward of up before each;
    #   4. the steady state, a round at a time: down's F (while it has had fewer than M), I and W, then
    #      up's F, I and W, until both stages have had M forwards;
    #   5. the cool-down: I's of both stages by turns, then down's last I's, each followed by the oldest W
    #      down still owes (the turns left r W's owed, so on rank r > 0 not that I's own), then every W left
    #      of up, then of down.
    # The maths: count time in unit actions (F = I = W = 1, messages free). Rank r's first F(down) starts
    # at r; microbatch 0 reaches stage up after 2P-1-r forwards; a gradient travels back one stage per
    # unit. Each phase lasts until what the next one needs can have arrived, which gives its length as a
    # function of P and r.
    # Pitfalls:
    # - the other half of the V (up = P+r) is not on rank r: the validator names the action;
    # - the phases' lengths depend on r; one forward more or less in phase 1 and a rank waits (the
    #   simulated bubble grows) or runs a forward twice (the validator counts them).
    raise NotImplementedError("TODO(m11): ZB-V's order on every rank")
    return Schedule("zbv", placement, orders, n_microbatches)


def dualpipev(world_size: int, n_microbatches: int) -> Schedule:
    """DualPipeV (DeepSeek's DualPipe cut in half, as in deepseek-ai/DualPipe and torch's
    ScheduleDualPipeV): the V placement, and phases in which a forward of one stage is paired with
    a full backward of the other. DualPipe overlaps the two of a pair (one's communication hides
    behind the other's compute); our executor runs them one after the other, F first. The W's of
    the first backwards and of the last ones are split off (I now, W later) to fill the warm-up and
    the cool-down. Peak activations 2P+1 half-size stages per rank."""
    check_arguments("dualpipev", world_size, n_microbatches)
    placement = v_placement(world_size)
    # TODO(m11): DualPipeV's order on every rank
    # Contract: DualPipe's phases, a published design rather than a derivation (the tests compare the order
    # with torch's ScheduleDualPipeV action by action). With down = r and up = 2P-1-r, microbatches counted
    # per stage for F, and per stage for B and I together (either gives the input gradient); the W of every
    # I is queued, oldest first:
    #   1. 2(P-r-1) times F(down)
    #   2. r+1 times: F(down), F(up)
    #   3. P-r-1 times: I(up), the oldest queued W, F(up)
    #   4. M-2P+r+1 times: F(down), B(up), F(up), B(down)         (two pairs)
    #   5. P-r-1 times: B(up), F(up), B(down)
    #   6. r+1 times (i = 0..r): X(up), X(down), where X is B at first and I from the switch on; the
    #      switch comes at i = (r+1)//2: before X(up) on odd ranks, between X(up) and X(down) on even ones
    #   7. P-r-1 times: the oldest queued W, I(down)
    #   8. r+1 times: the oldest queued W
    # Pitfalls:
    # - a B is the microbatch's I and W in one: it takes the next I number and queues no W;
    # - popping the newest W instead of the oldest still gives a valid schedule, but not DualPipeV's
    #   order (the tests compare the orders with torch's);
    # - the switch on the wrong parity changes how many I's phase 6 runs: phase 8 then pops an empty
    #   queue or leaves W's unrun.
    raise NotImplementedError("TODO(m11): DualPipeV's order on every rank")
    return Schedule("dualpipev", placement, orders, n_microbatches)


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved, "zbh1": zbh1, "zbv": zbv,
             "dualpipev": dualpipev}


def make_schedule(name: str, world_size: int, n_microbatches: int, stages_per_rank: int = 2) -> Schedule:
    """The schedule called `name` (a key of SCHEDULES); stages_per_rank is interleaved's v."""
    check_arguments(name, world_size, n_microbatches, stages_per_rank)
    if name == "interleaved":
        return interleaved(world_size, n_microbatches, stages_per_rank)
    return SCHEDULES[name](world_size, n_microbatches)


def stages_per_rank_of(name: str, stages_per_rank: int = 2) -> int:
    """How many stages each rank holds in schedule `name`."""
    return {"interleaved": stages_per_rank, "zbv": 2, "dualpipev": 2}.get(name, 1)


def idle_per_rank(name: str, world_size: int, n_microbatches: int, costs: Costs = Costs(),
                  atomic_pairs: bool = False) -> Fraction:
    """How long each rank idles in one step of `name`, in closed form, with stage costs `costs` and
    free messages (every rank idles the same). The chapter derives each; a ValueError says where a
    form does not hold. atomic_pairs: DualPipe's row, pairs started together (see simulate_schedule)."""
    P, M, F, I, W, B = world_size, n_microbatches, costs.F, costs.I, costs.W, costs.B
    check_arguments(name, P, M, stages_per_rank=2)
    if costs.hop:
        raise ValueError("the closed forms assume free messages (hop = 0); simulate a latency instead")
    if name in ("gpipe", "1f1b", "interleaved"):
        return (P - 1) * (F + B)
    if name == "zbh1":  # the paper's (P-1)(F+I-W) while the W's fit in the gaps (W <= F, I)
        if M < P:
            raise ValueError("zbh1's closed form needs M >= P: with fewer microbatches too few W's fill the cool-down")
        return (P - 1) * max(F + I - W, F, I)
    if name == "zbv":
        if not F == I == W:
            raise ValueError("zbv's closed form holds for F = I = W, the costs it is designed for; simulate others")
        return (P - 1) * F
    if name == "dualpipev":
        if not (F == I and W <= F):
            raise ValueError("dualpipev's closed form holds for F = I and W <= F; simulate other costs")
        # DualPipe's table: (PP/2 - 1)(F&B + B - 3W) with PP = 2P stages and F&B = F + B. Run one after
        # the other, a pair's F goes ahead while its B waits for a gradient: I less per hop.
        return (P - 1) * (F + 2 * B - 3 * W) if atomic_pairs else (P - 1) * (F + I - W)
    raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")


def bubble_formula(name: str, world_size: int, n_microbatches: int, costs: Costs = Costs(),
                   stages_per_rank: int = 2, atomic_pairs: bool = False) -> Fraction:
    """The idle fraction of a step: idle / (compute + idle), with compute = M * v * (F + B) per rank."""
    compute = n_microbatches * stages_per_rank_of(name, stages_per_rank) * (costs.F + costs.B)
    idle = idle_per_rank(name, world_size, n_microbatches, costs, atomic_pairs)
    return idle / (compute + idle)
