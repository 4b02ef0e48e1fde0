"""Benchmarks behind `python main.py bench NN`: one module per course module (course/bench/mNN.py,
exposing `main(argv)`). Each prints a measured-versus-theory table whose header names the device
and torch version, and writes the same rows to results/bench-NN.{json,csv} for the notebooks.

A benchmark measures the implementation `--impl` selects: it loads the learner's code when it
runs (`load(stem)` in a function, or `SelectedModule(stem)` for a module-level name), never when
it is imported, which happens before main.py knows which one is asked for.

Every benchmark opens the same way (`bench_parser`, then `start`): its options parsed and checked,
a bad one refused in one line before any rank starts; one thread per process (the ranks share the
cores); torch's optimizers imported once in the parent, not once in every forked rank. A benchmark
of several tables picks them with --only (`chosen_parts`).
"""
from __future__ import annotations

import argparse
import csv
import json
import platform
import tempfile

import torch

from course import RESULTS
from course.impl import load, reference


class SelectedModule:
    """Module `stem` of the implementation selected, imported at its first use: `m05 =
    SelectedModule("m05_schedules")` at the top of a benchmark, then `m05.train` in its functions."""

    def __init__(self, stem: str):
        self.stem = stem

    def __getattr__(self, name):
        return getattr(load(self.stem), name)


def bench_parser(module: str, doc: str, parts: tuple[str, ...] = ()) -> argparse.ArgumentParser:
    """`python main.py bench NN`'s parser, described by the first paragraph of the benchmark's docstring
    `doc`; with `parts`, the option --only that runs one of its tables."""
    parser = argparse.ArgumentParser(prog=f"main.py bench {module}", description=doc.split("\n\n")[0])
    if parts:
        parser.add_argument("--only", choices=parts, default=None, help=f"one table (default: all {len(parts)})")
    return parser


def start(parser: argparse.ArgumentParser, argv: list[str], check=None) -> argparse.Namespace:
    """The options of `argv`, checked by `check(parser, args)` (which calls parser.error: one line, exit 2)
    before anything is measured; then one thread per process, and the optimizers imported here."""
    args = parser.parse_args(argv)
    if check is not None:
        check(parser, args)
    torch.set_num_threads(1)
    torch.optim.Adam([torch.zeros(1, requires_grad=True)])  # imports torch._dynamo once, not once per forked rank
    return args


def chosen_parts(args: argparse.Namespace, parts: tuple[str, ...]) -> list[str]:
    """The tables to run: the one --only names, or all of them."""
    return [args.only] if args.only else list(parts)


def check_results_writable():
    """Exit with one line if results/ cannot take the tables, before a benchmark measures for minutes."""
    try:
        RESULTS.mkdir(exist_ok=True)
        with tempfile.TemporaryFile(dir=RESULTS):
            pass
    except OSError as exc:
        raise SystemExit(f"error: the benchmark's table cannot be saved in {RESULTS}: {exc.strerror or exc}")


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
    meta = {"title": title, "device": describe_device(device), "notes": notes}
    try:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / f"{name}.json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
        with open(RESULTS / f"{name}.csv", "w", newline="") as f:
            if rows:
                writer = csv.DictWriter(f, fieldnames=list(rows[0]))
                writer.writeheader()
                writer.writerows(rows)
    except OSError as exc:  # e.g. results/ made read-only while the benchmark ran
        raise SystemExit(f"error: the table above could not be saved in {RESULTS}: {exc.strerror or exc}")
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


def narrow_llama(parser, args):
    """The small Llama benches 13 and 18 share: dim // 8 query heads of 8 in 4 key/value groups, an FFN of
    about 8/3 dim (a multiple of 16), from the options --dim, --layers and --seq."""
    if args.dim < 32 or args.dim % 32:
        parser.error(f"--dim must be a multiple of 32 (dim // 8 query heads of 8 in 4 groups), got {args.dim}")
    return llama_config(parser, f"--dim {args.dim}", dim=args.dim, n_heads=args.dim // 8, n_kv_heads=4, head_dim=8,
                        ffn_dim=args.dim * 8 // 3 // 16 * 16, n_layers=args.layers, max_seq_len=args.seq)


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
