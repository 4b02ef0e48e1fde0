"""Chrome-trace export of profiled pipeline runs (given): open the JSON in https://ui.perfetto.dev
or chrome://tracing, one row per rank. `profiles` are the ranks' `course.profiler.export` dicts."""
from __future__ import annotations

import json


def chrome_trace(profiles: list[dict], path) -> None:
    """One Chrome-trace JSON for all ranks."""
    origin = min(p["steps"][0][0] for p in profiles)
    events = []
    for p in profiles:
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": p["rank"],
                       "args": {"name": f"rank {p['rank']}"}})
        for s in p["spans"]:
            label = s["kind"] if s["microbatch"] is None else f"{s['kind']} {s['microbatch']}"
            if s.get("stage") is not None:  # module 11: input / weight are the halves of a backward
                label += f" (stage {s['stage']})"
            events.append({"name": label, "cat": s["kind"], "ph": "X", "pid": 0, "tid": p["rank"],
                           "ts": (s["start"] - origin) * 1e6, "dur": (s["end"] - s["start"]) * 1e6,
                           "args": {"microbatch": s["microbatch"], "step": s["step"], "stage": s.get("stage")}})
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
