# Generated from solutions/m05_schedules.py by `python -m course.skeleton`: fill in the TODOs.
# Grade your work with `python main.py grade 05`. (skeleton 237a827d2e4c)
"""Module 05 - pipeline schedules.

Module 04 relayed the whole batch through the ranks; while one rank computes, all the others wait.
A schedule decides which rank does what, when, to shrink that waiting (the *bubble*):

* naive  - the whole batch forward through all ranks, then the whole backward. Each rank is busy
           for 1/P of the step.
* gpipe  - split the batch into M microbatches; run all M forwards, then all M backwards. Rank r
           starts its forward of microbatch m as soon as rank r-1 has sent it, so the ranks work
           at the same time. The idle fraction falls to (P-1)/(M+P-1), but every rank keeps the
           activations of all M microbatches until their backwards.
* 1f1b   - the same work, reordered: after a short warm-up of forwards, each rank alternates one
           forward and one backward, so rank r never holds more than P - r microbatches.

Every schedule is a function (stage, comms, x, y, chunks) -> loss (on the last rank, else None)
that leaves this rank's gradients in its parameters, exactly those of the full-batch loss: each
microbatch's loss is divided by M, so their gradients add up to the gradient of the mean.
"""
import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist

from course.profiler import EmulatedStage, Profiler, chrome_trace, export, format_report
from .m00_monolith import MLPConfig, make_batch
from .m00_monolith import train as train_monolith
from .m02_comms import PipelineComms, init_distributed
from .m04_sharded import ShardedMLP, check_world_size

TITLE = "Pipeline schedules: naive, GPipe and 1F1B, and the bubble they leave"
NPROC = 4
RESULTS = Path(__file__).resolve().parent.parent / "results"


def split_microbatches(batch: torch.Tensor, chunks: int) -> list[torch.Tensor]:
    """`chunks` equal microbatches along dimension 0, or a ValueError if they cannot be equal.

    Equal sizes matter: a receiving rank sizes its buffer from the microbatch size.
    """
    if chunks < 1 or batch.shape[0] % chunks != 0:
        raise ValueError(f"cannot split a batch of {batch.shape[0]} into {chunks} equal microbatches; "
                         f"use a number of chunks that divides {batch.shape[0]}")
    return list(batch.chunk(chunks))


def forward_step(stage, comms, x_mb, y_mb, chunks, sends):
    """Forward one microbatch on this rank; return (input, output) for its backward_step.

    The input comes from x_mb on the first rank, from the previous rank elsewhere; the output goes
    to the next rank with a non-blocking send (its handle is appended to `sends`). On the last
    rank the output is this microbatch's share of the loss: its cross-entropy divided by `chunks`.
    """
    # TODO(m05): receive (unless first), run the stage, send (unless last) or compute the loss share
    # Hint: a received input is a fresh leaf: .requires_grad_() so backward fills its .grad.
    # Hint: the receive buffer's shape is (x_mb.shape[0], stage.hidden).
    # Hint: sends.append(comms.isend_forward(output)): with blocking sends in both directions (here
    #       and in backward_step) 1F1B deadlocks.
    raise NotImplementedError('TODO(m05): receive (unless first), run the stage, send (unless last) or compute the loss share')


def backward_step(stage, comms, inp, out, sends):
    """Backward one microbatch from its (input, output): receive the output's gradient (unless
    last rank), backpropagate, send the input's gradient back (unless first rank)."""
    # TODO(m05): backpropagate this microbatch and pass the input gradient to the previous rank
    # Hint: the last rank's output is a loss: out.backward(). Elsewhere the gradient arrives from
    #       the next rank: comms.recv_backward(out.shape), then out.backward(that gradient).
    # Hint: sends.append(comms.isend_backward(inp.grad)) unless this is the first rank.
    raise NotImplementedError('TODO(m05): backpropagate this microbatch and pass the input gradient to the previous rank')


def wait_all(sends):
    """Wait for every non-blocking send of the step. Until then the tensor being sent must stay
    untouched, and its handle must be kept: on gloo a send whose handle is dropped is usually lost
    (the peer then hangs in recv) or fails with "Cannot lock pointer to unbound buffer"; a step that
    ends with sends in flight could also overwrite what the next step sends."""
    for handle in sends:
        handle.wait()


def naive(stage, comms, x, y, chunks=1):
    """The whole batch forward, then backward: one microbatch, whatever `chunks` says."""
    # TODO(m05): one forward_step and one backward_step of the whole batch
    raise NotImplementedError('TODO(m05): one forward_step and one backward_step of the whole batch')


def gpipe(stage, comms, x, y, chunks):
    """All forwards, then all backwards; returns the batch loss on the last rank."""
    # TODO(m05): split x and y; forward every microbatch, then backward every one; wait the sends
    # Hint: keep each microbatch's (input, output) until its backward. Any backward order gives
    #       the same gradients (they are summed); the loss is the sum of the shares, detached.
    raise NotImplementedError('TODO(m05): split x and y; forward every microbatch, then backward every one; wait the sends')


def one_f_one_b(stage, comms, x, y, chunks):
    """Warm-up forwards, then one forward / one backward in turn, then the remaining backwards."""
    # TODO(m05): warm up with min(P - rank - 1, M) forwards; steady state F(m + warm-up), B(m); cool down
    # Hint: keep (input, output) of the microbatches in flight in a list; backward the oldest.
    # Hint: with M < P - rank - 1 the warm-up alone forwards every microbatch (cap it at M).
    raise NotImplementedError('TODO(m05): warm up with min(P - rank - 1, M) forwards; steady state F(m + warm-up), B(m); cool down')


SCHEDULES = {"naive": naive, "gpipe": gpipe, "1f1b": one_f_one_b}


def train(schedule, rank, world_size, chunks, cfg=MLPConfig(), profiler=None, emulate_ms=0.0, device="cpu"):
    """Train this rank's stage with `schedule`; return (losses on the last rank, the stage)."""
    stage = ShardedMLP(cfg, rank, world_size).to(device)
    optimizer = torch.optim.Adam(stage.parameters(), lr=cfg.lr)
    comms = PipelineComms(rank, world_size, device)
    model = EmulatedStage(stage, emulate_ms) if emulate_ms else stage
    if profiler is not None:
        model, comms = profiler.wrap_stage(model), profiler.wrap_comms(comms)
    x, y = (t.to(device) for t in make_batch(cfg))
    losses = []
    for _ in range(cfg.steps):
        optimizer.zero_grad()
        if profiler is not None:
            dist.barrier()  # a common start, so the step time is the pipeline's, not the stragglers'
            with profiler.step():
                loss = SCHEDULES[schedule](model, comms, x, y, chunks)
        else:
            loss = SCHEDULES[schedule](model, comms, x, y, chunks)
        optimizer.step()
        if loss is not None:
            losses.append(loss.item())
    return losses, stage


# --- the demo: `python main.py run 05 [--schedule S] [--chunks M] [--nproc P]` ---

def add_args(parser: argparse.ArgumentParser):
    parser.add_argument("--schedule", default="1f1b", help=f"one of {', '.join(SCHEDULES)}")
    parser.add_argument("--chunks", type=int, default=8, help="microbatches per step, M (default 8)")
    parser.add_argument("--steps", type=int, default=MLPConfig.steps, help="training steps (default 50)")
    parser.add_argument("--emulate-ms", type=float, default=0.5,
                        help="emulated device: extra ms per layer forward (twice that backward); 0: CPU only")
    parser.add_argument("--trace", default=str(RESULTS / "m05-trace"),
                        help="write PREFIX.json (Chrome trace) and PREFIX.png (timeline)")


def check_args(args):
    """Called by main.py before any process starts."""
    if args.schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {args.schedule!r}; choose one of {', '.join(SCHEDULES)}")
    check_world_size(MLPConfig(), args.nproc)
    if args.chunks < 1:
        raise ValueError(f"--chunks must be at least 1, got {args.chunks}")
    if MLPConfig.batch % args.chunks != 0:
        raise ValueError(f"a batch of {MLPConfig.batch} cannot be split into {args.chunks} equal "
                         f"microbatches; use --chunks that divides {MLPConfig.batch}")
    if args.steps < 1 or args.emulate_ms < 0:
        raise ValueError("--steps must be at least 1 and --emulate-ms at least 0")


def demo(args):
    rank, world_size, device = init_distributed()
    cfg = MLPConfig(steps=args.steps)
    profiler = Profiler(rank)
    chunks = 1 if args.schedule == "naive" else args.chunks  # naive runs the whole batch at once
    losses, _ = train(args.schedule, rank, world_size, args.chunks, cfg, profiler, args.emulate_ms, device)
    if rank == world_size - 1:
        expected = train_monolith(cfg)
        print(f"{args.schedule} on {world_size} ranks, {chunks} microbatch{'es' * (chunks > 1)}, {cfg.steps} steps:")
        for step in range(0, cfg.steps, 5):
            print(f"  step {step:3d}  loss {losses[step]:.6f}   monolith {expected[step]:.6f}")
        print(f"  final     loss {losses[-1]:.6f}   monolith {expected[-1]:.6f}")
        worst = max(abs(a - b) for a, b in zip(losses, expected))
        verdict = "bit for bit" if losses == expected else f"up to float32 rounding ({worst:.1e})" \
            if worst <= 1e-6 else f"NO: they differ by up to {worst:.1e}"
        print(f"  every step's loss equals the monolith's: {verdict}")
    profiles = [None] * world_size
    dist.all_gather_object(profiles, export(profiler))
    if rank == 0:
        mode = f"emulated device, {args.emulate_ms:g} ms per layer forward" if args.emulate_ms else "CPU compute only"
        steps = f"mean over steps 2..{cfg.steps}" if cfg.steps > 1 else "one step, warm-up included"
        print(f"\nBubble report ({mode}; {steps}):")
        print(format_report(profiles, chunks))
        if args.trace:
            from course.plotting import plot_timeline

            os.makedirs(os.path.dirname(args.trace) or ".", exist_ok=True)
            chrome_trace(profiles, args.trace + ".json")
            plot_timeline(profiles, args.trace + ".png", step=-1,
                          title=f"{args.schedule}, P={world_size}, M={chunks}")
            print(f"trace: {args.trace}.json (open in ui.perfetto.dev), timeline: {args.trace}.png")
