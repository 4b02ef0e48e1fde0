"""Module 07's planted bugs (FSDP): see course/mutants/__init__.py."""
from course.mutants import Plant

FLAT, FSDP, PAYLOAD, WEIGHTS = "m07_flat_shards.py", "m07_fsdp.py", "m07_payload.py", "m07_sharded_weights.py"
PLANTS = [
    Plant(FLAT, "self.shard_numel = -(-self.numel // world_size)", "self.shard_numel = self.numel // world_size",
          "shard size rounded down: when N does not divide the block's numel, its last elements belong to no rank"),
    Plant(FLAT, "        start = rank * self.shard_numel\n        return flat[start:start + self.shard_numel]",
          "        start = rank * self.shard_numel\n        return flat[start:start + self.shard_numel].clone()",
          "the shard returned as a copy, not a view: writing a rank's shard no longer writes its slice of the buffer"),
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
    Plant(FSDP, "            acc.add_(g)\n", "            acc.add_(g / self.dp.size)\n",
          "the replicated weights' gradients averaged over d (as DDP does): each rank's loss is already divided by the "
          "global batch's tokens, so their sum over ranks is the mean, and these get 1/d of theirs"),
    Plant(FSDP, "        optimizer.step()\n        self.weights.invalidate()\n", "        optimizer.step()\n",
          "the gathered blocks not invalidated after the step: the next step reuses last step's weights"),
    Plant(FSDP, """            self.weights.release(layer)
            self.reduce_scatter_grad(layer, grads)
        self.finish_reduce_scatter()""", """            self.weights.release(layer)
            self.reduce_scatter_grad(layer, grads)""",
          "the last block's reduce-scatter never finished: layer 0's gradient shard misses it"),
    Plant(WEIGHTS, "if buf.layer == layer and buf.version == self.version:", "if buf.layer == layer:",
          "a resident block reused without checking its version: after a step it holds the old weights"),
    Plant(WEIGHTS, "            buf.pending.wait()\n            buf.pending = None\n", "            buf.pending = None\n",
          "the gathered block handed out before its all-gather is waited for: other ranks' shards are missing"),
    Plant(PAYLOAD, "turns = 2 * n_microbatches - 1", "turns = 2 * n_microbatches",
          "one turn too many: the forward of one microbatch and the backward of the next are one turn, not two"),
    Plant(PAYLOAD, "    shard = -(-block // d)\n", "    shard = block // d\n",
          "the shard's bytes without padding: a shard is the padded block over N, rounded up"),
    Plant(WEIGHTS, "        # Hint 3: the buffer's state becomes FREE, and nothing else changes\n        buf.state = FREE\n",
          "        buf.state, buf.layer = FREE, -1\n",
          "release forgets which layer the buffer holds: the blocks still there at the turns are gathered again"),
    Plant(WEIGHTS, "            buf.layer, buf.version = layer, self.version\n", "            buf.layer = layer\n",
          "the buffer's version never recorded: a block still there and current is never reused"),
    Plant(FSDP, "        mine = slice(self.dp.index * rows, (self.dp.index + 1) * rows)\n",
          "        mine = slice(0, rows)\n",
          "every rank trains on the first rows: the other ranks' rows are never seen, the first ones d times"),
    Plant(FSDP, "        self.dp.collectives.all_reduce(flat, label=\"replicated grads\")\n",
          "        self.dp.collectives.all_reduce(flat, label=\"replicated grads\")\n        flat /= self.dp.size\n",
          "the replicated gradients averaged after their sum (as DDP does): each rank's part is already divided by "
          "the global batch's tokens, so the sum is the mean"),
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
]
