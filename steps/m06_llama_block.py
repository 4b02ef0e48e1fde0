# Generated from solutions/m06_llama_block.py by `python -m course.skeleton`: fill in the TODOs.
# Grade your work with `python main.py grade 06`. (skeleton 9ef19667d124)
"""Module 06, part 2 - the transformer block: a forward sequence and its backward in reverse.

    x -> RMSNorm(ln1) -> q, k, v projections -> RoPE(q, k) -> causal GQA attention -> o projection
      -> h = x + attention out, RMSNorm(ln2) -> gate, up projections -> SwiGLU -> down projection
      -> y = h + FFN out

`LlamaBlock.forward(w, x, store)` runs the ops of m06_llama_ops in that order and saves what their
backwards need in `store`; `LlamaBlock.backward(w, dy, store)` runs the backwards in reverse and
returns (dx, grads). The block holds no weights: they are passed in, so a weight source can
gather them just in time (modules 07, 08). Its linears all go through `self.matmul` (module 09),
and the store decides what is kept (module 10).
"""
from dataclasses import dataclass, fields

import torch

from .m06_llama_ops import (ATTENTION_CHUNK, ChunkedAttention, Matmul, linear_backward,
                            linear_forward, residual_rmsnorm_backward, residual_rmsnorm_forward,
                            rmsnorm_backward, rmsnorm_forward, rope_backward, rope_forward, rope_tables,
                            swiglu_backward, swiglu_forward)


@dataclass(frozen=True)
class LlamaConfig:
    dim: int = 64            # width of the residual stream
    n_heads: int = 4         # query heads
    n_kv_heads: int = 2      # key/value heads (grouped-query attention: n_heads is a multiple)
    head_dim: int = 16       # n_heads * head_dim == dim
    ffn_dim: int = 176       # hidden width of the SwiGLU feed-forward
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    vocab_size: int = 256    # bytes
    n_layers: int = 2
    max_seq_len: int = 64

    def __post_init__(self):
        for name in ("dim", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "vocab_size", "n_layers", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"LlamaConfig.{name} must be a positive integer, got {getattr(self, name)}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}: "
                             "each key/value head must serve the same number of query heads")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even: RoPE rotates pairs of dimensions")
        if self.n_heads * self.head_dim != self.dim:
            raise ValueError(f"n_heads * head_dim = {self.n_heads} * {self.head_dim} = "
                             f"{self.n_heads * self.head_dim} must equal dim={self.dim}")
        if self.rope_theta <= 0 or self.norm_eps <= 0:
            raise ValueError(f"rope_theta and norm_eps must be positive, got {self.rope_theta} and {self.norm_eps}")

    def check_seq_len(self, seq_len: int):
        if not 1 <= seq_len <= self.max_seq_len:
            raise ValueError(f"sequence length {seq_len} is outside 1..max_seq_len={self.max_seq_len}")


@dataclass
class BlockWeights:
    """One block's weights (linears are (out, in) like nn.Linear). Also used for their gradients."""
    ln1: torch.Tensor     # (dim,)
    wq: torch.Tensor      # (n_heads * head_dim, dim)
    wk: torch.Tensor      # (n_kv_heads * head_dim, dim)
    wv: torch.Tensor      # (n_kv_heads * head_dim, dim)
    wo: torch.Tensor      # (dim, n_heads * head_dim)
    ln2: torch.Tensor     # (dim,)
    w_gate: torch.Tensor  # (ffn_dim, dim)
    w_up: torch.Tensor    # (ffn_dim, dim)
    w_down: torch.Tensor  # (dim, ffn_dim)

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, f.name) for f in fields(self)]


def init_block_weights(cfg: LlamaConfig, generator: torch.Generator, dtype=torch.float32) -> BlockWeights:
    """Norm weights at 1, linears drawn from N(0, 1/in_features) so activations keep their scale."""
    def linear(out_features, in_features):
        return (torch.randn(out_features, in_features, generator=generator, dtype=torch.float64)
                / in_features ** 0.5).to(dtype)
    kv = cfg.n_kv_heads * cfg.head_dim
    return BlockWeights(ln1=torch.ones(cfg.dim, dtype=dtype), wq=linear(cfg.dim, cfg.dim), wk=linear(kv, cfg.dim),
                        wv=linear(kv, cfg.dim), wo=linear(cfg.dim, cfg.dim), ln2=torch.ones(cfg.dim, dtype=dtype),
                        w_gate=linear(cfg.ffn_dim, cfg.dim), w_up=linear(cfg.ffn_dim, cfg.dim),
                        w_down=linear(cfg.dim, cfg.ffn_dim))


class ActivationStore:
    """The activations one block saves in its forward for its backward, by name. A value is a
    tensor, or a tuple of tensors (module 09 keeps an FP8 tensor with its scale).

    `keep` is the set of names to keep (None: all of them). A name that is not kept is dropped at
    once, so its memory is freed when the forward moves on; module 10's backward recomputes it and
    puts it back with `restore` before the normal backward reads it.
    """

    def __init__(self, keep: frozenset | None = None):
        self.keep, self.tensors = keep, {}

    def save(self, name: str, tensor: torch.Tensor):
        if self.keep is None or name in self.keep:
            self.tensors[name] = tensor

    def restore(self, name: str, tensor: torch.Tensor):
        self.tensors[name] = tensor

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise KeyError(f"activation {name!r} was not kept by this store; recompute it before the backward")
        return self.tensors[name]

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def clear(self):
        self.tensors.clear()

    def nbytes(self) -> int:
        """Bytes of memory the store holds alive: each distinct storage once, whole (a small view
        of a big tensor keeps all of it alive)."""
        tensors = [t for value in self.tensors.values() for t in (value if isinstance(value, tuple) else (value,))]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        return sum(storages.values())


class LlamaBlock:
    """The block's computation, without its weights: forward and backward over an activation store."""

    def __init__(self, cfg: LlamaConfig, matmul: Matmul | None = None, attention_chunk: int = ATTENTION_CHUNK,
                 attention=None):
        self.cfg, self.matmul = cfg, matmul or Matmul()
        self.attention = attention or ChunkedAttention(attention_chunk)  # forward / backward pair
        self._rope = {}

    def new_store(self) -> ActivationStore:
        """An empty store for one layer's activations (module 10 overrides what it keeps)."""
        return ActivationStore()

    def rope(self, seq_len: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin tables for this sequence length, built once per dtype and device."""
        key = (seq_len, dtype, str(device))
        if key not in self._rope:
            self._rope[key] = rope_tables(seq_len, self.cfg.head_dim, self.cfg.rope_theta, dtype, device)
        return self._rope[key]

    def attention_half(self, w: BlockWeights, x: torch.Tensor, store: ActivationStore) -> torch.Tensor:
        """x -> attention output (B, T, heads * head_dim), before the o projection."""
        cfg, mm = self.cfg, self.matmul
        B, T, _ = x.shape
        cos, sin = self.rope(T, x.dtype, x.device)
        # TODO(m06): forward of the attention half: norm, q/k/v projections, RoPE, attention
        # Hint: n1 = mm.prepare(norm output, store, 'n1') once: q, k and v multiply that (it saves 'n1').
        # Hint: save 'x', 'r1', 'q', 'k' (after RoPE), 'v', 'o' and 'lse' in the store; with 'n1' those
        #       are exactly what the backwards need. q is (B, T, n_heads, head_dim), k and v use n_kv_heads.
        # Hint: attention itself is o, lse = self.attention.forward(q, k, v) (your attention_forward).
        raise NotImplementedError('TODO(m06): forward of the attention half: norm, q/k/v projections, RoPE, attention')

    def ffn_half(self, w: BlockWeights, x: torch.Tensor, o: torch.Tensor, store: ActivationStore):
        """(block input x, attention output o) -> (h, s): the residual stream after attention and
        the SwiGLU output (prepared for the down projection). o is not prepared: attention's backward
        needs it as it is, so the o projection takes o itself (an FP8 policy converts it when it multiplies)."""
        cfg, mm = self.cfg, self.matmul
        # TODO(m06): forward of the FFN half up to SwiGLU: o projection, residual + norm, gate/up, SwiGLU
        # Hint: prepare the inputs of gate/up ('n2') and of down ('s') with mm.prepare; save 'h', 'r2', 'g', 'u'.
        raise NotImplementedError('TODO(m06): forward of the FFN half up to SwiGLU: o projection, residual + norm, gate/up, SwiGLU')

    def forward(self, w: BlockWeights, x: torch.Tensor, store: ActivationStore) -> torch.Tensor:
        """y = block(x) for x of shape (B, T, dim); fills `store` for the backward."""
        o = self.attention_half(w, x, store)
        h, s = self.ffn_half(w, x, o, store)
        # The last residual add saves nothing: its backward passes dy through to both sides.
        return h + linear_forward(s, w.w_down, self.matmul)

    def backward(self, w: BlockWeights, dy: torch.Tensor, store: ActivationStore):
        """(dx, grads) given dy = dL/dy, from what the forward saved; grads is a BlockWeights."""
        mm = self.matmul
        B, T, _ = dy.shape
        cos, sin = self.rope(T, dy.dtype, dy.device)
        # TODO(m06): backward of the FFN half: down, SwiGLU, gate and up, then the residual + norm
        # Hint: y = h + down(s), so dy reaches both h and the down projection. Undo the FFN's ops in
        #       reverse order; gate and up both read n2, so their two dn2 add up. residual_rmsnorm_backward
        #       then sums h's two gradients (dy along the residual, dn2 through the norm) into dh.
        # Hint: name the results dh, d_down, d_gate, d_up and d_ln2: the attention half's TODO uses them.
        raise NotImplementedError('TODO(m06): backward of the FFN half: down, SwiGLU, gate and up, then the residual + norm')
        # TODO(m06): backward of the attention half: o projection, attention, RoPE, q/k/v, norm
        # Hint: h = x + o W_o^T, so dh reaches x directly and through the attention half: undo its ops in
        #       reverse (self.attention.backward for attention, RoPE's backward where the forward rotated).
        #       q, k and v all read n1, so their three dn1 add up before the norm's backward.
        # Hint: attention's gradients come back with a head axis, (B, T, heads, D), maybe not contiguous;
        #       the projections made (B, T, heads * D) (k and v: kv_heads): reshape them (not view) before
        #       the projections' backward.
        # Hint: return (dx, grads): dx sums both paths to x; grads is a BlockWeights of all nine gradients.
        raise NotImplementedError('TODO(m06): backward of the attention half: o projection, attention, RoPE, q/k/v, norm')
