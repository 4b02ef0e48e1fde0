"""Module 10 - recompute: keep fewer activations in the forward, recompute them in the backward.

The activation store of module 06 keeps, for every layer, everything the block's backward reads:
about a dozen tensors of (B, T, dim) or (B, T, ffn_dim) each. Across all layers this is often the
largest item in GPU memory. A recompute option names the activations a store does *not* keep;
`RecomputeBlock.backward` first rebuilds them from those it kept, by running the same forward ops
again, then runs the unchanged backward of module 06. The ops are the same and run in the same
order, so the gradients are the same bit for bit; the price is the extra forward work.

The options follow those of llm.q, a CUDA/C++ LLM trainer (DROPPED below):

    none       keep everything
    swiglu     drop s = silu(g) u
    norms      drop the RMSNorm outputs n1, n2, r1, r2
    ffn        drop n2, r2, g, u, s
    attention  drop n1, r1, q, k, v, o, lse
    block      keep only the block input x

With module 09's FP8Matmul the linear inputs n1, n2 and s are kept as e4m3 with their abs-maxes.
The abs-maxes (4 bytes each) are kept whatever the option, so the recompute quantizes with the
forward's scales and skips the abs-max pass (an exact recompute would find the same ones).
"""
import torch

from .m06_llama_block import ActivationStore, BlockWeights, LlamaBlock, LlamaConfig
from .m06_llama_model import LlamaModel
from .m06_llama_ops import compute_dtype, linear_forward, rmsnorm_forward, swiglu_forward
from .m09_fp8_matmul import abs_max_name

ACTIVATIONS = frozenset({"x", "n1", "r1", "q", "k", "v", "o", "lse", "h", "n2", "r2", "g", "u", "s"})
DROPPED = {
    "none": frozenset(),
    "swiglu": frozenset({"s"}),
    "norms": frozenset({"n1", "r1", "n2", "r2"}),
    "ffn": frozenset({"n2", "r2", "g", "u", "s"}),
    "attention": frozenset({"n1", "r1", "q", "k", "v", "o", "lse"}),
    "block": ACTIVATIONS - {"x"},
}
OPTIONS = tuple(DROPPED)
LINEAR_INPUTS = ("n1", "n2", "s")  # what the block hands to matmul.prepare
ABS_MAXES = frozenset(abs_max_name(name) for name in LINEAR_INPUTS)  # saved by FP8Matmul only; always kept


def check_option(option: str):
    if option not in DROPPED:
        raise ValueError(f"unknown recompute option {option!r}; choose one of {', '.join(OPTIONS)}")


def activation_bytes(cfg: LlamaConfig, batch: int, seq_len: int, dtype: torch.dtype) -> dict[str, int]:
    """Bytes of each activation one block saves, by name, for a (batch, seq_len) input of `dtype`.

    The per-token statistics r1, r2 and lse are kept in compute_dtype(dtype) (float32 for bf16).
    """
    act = torch.tensor([], dtype=dtype).element_size()
    stat = torch.tensor([], dtype=compute_dtype(dtype)).element_size()
    tokens = batch * seq_len
    # >>> TODO(m10): the bytes of every activation one block saves, by name
    # Contract: return a dict with one entry per name in ACTIVATIONS: the bytes that activation takes for `tokens`
    #   tokens (batch * seq_len), `act` bytes a value for the activations and `stat` bytes a value for the per-token
    #   statistics (compute_dtype: float32 for bf16 activations). The tests compare every entry, name by name, with
    #   the bytes module 06's block really saves, in float32 and in bf16 (where act != stat).
    # Question: for each saved tensor, how many values does one token have, and of which kind?
    # Pitfalls: which widths are the query heads', which the key/value heads', which the residual stream's? Is
    #   attention's output saved before or after the o projection? How many log-sum-exps does one token have?
    #   (A swap of two sizes leaves every total right and fails the by-name check.)
    # Hint 1: the chapter's "Counting what a block keeps" counts a GELU MLP block's: read module 06's attention_half
    #         and ffn_half the same way, shape by shape.
    # Hint 2: per token: x, n1, h, n2: M values; q, o: H D; k, v: K D; g, u, s: F; r1, r2: one statistic; lse: H
    #         statistics. Bytes = tokens · values · (act, or stat for r1, r2, lse).
    # Hint 3: dim, q, kv, ffn = cfg.dim, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.ffn_dim
    #         per_token = dict(x=dim * act, n1=dim * act, r1=stat, q=q * act, k=kv * act, ..., lse=cfg.n_heads * stat,
    #                          ..., g=ffn * act, u=ffn * act, s=ffn * act)
    #         return {name: tokens * size for name, size in per_token.items()}
    dim, q, kv, ffn = cfg.dim, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.ffn_dim
    per_token = {"x": dim * act, "n1": dim * act, "r1": stat, "q": q * act, "k": kv * act, "v": kv * act,
                 "o": q * act, "lse": cfg.n_heads * stat, "h": dim * act, "n2": dim * act, "r2": stat,
                 "g": ffn * act, "u": ffn * act, "s": ffn * act}
    return {name: tokens * size for name, size in per_token.items()}
    # <<<


def kept_bytes(cfg: LlamaConfig, batch: int, seq_len: int, dtype: torch.dtype, option: str,
               fp8: bool = False) -> int:
    """Activation bytes one layer's store keeps with this recompute option (the formula).

    fp8: the block runs FP8Matmul(min_dim=0) (module 09): n1, n2 and s are kept as e4m3, one byte
    a value plus a float32 scale, and the three float32 abs-maxes are kept always.
    """
    check_option(option)
    sizes = activation_bytes(cfg, batch, seq_len, dtype)
    if fp8:
        width = {"n1": cfg.dim, "n2": cfg.dim, "s": cfg.ffn_dim}
        sizes.update({name: batch * seq_len * width[name] + 4 for name in LINEAR_INPUTS})
    always = 4 * len(ABS_MAXES) if fp8 else 0
    return always + sum(size for name, size in sizes.items() if name not in DROPPED[option])


class RecomputeBlock(LlamaBlock):
    """A LlamaBlock whose stores drop the activations of a recompute option, and whose backward
    recomputes them first."""

    def __init__(self, cfg: LlamaConfig, option: str = "none", **block_args):
        check_option(option)
        super().__init__(cfg, **block_args)
        self.option = option

    def new_store(self) -> ActivationStore:
        # What the option does not drop, and module 09's abs-maxes whatever the option (4 bytes each), so that a
        # recompute with FP8 linears quantizes with the forward's own.
        return ActivationStore(keep=(ACTIVATIONS - DROPPED[self.option]) | ABS_MAXES)

    def recompute(self, w: BlockWeights, store: ActivationStore):
        """Put back into `store` every activation the forward dropped, computed from what it kept
        by the forward's own ops in the forward's order (so the values are identical)."""
        missing = ACTIVATIONS - set(store.tensors)
        if not missing:
            return
        cfg, mm = self.cfg, self.matmul
        # Keeps everything; starts with what the store kept, so the recompute reads kept tensors and
        # kept abs-maxes from it (FP8Matmul.prepare then quantizes with the forward's abs-max).
        fresh = ActivationStore()
        fresh.tensors.update(store.tensors)
        # >>> TODO(m10): rebuild the dropped activations into `fresh`, earliest first, rerunning the least
        # Contract: `missing` (not empty) names what the forward dropped; `fresh` starts with everything the store
        #   kept, abs-maxes included. Afterwards every missing activation is in fresh, equal to the forward's bit for
        #   bit (the given lines after this block copy them into the store; the tests compare with torch.equal, with
        #   and without FP8 linears, and the gradients of every option with no recompute's), made by the forward's
        #   own ops (module 06's block and ops, linear inputs through the policy's prepare into fresh, as the forward
        #   hands them) from what was kept or already rebuilt. And no more forward work than that: the tests count the
        #   linears each option reruns (none, swiglu, norms 0; ffn 2; attention 3; block 6) and the norms (none,
        #   swiglu 0; ffn, attention 1; norms, block 2).
        # Question: for each missing name, what is the least forward work that rebuilds it from what is there, and in
        #   which order must the pieces run?
        # Pitfalls: which missing names can only one of the block's halves make, and which are one op away from what
        #   was kept? If a half has already rebuilt a name, is it rebuilt again? Is a dropped input read from `store`,
        #   which no longer has it, or from `fresh`?
        # Hint 1: the chapter's "Rebuilding the fewest" works the choice out on a GELU MLP block: which tensors of
        #         module 06's block does only attention_half make, and which only ffn_half?
        # Hint 2: only attention_half makes q, k, v, o and lse (and n1, r1 with them); only ffn_half makes h (and n2,
        #         r2, g, u, s with it). Otherwise: n1, r1 = RMSNorm(x; ln1); n2, r2 = RMSNorm(h; ln2); g, u = n2's two
        #         linears; s = SwiGLU(g, u); each only if missing, in the forward's order.
        # Hint 3: x = store["x"]
        #         if missing & {"q", "k", "v", "o", "lse"}: self.attention_half(w, x, fresh)
        #         elif missing & {"n1", "r1"}: n1, r1 = rmsnorm_forward(x, w.ln1, eps); mm.prepare(n1, fresh, "n1");
        #                                      fresh.save("r1", r1)
        #         if "h" in missing: self.ffn_half(w, x, fresh["o"], fresh)
        #         else: n2, r2 from fresh["h"] if missing (prepare n2 into fresh); g, u from fresh["n2"] if missing;
        #               s = swiglu of fresh's g and u, prepared into fresh, if missing
        x = store["x"]
        if missing & {"q", "k", "v", "o", "lse"}:
            self.attention_half(w, x, fresh)
        elif missing & {"n1", "r1"}:
            n1, r1 = rmsnorm_forward(x, w.ln1, cfg.norm_eps)
            mm.prepare(n1, fresh, "n1")
            fresh.save("r1", r1)
        if "h" in missing:
            self.ffn_half(w, x, fresh["o"], fresh)
        else:
            if missing & {"n2", "r2"}:
                n2, r2 = rmsnorm_forward(fresh["h"], w.ln2, cfg.norm_eps)
                mm.prepare(n2, fresh, "n2")
                fresh.save("r2", r2)
            if missing & {"g", "u"}:
                fresh.save("g", linear_forward(fresh["n2"], w.w_gate, mm))
                fresh.save("u", linear_forward(fresh["n2"], w.w_up, mm))
            if "s" in missing:
                mm.prepare(swiglu_forward(fresh["g"], fresh["u"]), fresh, "s")
        # <<<
        for name in missing:
            store.restore(name, fresh[name])

    def backward(self, w: BlockWeights, dy: torch.Tensor, store: ActivationStore):
        self.recompute(w, store)
        return super().backward(w, dy, store)


def measure_store_bytes(model: LlamaModel, tokens: torch.Tensor) -> int:
    """Bytes held by the first layer's store after a forward (what the formula predicts)."""
    stores = [model.block.new_store() for _ in range(model.cfg.n_layers)]
    model.forward_blocks(model.embedding[tokens], stores)
    return stores[0].nbytes()

