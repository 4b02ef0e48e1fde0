"""An independent Llama written the straightforward way (nn.Module, autograd, PyTorch's attention).

The tests of modules 06 and 10 compare the hand-written forward and backward against it, and
module 10's benchmark wraps its blocks in torch.utils.checkpoint. It shares nothing with the
course's Llama (solutions/m06_*) but the names of the weights (ln1, wq, ..., w_down).
`ModularLlama`, at the end, is the same model with every linear, norm and the embedding a
submodule, the form DTensor's parallelize_module addresses by name (module 12, course/reference_tp.py).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F


def rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE as a complex multiplication: the pair (x[i], x[i + D/2]) is the number x[i] + j x[i + D/2],
    turned by the angle t * theta^(-2i/D) at position t. x is (B, T, heads, D)."""
    T, D = x.shape[1], x.shape[-1]
    real = torch.promote_types(x.dtype, torch.float32)  # complex64 for bf16 and float32, complex128 for float64
    freqs = 1.0 / theta ** (torch.arange(0, D // 2, dtype=torch.float64, device=x.device) * 2 / D)
    angles = torch.arange(T, dtype=torch.float64, device=x.device)[:, None] * freqs
    turn = torch.polar(torch.ones_like(angles), angles).to(torch.complex128 if real == torch.float64 else torch.complex64)
    z = torch.complex(x[..., :D // 2].to(real), x[..., D // 2:].to(real)) * turn[:, None, :]
    return torch.cat((z.real, z.imag), dim=-1).to(x.dtype)


def rms_norm(x, weight, eps):
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


class ReferenceBlock(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads, head_dim, ffn_dim, rope_theta, norm_eps, dtype=torch.float64):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.theta, self.eps = rope_theta, norm_eps
        self.ln1 = nn.Parameter(torch.ones(dim, dtype=dtype))
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=False, dtype=dtype)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=False, dtype=dtype)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=False, dtype=dtype)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=False, dtype=dtype)
        self.ln2 = nn.Parameter(torch.ones(dim, dtype=dtype))
        self.w_gate = nn.Linear(dim, ffn_dim, bias=False, dtype=dtype)
        self.w_up = nn.Linear(dim, ffn_dim, bias=False, dtype=dtype)
        self.w_down = nn.Linear(ffn_dim, dim, bias=False, dtype=dtype)

    def forward(self, x):
        B, T, _ = x.shape
        n = rms_norm(x, self.ln1, self.eps)
        q = rope(self.wq(n).view(B, T, self.n_heads, self.head_dim), self.theta)
        k = rope(self.wk(n).view(B, T, self.n_kv_heads, self.head_dim), self.theta)
        v = self.wv(n).view(B, T, self.n_kv_heads, self.head_dim)
        group = self.n_heads // self.n_kv_heads  # query head h reads key/value head h // group
        k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        h = x + self.wo(o.transpose(1, 2).reshape(B, T, -1))
        n = rms_norm(h, self.ln2, self.eps)
        return h + self.w_down(F.silu(self.w_gate(n)) * self.w_up(n))

    def load(self, weights):
        """Copy a BlockWeights-like object's tensors (same names, nn.Linear layout) into this block."""
        with torch.no_grad():
            for name in ("ln1", "ln2"):
                getattr(self, name).copy_(getattr(weights, name))
            for name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
                getattr(self, name).weight.copy_(getattr(weights, name))
        return self

    def grads(self) -> dict:
        """Every weight's gradient, in the order a backward produces them (the last op's first)."""
        order = ("w_down", "w_gate", "w_up", "ln2", "wo", "wq", "wk", "wv", "ln1")
        return {name: (getattr(self, name).grad if name.startswith("ln") else getattr(self, name).weight.grad)
                for name in order}


class ReferenceLlama(nn.Module):
    def __init__(self, cfg, dtype=torch.float64):
        super().__init__()
        self.eps = cfg.norm_eps
        self.embedding = nn.Parameter(torch.zeros(cfg.vocab_size, cfg.dim, dtype=dtype))
        self.blocks = nn.ModuleList(
            ReferenceBlock(cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim, cfg.rope_theta,
                           cfg.norm_eps, dtype) for _ in range(cfg.n_layers))
        self.final_norm = nn.Parameter(torch.ones(cfg.dim, dtype=dtype))
        self.lm_head = nn.Parameter(torch.zeros(cfg.vocab_size, cfg.dim, dtype=dtype))

    def final_hidden(self, tokens, run_block=None):
        """The normed output of the last block; `run_block(block, x)` may wrap each block's call
        (e.g. in torch.utils.checkpoint)."""
        x = self.embedding[tokens]
        for block in self.blocks:
            x = run_block(block, x) if run_block else block(x)
        return rms_norm(x, self.final_norm, self.eps)

    def loss(self, tokens, targets):
        logits = self.final_hidden(tokens) @ self.lm_head.t()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


# ---------------------------------------------------------------------------------------------
# The same model with every linear, norm and the embedding a submodule, so that DTensor's
# parallelize_module can address each by name (module 12's comparison, course/reference_tp.py).
# ---------------------------------------------------------------------------------------------
class Attention(nn.Module):
    """q, k, v, o projections and causal GQA attention. The head counts come from the projections'
    outputs, so a column-parallel wq (this rank's heads) just works."""

    def __init__(self, dim, n_heads, n_kv_heads, head_dim, rope_theta, dtype):
        super().__init__()
        self.head_dim, self.group, self.theta = head_dim, n_heads // n_kv_heads, rope_theta
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=False, dtype=dtype)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=False, dtype=dtype)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=False, dtype=dtype)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=False, dtype=dtype)

    def forward(self, x):
        B, T = x.shape[:2]
        q = rope(self.wq(x).view(B, T, -1, self.head_dim), self.theta)
        k = rope(self.wk(x).view(B, T, -1, self.head_dim), self.theta)
        v = self.wv(x).view(B, T, -1, self.head_dim)
        k, v = k.repeat_interleave(self.group, dim=2), v.repeat_interleave(self.group, dim=2)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    def __init__(self, dim, ffn_dim, dtype):
        super().__init__()
        self.w_gate = nn.Linear(dim, ffn_dim, bias=False, dtype=dtype)
        self.w_up = nn.Linear(dim, ffn_dim, bias=False, dtype=dtype)
        self.w_down = nn.Linear(ffn_dim, dim, bias=False, dtype=dtype)

    def forward(self, x):
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class ModularBlock(nn.Module):
    def __init__(self, cfg, dtype):
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps, dtype=dtype)
        self.attention = Attention(cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.rope_theta, dtype)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps, dtype=dtype)
        self.ffn = FeedForward(cfg.dim, cfg.ffn_dim, dtype)

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.ffn(self.ffn_norm(h))

    def load(self, weights):
        """Copy a BlockWeights-like object's tensors (module 06's names) into this block."""
        places = {"ln1": self.attention_norm.weight, "ln2": self.ffn_norm.weight,
                  **{name: getattr(self.attention, name).weight for name in ("wq", "wk", "wv", "wo")},
                  **{name: getattr(self.ffn, name).weight for name in ("w_gate", "w_up", "w_down")}}
        with torch.no_grad():
            for name, param in places.items():
                param.copy_(getattr(weights, name))
        return self


class ModularLlama(nn.Module):
    """ReferenceLlama's model as a tree of submodules; forward returns the logits (B, T, vocab)."""

    def __init__(self, cfg, dtype=torch.float64):
        super().__init__()
        self.embedding = nn.Embedding(cfg.vocab_size, cfg.dim, dtype=dtype)
        self.blocks = nn.ModuleList(ModularBlock(cfg, dtype) for _ in range(cfg.n_layers))
        self.final_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps, dtype=dtype)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False, dtype=dtype)

    def forward(self, tokens):
        x = self.embedding(tokens)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.final_norm(x))

    def load(self, model):
        """Copy the weights of module 06's LlamaModel `model` (same names) into this one."""
        with torch.no_grad():
            self.embedding.weight.copy_(model.embedding)
            self.final_norm.weight.copy_(model.final_norm)
            self.lm_head.weight.copy_(model.lm_head)
        for block, weights in zip(self.blocks, model.blocks, strict=True):
            block.load(weights)
        return self
