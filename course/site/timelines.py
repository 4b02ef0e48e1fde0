"""The site's timelines page (given): every schedule of module 11 at one p and m, simulated with unit costs,
drawn by course/plotting.py as a PNG and written by course/trace.py as a Perfetto trace, the same pictures
and traces `python main.py run 05` and `run 11` make of measured runs.
"""
from __future__ import annotations

from pathlib import Path

from course.impl import reference
from course.plotting import plot_timeline
from course.simulate import simulate_schedule
from course.trace import chrome_trace

P, M = 4, 8


def write_timelines(folder: Path) -> str:
    """Draw every schedule into `folder` (NAME.png, NAME-trace.json); return the page's Markdown, whose
    links are relative to the folder's parent."""
    generators = reference("m11_generators")
    folder.mkdir(parents=True, exist_ok=True)
    lines = ["# Timelines of module 11's schedules", "",
             f"Every schedule of `solutions/m11_generators.py` with p = {P} ranks and m = {M} microbatches, "
             "timed by the course's simulator (`course/simulate.py`) with τ_F = τ_I = τ_W = 1 unit and free "
             "messages. Ranks are rows; forwards solid, full backwards hatched //, I hatched the other way, "
             "W dotted and paler, colours by microbatch; grey is idle. The [schedule explorer](explorer.md) "
             "draws any p, m, v and costs of its grid.", "",
             "Each picture has its trace beside it: open the JSON file in Perfetto (ui.perfetto.dev, "
             "*Open trace file*) or `chrome://tracing`, one row per rank, one unit shown as one second.", ""]
    for name in generators.SCHEDULES:
        try:
            schedule = generators.make_schedule(name, P, M)
        except ValueError as error:
            lines += [f"## {name}", "", f"Not drawn at p = {P}, m = {M}: {error}", ""]
            continue
        timeline = simulate_schedule(schedule.orders, schedule.placement)
        profiles = timeline.as_profiles()
        plot_timeline(profiles, folder / f"{name}.png", unit="units",
                      title=f"{name}, p = {P}, m = {M}: bubble {float(timeline.bubble):.1%} ({timeline.bubble})")
        chrome_trace(profiles, folder / f"{name}-trace.json")
        peak = ", ".join(map(str, timeline.peak_live))
        lines += [f"## {name}", "",
                  f"Bubble {timeline.bubble} = {float(timeline.bubble):.1%}; peak activations per rank "
                  f"{peak}. <a href='explorer.html?schedule={name}&p={P}&m={M}'>Explore it</a> · "
                  f"{{download}}`Perfetto trace <{folder.name}/{name}-trace.json>`", "",
                  f"![{name} timeline, p = {P}, m = {M}]({folder.name}/{name}.png)", ""]
    return "\n".join(lines)
