"""The scorecard says what was derived (issue 36.4): from the record of hints seen, `grade` and `list`
count a module's TODOs written with no hint seen, with hint 1 or 2 at most, and with hint 3. (The
hint command itself is tested in tests/test_course_cli.py.)"""
import json
import re

import pytest

import main
from course.catalog import MODULES
from course.hints import HintsSeen, hints_seen, module_todos


@pytest.fixture
def record(tmp_path, monkeypatch):
    """A record of hints seen, in a temporary folder: levels seen of module 05's TODOs 1, 2, 3, ..."""
    import course.hints
    path = tmp_path / "hints.json"
    monkeypatch.setattr(course.hints, "HINTS_SHOWN", path)
    monkeypatch.setattr(course.hints, "PASSED", tmp_path / "passed.json")

    monkeypatch.setattr(course.hints, "RENAMED_TITLES", {})

    def write(*levels: int):
        titles = [block.title for block in module_todos(MODULES["05"])]
        path.write_text(json.dumps({title: level for title, level in zip(titles, levels) if level}))
        return titles
    return write


def test_the_todos_are_counted_by_the_highest_level_seen(record):
    record(0, 1, 2, 3)
    seen = hints_seen(MODULES["05"])
    assert seen == HintsSeen(without=1, up_to_2=2, with_3=1)
    assert str(seen) == "1 of 4 TODOs without a hint, 2 with hint 1 or 2, 1 with hint 3"
    assert seen.compact() == "1/2/1"
    assert str(HintsSeen(14, 0, 0)) == "14 of 14 TODOs without a hint"
    assert str(HintsSeen(11, 0, 3)) == "11 of 14 TODOs without a hint, 3 with hint 3"
    # Only hint 1 seen: nothing may say that level 2 was (a learner run read "with hints up to level 2").
    assert str(HintsSeen(0, 3, 0)) == "0 of 3 TODOs without a hint, 3 with hint 1 or 2"
    assert "level 2" not in str(HintsSeen(0, 3, 0))


def test_a_renamed_title_keeps_what_was_seen_under_the_old_one(record):
    import course.hints
    old = "TODO(m05): a title it had before"
    titles = record(0, 1, 0, 0)
    course.hints.RENAMED_TITLES[old] = titles[1]  # the record holds both: the higher level counts
    course.hints.HINTS_SHOWN.write_text(json.dumps({old: 3, titles[1]: 1}))
    assert hints_seen(MODULES["05"]) == HintsSeen(without=3, up_to_2=0, with_3=1)
    assert course.hints.load_shown() == {titles[1]: 3}


def test_grade_says_how_many_todos_were_written_without_a_hint_when_the_module_passes(record, capsys):
    from course.grade import _scorecard
    record(0, 2, 3, 0)
    passed = [{"test": f"t.py::test_{k}", "outcome": "passed", "reason": ""} for k in range(4)]
    assert _scorecard(MODULES["05"], "steps", passed, 0) == 0
    assert capsys.readouterr().out.splitlines()[-1] == \
        "4/4 checks pass; 2 of 4 TODOs without a hint, 1 with hint 1 or 2, 1 with hint 3"
    failed = passed[:3] + [{"test": "t.py::test_3", "outcome": "failed", "reason": "off", "hint": None}]
    assert _scorecard(MODULES["05"], "steps", failed, 1) == 1
    assert "3/4 checks pass\n" in capsys.readouterr().out  # nothing to say until it passes
    _scorecard(MODULES["05"], "solutions", passed, 0)
    assert capsys.readouterr().out.splitlines()[-1] == "4/4 checks pass"  # the reference derived nothing


def test_hints_read_after_the_module_passed_do_not_count(record, capsys):
    # Two learner runs read every hint 1 after their module passed, to compare: grade had said "14 of 14 TODOs
    # without a hint", and list then said 0/14/0. The levels seen at the first pass are the count from then on.
    from course.grade import _scorecard
    import course.hints
    titles = record(0, 1, 0, 0)
    passed = [{"test": f"t.py::test_{k}", "outcome": "passed", "reason": ""} for k in range(4)]
    assert _scorecard(MODULES["05"], "steps", passed, 0) == 0
    assert capsys.readouterr().out.splitlines()[-1].endswith("; 3 of 4 TODOs without a hint, 1 with hint 1 or 2")
    course.hints.HINTS_SHOWN.write_text(json.dumps({title: 3 for title in titles}))  # every hint, afterwards
    assert hints_seen(MODULES["05"]) == HintsSeen(without=3, up_to_2=1, with_3=0)
    _scorecard(MODULES["05"], "steps", passed, 0)
    assert capsys.readouterr().out.splitlines()[-1].endswith("; 3 of 4 TODOs without a hint, 1 with hint 1 or 2")
    main.main(["list"])
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("05 "))
    assert " 3/1/0  " in row, row


def test_a_pass_that_cannot_be_kept_is_counted_from_the_record_as_it_stands(record, capsys, tmp_path, monkeypatch):
    # A read-only checkout: the first pass cannot be written down; the count is still the record's.
    from course.grade import _scorecard
    import course.hints
    (tmp_path / "file").write_text("")
    monkeypatch.setattr(course.hints, "PASSED", tmp_path / "file" / "passed.json")
    record(0, 3, 0, 0)
    passed = [{"test": "t.py::test_0", "outcome": "passed", "reason": ""}]
    assert _scorecard(MODULES["05"], "steps", passed, 0) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "1/1 checks pass; 3 of 4 TODOs without a hint, 1 with hint 3"


def test_grade_passes_even_when_the_record_cannot_be_read(record, capsys):
    from course.grade import _scorecard
    import course.hints
    course.hints.HINTS_SHOWN.write_text("not a record")
    passed = [{"test": "t.py::test_0", "outcome": "passed", "reason": ""}]
    assert _scorecard(MODULES["05"], "steps", passed, 0) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("1/1 checks pass; which hints you saw is unknown: ")


def test_list_shows_the_same_counts_per_module(record, capsys):
    record(1, 3, 0, 0)
    main.main(["list"])
    lines = capsys.readouterr().out.splitlines()
    rows = {row.split()[0]: row for row in lines[1:]}
    assert "hints: none/1-2/3" in lines[0] and "≤" not in lines[0]
    assert " 2/1/1  Pipeline schedules" in rows["05"], rows["05"]
    assert f" {len(module_todos(MODULES['01']))}/0/0  Manual split" in rows["01"], rows["01"]
    assert re.search(r"given +Monolith", rows["00"]), rows["00"]  # a given module: no count
