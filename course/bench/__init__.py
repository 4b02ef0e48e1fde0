"""Benchmarks behind `python main.py bench NN`: one module per course module (course/bench/mNN.py,
exposing `main(argv)`). Each prints a measured-versus-theory table whose header names the device
and torch version, and writes the same rows to results/bench-NN.{json,csv} for the notebooks.
"""
from __future__ import annotations

import csv
import json
import platform
import torch

from course import RESULTS
from course.impl import reference


def describe_device(device: str = "cpu") -> str:
    if device.startswith("cuda"):
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}"
    return f"CPU ({platform.machine()}, {torch.get_num_threads()} threads), torch {torch.__version__}"


def report(name: str, title: str, rows: list[dict], device: str = "cpu", notes: str = ""):
    """Print `rows` as a table under a header naming the device; save them as JSON and CSV."""
    header = f"{title}\n{describe_device(device)}"
    print(header)
    print("-" * max(len(line) for line in header.splitlines()))
    if rows:
        columns = list(rows[0])
        cells = [[_fmt(row[c]) for c in columns] for row in rows]
        widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
        print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
        for r in cells:
            print("  ".join(v.rjust(w) for v, w in zip(r, widths)))
    if notes:
        print(notes)
    RESULTS.mkdir(exist_ok=True)
    meta = {"title": title, "device": describe_device(device), "notes": notes}
    (RESULTS / f"{name}.json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
    with open(RESULTS / f"{name}.csv", "w", newline="") as f:
        if rows:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    print(f"(saved results/{name}.json and .csv)")
    return RESULTS / f"{name}.json"


def require_positive(parser, args, *names: str):
    """parser.error, naming the option, unless every one of `names` is at least 1."""
    for name in names:
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")


def llama_config(parser, what: str, **fields):
    """Module 06's LlamaConfig for a benchmark's options, or parser.error with its own reason (the
    given class, from the reference like every option check). `what` names the options involved."""
    try:
        return reference("m06_llama_block").LlamaConfig(**fields)
    except ValueError as exc:  # e.g. query heads that key/value heads cannot share evenly
        parser.error(f"{what}: {exc}")


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
