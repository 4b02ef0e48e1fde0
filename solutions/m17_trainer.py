"""Module 17, part 3 - the composed trainer: this rank's stages, module 11's executor, one step.

    ComposedLlama(cfg, mesh, n_microbatches, schedule="1f1b")   this rank's stages of the schedule's
                                                                placement (m17_stage), its StageComms

One optimizer step on the global batch (every rank draws the same B sequences from the seed, as in
module 06's `fit`, which trains this model as it trains every Llama of the course):

  1. the step's real tokens N_real, counted once on the whole global batch: every piece of the loss
     (a microbatch, of a rank's B/d rows, of its T/c positions) is divided by it
  2. this rank's B/d rows go to module 11's run_schedule: the stages' forwards and backwards, in the
     schedule's order, the microbatches' gradients adding up in the stages' whole buffers
  3. every gradient summed over the ranks that hold the same weight and saw other tokens:
        blocks           reduce-scatter over fsdp (d c), once per step (m17_stage)
        norm weights     with sequence parallelism each t rank normed T/t positions: all-reduce over t
        embedding, LM head, final norm (and a MoE layer's router)   all-reduce over d c
        experts          all-reduce over the expert-data group "ed" (module 16)
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
from .m11_actions import Action, Schedule
from .m11_executor import StageComms, run_schedule
from .m11_generators import make_schedule, stages_per_rank_of
from .m17_composition import check_composition, compose_groups
from .m17_stage import EvalMode, LlamaStage


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
                 whole=None, attention_chunk: int = ATTENTION_CHUNK):
        self.cfg, self.mesh, self.moe, self.dtype = cfg, mesh, moe, dtype
        self.groups = groups = compose_groups(mesh)
        v = stages_per_rank_of(schedule, stages_per_rank)
        check_composition(cfg, mesh.sizes, None, n_microbatches, v, moe.n_experts if moe else None)
        self.schedule = make_schedule(schedule, groups.pp.size, n_microbatches, v)
        validate(self.schedule)
        whole = whole if whole is not None else initial_model(cfg, seed, dtype, moe)
        if moe is None:
            def make(stage):
                return LlamaStage(cfg, groups, stage, self.schedule.n_stages, whole, variant, attention_chunk)
        else:
            from .m17_moe_stage import MoEStage, check_moe_mesh
            check_moe_mesh(mesh.sizes, moe)

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
        and saw other tokens (the module docstring's table)."""
        groups, stages = self.groups, list(self.stages.values())
        # >>> TODO(m17): each gradient summed over the ranks that hold the same weight and saw other tokens
        # Contract: afterwards each stage's grad_shards hold their fsdp sums (stage.reduce_scatter, once a step), and
        #   - the norm weights' gradients (the elements stage.norms of every grad shard, and the final norm's
        #     accumulator on the last stage) are summed over t, in one all-reduce labelled "norm grads";
        #   - every replicated weight's accumulator (stage.replicated_grads' values) over groups.replicas, in one
        #     all-reduce labelled "replicated grads";
        #   - with experts (a MoE model: groups.expert_data is not None), stage.expert_grads over groups.expert_data,
        #     in one all-reduce labelled "expert grads".
        # The question: a weight's gradient is partial over every axis whose ranks saw other tokens of it (rows,
        #   positions) and hold the same copy. A block's t slice is the same on the d c ranks (the reduce-scatter
        #   sums over them); a norm weight is whole on every t rank, but with sequence parallelism each normed T/t
        #   positions, so its shard is partial over t too.
        # Pitfalls: the norms' sum over t is of the reduce-scattered shards (after the reduce-scatter: t ranks' shards
        #   of one block hold their norms at the same positions). Summing anything over t that is not partial over t
        #   (a column's slice, the LM head's rows) adds other ranks' slices into it.
        # Hint 1: reduce-scatter every stage's blocks; then three sums, each over its group, each in one collective.
        # Hint 2: sum_over(group, parts, label) (above) takes tensors and (tensor, index) pairs.
        # Hint 3: each stage: reduce_scatter()
        #         sum_over(t, [(shard, stage.norms) for every stage and shard] + [last stage's "final_norm"], "norm grads")
        #         sum_over(replicas, [every replicated accumulator], "replicated grads")
        #         with experts: sum_over(expert_data, [every expert gradient], "expert grads")
        for stage in stages:
            stage.reduce_scatter()
        norms = [(shard, stage.norms) for stage in stages for shard in stage.grad_shards]
        norms += [stage.replicated_grads["final_norm"] for stage in stages if stage.is_last]
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
        # Contract: give every stage the step's divisor and the global batch's size (stage.begin_step(n_tokens, B)),
        #   run module 11's run_schedule(self.schedule, self.stages, self.comms, x, y) on this rank's rows of tokens
        #   and targets (self.share), finish the gradients (above), hand each parameter its gradient (p.grad, in p's
        #   dtype; parameters() and grads() are in the same order), step the optimizer; return the step's loss on
        #   every rank (step_loss of what run_schedule returned).
        # The maths: the loss is the mean over the step's real targets, N_real of them in the global batch. Each
        #   rank's share of each microbatch is its own targets' summed loss divided by N_real: summed over the m
        #   microbatches (run_schedule) and the d c ranks (step_loss; the gradients in finish_gradients), that is
        #   the mean and its gradient, with no scale left to apply anywhere.
        # Pitfalls: N_real counted on this rank's rows (or on a microbatch, or one slice of the sequence) divides by
        #   d (m, c) times too few tokens: the loss is off by that factor and every gradient too; AdamW hides most
        #   of a constant factor, but not from the tests' 1e-10 against one process (their message names it).
        # Hint 1: count, set, run the schedule, finish the gradients, step, report.
        # Hint 2: real_tokens(targets) on the whole global batch; self.share(tokens); tokens.shape[0] is B.
        # Hint 3: n_tokens = real tokens of the global targets;  every stage: begin_step(n_tokens, B)
        #         loss = run_schedule(self.schedule, self.stages, self.comms, share of tokens, share of targets)
        #         finish_gradients();  p.grad = g.to(p.dtype) for each pair;  optimizer.step()
        #         return step_loss(loss, self.groups)
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
        """The mean loss of a global batch, forwards only, no gradient, no update (given): a validation loss."""
        for stage in self.stages.values():
            stage.begin_step(real_tokens(targets), tokens.shape[0])
        with EvalMode(self.stages.values()):
            loss = run_schedule(self.eval_schedule, self.stages, self.eval_comms, self.share(tokens),
                                self.share(targets))
        return step_loss(loss, self.groups)
