"""Module 11: an action's text form, and the placements and tables of the Schedule (given code)."""
import pytest

from course.impl import load, reference

m11 = load("m11_actions")
ref = reference("m11_actions")


@pytest.mark.exercises("Action.parse")
@pytest.mark.parametrize("text, expected", [
    ("2F0", (2, "F", 0)), ("0B7", (0, "B", 7)), ("1I3", (1, "I", 3)), ("12W10", (12, "W", 10)), (" 3F1 ", (3, "F", 1))])
def test_text_form_parses_to_the_action(text, expected):
    got = m11.Action.parse(text)
    assert tuple(got) == expected, f"Action.parse({text!r}) gave {tuple(got)}, expected (stage, kind, microbatch) = {expected}"
    assert isinstance(got.stage, int) and isinstance(got.microbatch, int), \
        f"Action.parse({text!r}): stage and microbatch must be ints, got {type(got.stage).__name__}, " \
        f"{type(got.microbatch).__name__}"
    assert str(got) == text.strip(), f"str(Action.parse({text!r})) = {str(got)!r}: the text form should print back"


@pytest.mark.exercises("Action.parse")
@pytest.mark.parametrize("text", ["1X2", "F2", "2F", "2 F 0", "2F0 1F0", "", "-1F0", "2f0"])
def test_what_is_not_an_action_is_refused(text):
    with pytest.raises(ValueError) as refused:
        m11.Action.parse(text)
    assert repr(text) in str(refused.value) or text in str(refused.value), \
        f"Action.parse({text!r}) raised {str(refused.value)!r}: quote the text in the message"


@pytest.mark.exercises("Action.parse")
def test_a_printed_schedule_parses_back():
    schedule = ref.Schedule("s", (0, 1, 1, 0), [[(0, "F", 0), (3, "F", 0), (3, "I", 0), (0, "B", 0), (3, "W", 0)],
                                                [(1, "F", 0), (2, "F", 0), (2, "B", 0), (1, "B", 0)]], 1)
    text = schedule.table()
    assert text.splitlines()[0] == "rank 0: 0F0 3F0 3I0 0B0 3W0", text
    orders = [[m11.Action.parse(word) for word in line.split(":", 1)[1].split()] for line in text.splitlines()]
    assert orders == [list(order) for order in schedule.orders], f"{text}\nparsed back as {orders}"


@pytest.mark.given
def test_placements():
    assert ref.looped_placement(4, 2) == (0, 1, 2, 3, 0, 1, 2, 3)
    assert ref.v_placement(4) == (0, 1, 2, 3, 3, 2, 1, 0)
    assert ref.v_placement(2) == (0, 1, 1, 0)
    schedule = ref.parse_schedule("rank 0: 0F0 3F0 3B0 0B0\nrank 1: 1F0 2F0 2B0 1B0")
    assert schedule.placement == (0, 1, 1, 0) and schedule.n_microbatches == 1 and schedule.stages_of(0) == [0, 3]
    assert schedule.table({1: 2}).splitlines()[1] == "rank 1: 1F0 2F0 [2B0] 1B0"
