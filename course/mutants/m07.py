"""Module 07's planted bugs (FSDP): see course/mutants/__init__.py."""
from course.mutants import Plant

FLAT, FSDP, PAYLOAD, WEIGHTS = "m07_flat_shards.py", "m07_fsdp.py", "m07_payload.py", "m07_sharded_weights.py"
PLANTS = [
    Plant(FLAT, "self.shard_numel = -(-self.numel // world_size)", "self.shard_numel = self.numel // world_size",
          "shard size rounded down: when N does not divide the block's numel, its last elements belong to no rank"),
    Plant(FSDP, "self.shards = [self.layout.shard(self.layout.flatten(b), self.dp.index).clone() for b in self.blocks]",
          "self.shards = [self.layout.shard(self.layout.flatten(b), self.dp.index) for b in self.blocks]",
          "a shard kept as a view of the full flat block: every rank still holds the whole block's memory"),
    Plant(FSDP, "        self.finish_reduce_scatter()\n        full = self.layout.flatten(grads)",
          "        full = self.layout.flatten(grads)",
          "a new reduce-scatter started over the one in flight: the earlier one is never waited for nor added"),
    Plant(FSDP, "        n_tokens = real_tokens(targets)\n        rows = tokens.shape[0] // self.dp.size\n"
                "        mine = slice(self.dp.index * rows, (self.dp.index + 1) * rows)\n",
          "        rows = tokens.shape[0] // self.dp.size\n"
          "        mine = slice(self.dp.index * rows, (self.dp.index + 1) * rows)\n"
          "        n_tokens = real_tokens(targets[mine])\n",
          "the loss divided by this rank's real tokens, not the global batch's: the sums over ranks are d times the mean"),
    Plant(FSDP, "self.grad_shards[self.in_flight.layer].add_(self.in_flight.received)",
          "self.grad_shards[self.in_flight.layer].copy_(self.in_flight.received)",
          "the gradient shard overwritten, not accumulated: only the last microbatch's gradient survives"),
    Plant(FSDP, "        self.in_flight.work.wait()\n", "",
          "the reduce-scatter's slice read before its wait: on gloo (and nccl) it has not arrived yet"),
    Plant(FSDP, "        self.outer_grad.add_(received)\n", "        self.outer_grad.add_(received / self.dp.size)\n",
          "the outer weights' gradients averaged over d (as DDP does): each rank's loss is already divided by the "
          "global batch's tokens, so their sum over ranks is the mean, and these get 1/d of theirs"),
    Plant(FSDP, """            self.weights.release(layer)
            self.reduce_scatter_grad(layer, grads)
        self.finish_reduce_scatter()""", """            self.weights.release(layer)
            self.reduce_scatter_grad(layer, grads)""",
          "the last block's reduce-scatter never finished: layer 0's gradient shard misses it"),
    Plant(WEIGHTS, "if buf.layer == layer and buf.version == self.version:", "if buf.layer == layer:",
          "a resident block reused without checking its version: after a step it holds the old weights"),
    Plant(WEIGHTS, "            buf.pending.wait()\n            buf.pending = None\n", "            buf.pending = None\n",
          "the gathered block handed out before its all-gather is waited for: other ranks' shards are missing"),
    Plant(PAYLOAD, "turns = 2 * m - 1", "turns = 2 * m",
          "one turn too many: the forward of one microbatch and the backward of the next are one turn, not two"),
    Plant(PAYLOAD, "    shard, outer_shard = -(-block // d), -(-outer // d)\n",
          "    shard, outer_shard = block // d, outer // d\n",
          "the shard's bytes without padding: a shard is the padded block over N, rounded up"),
    Plant(WEIGHTS, "            buf.layer, buf.version = layer, self.version\n", "            buf.layer = layer\n",
          "the buffer's version never recorded: a block still there and current is never reused"),
    Plant(FSDP, "        mine = slice(self.dp.index * rows, (self.dp.index + 1) * rows)\n",
          "        mine = slice(0, rows)\n",
          "every rank trains on the first rows: the other ranks' rows are never seen, the first ones d times"),
    Plant(FSDP, "        received = torch.empty_like(self.outer_grad)\n"
                "        self.dp.collectives.reduce_scatter(received, full, label=\"outer\")\n"
                "        self.outer_grad.add_(received)\n",
          "        self.dp.collectives.all_reduce(full, label=\"outer\")\n"
          "        self.outer_grad.add_(self.outer_layout.shard(full, self.dp.index))\n",
          "the outer weights' gradients all-reduced, then this rank's slice kept: the same numbers for twice the bytes "
          "and a whole gradient's sum on every rank (replicated data parallelism's collective, not FSDP's)"),
    Plant(FSDP, "        for g in self.grads():\n            g.zero_()\n", "",
          "the accumulators never zeroed: from the second step on each gradient adds to the last step's"),
    Plant(FSDP, "self.layout.shard(self.layout.flatten(b), self.dp.index)",
          "self.layout.shard(self.layout.flatten(b), 0)",
          "every rank keeps rank 0's shard: the gathered blocks repeat rank 0's slice d times"),
    Plant(FSDP, "        self.in_flight = ReduceScatterInFlight(work, full, received, layer)\n",
          "        work.wait()\n        self.in_flight = ReduceScatterInFlight(work, full, received, layer)\n",
          "the reduce-scatter waited for right after its start: right numbers, but it no longer travels while the "
          "next block's backward computes"),
    Plant(FLAT, "self.shard_numel = -(-self.numel // world_size)",
          "self.shard_numel = (self.numel + world_size - 1) / world_size",
          "true division: the sizes are floats (a tensor's size must be an int), and not even whole numbers"),
    Plant(FSDP, "self.grad_shards[self.in_flight.layer].add_(self.in_flight.received)",
          "self.grad_shards[self.in_flight.layer].add_(self.in_flight.received / self.dp.size)",
          "the received slice averaged over d: each loss is already divided by the global batch's tokens, so the "
          "sum over ranks is the mean's gradient, and this is 1/d of it"),
    # The embedding, final norm and LM head sharded as one more group (issue 34).
    Plant(FSDP, "self.outer_layout.shard(self.outer_layout.flatten(outer), self.dp.index)",
          "self.outer_layout.shard(self.outer_layout.flatten(outer), 0)",
          "every rank keeps rank 0's shard of the embedding, final norm and LM head: the gathered ones repeat it d times"),
    Plant(FSDP, "full = self.outer_layout.flatten(OuterWeights(grads.embedding, grads.final_norm, grads.lm_head))",
          "full = torch.cat([grads.embedding.reshape(-1), grads.final_norm, grads.lm_head.reshape(-1)])",
          "the outer gradients laid end to end without the layout's padding: over 3 ranks they do not cut into "
          "equal slices"),
    Plant(FSDP, "full = self.outer_layout.flatten(OuterWeights(grads.embedding, grads.final_norm, grads.lm_head))",
          "full = self.outer_layout.flatten(OuterWeights(grads.lm_head, grads.final_norm, grads.embedding))",
          "the embedding's and the LM head's gradients swapped (one shape, two weights): each updates the other"),
    Plant(FSDP, "        self.outer_grad.add_(received)\n", "        self.outer_grad.copy_(received)\n",
          "the outer gradient shard overwritten, not accumulated: only the last microbatch's gradient survives"),
    Plant(FSDP, "whole = torch.empty(self.outer_layout.padded_numel, dtype=self.outer_shard.dtype)",
          "whole = torch.empty(self.outer_layout.numel, dtype=self.outer_shard.dtype)",
          "the outer weights gathered into a buffer of the unpadded size: every rank's padded shard does not fit"),
    Plant(PAYLOAD, "L * m), (outer_shard, m, m)):", "L * m), (outer_shard, 1, 1)):",
          "the outer weights gathered and reduce-scattered once a step: each microbatch gathers them and "
          "reduce-scatters their gradients (they are dropped at its end)"),
    Plant(PAYLOAD, "\"buffers\": (min(2, L) * d * shard + d * outer_shard + 2 * shard) * b",
          "\"buffers\": (min(2, L) * d * shard + 2 * shard) * b",
          "the buffers without the outer weights gathered whole: during a microbatch every rank holds all of them"),
    # Issue 36's divisor of every train_step, the other way to get it wrong (issue 37).
    Plant(FSDP, "        loss = sum(self.accumulate(tok, tgt, n_tokens) for tok, tgt in\n",
          "        loss = sum(self.accumulate(tok, tgt, real_tokens(tgt)) for tok, tgt in\n",
          "each microbatch divided by its own real tokens: every microbatch's gradient is the mean of its piece, so the "
          "sums over microbatches and ranks are m d times the step's", new=True),
    # A learner run's plants (issue 36's second round): each first blamed on a neighbouring TODO.
    Plant(WEIGHTS, "            buf.layer, buf.version = layer, self.version\n        buf.state = GATHERING\n",
          "            buf.layer, buf.version = layer, self.version\n            buf.state = GATHERING\n",
          "GATHERING set only when a gather is sent: a layer still resident stays FREE, and its get is refused",
          new=True),
    Plant(WEIGHTS, "            buf.pending = None\n        buf.state = IN_USE\n", "            buf.pending = None\n",
          "get hands the block out but leaves the buffer GATHERING: release finds it not in use", new=True),
    Plant(FSDP, "        received = torch.empty_like(self.grad_shards[layer])\n",
          "        received = self.grad_shards[layer]\n",
          "the reduce-scatter writes straight into the gradient shard: it overwrites the sum of the earlier "
          "microbatches, and finish adds the slice to itself", new=True),
    Plant(FSDP, "        self.grad_shards[self.in_flight.layer].add_(self.in_flight.received)\n        self.in_flight = None\n",
          "        self.grad_shards[self.in_flight.layer].add_(self.in_flight.received)\n",
          "the settled reduce-scatter is not forgotten: the next finish adds the same slice again", new=True),
    Plant(PAYLOAD, "\"buffers\": (min(2, L) * d * shard", "\"buffers\": (2 * d * shard",
          "two full-size block buffers counted whatever L: a model of one block only ever fills buffer 0 (a learner "
          "run's plant)", new=True),
]
