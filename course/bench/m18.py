"""Module 18 benchmark: module 17's composed trainer against PyTorch's own composition, torchtitan's
recipe, on the same p x d x t mesh of forked gloo ranks.

    python main.py bench 18 [--meshes p=2,d=2,t=2;p=2,d=2;d=2,t=2] [--steps 4] [--dim 64] [--layers 4]

Both train module 06's Llama (float64, so that the losses can be compared closely) on the same
global batches (module 06's `fit`), from the same initial weights, on the same ranks:
  ours    module 17's ComposedLlama (the selected implementation, --impl): module 11's 1F1B over p,
          module 12's tensor and sequence parallelism over t, module 07's flat shards over d,
          gathered once a step
  torch   the nn.Module Llama cut into p stages, DTensor's `parallelize_module` over t (module 12's
          Megatron plan without sequence parallelism, the LM head's logits gathered), FSDP2's
          `fully_shard` over d per block and per stage, `torch.distributed.pipelining`'s
          Schedule1F1B over p (c = e = 1: torch's public context parallelism needs GPU kernels and
          core torch has no expert parallelism)
Columns:
  max |Δloss|      the largest difference of the two runs' losses over the steps (tolerance 1e-9:
                   both sum the same products in other orders, float64, AdamW for a few steps)
  step ms          median wall time of one step after a warm-up, rank 0; ours/torch their ratio
  sent B/step      bytes rank 0 sends in one step over the mesh's collectives, counted for both
                   by course/collectives.py's ring formulas (ours from its log, torch's from the
                   collectives FSDP2 and DTensor issue, course/reference_2d.TorchCollectiveLog);
                   neither counts the pipeline's sends (point to point, outside both logs)
  plan B/step      module 18's plan of ours (solutions/m18_costs.py, without p): rank 0 is the
                   first stage, so with p > 1 the plan (every stage with the embedding and the
                   head) bounds it from above. The plan shards the embedding, head and final norm
                   as FSDP2 does (a gather and a reduce-scatter) where ours all-reduces them: in
                   float64, whose gradients are as wide as the weights, the same bytes
"""
from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed.fsdp  # noqa: F401  imported once here, not in every forked rank
import torch.distributed.pipelining  # noqa: F401
import torch.distributed.tensor.parallel  # noqa: F401

from course.bench import narrow_llama, report, require_positive
from course.costs import StepCost, measured_cost
from course.impl import load, reference
from course.launch import run_ranks
from course.mesh import MeshError, init_mesh, parse_mesh
from course.timing import StepTimer

TOLERANCE = 1e-9


class TorchComposed:
    """PyTorch's composition on this rank, with module 06's `fit` contract (cfg, parameters, train_step)."""

    def __init__(self, cfg, sizes: dict[str, int], n_microbatches: int, whole):
        import warnings

        import torch.nn as nn
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        from course.reference_fsdp import fully_shard_api
        from course.reference_llama import ModularLlama
        from course.reference_tp import tp_plan

        # FSDP2 warns when a wrapped module returns a view (an in-place op on it would skip its hook); the
        # blocks' outputs are sums, used out of place by the next block and the schedule
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
        p, d, t = sizes["p"], sizes["d"], sizes["t"]
        self.cfg, self.d = cfg, d
        self.mesh = mesh = init_device_mesh("cpu", (p, d, t), mesh_dim_names=("p", "d", "t"))
        llama = ModularLlama(cfg, dtype=whole.embedding.dtype).load(whole)
        i_p, per_stage = mesh["p"].get_local_rank(), cfg.n_layers // p
        self.first, self.last = i_p == 0, i_p == p - 1
        stage = nn.Module()   # torchtitan's cut: the first stage embeds, the last norms and projects
        stage.embedding = llama.embedding if self.first else None
        stage.blocks = nn.ModuleList(llama.blocks[i_p * per_stage:(i_p + 1) * per_stage])
        stage.final_norm, stage.lm_head = (llama.final_norm, llama.lm_head) if self.last else (None, None)
        stage.forward = lambda x: self._forward(stage, x)
        _, block_plan = tp_plan(sequence_parallel=False)
        for block in stage.blocks:
            parallelize_module(block, mesh["t"], block_plan)
        root = {}
        if self.first:
            root["embedding"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        if self.last:   # logits gathered whole over t: a plain cross-entropy, no loss_parallel inside a schedule
            root["lm_head"] = ColwiseParallel(output_layouts=Replicate())
        if root:
            parallelize_module(stage, mesh["t"], root)
        fully_shard = fully_shard_api()
        for block in stage.blocks:
            fully_shard(block, mesh=mesh["d"])
        fully_shard(stage, mesh=mesh["d"])
        self.stage = stage
        self.n_real = 1
        pipe_stage = PipelineStage(stage, i_p, p, torch.device("cpu"), group=mesh["p"].get_group())
        self.schedule = Schedule1F1B(pipe_stage, n_microbatches, loss_fn=self._loss, scale_grads=False)

    @staticmethod
    def _forward(stage, x):
        if stage.embedding is not None:
            x = stage.embedding(x)
        for block in stage.blocks:
            x = block(x)
        if stage.lm_head is not None:
            x = stage.lm_head(stage.final_norm(x))
        return x

    def _loss(self, logits, targets):
        """A microbatch's summed cross-entropy over the step's real tokens, times d: FSDP2 averages the
        gradients over d, so the sum over the d ranks is what remains (module 06's loss: one divisor)."""
        import torch.nn.functional as F
        loss = F.cross_entropy(logits.flatten(0, 1), targets.reshape(-1), reduction="sum")   # ignore_index -100
        return loss / self.n_real * self.d

    def parameters(self):
        return list(self.stage.parameters())

    def train_step(self, tokens, targets, n_microbatches, optimizer):
        return self.reported(self.step(tokens, targets, optimizer))

    def step(self, tokens, targets, optimizer) -> float:
        """One optimizer step; this rank's share of the loss (the last stage's, t index 0; else 0)."""
        self.n_real = reference("m06_llama_model").real_tokens(targets)
        rows = tokens.shape[0] // self.d
        i_d = self.mesh["d"].get_local_rank()
        x, y = tokens[i_d * rows:(i_d + 1) * rows], targets[i_d * rows:(i_d + 1) * rows]
        shares = []
        optimizer.zero_grad()
        args = (x,) if self.first else ()
        kwargs = {"target": y, "losses": shares} if self.last else {}
        self.schedule.step(*args, **kwargs)
        optimizer.step()
        return sum(s.item() for s in shares) / self.d if self.last and self.mesh["t"].get_local_rank() == 0 else 0.0

    @staticmethod
    def reported(mine: float) -> float:
        """The step's loss on every rank: the shares summed over the world (reporting, not training traffic)."""
        import torch.distributed as dist

        total = torch.tensor([mine], dtype=torch.float64)
        dist.all_reduce(total)
        return total.item()


def _collectives_only():
    from course.reference_2d import TorchCollectiveLog

    class CollectivesOnly(TorchCollectiveLog):
        """torch's collectives; its pipeline's point-to-point sends and receives left out, like ours."""
        _IGNORED = TorchCollectiveLog._IGNORED | {"send", "recv_"}
    return CollectivesOnly()


def _run(cfg, sizes, steps, batch, microbatches, which):
    torch.manual_seed(0)
    m06, initial = reference("m06_llama_model"), reference("m17_trainer").initial_model  # the loop, the weights
    whole = initial(cfg, 0, torch.float64)
    log = []
    if which == "ours":
        mesh = init_mesh(reference("m17_composition").full_sizes(sizes))
        log = mesh.log
        model = load("m17_trainer").ComposedLlama(cfg, mesh, microbatches, "1f1b", 1, dtype=torch.float64,
                                                    whole=whole)
    else:
        model = TorchComposed(cfg, sizes, microbatches, whole)
    timer = StepTimer(log)
    m06.fit(model, steps + 1, batch, 3e-3, n_microbatches=microbatches, on_step=timer)  # step 1: a warm-up
    if which == "ours":
        # the pipeline's sends (logged over "p") left out, like torch's, which its counter does not see
        sent = measured_cost([record for record in log[timer.calls[0]:timer.calls[1]] if record.axis != "p"])
    else:   # one more step, untimed: the dispatch mode that counts would slow the timed ones
        from course.dataset import load_text, random_batch
        counter = _collectives_only()
        tokens, targets = random_batch(load_text(), batch, cfg.max_seq_len, torch.Generator().manual_seed(1))
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.0, weight_decay=0.0)
        with counter:
            model.step(tokens, targets, optimizer)
        sent = f"? ({', '.join(sorted(counter.unknown))})" if counter.unknown else measured_cost(counter.log)
    return {"times": timer.times[1:], "losses": timer.losses, "sent": sent}


def _plan(cfg, sizes, batch, microbatches) -> StepCost:
    """Module 18's plan of ours on rank 0 (the reference's formulas), the pipeline's sends left out."""
    layouts, costs, presets = reference("m18_layout"), reference("m18_costs"), reference("m18_presets")
    layout = layouts.Layout(p=sizes["p"], d=sizes["d"], t=sizes["t"], zero=3, m=microbatches,
                            schedule="1f1b" if sizes["p"] > 1 else "none")
    float64 = layouts.Precision(torch.float64, master=False)   # the runs' dtype, AdamW's moments in it
    cost = costs.rank_cost(presets.Model("bench", cfg, batch=batch), layout, batch, float64)
    return StepCost({k: v for k, v in cost.sent.items() if k[0] != "p"})


def _whole(x: float):
    return int(x) if float(x).is_integer() else x


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="main.py bench 18", description=__doc__.split("\n\n")[0])
    parser.add_argument("--meshes", default="p=2,d=2,t=2;p=2,d=2;d=2,t=2",
                        help="meshes over p, d, t separated by ';' (default: p=2,d=2,t=2;p=2,d=2;d=2,t=2)")
    parser.add_argument("--steps", type=int, default=4, help="timed steps, after one warm-up (default 4)")
    parser.add_argument("--dim", type=int, default=64, help="width M: M/8 query heads of 8, 4 key/value heads "
                        "(default 64)")
    parser.add_argument("--layers", type=int, default=4, help="blocks L, divided over p (default 4)")
    parser.add_argument("--batch", type=int, default=8, help="global batch B (default 8)")
    parser.add_argument("--microbatches", type=int, default=2, help="m (default 2)")
    parser.add_argument("--seq", type=int, default=32, help="sequence length T (default 32)")
    args = parser.parse_args(argv)
    cfg, meshes = check(parser, args)
    torch.set_num_threads(1)
    rows = []
    for sizes in meshes:
        ranks = sizes["p"] * sizes["d"] * sizes["t"]
        results = {which: run_ranks(_run, ranks, cfg, sizes, args.steps, args.batch, args.microbatches, which,
                                    timeout=600)[0] for which in ("ours", "torch")}
        ours_ms, torch_ms = (1e3 * statistics.median(results[w]["times"]) for w in ("ours", "torch"))
        gap = max(abs(a - b) for a, b in zip(results["ours"]["losses"], results["torch"]["losses"], strict=True))
        plan = _plan(cfg, sizes, args.batch, args.microbatches)
        name = ",".join(f"{a}={s}" for a, s in sizes.items() if s > 1)
        for which, ms in (("ours", ours_ms), ("torch", torch_ms)):
            sent, ours = results[which]["sent"], which == "ours"
            rows.append({"mesh": name, "impl": which, "max |Δloss|": gap if ours else "-",
                         "within 1e-9": ("yes" if gap <= TOLERANCE else "NO") if ours else "-",
                         "step ms": ms, "ours/torch": ours_ms / torch_ms if ours else "-",
                         "sent B/step": sent if isinstance(sent, str) else _whole(sent.sent_bytes()),
                         "all_gather": "-" if isinstance(sent, str) else _whole(sent.sent_bytes(op="all_gather")),
                         "reduce_scatter": "-" if isinstance(sent, str) else _whole(sent.sent_bytes(op="reduce_scatter")),
                         "all_reduce": "-" if isinstance(sent, str) else _whole(sent.sent_bytes(op="all_reduce")),
                         "plan B/step": _whole(plan.sent_bytes()) if ours else "-",
                         "final loss": results[which]["losses"][-1]})
        print(f"  measured {name}", flush=True)
    report("bench-18", f"Module 17's composition against PyTorch's (FSDP2 + DTensor TP + pipelining) on CPU ranks: "
                       f"{cfg.n_layers} blocks of dim {cfg.dim}, batch {args.batch} x {cfg.max_seq_len} tokens in "
                       f"{args.microbatches} microbatches, float64", rows,
           notes="ours: m17_trainer.ComposedLlama; torch: course/bench/m18.py's TorchComposed. Bytes: rank 0, "
                 "ring formulas, pipeline sends not counted.")


def check(parser, args):
    """Refuse bad arguments before any rank starts; returns (cfg, meshes)."""
    require_positive(parser, args, "steps", "layers", "batch", "microbatches", "seq")
    cfg = narrow_llama(parser, args)
    composition = reference("m17_composition")
    meshes = []
    for text in args.meshes.split(";"):
        try:
            given = parse_mesh(text)
        except MeshError as error:
            parser.error(str(error))
        if set(given) - {"p", "d", "t"}:
            parser.error(f"--meshes: p, d and t only (torch's public context and expert parallelism are not "
                         f"composed here), got {text.strip()!r}")
        sizes = {axis: given.get(axis, 1) for axis in ("p", "d", "t")}
        if sizes["p"] * sizes["d"] * sizes["t"] > 8:
            parser.error(f"mesh {text.strip()} needs more than 8 ranks: this benchmark runs 8 CPU ranks at most")
        try:
            composition.check_composition(cfg, sizes, args.batch, args.microbatches)
        except ValueError as error:
            parser.error(str(error))
        if sizes["p"] > 1 and args.microbatches < sizes["p"]:
            parser.error(f"--microbatches {args.microbatches} < p = {sizes['p']}: 1F1B needs at least p")
        meshes.append(sizes)
    return cfg, meshes
