# Generated from solutions/m16_moe_layer.py by `python -m course.skeleton`: fill in the TODOs.
# Grade your work with `python main.py grade 16`. (skeleton 778ce3aab080)
"""Module 16, part 4 - the mixture-of-experts layer, and module 06's block with it in place of the SwiGLU.

    n (N, M) -> route -> plan (capacity, expert-major slots) -> rows = n[tokens]
      -> send_to_experts (counts all-to-all, rows all-to-all, regroup) -> each local expert's SwiGLU on its rows
      -> return_from_experts (inverse regroup, all-to-all home) -> combine: y = h + Σ_i w_i expert_i(n)
      (+ the shared expert, weight 1, on every token; + the auxiliary loss on the scores)

The backward (`MoELayer.backward`, yours) runs the chain in reverse, through every piece above,
each exchange of rows included: the forward's saved values are in the store.

The experts are module 06's SwiGLU, E/e of them on each member of the expert group, each on its own
rows (a loop of GEMMs here; a grouped GEMM in production). Expert j's weights: gate (F, M), up (F,
M), down (M, F), stacked along a leading expert axis.

`MoEBlock` is module 06's block with the dense FFN replaced: it runs module 06's own `LlamaBlock`
with an FFN of one unit whose weights are all zero (its output is exactly 0, and so is every
gradient through it), so module 06 computes the attention half, h = x + attention, and n2 =
RMSNorm(h) with ln2 (saved as 'n2'); the MoE layer reads n2 and returns y = h + MoE(n2). In the
backward, the MoE's gradient of n2 goes back through that norm here (module 06's zero FFN adds
none), and module 06's backward takes the sum from h on: its attention half, ln1, and x.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from course.mesh import Group
from .m06_llama_block import ActivationStore, BlockWeights, LlamaBlock, LlamaConfig
from .m06_llama_ops import rmsnorm_backward, swiglu_backward, swiglu_forward
from .m16_dispatch import combine, combine_backward, plan_dispatch
from .m16_expert_parallel import local_experts, plan_exchange, return_from_experts, send_to_experts
from .m16_router import MoEConfig, check_expert_split, route, route_backward, sequence_aux_loss


@dataclass
class ExpertWeights:
    """Some experts' SwiGLU weights, a leading expert axis on each. Also used for their gradients."""
    gate: torch.Tensor   # (experts, F, M)
    up: torch.Tensor     # (experts, F, M)
    down: torch.Tensor   # (experts, M, F)

    def tensors(self) -> list[torch.Tensor]:
        return [self.gate, self.up, self.down]

    def slice(self, experts: range) -> "ExpertWeights":
        return ExpertWeights(*(t[experts.start:experts.stop].clone() for t in self.tensors()))


@dataclass
class MoEWeights:
    """One MoE layer's weights on one rank: the router and the bias (every rank, the same), its local
    experts, the shared expert if any. Also used for the gradients (bias None: it has none)."""
    router: torch.Tensor                 # W_r (E, M)
    bias: torch.Tensor | None            # ρ (E,): selection only, updated by update_biases, not by the optimizer
    experts: ExpertWeights               # this rank's E/e experts
    shared: ExpertWeights | None = None  # one expert every token goes through, or None

    def dense_tensors(self) -> list[torch.Tensor]:
        """What every rank holds the same copy of: the router and the shared expert."""
        return [self.router, *(self.shared.tensors() if self.shared is not None else [])]


def init_moe_weights(moe: MoEConfig, dim: int, generator: torch.Generator, experts: range,
                     dtype=torch.float32) -> MoEWeights:
    """Every expert drawn in turn from the generator (so all ranks draw the same ones and each keeps
    `experts`), from N(0, 1/in_features) like module 06's linears: every expert differs."""
    def linear(*shape):
        return (torch.randn(*shape, generator=generator, dtype=torch.float64) / shape[-1] ** 0.5).to(dtype)
    E, F = moe.n_experts, moe.expert_dim
    router = linear(E, dim)
    every = ExpertWeights(linear(E, F, dim), linear(E, F, dim), linear(E, dim, F))
    shared = ExpertWeights(linear(1, F, dim), linear(1, F, dim), linear(1, dim, F)) if moe.shared_expert else None
    return MoEWeights(router, torch.zeros(E, dtype=dtype), every.slice(experts), shared)


def experts_forward(rows: torch.Tensor, counts: list[int], w: ExpertWeights):
    """Each expert's SwiGLU on its own block of rows (counts[j] rows for expert j, in order), given.
    Returns (out, saved): out (R, M); saved, what experts_backward reads."""
    outputs, saved = [], []
    for j, block in enumerate(rows.split(counts)):
        g, u = block @ w.gate[j].t(), block @ w.up[j].t()
        s = swiglu_forward(g, u)
        outputs.append(s @ w.down[j].t())
        saved.append((block, g, u, s))
    return torch.cat(outputs), saved


def experts_backward(d_out: torch.Tensor, saved, w: ExpertWeights):
    """(d_rows, grads) for experts_forward, given: grads an ExpertWeights of the experts' gradients."""
    d_rows, grads = [], ExpertWeights(*(torch.zeros_like(t) for t in w.tensors()))
    for j, ((block, g, u, s), d_block) in enumerate(zip(saved, d_out.split([len(b) for b, *_ in saved]),
                                                        strict=True)):
        ds, grads.down[j] = d_block @ w.down[j], d_block.t() @ s
        dg, du = swiglu_backward(ds, g, u)
        grads.gate[j], grads.up[j] = dg.t() @ block, du.t() @ block
        d_rows.append(dg @ w.gate[j] + du @ w.up[j])
    return torch.cat(d_rows), grads


@dataclass
class RoutingRecord:
    """What one forward of a layer routed, for the statistics (loads, drops, bytes) of a step."""
    loads: torch.Tensor      # (E,): slots the router sent each expert, before the capacity
    dropped: int             # slots the capacity dropped
    aux: float               # Σ over this forward's sequences of L_seq (0 without the auxiliary loss)
    sent: torch.Tensor       # (E,): rows this rank sent each expert (after the capacity)
    received: torch.Tensor   # (e, E/e): rows each member sent this rank's experts


class MoELayer:
    """The MoE feed-forward on one member of an expert group: forward and backward over a store."""

    def __init__(self, moe: MoEConfig, experts: Group):
        check_expert_split(moe, experts.size)
        self.moe, self.group = moe, experts
        self.local = local_experts(moe.n_experts, experts)
        self.aux_weight = 1.0      # the weight of one sequence's L_seq in the loss (the model sets 1 / B)
        self.records: list[RoutingRecord] = []   # one per forward, in call order (the model reads and clears)

    def forward(self, w: MoEWeights, h: torch.Tensor, n: torch.Tensor, store: ActivationStore) -> torch.Tensor:
        """y = h + MoE(n) for h, n (B, T, M): h the residual stream, n its normed copy (the layer's input)."""
        moe, group, shape = self.moe, self.group, h.shape
        h, n = h.reshape(-1, shape[-1]), n.reshape(-1, shape[-1])
        routing = route(n, w.router, w.bias if moe.balance == "bias" else None, moe)
        plan = plan_dispatch(routing.experts, moe.n_experts, moe.capacity(len(n)))
        exchange = plan_exchange(plan.counts, group)
        arrived = send_to_experts(n[plan.tokens], exchange, group, "dispatch")
        out, expert_acts = experts_forward(arrived, exchange.expert_counts.tolist(), w.experts)
        back = return_from_experts(out, exchange, group, "combine")
        y = combine(h, back, plan, routing.weights)
        if w.shared is not None:
            shared_out, shared_acts = experts_forward(n, [len(n)], w.shared)
            y = y + shared_out
            store.save("moe_shared", shared_acts)
        aux = 0.0
        if moe.balance == "aux":
            losses, d_scores = sequence_aux_loss(routing.scores, routing.experts, shape[1], moe)
            store.save("moe_d_scores", self.aux_weight * d_scores)
            aux = losses.sum().item()
        for name, value in (("moe_n", n), ("moe_routing", routing), ("moe_plan", plan), ("moe_exchange", exchange),
                            ("moe_experts", expert_acts), ("moe_back", back)):
            store.save(name, value)
        self.records.append(RoutingRecord(torch.bincount(routing.experts.reshape(-1), minlength=moe.n_experts),
                                          int((~plan.kept).sum()), aux, plan.counts, exchange.received))
        return y.view(shape)

    def backward(self, w: MoEWeights, dy: torch.Tensor, store: ActivationStore):
        """(dn, grads) for forward, given dy = dL/dy (B, T, M): dn the gradient of n (dL/dh is dy itself,
        through the residual), grads a MoEWeights of the gradients (bias None)."""
        group, shape = self.group, dy.shape
        dy = dy.reshape(-1, shape[-1])
        n, routing, plan, exchange = store["moe_n"], store["moe_routing"], store["moe_plan"], store["moe_exchange"]
        # TODO(m16): the MoE layer's backward: every gradient of the layer, through every piece of its forward
        # Contract: return (dn, grads): dn of dy's `shape` (B, T, M), the gradient of the layer's input n from every path
        #   (the routed experts' rows, the shared expert, the router); grads = MoEWeights(router=dW_r, bias=None,
        #   experts=the local experts' gradients, shared=the shared expert's or None). The exchange that carries the
        #   combine's gradient is labelled "combine backward", the one that carries the experts' input gradient "dispatch
        #   backward". The tests compare dn and every gradient with autograd on one rank and with the single-process layer
        #   on 2 and 4.
        # Maths: the forward (above) is a chain of given pieces and yours; its saved values are in the store: 'moe_n',
        #   'moe_routing', 'moe_plan', 'moe_exchange', 'moe_experts' (experts_forward's saved), 'moe_back' (the rows back
        #   from the experts), 'moe_shared' (with a shared expert) and 'moe_d_scores' (with the auxiliary loss: its
        #   gradient of σ, already weighted).
        # Question: which of your two row exchanges carries each gradient, and which way?
        # Pitfalls: what does a token chosen by k experts receive from its k rows? Which paths besides the routed experts
        #   reach n? Does every member run both exchanges when it has nothing to send?
        raise NotImplementedError("TODO(m16): the MoE layer's backward: every gradient of the layer, through every piece of its forward")


@dataclass
class MoEBlockWeights:
    """One MoE block's weights on one rank: module 06's BlockWeights with a zero FFN (zero_ffn: the
    attention half and both norms count), and the MoE layer's. Also used for the gradients."""
    dense: BlockWeights
    moe: MoEWeights


def zero_ffn(w: BlockWeights) -> BlockWeights:
    """Module 06's block weights with the dense FFN replaced by one unit of zero weights: it adds
    exactly 0 to the residual stream, and its weights get exactly 0 as their gradients."""
    dim = w.ln2.shape[0]
    zeros = {"w_gate": w.w_gate.new_zeros(1, dim), "w_up": w.w_up.new_zeros(1, dim),
             "w_down": w.w_down.new_zeros(dim, 1)}
    return BlockWeights(**{f.name: zeros.get(f.name, getattr(w, f.name)) for f in fields(w)})


class MoEBlock(LlamaBlock):
    """Module 06's block with the MoE layer in place of its SwiGLU (see the module docstring)."""

    def __init__(self, cfg: LlamaConfig, moe: MoEConfig, experts: Group):
        super().__init__(cfg)
        self.moe_layer = MoELayer(moe, experts)

    def forward(self, w: MoEBlockWeights, x: torch.Tensor, store: ActivationStore) -> torch.Tensor:
        h = super().forward(w.dense, x, store)   # the zero FFN adds exactly 0: this is h = x + attention
        return self.moe_layer.forward(w.moe, h, store["n2"], store)

    def backward(self, w: MoEBlockWeights, dy: torch.Tensor, store: ActivationStore):
        dn2, moe_grads = self.moe_layer.backward(w.moe, dy, store)
        dh_norm, d_ln2 = rmsnorm_backward(dn2, store["h"], store["r2"], w.dense.ln2)
        # Module 06's backward from h on: its zero FFN passes dy + dh_norm through unchanged.
        dx, dense_grads = super().backward(w.dense, dy + dh_norm, store)
        dense_grads.ln2 = dense_grads.ln2 + d_ln2   # module 06's own share is exactly 0
        return dx, MoEBlockWeights(dense_grads, moe_grads)
