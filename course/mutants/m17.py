"""Module 17's planted bugs (the composed trainer, its checkpoints): see course/mutants/__init__.py."""
from course.mutants import Plant

COMPOSITION, STAGE, TRAINER, COSTS = "m17_composition.py", "m17_stage.py", "m17_trainer.py", "m17_costs.py"
CHECKPOINT, RUN = "m17_checkpoint.py", "m17_run.py"


def at_line(indent: int, code: str) -> str:
    """`code` where a line of code starts (`indent` spaces in): the same text in a hint's comment does not match."""
    return "\n" + " " * indent + code


PLANTS = [
    # The list.
    Plant(TRAINER, "        n_tokens = real_tokens(targets)\n        for stage in self.stages.values():\n"
                   "            stage.begin_step(n_tokens, tokens.shape[0])\n        loss = run_schedule(",
          "        n_tokens = real_tokens(self.share(targets))\n        for stage in self.stages.values():\n"
          "            stage.begin_step(n_tokens, tokens.shape[0])\n        loss = run_schedule(",
          "the loss normalised over one axis too few: this rank's rows' tokens, not the step's (off by d)"),
    Plant(COMPOSITION, at_line(18, 'fsdp=mesh.group("d", "c")'), at_line(18, 'fsdp=mesh.group("d")'),
          "FSDP over d only: with c > 1 the context ranks hold the same slice, so their gradients go unsummed"),
    Plant(STAGE, at_line(8, "works = [fsdp.collectives.all_gather(full, shard,"),
          at_line(8, "works = [self.groups.tp.collectives.all_gather(full, shard,"),
          "the FSDP gather over the wrong group (t): it assembles other slices' shards into this slice"),
    Plant(COMPOSITION, 'return Groups(pp=mesh.group("p")',
          'return Groups(pp=Group("p", mesh.index["p"], tuple(range(mesh.sizes["p"])), mesh.group("p").collectives)',
          "the pipeline's neighbours taken from the world (ranks 0 .. p-1) instead of the p axis's members"),
    Plant(TRAINER, at_line(8, "sum_over(groups.tp, norms, \"norm grads\")\n"), "\n",
          "the gradient of a replicated norm not summed over t: each t rank normed only T/t positions"),
    # Groups and sums.
    Plant(TRAINER, "norms = [(shard, stage.norms) for stage in stages for shard in stage.grad_shards]",
          "norms = []",
          "only the final norm summed over t: the blocks' ln1 and ln2 (inside the flat shards) are partial too"),
    Plant(STAGE, at_line(8, 'self.groups.fsdp.collectives.reduce_scatter(self.outer_grad, self.outer_full_grad, '
                             'label="outer")'),
          at_line(8, 'self.groups.data.collectives.reduce_scatter(self.outer_grad, self.outer_full_grad, label="outer")'),
          "the embedding's and LM head's gradients reduce-scattered over d only: the context ranks saw other positions "
          "of the same rows"),
    Plant(TRAINER, 'sum_over(groups.expert_data, [g for stage in stages for g in stage.expert_grads], "expert grads")',
          'sum_over(groups.replicas, [g for stage in stages for g in stage.expert_grads], "expert grads")',
          "expert gradients summed over every data rank: the other expert groups' members hold other experts"),
    # How a stage holds an FSDP x TP block.
    Plant(STAGE, at_line(8, "self.shards = [self.layout.shard(self.layout.flatten(s), fsdp.index).clone() for s in slices]"),
          at_line(8, "self.shards = [self.layout.shard(self.layout.flatten(s), tp.index).clone() for s in slices]"),
          "the fsdp shard picked by the rank's t index: the d c ranks of a slice keep the same piece"),
    Plant(STAGE, "for layer in self.layers]\n        self.layout = FlatLayout(slices[0], fsdp.size)",
          "for layer in self.layers]\n        self.layout = FlatLayout(whole.blocks[self.layers[0]], fsdp.size)",
          "the flat layout of the whole block, not of the t slice: the shards cut the wrong tensors"),
    Plant(STAGE, at_line(8, "works = [fsdp.collectives.reduce_scatter(shard, full,"),
          at_line(8, "works = [self.groups.data.collectives.reduce_scatter(shard, full,"),
          "the gradients reduce-scattered over d only: with c > 1 each shard misses the context ranks' part"),
    # The loss.
    Plant(STAGE, "self.positions(targets).reshape(-1), cfg.vocab_size, tp,\n"
                 "                                                     self.n_tokens)",
          "self.positions(targets).reshape(-1), cfg.vocab_size, tp)",
          "each microbatch's loss divided by its own tokens on this rank (the mean of a piece, not of the step)"),
    Plant(TRAINER, at_line(8, "loss = run_schedule(self.schedule, self.stages, self.comms, self.share(tokens), "
                               "self.share(targets))"),
          at_line(8, "loss = run_schedule(self.schedule, self.stages, self.comms, tokens, targets)"),
          "every data rank trains on the whole global batch: d copies of every token's gradient"),
    # FSDP across the microbatches.
    Plant(STAGE, "        self.full_grads = [torch.zeros(self.layout.padded_numel, dtype=self.grad_dtype) for _ in self.shards]\n",
          "        self.full_grads = [torch.empty(self.layout.padded_numel, dtype=self.grad_dtype) for _ in self.shards]\n",
          "the whole gradient buffers not zeroed: the step's microbatches add into what the memory held"),
    Plant(COSTS, at_line(12, '("dc", "reduce_scatter"): n_blocks * (n - 1) * shard * grad_dtype(dtype).itemsize'),
          at_line(12, '("dc", "reduce_scatter"): n_blocks * (n - 1) * shard * dtype.itemsize'),
          "the gradients' bytes counted in the weights' dtype: they travel in the float32 accumulators"),
    Plant(COSTS, "shard = -(-P // n)", "shard = P // n",
          "the shard of the unpadded slice: the flat buffer is padded to a multiple of d c"),
    # Checkpoints.
    Plant(RUN, "        losses.append(model.train_step(tokens, targets, n_microbatches, optimizer))\n"
               "        if checkpoint_dir and checkpoint_every and (step + 1) % checkpoint_every == 0:\n"
               "            save(model, optimizer, training_state(generator, losses), checkpoint_dir, step + 1, description,\n"
               "                 make_writer)\n",
          "        if checkpoint_dir and checkpoint_every and (step + 1) % checkpoint_every == 0:\n"
          "            save(model, optimizer, training_state(generator, losses + [0.0]), checkpoint_dir, step + 1,\n"
          "                 description, make_writer)\n"
          "        losses.append(model.train_step(tokens, targets, n_microbatches, optimizer))\n",
          "the checkpoint saved before the optimizer's step: step k's data position beside step k - 1's weights"),
    Plant(CHECKPOINT, "\n    return DTensor.from_local(piece, device_mesh, placements, run_check=False, shape=torch.Size(shape),\n",
          "\n    return piece\n    return DTensor.from_local(piece, device_mesh, placements, run_check=False, shape=torch.Size(shape),\n",
          "a shard saved as a plain tensor: DCP takes it for a replicated copy and keeps one rank's"),
    Plant(CHECKPOINT, "    elif field in ROW_PARALLEL:\n        over_t = Shard(1)\n",
          "    elif field in ROW_PARALLEL:\n        over_t = Shard(0)\n",
          "a row-parallel weight (wo, w_down) placed by rows: round-trips on the same t, scrambled on another"),
    Plant(CHECKPOINT, "    if field in COLUMN_PARALLEL or field in (\"embedding\", \"lm_head\"):\n",
          "    if field in COLUMN_PARALLEL:\n",
          "the vocabulary rows saved as replicated: DCP keeps one t rank's rows for all of them"),
    Plant(CHECKPOINT, "    if dist.get_rank() == 0:\n        os.rename(partial, final)\n    dist.barrier()\n    return final",
          "    return final",
          "the partial directory never renamed: the run's checkpoints are invisible to a resume"),
    Plant(CHECKPOINT, "    dist.barrier()\n    dcp.save(state, storage_writer=(make_writer or dcp.FileSystemWriter)(partial))\n"
                      "    dist.barrier()\n    if dist.get_rank() == 0:\n        os.rename(partial, final)\n",
          "    dist.barrier()\n    if dist.get_rank() == 0:\n        os.rename(partial, final)\n"
          "    dcp.save(state, storage_writer=(make_writer or dcp.FileSystemWriter)(final))\n",
          "renamed before the save: a rank killed mid-save leaves a half-written checkpoint under a complete name"),
    # Added with the module's closing checks.
    Plant(STAGE, at_line(8, "self.shards = [self.layout.shard(self.layout.flatten(s), fsdp.index).clone() for s in slices]"),
          at_line(8, "self.shards = [self.layout.shard(self.layout.flatten(s), self.groups.data.index).clone() "
                     "for s in slices]"),
          "the fsdp shard picked by the rank's place along d only: with c > 1 two ranks keep the same piece"),
    Plant(TRAINER, at_line(8, "sum_over(groups.tp, norms, \"norm grads\")\n"),
          "\n        sum_over(groups.replicas, norms, \"norm grads\")\n",
          "the norms' extra sum over the replicas' group instead of t: counted twice over d c, never over t"),
    Plant(CHECKPOINT, at_line(4, 'placements = [over_t if axis == "t" else Replicate() for axis in device_mesh.mesh_dim_names]'),
          '\n    placements = [over_t if axis == "t" else Shard(0) if axis == "d" else Replicate()\n'
          '                  for axis in device_mesh.mesh_dim_names]',
          "Shard over d because FSDP shards over d: after the gather the d ranks hold copies of one slice"),
    Plant(RUN, "        if checkpoint_dir and checkpoint_every and (step + 1) % checkpoint_every == 0:\n"
               "            save(model, optimizer, training_state(generator, losses), checkpoint_dir, step + 1,",
          "        if checkpoint_dir and checkpoint_every and step % checkpoint_every == 0:\n"
          "            save(model, optimizer, training_state(generator, losses), checkpoint_dir, step + 1,",
          "the checkpoint's schedule off by one: saved after steps 1, 3, ... under their own numbers, never step k"),
    Plant(CHECKPOINT, "        (partial / \"config.json\").write_text(json.dumps(description))\n    dist.barrier()\n"
                      "    dcp.save(state, storage_writer=(make_writer or dcp.FileSystemWriter)(partial))\n    dist.barrier()\n"
                      "    if dist.get_rank() == 0:\n        os.rename(partial, final)\n",
          "    dist.barrier()\n    dcp.save(state, storage_writer=(make_writer or dcp.FileSystemWriter)(partial))\n"
          "    dist.barrier()\n    if dist.get_rank() == 0:\n        os.rename(partial, final)\n"
          "        (final / \"config.json\").write_text(json.dumps(description))\n",
          "config.json written after the rename (a learner run's survivor): for a moment step_N/ is incomplete"),
    # The embedding, final norm and LM head sharded over fsdp as one more group (issue 34).
    Plant(STAGE, "self.outer_shard = self.outer_layout.shard(self.outer_layout.flatten(outer), fsdp.index).clone()",
          "self.outer_shard = self.outer_layout.shard(self.outer_layout.flatten(outer), tp.index).clone()",
          "the outer weights' fsdp shard picked by the rank's t index: the fsdp ranks of a stage keep the same piece"),
    Plant(STAGE, "outer = OuterWeights(vocab_rows(whole.embedding, self.padded_vocab, tp) if self.is_first "
                 "else whole.embedding[:0],",
          "outer = OuterWeights(whole.embedding if self.is_first else whole.embedding[:0],",
          "the whole embedding sharded over fsdp instead of this t rank's vocabulary rows: it gathers rows the "
          "rank's vocabulary-parallel embedding does not own"),
    Plant(STAGE, at_line(8, 'self.groups.fsdp.collectives.all_gather(self.outer_full, self.outer_shard, label="outer")'),
          at_line(8, 'self.groups.tp.collectives.all_gather(self.outer_full, self.outer_shard, label="outer")'),
          "the outer weights gathered over t: other t ranks' vocabulary rows' shards assembled as this rank's"),
    Plant(STAGE, '        self.groups.fsdp.collectives.reduce_scatter(self.outer_grad, self.outer_full_grad, label="outer")\n',
          '        self.groups.fsdp.collectives.all_reduce(self.outer_full_grad, label="outer")\n'
          '        self.outer_grad.copy_(self.outer_layout.shard(self.outer_full_grad, self.groups.fsdp.index))\n',
          "the LM head's gradient all-reduced, then this rank's slice kept: the same numbers for twice the bytes "
          "(replicated data parallelism's collective, not FSDP's)"),
    Plant(STAGE, at_line(8, "self.outer_full_grad = torch.zeros(self.outer_layout.padded_numel, dtype=self.grad_dtype)"),
          at_line(8, "self.outer_full_grad = torch.empty(self.outer_layout.padded_numel, dtype=self.grad_dtype)"),
          "the outer weights' whole gradient buffer not zeroed: the step's microbatches add into what the memory held"),
    Plant(TRAINER, "        norms += [(stage.outer_grad, stage.outer_norms) for stage in stages]\n", "",
          "the final norm left unreduced over t: with sequence parallelism each t rank normed only T/t positions"),
    Plant(STAGE, "            accumulators.final_norm.add_(d_final)", "            accumulators.final_norm.copy_(d_final)",
          "the final norm's gradient assigned, not added: only the step's last microbatch counts"),
    # Issue 37's learner runs of module 17 (blame), and the bf16 path the contract names (issue 37.3).
    Plant(STAGE, at_line(8, "self.full_grads = [torch.zeros(self.layout.padded_numel, dtype=self.grad_dtype) for _ in "
                            "self.shards]"),
          at_line(8, "self.full_grads = [torch.zeros(self.layout.padded_numel, dtype=self.dtype) for _ in self.shards]"),
          "the whole gradient buffers in the weights' dtype, not grad_dtype: in bf16 the microbatches add up in bf16 "
          "and the reduce-scatter into the float32 shards fails", new=True),
    Plant(STAGE, at_line(8, "self.outer_full_grad = torch.zeros(self.outer_layout.padded_numel, dtype=self.grad_dtype)"),
          at_line(8, "self.outer_full_grad = torch.zeros(self.outer_layout.padded_numel, dtype=self.dtype)"),
          "the outer weights' whole gradient buffer in the weights' dtype, not grad_dtype (bf16: not float32)", new=True),
    Plant(STAGE, at_line(8, "self.shards = [self.layout.shard(self.layout.flatten(s), fsdp.index).clone() for s in slices]"),
          at_line(8, "whole_layout = FlatLayout(whole.blocks[self.layers[0]], fsdp.size * tp.size)") +
          at_line(8, "self.shards = [whole_layout.shard(whole_layout.flatten(whole.blocks[layer]), fsdp.index * tp.size "
                     "+ tp.index)[:self.layout.shard_numel].clone() for layer in self.layers]"),
          "the block sliced over t after FSDP instead of before: the whole block's flat buffer cut over the d c t ranks, "
          "so a rank's shard holds pieces of other t slices", new=True),
    Plant(TRAINER, 'sum_over(groups.replicas, [g for stage in stages for g in stage.replicated_grads.values()], '
                   '"replicated grads")',
          'if groups.data.index == 0:\n            sum_over(groups.replicas, [g for stage in stages for g in '
          'stage.replicated_grads.values()], "replicated grads")',
          "the replicated weights' sum on data rank 0 only: its partners never join the all-reduce (a hang; with the "
          "outer weights sharded, only a MoE model's routers and shared experts are replicated)", new=True),
    # Issue 37's learner run of 17 (grader gaps): a size that needs padding, a shard that is a view.
    Plant(STAGE, at_line(8, "self.outer_full = torch.empty(self.outer_layout.padded_numel, dtype=self.dtype)"),
          at_line(8, "self.outer_full = torch.empty(self.outer_layout.numel, dtype=self.dtype)"),
          "the outer weights gathered into a buffer of the unpadded size: when the fsdp group does not divide the "
          "outer group, every rank's padded shard does not fit", new=True),
    Plant(STAGE, at_line(8, "self.shards = [self.layout.shard(self.layout.flatten(s), fsdp.index).clone() for s in slices]"),
          at_line(8, "self.shards = [self.layout.shard(self.layout.flatten(s), fsdp.index) for s in slices]"),
          "a block shard kept as a view of the whole flat buffer: every rank still holds the whole t slice's memory",
          new=True),
    Plant(STAGE, "                 for full, shard, layer in zip(self.full, self.shards, self.layers, strict=True)]\n"
                 "        for work in works:\n            work.wait()\n",
          "                 for full, shard, layer in zip(self.full, self.shards, self.layers, strict=True)]\n",
          "the blocks' all-gathers never waited for: the first forward may read buffers not yet filled (a learner "
          "run's plant, seen before only as NaN losses, by a race)", new=True),
    Plant(RUN, "        losses.append(model.train_step(tokens, targets, n_microbatches, optimizer))\n"
               "        if checkpoint_dir and checkpoint_every and (step + 1) % checkpoint_every == 0:\n"
               "            save(model, optimizer, training_state(generator, losses), checkpoint_dir, step + 1, description,\n"
               "                 make_writer)\n",
          "        if checkpoint_dir and checkpoint_every and (step + 1) % checkpoint_every == 0:\n"
          "            save(model, optimizer, training_state(generator, losses), checkpoint_dir, step + 1, description,\n"
          "                 make_writer)\n"
          "        losses.append(model.train_step(tokens, targets, n_microbatches, optimizer))\n",
          "checkpoint \"step k\" saved before the k-th step ran: it holds k - 1 steps' weights and losses (a learner "
          "run's plant, its failure 110 lines of DCP tracebacks)", new=True),
]
