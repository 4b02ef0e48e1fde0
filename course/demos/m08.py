"""`python main.py run 08`: two steps of module 06's Llama with its blocks streamed from host memory
through two buffers, on CPU, an optimizer step between them: the same loss and gradients as the
all-resident model, and the event graph of the compute and copy streams checked for hazards."""
import argparse
import time

import torch

from course.arguments import check_counts
from course.impl import load
from course.streams import FakeRuntime, find_hazards, record_compute


def add_args(parser: argparse.ArgumentParser):
    parser.add_argument("--layers", type=int, default=4, help="blocks (default 4)")


def check_args(args):
    check_counts(args, "layers")


def demo(args):
    m06_block, m06_model, m08 = load("m06_llama_block"), load("m06_llama_model"), load("m08_host_weights")
    torch.set_num_threads(1)
    cfg = m06_block.LlamaConfig(n_layers=args.layers)
    tokens = torch.randint(0, cfg.vocab_size, (4, cfg.max_seq_len), generator=torch.Generator().manual_seed(0))
    resident = m06_model.LlamaModel(cfg)
    loss, grads = resident.forward_backward(tokens, tokens)
    streamed = m06_model.LlamaModel(cfg)
    runtime = FakeRuntime()  # on CPU: copies run at once, and the event graph is recorded
    streamed.weights = m08.HostWeights(streamed.blocks, runtime)
    streamed.blocks = []  # from here on, the blocks live only in (pinned) host memory
    record_compute(streamed, runtime)  # the event graph books each block's kernels where they are issued
    began, same = time.perf_counter(), True
    for step in range(2):  # two steps, an optimizer step between them: invalidate, then the host writes
        loss_streamed, grads_streamed = streamed.forward_backward(tokens, tokens)
        same = same and torch.equal(loss, loss_streamed) and all(
            torch.equal(a, b) for a, b in zip(grads.tensors(), grads_streamed.tensors()))
        if step == 0:
            streamed.weights.invalidate()
            runtime.host_writes(streamed.weights.host, "optimizer step")  # (it writes the same values back)
    print(f"{cfg.n_layers} blocks streamed from host memory through 2 buffers: "
          f"{streamed.weights.copies} block copies in two steps ({time.perf_counter() - began:.2f} s on CPU)")
    print(f"Loss and gradients equal the all-resident model's bit for bit: {same}")
    hazards = find_hazards(runtime.nodes)
    print(f"Event graph: {len(runtime.nodes)} operations on the compute and copy streams, "
          f"{len(hazards)} hazards (two accesses to the same buffer, one a write, in no fixed order)")
    print("On a GPU, `python main.py bench 08 --device cuda` measures the overlap.")
