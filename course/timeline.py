"""One step of module 17's composed trainer, timed on every rank (given): each stage's forwards and
backwards, and every collective and pipeline message, on one row per rank and axis, written as a
Perfetto (Chrome) trace and as a picture.

It wraps, on each rank, the model's stages (forward, backward), its StageComms (send, recv: the p axis)
and the Collectives of every group of the mesh (each call a span on its axis's row; a collective
started without waiting gets a second span, `wait ...`, when it is waited for), runs one step, and
gathers every rank's spans on rank 0. Spans are time.perf_counter() readings: on Linux one clock for
every process, so the ranks' rows line up."""
from __future__ import annotations

import functools
import json
import os
import time

import torch
import torch.distributed as dist

LANES = ("compute", "p", "dc", "t", "c", "e", "ed")
LANE_NAMES = {"compute": "compute (stage forward / backward)", "p": "p: pipeline messages", "dc": "dc: FSDP, sums",
              "t": "t: tensor / sequence parallel", "c": "c: attention's ring", "e": "e: experts' all-to-all",
              "ed": "ed: expert gradients"}
COLOURS = {"p": "tab:purple", "dc": "tab:blue", "d": "tab:blue", "t": "tab:orange", "c": "tab:green", "e": "tab:red",
           "ed": "tab:brown"}
OPS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send", "isend", "recv", "irecv")
SHORT = {"all_gather": "AG", "reduce_scatter": "RS", "all_reduce": "AR", "all_to_all": "A2A", "send": "send",
         "isend": "send", "recv": "recv", "irecv": "recv"}


class _Waited:
    """A collective's work whose wait() is recorded as a span."""

    def __init__(self, work, record, lane, name):
        self.work, self.record, self.lane, self.name = work, record, lane, name

    def wait(self):
        start = time.perf_counter()
        result = self.work.wait()
        self.record(self.lane, f"wait {self.name}", start, time.perf_counter())
        return result


class StepRecorder:
    """Spans (lane, name, start, end) of this rank, from the wrapped objects."""

    def __init__(self):
        self.spans: list[tuple[str, str, float, float]] = []

    def record(self, lane, name, start, end):
        self.spans.append((lane, name, start, end))

    def timed(self, lane, name_of, method):
        @functools.wraps(method)
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            result = method(*args, **kwargs)
            name = name_of(*args, **kwargs)
            self.record(lane, name, start, time.perf_counter())
            if result is not None and hasattr(result, "wait") and kwargs.get("async_op"):
                return _Waited(result, self.record, lane, name)
            return result
        return wrapper

    def wrap_mesh(self, mesh):
        for group in mesh.groups.values():
            collectives, lane = group.collectives, "dc" if group.axis in ("d", "dc") else group.axis
            for op in OPS:
                def name_of(*args, op=op, **kwargs):
                    label = kwargs.get("label") or next((a for a in args if isinstance(a, str)), "")
                    return f"{op} {label}".strip()
                setattr(collectives, op, self.timed(lane, name_of, getattr(collectives, op)))

    def wrap_model(self, model):
        for index, stage in model.stages.items():
            stage.forward = self.timed("compute", lambda x, mb, *a, index=index, **k: f"F{mb} s{index}", stage.forward)
            stage.backward = self.timed("compute", lambda mb, *a, index=index, **k: f"B{mb} s{index}", stage.backward)
        comms = model.comms
        comms.send = self.timed("p", lambda t, message, stage, mb: f"send {message} s{stage} {mb}", comms.send)
        comms.recv = self.timed("p", lambda message, stage, mb, shape: f"recv {message} s{stage} {mb}", comms.recv)

    def unwrap(self, model):
        for stage in model.stages.values():
            del stage.forward, stage.backward
        del model.comms.send, model.comms.recv
        for group in model.mesh.groups.values():
            for op in OPS:
                vars(group.collectives).pop(op, None)


def trace_one_step(model, text, args, rank: int):
    """Time one more step of `model` (learning rate 0: the weights stay as trained) on every rank; rank 0
    writes args.trace + ".json" and ".png"."""
    from course.dataset import random_batch

    recorder = StepRecorder()
    recorder.wrap_mesh(model.mesh)
    recorder.wrap_model(model)
    generator = torch.Generator().manual_seed(args.seed + 1)
    tokens, targets = random_batch(text.train, args.batch, model.cfg.max_seq_len, generator)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    dist.barrier()
    began = time.perf_counter()
    model.train_step(tokens, targets, args.microbatches, optimizer)
    ended = time.perf_counter()
    recorder.unwrap(model)
    where = " ".join(f"{axis}{i}" for axis, i in model.mesh.index.items())
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {"rank": rank, "where": where, "spans": recorder.spans, "step": (began, ended)})
    if rank == 0:
        os.makedirs(os.path.dirname(args.trace) or ".", exist_ok=True)
        chrome_trace(everyone, args.trace + ".json")
        plot_step(everyone, args.trace + ".png", f"one step on mesh {args.mesh}: every rank, every axis")
        print(f"timeline of one step: {args.trace}.json (open in ui.perfetto.dev), {args.trace}.png")


def chrome_trace(ranks: list[dict], path):
    origin = min(r["step"][0] for r in ranks)
    events = []
    for r in ranks:
        events.append({"name": "process_name", "ph": "M", "pid": r["rank"], "args": {"name": f"rank {r['rank']} "
                                                                                             f"({r['where']})"}})
        for lane in LANES:
            events.append({"name": "thread_name", "ph": "M", "pid": r["rank"], "tid": LANES.index(lane),
                           "args": {"name": LANE_NAMES[lane]}})
        for lane, name, start, end in r["spans"]:
            events.append({"name": name, "cat": lane, "ph": "X", "pid": r["rank"], "tid": LANES.index(lane),
                           "ts": (start - origin) * 1e6, "dur": (end - start) * 1e6})
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)


def plot_step(ranks: list[dict], path, title: str):
    """Rows: each rank's lanes that have spans; compute in grey shades (F light, B dark), collectives by axis."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    origin = min(r["step"][0] for r in ranks)
    rows = [(r["rank"], r["where"], lane) for r in ranks for lane in LANES if any(s[0] == lane for s in r["spans"])]
    figure = Figure(figsize=(14, 0.22 * len(rows) + 1.6))
    ax = figure.add_subplot()
    for y, (rank, where, lane) in enumerate(rows):
        spans = [s for s in ranks[rank]["spans"] if s[0] == lane]
        for _, name, start, end in spans:
            left, width = (start - origin) * 1e3, max((end - start) * 1e3, 0.02)
            colour = ("0.75" if name.startswith("F") else "0.35") if lane == "compute" else COLOURS[lane]
            alpha = 0.45 if name.startswith("wait") else 1.0
            ax.barh(y, width, left=left, height=0.8, color=colour, alpha=alpha, linewidth=0)
            if lane == "compute" and width > 4:
                ax.text(left + width / 2, y, name.split()[0], ha="center", va="center", fontsize=5,
                        color="black" if name.startswith("F") else "white")
            elif width > 12:  # a collective long enough to read: its kind and label (AG block 3, RS block 3, ...)
                words = name.split()
                op = words[1] if words[0] == "wait" else words[0]
                text = " ".join([SHORT.get(op, op), *words[2 if words[0] == "wait" else 1:]][:3])
                ax.text(left + width / 2, y, text, ha="center", va="center", fontsize=4.5)
    ax.set_yticks(range(len(rows)), [f"rank {r} ({w}) {lane}" for r, w, lane in rows], fontsize=6)
    ax.invert_yaxis()
    ax.set_xlabel("ms since the step began (compute: light F, dark B; collectives coloured by axis, pale: waiting "
                  "for one started without waiting)")
    handles = [Patch(color=c, label=LANE_NAMES[a]) for a, c in COLOURS.items() if a in LANE_NAMES]
    ax.legend(handles=handles, fontsize=7, loc="lower right")
    ax.set_title(title)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
