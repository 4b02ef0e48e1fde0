"""Module 11's given machinery: the validator (course/validate.py) refuses what cannot run, with a
message that says why, and the schedule simulator times what can (with messages that cost, and with
DualPipe's pairs)."""
from fractions import Fraction

import pytest

import course.validate as validator
from course.impl import reference
from course.mesh import group_of
from course.simulate import Costs, Deadlock, simulate_schedule

pytestmark = pytest.mark.given
actions = reference("m11_actions")
parse = actions.parse_schedule


def _refusal(text, placement=None) -> str:
    with pytest.raises(validator.ScheduleError) as refused:
        validator.validate(parse(text, placement))
    return str(refused.value)


def test_a_valid_hand_written_schedule_passes():
    validator.validate(parse("""
        rank 0: 0F0 0F1 0B0 0B1
        rank 1: 1F0 1B0 1F1 1B1"""))
    validator.validate(parse("""
        0F0 0F1 0I0 0I1 0W1 0W0
        1F0 1I0 1F1 1W0 1I1 1W1"""))


def test_a_deadlock_is_refused_with_each_ranks_stuck_action_marked():
    # Rank 0 wants the gradient of microbatch 0 before it forwards microbatch 1; rank 1 wants the
    # forward of microbatch 1 before it sends that gradient. Each waits for the other.
    message = _refusal("""
        0F0 0B0 0F1 0B1
        1F0 1F1 1B0 1B1""")
    first, *table = message.splitlines()
    assert first == ("hand-written deadlocks: rank 0 at 0B0 waits for 1B0 or 1I0 (rank 1); "
                     "rank 1 at 1F1 waits for 0F1 (rank 0)"), first
    assert table == ["rank 0: 0F0 [0B0] 0F1 0B1", "rank 1: 1F0 [1F1] 1B0 1B1"], table



def test_the_simulators_deadlock_names_each_ranks_next_action_and_what_it_waits_for():
    # The same deadlock given to the simulator directly (the validator's dry run, a notebook's own
    # schedule): each stuck rank's next action, what it waits for and which rank would make it.
    with pytest.raises(Deadlock) as stuck:
        simulate_schedule([[(0, "F", 0), (0, "B", 0), (0, "F", 1), (0, "B", 1)],
                           [(1, "F", 0), (1, "F", 1), (1, "B", 0), (1, "B", 1)]], [0, 1])
    assert str(stuck.value) == ("the schedule deadlocks: rank 0 at 0B0 waits for 1B0 or 1I0 (rank 1); "
                                "rank 1 at 1F1 waits for 0F1 (rank 0)"), str(stuck.value)
    assert stuck.value.positions == [1, 1]


@pytest.mark.parametrize("text, placement, message", [
    ("0F0 0F1 0I0 0I1 0W0\n1F0 1F1 1B0 1B1", None,
     "stage 0, microbatch 1 has 0 B, 1 I and 0 W: expected one B, or one I and one W (an I without its W"),
    ("0F0 0W0 0I0\n1F0 1B0", None, "rank 0 runs 0W0 before 0I0, which it needs"),
    ("0B0 0F0\n1F0 1B0", None, "rank 0 runs 0B0 before 0F0, which it needs"),
    ("0F0 1F0 0B0\n1B0", (0, 1), "rank 0 runs 1F0, but stage 1 is on rank 1"),
    ("0F0 0F0 0B0\n1F0 1B0", None, "stage 0, microbatch 0 has 2 forwards (F), expected exactly one"),
    ("0F0 0B0 0I0 0W0\n1F0 1B0", None, "stage 0, microbatch 0 has 1 B, 1 I and 1 W"),
    ("0F0 0B0\n1F0 1B0 1F1 1B1", None, "stage 0, microbatch 1 has 0 forwards"),
    ("0F0 0X0", None, "'0X0' is not an action"),
])
def test_malformed_schedules_are_refused_naming_the_action(text, placement, message):
    if "X" in text:
        with pytest.raises(ValueError, match=message):
            parse(text)
        return
    assert message in _refusal(text, placement)


def test_every_refusal_is_a_value_error_with_a_one_line_reason():
    assert issubclass(validator.ScheduleError, ValueError)
    assert "\n" not in _refusal("0F0 0W0 0I0\n1F0 1B0")


def test_a_deadlocking_schedule_is_refused_before_the_executor_sends_anything():
    executor, m00 = reference("m11_executor"), reference("m00_monolith")
    schedule = parse("0F0 0B0 0F1 0B1\n1F0 1F1 1B0 1B1")
    cfg = m00.MLPConfig(steps=1)
    with pytest.raises(validator.ScheduleError, match="deadlocks"):  # no process group exists: nothing was sent
        pp = group_of("p", 0, (0, 1))
        executor.train(schedule, executor.build_stages(cfg, schedule, pp), executor.StageComms(pp, schedule.placement, 2),
                       cfg)


def test_stage_comms_knows_which_receives_its_order_will_post_early():
    # A V over two ranks: rank 0 holds stages 0 and 3, rank 1 stages 1 and 2. Only messages from the
    # other rank are posted early: 2F's input comes from stage 1, on rank 1 itself.
    executor = reference("m11_executor")
    schedule = parse("0F0 3F0 3B0 0B0\n1F0 2F0 2B0 1B0", placement=(0, 1, 1, 0))
    ahead = [executor.StageComms(group_of("p", rank, (0, 1)), schedule.placement, 1, order=schedule.orders[rank]).expected
             for rank in (0, 1)]
    assert ahead == [[("act", 3, 0), ("grad", 0, 0)], [("act", 1, 0), ("grad", 2, 0)]]


def test_stage_comms_leaves_no_receive_posted_after_a_step():
    from course.launch import run_ranks

    def one_step():
        from course.mesh import world_group
        executor, generators, m00 = (reference(m) for m in ("m11_executor", "m11_generators", "m00_monolith"))
        pp, cfg = world_group(), m00.MLPConfig(steps=1)
        schedule = generators.make_schedule("zbv", 2, 4)
        comms = executor.StageComms(pp, schedule.placement, 4, order=schedule.orders[pp.index])
        executor.run_schedule(schedule, executor.build_stages(cfg, schedule, pp), comms, *m00.make_batch(cfg))
        return len(comms.expected), comms.posted

    assert run_ranks(one_step, 2, timeout=20) == [(8, {}), (8, {})]


def test_simulator_times_messages_between_ranks_but_not_within_one():
    # GPipe, p = 2, m = 1, with a latency h per message between ranks: F, h, F, B, h, B.
    h = Fraction(1, 4)
    timeline = simulate_schedule([[(0, "F", 0), (0, "B", 0)], [(1, "F", 0), (1, "B", 0)]], (0, 1), Costs(hop=h))
    assert timeline.makespan == 1 + h + 1 + 2 + h + 2
    # The same two stages on one rank: no message, no latency.
    timeline = simulate_schedule([[(0, "F", 0), (1, "F", 0), (1, "B", 0), (0, "B", 0)]], (0, 0), Costs(hop=h))
    assert timeline.makespan == 6 and timeline.bubble == 0 and timeline.peak_live == [2]


def test_simulator_runs_pairs_together_only_when_asked():
    # A V over two ranks; rank 0 holds stages 0 and 3. Its "3F1 0B0" is a pair: run apart, 3F1 starts
    # as soon as 2F1 has arrived; run together (DualPipe's overlapped pairs), it also waits for the
    # gradient 0B0 needs, which 1B0 sends later.
    orders = [[(0, "F", 0), (3, "F", 0), (0, "F", 1), (3, "B", 0), (3, "F", 1), (0, "B", 0), (3, "B", 1), (0, "B", 1)],
              [(1, "F", 0), (2, "F", 0), (1, "F", 1), (2, "B", 0), (2, "F", 1), (1, "B", 0), (2, "B", 1), (1, "B", 1)]]
    for together in (False, True):
        timeline = simulate_schedule(orders, (0, 1, 1, 0), atomic_pairs=together)
        start = {a: s for rank in timeline.spans for a, s, _ in rank}
        end = {a: e for rank in timeline.spans for a, _, e in rank}
        waits_for = end[(1, "B", 0)] if together else end[(2, "F", 1)]
        assert start[(3, "F", 1)] == waits_for, (together, start[(3, "F", 1)], waits_for)
        assert start[(0, "B", 0)] == (end[(3, "F", 1)] if together else end[(1, "B", 0)])
    assert simulate_schedule(orders, (0, 1, 1, 0), atomic_pairs=True).makespan == 24
    assert simulate_schedule(orders, (0, 1, 1, 0)).makespan == 22


def test_an_overlapped_pair_runs_as_one_action_of_its_own_cost():
    # The V over two ranks above, rank 0's "3F1 0B0" a pair: with τ_F&B = 2 < τ_F + τ_B = 3 it starts when
    # both have their inputs and lasts 2, drawn as its F then its B scaled by 2/3, one outline round both.
    orders = [[(0, "F", 0), (3, "F", 0), (0, "F", 1), (3, "B", 0), (3, "F", 1), (0, "B", 0), (3, "B", 1), (0, "B", 1)],
              [(1, "F", 0), (2, "F", 0), (1, "F", 1), (2, "B", 0), (2, "F", 1), (1, "B", 0), (2, "B", 1), (1, "B", 1)]]
    plain = simulate_schedule(orders, (0, 1, 1, 0), atomic_pairs=True)
    overlapped = simulate_schedule(orders, (0, 1, 1, 0), Costs(FB=Fraction(2)), atomic_pairs=True)
    spans = {a: (s, e) for rank in overlapped.spans for a, s, e in rank}
    start, end = spans[(3, "F", 1)][0], spans[(0, "B", 0)][1]
    assert end - start == 2 and spans[(3, "F", 1)][1] - start == Fraction(2, 3), spans
    assert overlapped.makespan < plain.makespan == 24, (overlapped.makespan, plain.makespan)
    drawn = overlapped.as_profiles()[0]["spans"]
    assert [s["pair"] for s in drawn] == [False, False, True, True, True, True, False, False], drawn  # 0F1 3B0, 3F1 0B0
    assert Costs().pair == 3 and Costs(FB=Fraction(5, 2)).pair == Fraction(5, 2)


def test_the_chapters_conventions_table_is_the_simulators():
    """docs/11's table of published bubbles: every number in it is what course/bubble.py's PUBLISHED
    evaluates to, the published formula and the simulator read in the source's convention; and the
    two agree on every row but the one the chapter explains."""
    from course import REPO
    from course.bubble import PUBLISHED, conventions_table, in_convention

    chapter = (REPO / "docs" / "11-schedules-as-data.md").read_text()
    assert conventions_table() in chapter, \
        "docs/11-schedules-as-data.md's conventions table is not course.bubble.conventions_table()'s: regenerate it"
    for row in PUBLISHED:
        simulated = in_convention(row.timeline(), row.convention)
        assert (simulated == row.published()) == row.agrees, \
            f"{row.source}, {row.figure}: published {row.published()}, the simulator {simulated} ({row.convention})"


def test_the_span_bubble_of_a_run_reads_like_the_simulators():
    """summarize's span_idle (measured profiles) and in_convention's "span rate" (a simulated timeline)
    are the same reading: on a simulated timeline drawn as profiles they agree."""
    from course.bubble import in_convention, summarize

    generators = reference("m11_generators")
    for name in ("zbh2", "zbh1", "zbv"):
        schedule = generators.make_schedule(name, 4, 8)
        timeline = simulate_schedule(schedule.orders, schedule.placement)
        summary = summarize(timeline.as_profiles(), skip_first=False)
        assert summary["span_idle"] == pytest.approx(float(in_convention(timeline, "span rate"))), name
        assert summary["idle"] == pytest.approx(float(timeline.bubble)), name
