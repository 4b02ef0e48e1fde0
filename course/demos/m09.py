"""`python main.py run 09`: train module 06's Llama with FP8 linears beside the fp32 run.

Both runs start from the same weights and see the same batches; they differ only in the matmul
policy their LlamaBlock gets: module 06's `Matmul` (fp32) or `FP8Matmul`. Every linear of every
block (q, k, v, o, gate, up, down) then runs its forward and both backward matmuls in FP8. The
embedding and the LM head stay in fp32, as FP8 recipes usually keep them.

All matmuls here are far below the size where FP8 pays off (see `python main.py bench 09`), so
the demo forces FP8 everywhere (min_dim=0): it shows that training *works* in FP8, not that it
is faster.
"""
import time

import torch

from course.arguments import check_counts
from course.impl import load


def add_args(parser):
    parser.add_argument("--steps", type=int, default=300, help="training steps (default 300)")


def check_args(args):
    check_counts(args, "steps")


def demo(args):
    m06_block, m06_model, m09_matmul = load("m06_llama_block"), load("m06_llama_model"), load("m09_fp8_matmul")
    torch.set_num_threads(1)  # tensors this small run faster on one thread than split across several
    cfg = m06_block.LlamaConfig()
    print(f"Training module 06's {cfg.n_layers}-layer Llama (dim {cfg.dim}, ffn {cfg.ffn_dim}) on bytes of "
          f"Shakespeare, fp32 linears vs FP8 linears\n(FP8 forced on every block linear with min_dim=0: "
          f"at this size FP8 is slower, this shows that it trains):")
    began = time.perf_counter()
    _, reference = m06_model.train(cfg, args.steps)
    fp8_block = m06_block.LlamaBlock(cfg, matmul=m09_matmul.FP8Matmul(min_dim=0))
    _, fp8 = m06_model.train(cfg, args.steps, block=fp8_block)
    print(f"  {'step':>4}  {'fp32 loss':>10}  {'fp8 loss':>10}  {'difference':>10}")
    for step in sorted({*range(0, args.steps, max(1, args.steps // 10)), args.steps - 1}):  # the last once
        print(f"  {step:4d}  {reference[step]:10.4f}  {fp8[step]:10.4f}  {fp8[step] - reference[step]:+10.4f}")
    last = min(10, args.steps)
    mean = lambda losses: sum(losses[-last:]) / last  # noqa: E731
    print(f"Mean of the last {last} losses: fp32 {mean(reference):.4f}, FP8 {mean(fp8):.4f} "
          f"({100 * (mean(fp8) / mean(reference) - 1):+.1f}%); both runs {time.perf_counter() - began:.1f} s.")
