"""The course's website (course/site/) builds, loads nothing from outside, and every link in it resolves.

The site is built once, into a temporary folder, with the explorer's small grid, one case of the layout
calculator and without executing a notebook (those the suite has executed are shown with their outputs, the
others without): about 20 s on two cores, half of it the chapters' figures. Its pages in a real browser, the
notebooks' outputs and the chapters' figures among them, are the browser check's (`python main.py site
--check`, the second step of .ci/run).
"""
from __future__ import annotations

import ast
import json
import re
from fractions import Fraction

import pytest

import main
from course import REPO
from course.catalog import MODULES
from course.impl import reference
from course.simulate import Costs, simulate_schedule

# Sphinx's deprecations of the API the theme and MyST still use are theirs to act on, not the course's.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::PendingDeprecationWarning")
pytest.importorskip("myst_nb", reason="the site's packages are not installed (pip install -r requirements.txt)")

from course.site import calculator, explorer, figures, notebooks, pages  # noqa: E402
from course.site.build import build  # noqa: E402
from course.site.html_check import check_site  # noqa: E402


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    index, warnings = build(tmp_path_factory.mktemp("site") / "site", execute="none", grid=explorer.SMALL,
                            cases=calculator.SMALL)
    return index.parent, warnings


def script_data(path) -> dict:
    """The JSON object a data script of the explorer assigns on its last line, `EXPLORER.x = {...};`."""
    return json.loads(path.read_text().splitlines()[-1].partition(" = ")[2].rstrip(";"))


def test_the_site_builds_without_a_warning(site):
    folder, warnings = site
    assert not warnings, "Sphinx warned (a link to a page that is not there is one):\n" + "\n".join(warnings)
    expected = ["index.html", "explorer.html", "calculator.html", "hardware.html", "timelines.html",
                "docs/glossary.html"]
    expected += [f"docs/{p.stem}.html" for p in (REPO / "docs").glob("[0-9][0-9]-*.md")]
    expected += [f"notebooks/{p.stem}.html" for p in (REPO / "notebooks").glob("*.ipynb")]
    assert not [page for page in expected if not (folder / page).is_file()], "pages missing from the site"
    maths = [page for page in folder.rglob("*.html") if 'class="math' in page.read_text()]
    assert folder / "explorer.html" in maths, "the explorer's page has no maths (its formula is the bubble's)"
    untypeset = [page.name for page in maths if "_static/katex/katex.min.js" not in page.read_text()]
    assert not untypeset, f"pages with maths that do not load KaTeX: {untypeset}"


def test_no_asset_from_outside_and_every_link_resolves(site):
    problems = check_site(site[0])
    assert not problems, f"{len(problems)} problems in the built site:\n" + "\n".join(problems[:30])


def test_the_navigation_follows_the_tracks(site):
    tracks = pages.tracks((REPO / "README.md").read_text())
    assert [name for name, _, _ in tracks] == ["Pipeline", "Llama", "Composition"], f"README's tracks: {tracks}"
    placed = [n for _, numbers, _ in tracks for n in numbers]
    assert len(set(placed)) == len(placed) and set(placed) <= set(MODULES), f"README.md's tracks: {placed}"
    chapters = {p.name[:2] for p in (REPO / "docs").glob("[0-9][0-9]-*.md")}
    assert not chapters - set(placed), f"chapters in no track of README.md: {sorted(chapters - set(placed))}"
    home = (site[0] / "index.html").read_text()
    for name, numbers, _ in tracks:
        assert f"{name} track" in home
        links = [home.index(f'href="docs/{next((REPO / "docs").glob(f"{n}-*.md")).stem}.html"') for n in numbers]
        assert links == sorted(links), f"the {name} track's chapters are not in the catalog's order"


def test_the_explorer_has_every_schedule_of_module_11_as_the_simulator_times_it(site):
    generators = reference("m11_generators")
    data = site[0] / "_static" / "explorer"
    index = script_data(data / "index.js")
    assert [s["name"] for s in index["schedules"]] == list(generators.SCHEDULES)
    zbv = script_data(data / "zbv.js")
    run = zbv["configs"]["4,8,2"]["runs"]["1,1,1"]
    schedule = generators.make_schedule("zbv", 4, 8)
    timeline = simulate_schedule(schedule.orders, schedule.placement, Costs())
    assert Fraction(run["bubble"]) == timeline.bubble and run["makespan"] == timeline.makespan
    assert run["start"] == [[start for _, start, _ in spans] for spans in timeline.spans]
    assert zbv["refused"]["4,4,2"].startswith("zbv's warm-up"), "a refusal keeps check_arguments' reason"
    assert Fraction(run["closed"]["bubble"]) == generators.bubble_formula("zbv", 4, 8)


def test_the_calculator_prints_what_main_py_plan_prints(site, monkeypatch, capsys):
    from course import plan

    case = calculator.SMALL[0]
    data = site[0] / "_static" / "calculator"
    index = json.loads((data / "index.js").read_text().splitlines()[-1].partition(" = ")[2].rstrip(";"))
    summary = next(c for c in index if c["key"] == case.key)
    first = summary["fastest"][0]
    layouts = script_data(data / case.key / f"{first['mesh']}.js")
    choices, name, memory, sent, calls, time, rest, miss = next(l for l in layouts if l[1] == first["name"])
    layout = next(q.layout for q in calculator.costed(case) if str(q.layout) == name)
    # ZeRO as plan's --zero names it: "2once" for a ZeRO-2 layout that reduce-scatters once a step.
    named = {"zero": f"{layout.zero}once" if layout.reduce_once else str(layout.zero)}
    assert choices == [named.get(c, getattr(layout, c)) for c in calculator.CHOICES] and miss is None and rest is not None
    monkeypatch.setenv("COURSE_IMPL", "solutions")   # plan.main sets it: restored after the test
    plan.main(calculator.plan_command(case, layout))
    printed = [line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("1  ")]
    assert len(printed) == 1 and printed[0].split()[1:] == (name + rest).split(), (printed, name + rest)
    costs, presets, layouts_module = reference("m18_costs"), reference("m18_presets"), reference("m18_layout")
    model = presets.MODELS[case.model]
    cost = costs.rank_cost(model, layout, model.batch, layouts_module.MIXED)
    assert memory == cost.memory and sum(sent.values()) == sum(cost.sent.values())
    refused = next(l for m in summary["meshes"] for l in script_data(data / case.key / f"{m['key']}.js") if l[7])
    assert refused[7].startswith("error: nothing fits: the closest layout, {layout}, keeps"), refused[7]


def test_every_chapter_03_to_18_shows_its_figures_of_the_manifest(site):
    import inspect

    from course.site import drawings

    drawn = {p.stem for p in (site[0] / "_images").glob("*.png")}
    for number in (f"{n:02d}" for n in range(3, 19)):
        chapter = next((REPO / "docs").glob(f"{number}-*.md"))
        manifest = [f.name for f in figures.of_chapter(number)]
        assert manifest, f"no figure in the manifest for chapter {number}"
        named = figures.named_figures(chapter.read_text())
        assert named == manifest, f"{chapter.name} names the figures {named}, the manifest {manifest}"
        html = (site[0] / "docs" / f"{chapter.stem}.html").read_text()
        for name in manifest:
            assert f'id="fig-{name}"' in html and name in drawn, f"figure {name} not on {chapter.stem}.html"
    assert all(inspect.isfunction(getattr(drawings, f.draw, None)) for f in figures.FIGURES)


def test_every_chapter_title_has_the_same_style():
    titles = [p.read_text().splitlines()[0] for p in sorted((REPO / "docs").glob("[0-9][0-9]-*.md"))]
    odd = [t for t in titles if not re.fullmatch(r"# \d\d · \S.*", t)]
    assert not odd, f"chapter titles not written '# NN · Title': {odd}"


def test_chapter_05s_maths_is_typeset(site):
    html = (site[0] / "docs" / f"{next((REPO / 'docs').glob('05-*.md')).stem}.html").read_text()
    assert 'class="math' in html and "_static/katex/katex.min.js" in html, "chapter 05's $$ formula is not maths"


def test_the_explorer_formulas_are_the_closed_forms_of_module_11():
    generators = reference("m11_generators")
    grid = explorer.Grid(p=(2, 3, 4), m=(1, 2, 4, 6, 8), v=(2, 3), costs=(1, 2))
    forms = {name: explorer.verified_form(generators, name, explorer.schedule_data(generators, name, grid))
             for name in generators.SCHEDULES}
    assert all(forms.values()), f"schedules without a closed form read from idle_per_rank: {forms}"
    assert forms["interleaved"] == r"(p-1+(v-1)\max(0, p-m))(\tau_F+\tau_B)", forms["interleaved"]
    data = explorer.schedule_data(generators, "zbh1", grid)
    run = next(r for c in data["configs"].values() for r in c["runs"].values() if "idle" in r["closed"])
    run["closed"]["idle"] = str(Fraction(run["closed"]["idle"]) + 1)   # a function that disagrees with its branch
    assert explorer.verified_form(generators, "zbh1", data) is None, "a branch that disagrees was not caught"
    expression = ast.parse("(p - 1) * max(costs.F + costs.I - 2 * costs.W, costs.F)", mode="eval").body
    assert explorer.tex(expression) == r"(p-1)\max(\tau_F+\tau_I-2\tau_W, \tau_F)"


def test_the_html_check_finds_what_is_wrong(tmp_path):
    (tmp_path / "pic.png").write_bytes(b"")
    (tmp_path / "style.css").write_text("a { background: url(https://example.org/x.png) } b { x: url(gone.woff2) }")
    (tmp_path / "other.html").write_text('<p id="here">')
    (tmp_path / "index.html").write_text(
        '<script src="https://cdn.example.org/lib.js"></script><link rel="stylesheet" href="style.css">'
        '<img src="pic.png"><img src="missing.png"><iframe src="//example.org/frame"></iframe>'
        '<a href="other.html#here">ok</a><a href="other.html#nowhere">bad anchor</a><a href="nope.html">gone</a>'
        '<a href="https://ui.perfetto.dev">a link out is fine</a><div style="background: url(http://x.org/a.png)">')
    problems = "\n".join(check_site(tmp_path))
    for found in ("loads https://cdn.example.org/lib.js from outside", "missing.png, which is not in the site",
                  "//example.org/frame from outside", "has no #nowhere", "nope.html, which is not in the site",
                  "https://example.org/x.png from outside the site (CSS", "url(gone.woff2) names no file",
                  "http://x.org/a.png from outside"):
        assert found in problems, f"not found: {found}\nin:\n{problems}"
    assert "pic.png" not in problems and "perfetto" not in problems and "#here" not in problems


def test_an_executed_copy_is_used_only_while_it_is_the_committed_notebook(tmp_path, monkeypatch):
    import nbformat

    monkeypatch.setattr(notebooks, "EXECUTED", tmp_path / "executed")
    notebook = tmp_path / "01-x.ipynb"
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1 + 1")])
    nbformat.write(nb, notebook)
    assert notebooks.executed_copy(notebook) is None
    nb.cells[0].outputs = [nbformat.v4.new_output("execute_result", {"text/plain": "2"}, execution_count=1)]
    (tmp_path / "run").mkdir()
    nbformat.write(nb, tmp_path / "run" / notebook.name)
    notebooks.keep_executed(tmp_path / "run" / notebook.name)
    assert notebooks.executed_copy(notebook) == tmp_path / "executed" / notebook.name
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1 + 2")]), notebook)
    assert notebooks.executed_copy(notebook) is None, "a copy of an edited notebook is stale"


def test_the_site_command_parses():
    args = main.parse(["site", "--check", "--execute"])
    assert (args.command, args.check, args.execute, args.open) == ("site", True, True, False)
    with pytest.raises(SystemExit):
        main.parse(["site", "--no-such-option"])


@pytest.mark.parametrize("blocked", ["site", "executed"])
def test_a_read_only_checkout_is_one_line_before_any_work(blocked, tmp_path, monkeypatch, capsys):
    # Issue 33: a traceback, once a notebook had run. A file stands where results/ should be: unwritable for
    # root too, as a read-only checkout is.
    import course.site.build
    (tmp_path / "file").write_text("")
    monkeypatch.setattr(course.site.build, "SITE", (tmp_path / "file" if blocked == "site" else tmp_path) / "site")
    monkeypatch.setattr(notebooks, "EXECUTED", (tmp_path / "file" if blocked == "executed" else tmp_path) / "executed")
    monkeypatch.setattr(course.site.build, "build", lambda *a, **k: pytest.fail("the site was built"))
    assert course.site.build.main(main.parse(["site"])) == 1
    out, err = capsys.readouterr()
    assert out == "" and err == (f"error: the site cannot be built: cannot write in {tmp_path}/file/{blocked} "
                                 f"({tmp_path}/file is a file)\n"), err
