"""`python main.py run 06`: train module 06's tiny Llama on bytes of Shakespeare with the learner's
hand-written backward, then sample from it."""
import argparse
import time

import torch

from course.arguments import check_counts
from course.dataset import TEXT
from course.demos import log_every, printable
from course.impl import load


def add_args(parser: argparse.ArgumentParser):
    parser.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    parser.add_argument("--sample", type=int, default=200, help="bytes to sample after training")


def check_args(args):
    check_counts(args, "steps")
    check_counts(args, "sample", low=0)


def sample(model, prompt: str, length: int, temperature: float = 0.8, seed: int = 0) -> str:
    """`length` bytes drawn one at a time from the model's next-token distribution, after `prompt`."""
    generator = torch.Generator().manual_seed(seed)
    tokens = list(prompt.encode())
    for _ in range(length):
        context = torch.tensor([tokens[-model.cfg.max_seq_len:]])
        probs = torch.softmax(model.next_token_logits(context)[0] / temperature, dim=-1)
        tokens.append(torch.multinomial(probs, 1, generator=generator).item())
    return bytes(tokens).decode(errors="replace")


def demo(args):
    block, model_module = load("m06_llama_block"), load("m06_llama_model")
    torch.set_num_threads(1)  # tensors this small run faster on one thread than split across several
    cfg = block.LlamaConfig()
    print(f"Training a {cfg.n_layers}-layer Llama (dim {cfg.dim}, {cfg.n_heads} query / {cfg.n_kv_heads} "
          f"key-value heads) on {TEXT.name}, bytes as tokens:")
    began = time.perf_counter()
    model, losses = model_module.train(cfg, args.steps, on_step=log_every(max(1, args.steps // 10), args.steps))
    last = losses[-10:]  # fewer when fewer steps ran
    print(f"  {args.steps} steps in {time.perf_counter() - began:.1f} s; "
          f"loss {losses[0]:.3f} -> {sum(last) / len(last):.3f} (mean of the last {len(last)})")
    if args.sample:
        print("\nSample (temperature 0.8):\n" + printable(sample(model, "MENENIUS:\n", args.sample)))
