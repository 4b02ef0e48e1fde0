"""Module 17, part 3 - the composed trainer: this rank's stages, module 11's executor, one step.

    ComposedLlama(cfg, mesh, n_microbatches, schedule="1f1b")   this rank's stages of the schedule's
                                                                placement (m17_stage), its StageComms

Switches: n_microbatches is module 10's gradient accumulation (m microbatches a step, one update);
recompute=True is module 10's "block" recompute (each block keeps its input only and runs its forward
again in the backward); fp8=True runs every block's seven linears through module 09's FP8Matmul, on
each rank's tensor-parallel slices (module 12's policy seam): the LM head, the norms and attention
stay in high precision, as in module 09's block.

One optimizer step on the global batch (every rank draws the same B sequences from the seed, as in
module 06's `fit`, which trains this model as it trains every Llama of the course):

  1. the step's divisor, given to every stage: every piece of the loss (a microbatch, of a rank's B/d
     rows, of its T/c positions) is divided by it (what it is: train_step's question)
  2. this rank's B/d rows go to module 11's run_schedule: the stages' forwards and backwards, in the
     schedule's order, the microbatches' gradients adding up in the stages' whole buffers
  3. every gradient summed over the ranks that hold the same weight and saw other tokens of it: the
     blocks' and the outer weights' by the stages' reduce-scatters (once per step, m17_stage), the
     rest by one all-reduce per group (which weights over which group: finish_gradients' question)
  4. AdamW on this rank's shards and copies (elementwise: the single process's update, sliced)
  5. the step's loss: the last stage's shares, summed over d and c, reported on every rank

Float64, every rank sums the same terms as one process in another order: the losses and the final
weights equal module 06's single-process training within 1e-10 (tests/test_17_trainer.py states
the measured gaps).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from course.mesh import Group, Mesh
from course.validate import validate
from .m06_llama_block import LlamaConfig
from .m06_llama_model import LlamaModel, real_tokens
from .m06_llama_ops import ATTENTION_CHUNK
from .m09_fp8_matmul import FP8Matmul
from .m11_actions import Action, Schedule
from .m11_executor import StageComms, run_schedule
from .m11_generators import make_schedule, stages_per_rank_of
from .m17_composition import check_composition, compose_groups
from .m17_stage import EvalMode, LlamaStage

# The smallest linear FP8Matmul quantizes with --fp8: every one of the tiny model's (its sizes are multiples of
# 16, check_fp8). Module 09's default, 16384, is where FP8 starts to pay on an H100 or H200 (docs/09); here FP8
# is about the numbers.
FP8_MIN_DIM = 16


def initial_model(cfg: LlamaConfig, seed: int = 0, dtype=torch.float32, moe=None):
    """The single-process model every rank takes its pieces from (given): module 06's Llama, or with
    `moe` module 16's MoE Llama (on one process: every expert), both drawn from the seed."""
    if moe is None:
        return LlamaModel(cfg, seed, dtype)
    from .m16_moe_model import MoELlama, one_rank_mesh
    return MoELlama(cfg, moe, one_rank_mesh(), seed, dtype)


def sum_over(group: Group, parts: list, label: str):
    """Sum tensors (or some of their elements) over `group`, in place, in one all-reduce (given).
    Each part is a tensor, or (tensor, index): its elements at `index` (a 1-D tensor of positions)."""
    parts = [part if isinstance(part, tuple) else (part, None) for part in parts]
    if not parts:
        return
    pieces = [(t if index is None else t[index]).reshape(-1) for t, index in parts]
    flat = torch.cat(pieces)
    group.collectives.all_reduce(flat, label=label)
    for (t, index), summed in zip(parts, flat.split([p.numel() for p in pieces]), strict=True):
        if index is None:
            t.copy_(summed.view_as(t))
        else:
            t[index] = summed


def step_loss(loss, groups) -> float:
    """The step's loss on every rank (given): the last stage's shares, which each (d, c) rank holds
    for its tokens (the same on its t ranks), summed over the world with one uncounted all-reduce:
    reporting, not training traffic."""
    mine = loss.item() if loss is not None and groups.tp.index == 0 else 0.0
    total = torch.tensor([mine], dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(total)
    return total.item()


def forward_only(schedule: Schedule) -> Schedule:
    """The forwards of `schedule`, microbatch after microbatch, each rank's stages in order (given):
    what an evaluation runs. Every F waits only on earlier stages' F, so no rank waits forever."""
    orders = [[Action(stage, "F", i) for i in range(schedule.n_microbatches) for stage in schedule.stages_of(rank)]
              for rank in range(schedule.world_size)]
    return Schedule(f"{schedule.name} forwards", schedule.placement, orders, schedule.n_microbatches)


class ComposedLlama:
    """This rank's stages of the Llama `cfg` on a p x d x c x t mesh (e carved out of d x c for a MoE model)."""

    def __init__(self, cfg: LlamaConfig, mesh: Mesh, n_microbatches: int = 1, schedule: str = "1f1b",
                 stages_per_rank: int = 2, seed: int = 0, dtype=torch.float32, variant: str = "zigzag", moe=None,
                 whole=None, attention_chunk: int = ATTENTION_CHUNK, recompute: bool = False, fp8: bool = False):
        self.cfg, self.mesh, self.moe, self.dtype = cfg, mesh, moe, dtype
        self.groups = groups = compose_groups(mesh)
        v = stages_per_rank_of(schedule, stages_per_rank)
        check_composition(cfg, mesh.sizes, None, n_microbatches, v, moe.n_experts if moe else None)
        self.schedule = make_schedule(schedule, groups.pp.size, n_microbatches, v)
        validate(self.schedule)
        whole = whole if whole is not None else initial_model(cfg, seed, dtype, moe)
        matmul = FP8Matmul(min_dim=FP8_MIN_DIM) if fp8 else None  # one weight cache for all this rank's stages
        if moe is None:
            def make(stage):
                return LlamaStage(cfg, groups, stage, self.schedule.n_stages, whole, variant, attention_chunk, recompute,
                                  matmul)
        else:
            from .m17_moe_stage import MoEStage, check_moe_mesh
            check_moe_mesh(mesh.sizes, moe, recompute, fp8)

            def make(stage):
                return MoEStage(cfg, groups, stage, self.schedule.n_stages, whole, moe, attention_chunk)
        self.stages = {stage: make(stage) for stage in self.schedule.stages_of(groups.pp.index)}
        self.comms = self.stage_comms(self.schedule)
        self.eval_schedule = forward_only(self.schedule)
        self.eval_comms = self.stage_comms(self.eval_schedule)

    def stage_comms(self, schedule: Schedule) -> StageComms:
        pp = self.groups.pp
        return StageComms(pp, schedule.placement, schedule.n_microbatches, dtype=self.dtype,
                          order=schedule.orders[pp.index])

    def parameters(self) -> list[torch.Tensor]:
        """What this rank's optimizer updates, stage after stage, in the order of grads()."""
        return [p for stage in self.stages.values() for p in stage.parameters()]

    def grads(self) -> list[torch.Tensor]:
        return [g for stage in self.stages.values() for g in stage.grads()]

    def share(self, tokens: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a global batch: block i_d of d (given)."""
        data = self.groups.data
        rows = tokens.shape[0] // data.size
        return tokens[data.index * rows:(data.index + 1) * rows]

    def finish_gradients(self):
        """After the schedule: every gradient this rank holds summed over the ranks that hold the same weight
        and saw other tokens (the module docstring's step 3)."""
        groups, stages = self.groups, list(self.stages.values())
        # >>> TODO(m17): each gradient summed over the ranks that hold the same weight and saw other tokens
        # Contract: afterwards every gradient this rank holds (each stage's grad_shards, outer_grad, replicated_grads
        #   and expert_grads) is the whole gradient of its piece: the sum over every rank that holds the same piece and
        #   saw other tokens of it. The blocks' and the outer weights' sums over fsdp are the stages' reduce-scatters
        #   (once a step); every other sum is one all-reduce (sum_over, above) per group, labelled "norm grads" (the
        #   norm weights: the positions stage.norms of each grad shard, stage.outer_norms of the outer gradient shard),
        #   "replicated grads" (stage.replicated_grads: a MoE model's routers and shared experts) and, with a MoE model
        #   (groups.expert_data is not None), "expert grads" (stage.expert_grads).
        # The question, for each kind of weight (a block's t slice, the block norms inside it, the final norm, the
        #   vocabulary rows, a router, an expert): along which axes do the ranks hold the same copy of it, and along
        #   which of those did they see other tokens (rows, positions) of it? Its gradient is partial over those.
        # Pitfalls: the norms sit inside the flat shards: is their extra sum taken before or after the reduce-scatter,
        #   and where in the shard are they? What does summing a weight over ranks that hold different slices of it add
        #   in?
        # Hint 1: for each row of docs/17's table "Which gradient is summed over which axis": which ranks hold the same
        #         copy, and which of them computed with other rows or other positions? (The chapter works it on d alone
        #         and on t alone.)
        # Hint 2: a block's t slice, the vocabulary rows: Σ over d c, done by the reduce-scatters. A norm weight is
        #         whole on every t rank and each normed T/t positions (sequence parallelism): g = Σ_t g_t, summed over
        #         t, in one all-reduce, after the reduce-scatter over d c. A router or shared expert: Σ over d c
        #         (replicas). A rank's experts: Σ over module 16's ed (expert_data).
        # Hint 3: for each stage: stage.reduce_scatter()
        #         norms = [(shard, stage.norms) for every stage and shard]
        #                 + [(stage.outer_grad, stage.outer_norms) for every stage]
        #         sum_over(groups.tp, norms, "norm grads")
        #         sum_over(groups.replicas, [every replicated accumulator], "replicated grads")
        #         with experts: sum_over(groups.expert_data, [every expert gradient], "expert grads")
        for stage in stages:
            stage.reduce_scatter()
        norms = [(shard, stage.norms) for stage in stages for shard in stage.grad_shards]
        norms += [(stage.outer_grad, stage.outer_norms) for stage in stages]
        sum_over(groups.tp, norms, "norm grads")
        sum_over(groups.replicas, [g for stage in stages for g in stage.replicated_grads.values()], "replicated grads")
        if groups.expert_data is not None:
            sum_over(groups.expert_data, [g for stage in stages for g in stage.expert_grads], "expert grads")
        # <<<

    def train_step(self, tokens: torch.Tensor, targets: torch.Tensor, n_microbatches: int, optimizer) -> float:
        """One optimizer step on the global batch tokens, targets (B, T), the same on every rank (module 06's
        `fit` contract); returns the step's mean loss over its real tokens, the same on every rank."""
        if n_microbatches != self.schedule.n_microbatches:
            raise ValueError(f"this model runs {self.schedule.name} with {self.schedule.n_microbatches} microbatches "
                             f"(ComposedLlama's n_microbatches), not {n_microbatches}")
        # >>> TODO(m17): one composed step: the loss's divisor, this rank's rows through the schedule, the sums, AdamW
        # Contract: one optimizer step on the global batch (module 06's `fit` contract): afterwards AdamW has updated
        #   every parameter this rank holds with the whole gradient of the step's loss, and the step's loss is returned,
        #   the same on every rank (step_loss of what module 11's run_schedule returned). The given pieces:
        #   stage.begin_step(n_tokens, B) (a stage's divisor, before its schedule), module 11's run_schedule,
        #   finish_gradients (above), and parameters() and grads() (the same order; p.grad must be in p's dtype).
        # The question: the loss is the mean over the step's real targets (module 06's IGNORE_INDEX marks the others).
        #   Each rank's share of a microbatch is summed, plainly, over the m microbatches (run_schedule) and over the
        #   ranks (step_loss; the gradients in finish_gradients): what must every share be divided by, counted where, so
        #   that those plain sums are that mean and its gradient, with no scale left to apply anywhere?
        # Pitfalls: which rows of the global batch are this rank's? A divisor off by a constant factor puts the loss off
        #   by that factor and every gradient too: AdamW hides most of it, but not the tests' 1e-10 against one process.
        # Hint 1: the loss L = (1/N) Σ_j ℓ_j is cut into pieces by microbatch, data rank and context rank: for the
        #         pieces' plain sum to be L, which N must each piece divide by, and can one rank count it? (docs/17,
        #         "The loss: one divisor, derived": worked for gradient accumulation on one process.)
        # Hint 2: every piece divides its sum by N_real, counted once on the whole global batch (its real targets, the
        #         same number on every rank): L = Σ_pieces (S_piece / N_real). The rank's rows are block i_d of d.
        # Hint 3: n_tokens = real_tokens(targets)  (the global targets)
        #         for each stage: stage.begin_step(n_tokens, tokens.shape[0])
        #         loss = run_schedule(self.schedule, self.stages, self.comms, self.share(tokens), self.share(targets))
        #         self.finish_gradients();  p.grad = g.to(p.dtype) for p, g in zip(self.parameters(), self.grads())
        #         optimizer.step();  return step_loss(loss, self.groups)
        n_tokens = real_tokens(targets)
        for stage in self.stages.values():
            stage.begin_step(n_tokens, tokens.shape[0])
        loss = run_schedule(self.schedule, self.stages, self.comms, self.share(tokens), self.share(targets))
        self.finish_gradients()
        for p, g in zip(self.parameters(), self.grads(), strict=True):
            p.grad = g.to(p.dtype)
        optimizer.step()
        return step_loss(loss, self.groups)
        # <<<

    @torch.no_grad()
    def evaluate(self, tokens: torch.Tensor, targets: torch.Tensor) -> float:
        """The mean loss of a global batch, forwards only, no gradient, no update (given): a validation loss.
        With no gradient to keep in scale, the shares are summed losses (a divisor of 1), and the report
        divides their total once."""
        for stage in self.stages.values():
            stage.begin_step(1, tokens.shape[0])
        with EvalMode(self.stages.values()):
            loss = run_schedule(self.eval_schedule, self.stages, self.eval_comms, self.share(tokens),
                                self.share(targets))
        return step_loss(loss, self.groups) / real_tokens(targets)
