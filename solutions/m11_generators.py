"""Module 11 - the schedules, generated as data, and the bubble each one leaves.

Every generator takes the number of pipeline ranks p (`world_size`: a schedule's ranks are the
places 0 .. p - 1 of the pipeline's group) and of microbatches m (`n_microbatches`) and returns a
Schedule (m11_actions): a placement of the stages on the ranks and one list of actions per rank. The executor (m11_executor) runs any of them; none of them knows how.

    gpipe        one stage per rank; all forwards, then all backwards          (module 05)
    1f1b         one stage per rank; warm-up, one forward / one backward, cool-down  (module 05)
    interleaved  v stages per rank, looped; 1F1B over the p v stages          bubble / v
    zbh1         one stage per rank; backward split into I and W, W deferred into the cool-down
    zbv          two stages per rank in a V; I/W split; warm-up filled from both ends
    dualpipev    the V, DualPipe's phases: a forward of one stage paired with a backward of the other

Arguments a schedule cannot serve are refused by `check_arguments` with a one-line ValueError that
says what would work.

The bubble of each, as a closed form, is `idle_per_rank`: with stage costs τ_F, τ_I, τ_W (the times
of one stage's F, I and W actions; τ_B = τ_I + τ_W, see course/simulate.py's Costs) and free
messages, every rank idles that long in a step. The chapter
derives them; the tests check the simulator against them.
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
    if name == "interleaved":
        if stages_per_rank < 2:
            raise ValueError(f"interleaved needs at least 2 stages per rank, got {stages_per_rank}; "
                             "with one stage per rank it is 1f1b")
        if m % p:
            raise ValueError(f"interleaved sends the microbatches round the ranks in groups of p = {p}: "
                             f"n_microbatches must be a multiple of {p}, got {m}; use {p * (m // p + 1)}, say")
    if name == "zbv" and m < 2 * p - 1:
        raise ValueError(f"zbv's warm-up runs 2p-1 = {2 * p - 1} forwards of the V's first stage on rank 0: "
                         f"it needs at least {2 * p - 1} microbatches for p = {p}, got {m}")
    if name == "dualpipev" and m < 2 * p:
        raise ValueError(f"dualpipev needs at least 2p = {2 * p} microbatches for p = {p} (its warm-up fills the "
                         f"V's {2 * p} stages), got {m}")


def gpipe(world_size: int, n_microbatches: int) -> Schedule:
    """Module 05's GPipe as data: every rank forwards microbatches 0..m-1, then backwards them in
    the same order. Bubble (p-1)/(m+p-1); every rank keeps all m microbatches' activations."""
    check_arguments("gpipe", world_size, n_microbatches)
    # >>> TODO(m11): GPipe's order on every rank
    # Contract: orders[r] is rank r's list of Actions, all on its stage r: the m forwards, then the m
    # full backwards (kind "B"), each in microbatch order 0..m-1: what module 05's gpipe ran.
    # Pitfalls:
    # - rank r's stage is r (one_stage_per_rank), not 0 on every rank: the validator then says "rank 1
    #   runs 0F0, but stage 0 is on rank 0".
    # Hint 1: per rank, the list of its forwards followed by the list of its backwards.
    # Hint 2: Action(stage, "F", microbatch) and Action(stage, "B", microbatch); two comprehensions joined.
    # Hint 3: orders <- for each rank r: [F(r, i) for every i] + [B(r, i) for every i]
    orders = [[Action(r, "F", m) for m in range(n_microbatches)] + [Action(r, "B", m) for m in range(n_microbatches)]
              for r in range(world_size)]
    # <<<
    return Schedule("gpipe", one_stage_per_rank(world_size), orders, n_microbatches)


def one_f_one_b(world_size: int, n_microbatches: int) -> Schedule:
    """Module 05's 1F1B as data: min(p-r-1, m) warm-up forwards on rank r, then F(i + warm-up), B(i)
    pairs, then the backwards left. Bubble (p-1)/(m+p-1); rank r keeps at most min(p-r, m)."""
    check_arguments("1f1b", world_size, n_microbatches)
    # >>> TODO(m11): 1F1B's order on every rank
    # Contract: module 05's one_f_one_b order exactly, as Actions on stage r: min(p-r-1, m) warm-up
    # forwards; then pairs of one forward (the next microbatch) and one full backward (the oldest in
    # flight); then the backwards left. Each microbatch gets one F and one B, each kind in microbatch order.
    # Pitfalls:
    # - a warm-up not capped at m asks for microbatches that do not exist (m < p-r-1);
    # - one warm-up forward too few and rank r waits for a backward in every pair (the simulated bubble
    #   grows); one too many and it keeps p-r+1 microbatches (the tests count both).
    # Hint 1: module 05's three phases, appending Actions instead of running them.
    # Hint 2: warm-up w = min(world_size - r - 1, n_microbatches); the steady state pairs F(k + w) with B(k).
    # Hint 3: for each rank r: order <- F(r, 0..w-1)
    #             for k in 0..m-w-1: add F(r, k + w), then B(r, k)
    #             add B(r, m-w..m-1); append order to orders
    orders = []
    for r in range(world_size):
        warmup = min(world_size - r - 1, n_microbatches)
        order = [Action(r, "F", m) for m in range(warmup)]
        for m in range(n_microbatches - warmup):
            order += [Action(r, "F", m + warmup), Action(r, "B", m)]
        orders.append(order + [Action(r, "B", m) for m in range(n_microbatches - warmup, n_microbatches)])
    # <<<
    return Schedule("1f1b", one_stage_per_rank(world_size), orders, n_microbatches)


def interleaved(world_size: int, n_microbatches: int, stages_per_rank: int = 2) -> Schedule:
    """Interleaved 1F1B (Megatron-LM): the model cut into p v stages, stage s on rank s % p. Each rank
    runs 1F1B over its v stages: microbatches go round in groups of p, forwards through its stages
    first to last, backwards last to first. Each stage is 1/v of a rank's layers, so the bubble's
    time is divided by v; the warm-up is longer, so a rank keeps more (smaller) activations."""
    check_arguments("interleaved", world_size, n_microbatches, stages_per_rank)
    placement = looped_placement(world_size, stages_per_rank)
    # >>> TODO(m11): interleaved 1F1B's order on every rank
    # Contract: rank r runs v*m forwards and v*m full backwards (kind "B") on its stages r, r+p, r+2p...
    # Its k-th forward (k from 0) is microbatch (k // (p*v)) * p + k % p on its local stage (k // p) % v;
    # its k-th backward is the same microbatch on local stage v-1 - (k // p) % v. Warm-up: (v-1)*p +
    # 2*(p-r-1) forwards, capped at v*m; then pairs F(k + warm-up), B(k); then the backwards left.
    # Pitfalls:
    # - local stage j of rank r is stage j*p + r (the looped placement), not r*v + j: the validator says
    #   the rank runs a stage that is not on it;
    # - backwards go through the local stages in reverse (the last stage's backward comes first);
    # - 1F1B's warm-up of p-r-1 is too short here: a rank would run a backward before its own forward
    #   (the validator refuses it). (v-1)p + (p-r-1) runs, and with free messages even has the same
    #   bubble; the p-r-1 more (Megatron-LM's choice, which torch follows and the tests compare with)
    #   keep a rank computing while the first gradients travel back.
    # Hint 1: write forward(k) and backward(k) from the formulas, then 1F1B's three phases over k.
    # Hint 2: microbatch = (k // (world_size * v)) * world_size + k % world_size;
    #         stage = local * world_size + r.
    # Hint 3: for each rank r: w <- min((v-1)p + 2(p-r-1), v*m)
    #             order <- forward(0..w-1); for k in 0..vm-w-1: forward(k + w), backward(k)
    #             then backward(vm-w..vm-1)
    orders = []
    v, total = stages_per_rank, stages_per_rank * n_microbatches
    for r in range(world_size):
        def microbatch(k):
            return (k // (world_size * v)) * world_size + k % world_size

        def forward(k):
            return Action(((k // world_size) % v) * world_size + r, "F", microbatch(k))

        def backward(k):
            return Action((v - 1 - (k // world_size) % v) * world_size + r, "B", microbatch(k))

        warmup = min((v - 1) * world_size + 2 * (world_size - r - 1), total)
        order = [forward(k) for k in range(warmup)]
        for k in range(total - warmup):
            order += [forward(k + warmup), backward(k)]
        orders.append(order + [backward(k) for k in range(total - warmup, total)])
    # <<<
    return Schedule("interleaved", placement, orders, n_microbatches)


def zbh1(world_size: int, n_microbatches: int) -> Schedule:
    """ZB-H1 (Qi et al., Zero Bubble Pipeline Parallelism, 2024): 1F1B with each backward split into
    I and W. I goes where 1F1B's B was (the rank before waits for it); rank r defers its first r W's
    and runs them in the cool-down, where 1F1B's rank r sat idle. Same peak activations as 1F1B's
    rank 0 (p microbatches) on every rank; idle (p-1)(τ_F+τ_I-τ_W) per rank instead of 1F1B's
    (p-1)(τ_F+τ_B) (in the zero-bubble paper's notation (p-1)(T_F+T_B-T_W), its B being our I)."""
    check_arguments("zbh1", world_size, n_microbatches)
    # >>> TODO(m11): ZB-H1's order on every rank
    # Contract: 1F1B's order with every B(k) replaced by I(k). After the k-th I (k from 0), rank r runs
    # the W of the oldest microbatch whose W is pending, except for its first r I's: rank r lets r W's
    # wait, and runs them at the very end, oldest first. One F, one I, one W per microbatch.
    # The maths: rank r has r forwards' worth of idle time in 1F1B's cool-down; the deferred W's fill it,
    # so its last I comes earlier and the ranks before it finish earlier too: the idle time drops from
    # (p-1)(τ_F+τ_B) to (p-1)(τ_F+τ_I-τ_W) while the W's fit in the gaps (τ_W <= τ_F, τ_I).
    # Pitfalls:
    # - deferring p-1-r W's (the mirror image): rank 0 keeps nearly 2p microbatches, and the bubble is
    #   1F1B's, (p-1)(τ_F+τ_I+τ_W);
    # - deferring none: the I's still go out early, but the cool-down's gaps stay empty: (p-1)(τ_F+τ_I);
    # - deferring r+1: one more microbatch kept on every rank (the tests count it) for no smaller bubble
    #   (at m = p, a bigger one);
    # - a W before its own I is refused by the validator.
    # Hint 1: 1F1B's phases with I for B; count the W's done; after the k-th I, add a W when k >= r.
    # Hint 2: the W after the k-th I is W(k - r); at the end, W(i) for every i from the count to m-1.
    # Hint 3: for each rank r: w <- min(p-r-1, m); order <- F(0..w-1); done <- 0
    #             for k in 0..m-1: F(k + w) if it exists; I(k); if k >= r: W(done), done += 1
    #             then W(done..m-1)
    orders = []
    for r in range(world_size):
        warmup = min(world_size - r - 1, n_microbatches)
        order = [Action(r, "F", m) for m in range(warmup)]
        weights_done = 0
        for k in range(n_microbatches):
            if k + warmup < n_microbatches:
                order.append(Action(r, "F", k + warmup))
            order.append(Action(r, "I", k))
            if k >= r:  # rank r keeps its first r W's for the cool-down
                order.append(Action(r, "W", weights_done))
                weights_done += 1
        orders.append(order + [Action(r, "W", m) for m in range(weights_done, n_microbatches)])
    # <<<
    return Schedule("zbh1", one_stage_per_rank(world_size), orders, n_microbatches)


def zbv(world_size: int, n_microbatches: int) -> Schedule:
    """ZB-V (the zero-bubble paper, section 6): 2p stages in a V, rank r holding stage r (going down)
    and 2p-1-r (coming back). Rank 0 holds the first and the last stage, so it can start the
    backward of a microbatch as soon as the V has turned: the warm-up is filled from both ends. Peak
    activations 2p half-size stages per rank: 1F1B's rank-0 memory on every rank."""
    check_arguments("zbv", world_size, n_microbatches)
    placement = v_placement(world_size)
    # >>> TODO(m11): ZB-V's order on every rank
    # Contract: with down = r and up = 2p-1-r, rank r's list is ZB-V's as torch.distributed.pipelining's
    # ScheduleZBVZeroBubble builds it (the tests compare the two action by action, and with orders checked
    # by hand for p = 2), microbatches taken in order for each (stage, kind), in five phases:
    #   1. forwards of down only, until microbatch 0 can have come back up the V to stage up;
    #   2. forwards of up and down by turns, until up's first input gradient can have arrived;
    #   3. up's first backwards, each I followed at once by its W, a forward of up before each;
    #   4. the steady state, a round at a time: down's F (while it has had fewer than m), I and W, then
    #      up's F, I and W, until both stages have had m forwards;
    #   5. the cool-down: I's of both stages by turns, then down's last I's, each followed by the oldest W
    #      down still owes (the turns left r W's owed, so on rank r > 0 not that I's own), then every W left
    #      of up, then of down.
    # The maths: count time in unit actions (τ_F = τ_I = τ_W = 1, messages free). Rank r's first F(down)
    # starts at r; microbatch 0 reaches stage up after 2p-1-r forwards; a gradient travels back one stage per
    # unit. Each phase lasts until what the next one needs can have arrived, which gives its length as a
    # function of p and r.
    # Pitfalls:
    # - the other half of the V (up = p+r) is not on rank r: the validator names the action;
    # - the phases' lengths depend on r; one forward more or less in phase 1 and a rank waits (the
    #   simulated bubble grows) or runs a forward twice (the validator counts them).
    # Hint 1: phase 1 fills the slots from r to 2p-1-r; phase 2 alternates until the gradient of
    #         microbatch 0, started on rank 0 at 2p, has come down to stage up (rank r): r rounds.
    # Hint 2: the counts: 1. 2(p-r)-1 times F(down); 2. r times F(up), F(down); 3. p-r times F(up), I(up),
    #         W(up); 4. while up has had fewer forwards than down, or down fewer than m: F(down) (only while
    #         down has had fewer than m), I(down), W(down), F(up), I(up), W(up); 5. r times I(down), I(up);
    #         then p-r times I(down), W(down); then the W's left of up, then of down.
    # Hint 3: count <- {}; add(stage, kind): m <- count of (stage, kind); append Action(stage, kind, m);
    #             increment the count
    #         then the five phases with Hint 2's counts, each a loop of add calls
    orders = []
    for r in range(world_size):
        down, up, order, count = r, 2 * world_size - 1 - r, [], {}

        def add(*steps):  # each step (stage, kind) runs that stage's next microbatch of that kind
            for stage, kind in steps:
                count[(stage, kind)] = count.get((stage, kind), 0) + 1
                order.append(Action(stage, kind, count[(stage, kind)] - 1))

        def done(stage, kind):
            return count.get((stage, kind), 0)

        add(*[(down, "F")] * (2 * (world_size - r) - 1))
        add(*[(up, "F"), (down, "F")] * r)
        add(*[(up, "F"), (up, "I"), (up, "W")] * (world_size - r))
        while done(up, "F") < done(down, "F") or done(down, "F") < n_microbatches:
            if done(down, "F") < n_microbatches:
                add((down, "F"))
            add((down, "I"), (down, "W"), (up, "F"), (up, "I"), (up, "W"))
        add(*[(down, "I"), (up, "I")] * r)
        add(*[(down, "I"), (down, "W")] * (world_size - r))
        add(*[(up, "W")] * (n_microbatches - done(up, "W")))
        add(*[(down, "W")] * (n_microbatches - done(down, "W")))
        orders.append(order)
    # <<<
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
    # >>> TODO(m11): DualPipeV's order on every rank
    # Contract: DualPipe's phases, a published design rather than a derivation (the tests compare the order
    # with torch's ScheduleDualPipeV action by action). With down = r and up = 2p-1-r, microbatches counted
    # per stage for F, and per stage for B and I together (either gives the input gradient); the W of every
    # I is queued, oldest first:
    #   1. 2(p-r-1) times F(down)
    #   2. r+1 times: F(down), F(up)
    #   3. p-r-1 times: I(up), the oldest queued W, F(up)
    #   4. m-2p+r+1 times: F(down), B(up), F(up), B(down)         (two pairs)
    #   5. p-r-1 times: B(up), F(up), B(down)
    #   6. r+1 times (k = 0..r): X(up), X(down), where X is B at first and I from the switch on; the
    #      switch comes at k = (r+1)//2: before X(up) on odd ranks, between X(up) and X(down) on even ones
    #   7. p-r-1 times: the oldest queued W, I(down)
    #   8. r+1 times: the oldest queued W
    # Pitfalls:
    # - a B is the microbatch's I and W in one: it takes the next I number and queues no W;
    # - popping the newest W instead of the oldest still gives a valid schedule, but not DualPipeV's
    #   order (the tests compare the orders with torch's);
    # - the switch on the wrong parity changes how many I's phase 6 runs: phase 8 then pops an empty
    #   queue or leaves W's unrun.
    # Hint 1: a counter per (stage, "F") and (stage, "I"), and a collections.deque of the queued I's.
    # Hint 2: a helper appending the next microbatch of a (stage, kind) that queues the action when the kind
    #         is I; another that pops the oldest queued I and appends its W (Action._replace(kind="W")).
    # Hint 3: the eight phases as listed, each a loop of those two helpers; in phase 6 keep a flag
    #         split <- False, set it at the switch, and add I when it is set, else B
    orders = []
    for r in range(world_size):
        down, up, order, count, queued = r, 2 * world_size - 1 - r, [], {}, deque()

        def add(*steps):  # each step (stage, kind) runs that stage's next microbatch of that kind
            for stage, kind in steps:
                key = (stage, "F" if kind == "F" else "I")  # B and I both give the input gradient
                count[key] = count.get(key, 0) + 1
                order.append(Action(stage, kind, count[key] - 1))
                if kind == "I":
                    queued.append(order[-1])

        def weight():  # the W of the oldest I whose W has not run
            if queued:
                order.append(queued.popleft()._replace(kind="W"))

        p = world_size
        add(*[(down, "F")] * (2 * (p - r - 1)))
        add(*[(down, "F"), (up, "F")] * (r + 1))
        for _ in range(p - r - 1):
            add((up, "I"))
            weight()
            add((up, "F"))
        add(*[(down, "F"), (up, "B"), (up, "F"), (down, "B")] * (n_microbatches - 2 * p + r + 1))
        add(*[(up, "B"), (up, "F"), (down, "B")] * (p - r - 1))
        split = False  # from here on, backwards leave their W for later
        for i in range(r + 1):
            split = split or (i == (r + 1) // 2 and r % 2 == 1)
            add((up, "I" if split else "B"))
            split = split or (i == (r + 1) // 2 and r % 2 == 0)
            add((down, "I" if split else "B"))
        for _ in range(p - r - 1):
            weight()
            add((down, "I"))
        for _ in range(r + 1):
            weight()
        orders.append(order)
    # <<<
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
    """How long each rank idles in one step of `name`, in closed form, with stage costs `costs`
    (costs.F, costs.I, costs.W are τ_F, τ_I, τ_W; costs.B is τ_B) and free messages (every rank idles
    the same). The chapter derives each; a ValueError says where a form does not hold. atomic_pairs:
    DualPipe's row, pairs started together (see simulate_schedule)."""
    p, m = world_size, n_microbatches
    check_arguments(name, p, m, stages_per_rank=2)
    if costs.hop:
        raise ValueError("the closed forms assume free messages (τ_hop = 0); simulate a latency instead")
    if name in ("gpipe", "1f1b", "interleaved"):
        return (p - 1) * (costs.F + costs.B)
    if name == "zbh1":  # (p-1)(τ_F+τ_I-τ_W) while the W's fit in the gaps (τ_W <= τ_F, τ_I)
        if m < p:
            raise ValueError("zbh1's closed form needs m >= p: with fewer microbatches too few W's fill the cool-down")
        return (p - 1) * max(costs.F + costs.I - costs.W, costs.F, costs.I)
    if name == "zbv":
        if not costs.F == costs.I == costs.W:
            raise ValueError("zbv's closed form holds for τ_F = τ_I = τ_W, the costs it is designed for; simulate others")
        return (p - 1) * costs.F
    if name == "dualpipev":
        if not (costs.F == costs.I and costs.W <= costs.F):
            raise ValueError("dualpipev's closed form holds for τ_F = τ_I and τ_W <= τ_F; simulate other costs")
        # DualPipe's table, in its notation: (PP/2 - 1)(F&B + B - 3W) with PP = 2p stages; in ours,
        # (p-1)(τ_F&B + τ_B - 3 τ_W) with τ_F&B = τ_F + τ_B. Run one after the other, a pair's F goes
        # ahead while its B waits for a gradient: τ_I less per hop.
        if atomic_pairs:
            return (p - 1) * (costs.F + 2 * costs.B - 3 * costs.W)
        return (p - 1) * (costs.F + costs.I - costs.W)
    raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")


def bubble_formula(name: str, world_size: int, n_microbatches: int, costs: Costs = Costs(),
                   stages_per_rank: int = 2, atomic_pairs: bool = False) -> Fraction:
    """The idle fraction of a step: idle / (compute + idle), with compute = m v (τ_F + τ_B) per rank."""
    compute = n_microbatches * stages_per_rank_of(name, stages_per_rank) * (costs.F + costs.B)
    idle = idle_per_rank(name, world_size, n_microbatches, costs, atomic_pairs)
    return idle / (compute + idle)
