"""`python main.py run 10`: one step of module 06's Llama with each recompute option: what each
layer's store keeps (formula and measured) and gradients bit-identical to keeping everything."""
import torch

from course.dataset import load_text, random_batch
from course.impl import load


def demo(args):
    m06_block, m06_model, m10 = load("m06_llama_block"), load("m06_llama_model"), load("m10_recompute")
    torch.set_num_threads(1)  # tensors this small run faster on one thread than split across several
    cfg, batch = m06_block.LlamaConfig(), 16
    model = m06_model.LlamaModel(cfg, seed=0)
    tokens, targets = random_batch(load_text(), batch, cfg.max_seq_len, torch.Generator().manual_seed(0))
    print(f"One {cfg.n_layers}-layer Llama step (batch {batch}, {cfg.max_seq_len} tokens, dim {cfg.dim}) "
          f"with each recompute option:\n")
    print(f"{'option':>10} {'kept KiB/layer':>15} {'store KiB':>10}  gradients vs none")
    baseline = None
    for option in m10.OPTIONS:
        model.block = m10.RecomputeBlock(cfg, option)  # the model loop does not change, only the block
        measured = m10.measure_store_bytes(model, tokens)
        grads = model.forward_backward(tokens, targets)[1].tensors()
        baseline = baseline or grads
        same = all(torch.equal(a, b) for a, b in zip(grads, baseline))
        print(f"{option:>10} {m10.kept_bytes(cfg, batch, cfg.max_seq_len, torch.float32, option) / 1024:15.1f} "
              f"{measured / 1024:10.1f}  {'identical, bit for bit' if same else 'DIFFERENT'}")
    print("\nStep time and peak memory, next to torch.utils.checkpoint: python main.py bench 10 [--device cuda]")
