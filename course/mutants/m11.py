"""Module 11's planted bugs (schedules as data): see course/mutants/__init__.py."""
from course.mutants import Plant

ACTIONS, EXEC, GEN, STAGE = "m11_actions.py", "m11_executor.py", "m11_generators.py", "m11_stage.py"
PLANTS = [
    Plant(ACTIONS, "\n        match = TEXT.fullmatch(text.strip())", "\n        match = TEXT.fullmatch(text.strip().upper())",
          "lowercase text accepted ('2f0'): the text form is the inverse of __str__, which writes F, B, I, W"),
    Plant(GEN, """        warmup = min(world_size - r - 1, n_microbatches)
        order = [Action(r, "F", m) for m in range(warmup)]
        weights_done = 0""", """        warmup = world_size - r - 1
        order = [Action(r, "F", m) for m in range(warmup)]
        weights_done = 0""",
          "ZB-H1's warm-up not capped at M: with fewer microbatches than stages it forwards ones that do not exist"),
    Plant(GEN, "            if k >= r:  # rank r keeps its first r W's for the cool-down",
          "            if k > r:  # rank r keeps its first r W's for the cool-down",
          "ZB-H1 holds back r + 1 W's, not r: a later W than the schedule's, so more held memory and another order"),
    Plant(GEN, "warmup = min((v - 1) * g + 2 * (world_size - r - 1), total)",
          "warmup = min((v - 1) * g + (world_size - r - 1), total)",
          "interleaved warm-up of (v-1)P + P-r-1: a rank's first backward comes before its gradient can have arrived"),
    Plant(GEN, 'return Action((v - 1 - (k // g) % v) * world_size + r, "B", microbatch(k))',
          'return Action(((k // g) % v) * world_size + r, "B", microbatch(k))',
          "interleaved backwards visit a rank's chunks in forward order: the gradient flows from the last chunk back"),
    Plant(GEN, 'add(*[(down, "F")] * (2 * (world_size - r) - 1))', 'add(*[(down, "F")] * (2 * (world_size - r - 1)))',
          "ZB-V's first phase one forward short: 2(P-r)-1 forwards on the way down, not 2(P-r-1)"),
    Plant(GEN, "                order.append(queued.popleft()._replace(kind=\"W\"))",
          "                order.append(queued.pop()._replace(kind=\"W\"))",
          "DualPipeV runs the W of the newest I, not the oldest: its weight gradients come in another order"),
    Plant(GEN, "split = split or (i == (r + 1) // 2 and r % 2 == 1)", "split = split or (i == (r + 1) // 2 and r % 2 == 0)",
          "DualPipeV's cool-down splits B into I and W at the wrong point for odd ranks: the parity swapped"),
    Plant(EXEC, "    return sum(shares) if shares else None", "    return torch.stack(shares).sum() if shares else None",
          "the loss summed in another order (torch's pairwise sum, not the microbatches in order): not bit for bit"),
    Plant(EXEC, "        sends.append(comms.send(out, \"act\", action.stage + 1, m))", "        comms.send(out, \"act\", action.stage + 1, m)",
          "a forward send's handle dropped: never waited, so the step may end (or the buffer change) before it is delivered"),
    Plant(EXEC, "    wait_all(sends)\n    return sum(shares)", "    return sum(shares)",
          "run_schedule returns without waiting for its sends: messages may still be in flight at the next step"),
    Plant(STAGE, "dz = torch.where(outputs[index] > 0, dy, 0.0)", "dz = torch.where(outputs[index] >= 0, dy, 0.0)",
          "ReLU's mask with >= 0: a ReLU output is never negative, so no gradient is masked at all"),
    Plant(STAGE, """                if param.grad is None:
                    param.grad = grad
                else:
                    param.grad += grad""", """                param.grad = grad""",
          "W overwrites .grad instead of accumulating: only the last microbatch's weight gradient survives"),
    Plant(STAGE, "dz.t() @ x), (layer.bias, dz.sum(0))):\n", "dz.t() @ x), (layer.bias, dz.mean(0))):\n",
          "the bias gradient averaged over the microbatch's rows: the loss's 1/M scale is already in dz"),
    Plant(EXEC, "\n    for action in schedule.orders[comms.pp.index]:",
          "\n    for action in schedule.orders[comms.pp.ranks[comms.pp.index]]:",
          "a rank's list is at its place in the pipeline's group, not at its global rank: on a mesh they differ"),
    # issue 25: ZB-H2, and interleaved 1F1B for every m torch accepts
    Plant(GEN, "warmup = min(2 * (world_size - r - 1), n_microbatches)",
          "warmup = min(2 * (world_size - r) - 1, n_microbatches)",
          "ZB-H2's warm-up one forward too long (2(p-r)-1 before the round's own F): every rank keeps 2p microbatches"),
    Plant(GEN, "warmup = min(2 * (world_size - r - 1), n_microbatches)",
          "warmup = min(world_size - r - 1, n_microbatches)",
          "ZB-H2 with ZB-H1's warm-up: rank r waits for its first gradient, idle time stays inside the spans"),
    Plant(GEN, "warmup = min(2 * (world_size - r - 1), n_microbatches)", "warmup = 2 * (world_size - r - 1)",
          "ZB-H2's warm-up not capped at m: with m < 2p-1 it forwards microbatches that do not exist"),
    Plant(GEN, "if k >= 2 * r:  # rank r keeps its first 2r W's for the cool-down",
          "if k >= r:  # rank r keeps its first 2r W's for the cool-down",
          "ZB-H2 holding back ZB-H1's r W's: the cool-down keeps gaps, the last ranks idle inside their spans"),
    Plant(GEN, "if k >= 2 * r:  # rank r keeps its first 2r W's for the cool-down",
          "if k > 2 * r:  # rank r keeps its first 2r W's for the cool-down",
          "ZB-H2 holding back 2r + 1 W's: one more microbatch kept on every rank, and another order"),
    Plant(GEN, "if k >= 2 * r:  # rank r keeps its first 2r W's for the cool-down",
          "if k < n_microbatches - 2 * r:  # rank r keeps its first 2r W's for the cool-down",
          "ZB-H2 deferring the wrong W's: the last 2r instead of the first, so the early rounds run W's "
          "where the forwards should go"),
    Plant(GEN, "    g = microbatches_per_round(world_size, n_microbatches)\n    for r in range(world_size):",
          "    g = world_size\n    for r in range(world_size):",
          "interleaved's groups of p where m is not a multiple of p: microbatches that do not exist, not torch's order"),
    Plant(GEN, "warmup = min((v - 1) * g + 2 * (world_size - r - 1), total)",
          "warmup = min((v - 1) * world_size + 2 * (world_size - r - 1), total)",
          "interleaved's warm-up counted in groups of p, not of g: torch's order only where p divides m"),
    # issue 26: the counts the chapter's arguments give (ZB-V's, carried to DualPipeV), the executor's messages
    Plant(GEN, """        for _ in range(p - r - 1):
            add((up, "I"))""", """        for _ in range(p - r):
            add((up, "I"))""",
          "DualPipeV's phase 3 one round too long: phase 4's first B(down) had its gradient a round earlier"),
    Plant(GEN, 'add(*[(up, "F"), (up, "I"), (up, "W")] * (world_size - r))',
          'add(*[(up, "F"), (up, "I"), (up, "W")] * (world_size - r - 1))',
          "ZB-V's phase 3 one round short (p-r-1): the first I(down) comes before its gradient can have arrived"),
    Plant(GEN, 'add(*[(down, "I"), (up, "I")] * r)', 'add(*[(up, "I"), (down, "I")] * r)',
          "ZB-V's cool-down turns start with up's I: valid, but not ZB-V's order (down's gradient arrives first)"),
    Plant(EXEC, 'sends.append(comms.send(grad_input, "grad", action.stage - 1, m))',
          'sends.append(comms.send(grad_input, "grad", action.stage, m))',
          "the input gradient named after the stage that sends it: a message is named by the stage that receives it"),
    # issue 26 (helper b): the scorecard's help names the planted function (stage: I or W; executor: which of the two)
    Plant(STAGE, "((layer.weight, dz.t() @ x), (layer.bias, dz.sum(0))):\n",
          "((layer.weight, x.t() @ dz), (layer.bias, dz.sum(0))):\n",
          "W's weight gradient transposed (x^T dz): square for the hidden layers, so it runs there; the head's is not"),
    Plant(EXEC, 'backward = stage.backward if action.kind == "B" else stage.backward_input',
          'backward = stage.backward if action.kind in ("B", "I") else stage.backward_input',
          "I run as a whole B: the weight gradient is computed at I, and the W that follows runs it again"),
    Plant(EXEC, """    elif action.kind == "W":
        stage.backward_weight(m)""", """    elif action.kind == "W":
        pass""",
          "W skipped: no weight gradient ever reaches .grad on a zero-bubble schedule's stages"),
    # issue 37 (helper d1112): plausible mistakes of the rewritten TODOs, each to be caught and blamed on its own TODO
    Plant(GEN, "            if k >= r:  # rank r keeps its first r W's for the cool-down",
          "            if k >= world_size - 1 - r:  # rank r keeps its first r W's for the cool-down",
          "ZB-H1's mirror image: rank r holds back p-1-r W's, so rank 0 keeps nearly 2p microbatches", new=True),
    Plant(GEN, "warmup = min((v - 1) * g + 2 * (world_size - r - 1), total)",
          "warmup = min((v - 1) * g + 2 * (world_size - r - 1) + 1, total)",
          "interleaved's warm-up one forward too long: valid, but one more activation kept and not Megatron-LM's order",
          new=True),
    Plant(GEN, "            return (k // (g * v)) * g + k % g", "            return (k // v) % g + (k // (g * v)) * g",
          "interleaved's k-th forward takes the microbatches round the local stages one by one, not a group at a time",
          new=True),
    Plant(GEN, 'add(*[(down, "F")] * (2 * (p - r - 1)))', 'add(*[(down, "F")] * (2 * (p - r) - 1))',
          "DualPipeV's phase 1 with ZB-V's count: one forward of down too many before up's first", new=True),
    Plant(GEN, """        for _ in range(r + 1):
            weight()
        orders.append(order)""", """        for _ in range(r):
            weight()
        orders.append(order)""",
          "DualPipeV's last phase one W short: a W left in the queue never computes its weight gradient", new=True),
    Plant(STAGE, "            dy = None if index == 0 and self.is_first else dz @ linears[index].weight",
          "            dy = dz @ linears[index].weight",
          "I computes the first stage's input gradient too: a matmul for a gradient nobody uses", new=True),
    Plant(STAGE, "        saved = self.saved.pop(microbatch)\n", "        saved = self.saved[microbatch]\n",
          "W reads the microbatch's activations without freeing them: every microbatch stays alive to the end", new=True),
    Plant(EXEC, '        grad = None if stage.is_last else comms.recv("grad", action.stage, m, shape)',
          '        grad = None if stage.is_last else comms.recv("grad", action.stage + 1, m, shape)',
          "the gradient asked for under the name of the stage that sends it: a message is named by its receiver",
          new=True),
]
