"""What module 17's stage and trainer tests share: the single-process model both sides start from."""
import torch

from course.impl import reference

m06 = reference("m06_llama_model")  # the single-process model: trusted, not graded by module 17
m16 = reference("m16_moe_model")


def whole_model(cfg, moe=None, dtype=torch.float64):
    """Module 06's Llama (module 16's MoE Llama with `moe`), its norm weights drawn around 1 (equal entries
    would hide a permuted gather or one norm's weight used for another)."""
    model = m16.MoELlama(cfg, moe, m16.one_rank_mesh(), 0, dtype) if moe else m06.LlamaModel(cfg, 0, dtype)
    g = torch.Generator().manual_seed(4)
    blocks = [b.dense if moe else b for b in model.blocks]
    for norm in [*(w for b in blocks for w in (b.ln1, b.ln2)), model.final_norm]:
        norm.add_((0.1 * torch.randn(norm.shape, generator=g, dtype=torch.float64)).to(dtype))
    return model
