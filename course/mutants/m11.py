"""Module 11's planted bugs (schedules as data): see course/mutants/__init__.py."""
from course.mutants import Plant

ACTIONS, EXEC, GEN, STAGE = "m11_actions.py", "m11_executor.py", "m11_generators.py", "m11_stage.py"
PLANTS = [
    Plant(ACTIONS, "match = TEXT.fullmatch(text.strip())", "match = TEXT.fullmatch(text.strip().upper())",
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
    Plant(GEN, """        warmup = min(world_size - r - 1, n_microbatches)
        order = [Action(r, "F", m) for m in range(warmup)]
        for m in range(n_microbatches - warmup):""", """        warmup = min(world_size - r, n_microbatches)
        order = [Action(r, "F", m) for m in range(warmup)]
        for m in range(n_microbatches - warmup):""",
          "1F1B's warm-up one forward too long: rank r holds P - r + 1 microbatches, and the order is not 1F1B's"),
    Plant(GEN, "warmup = min((v - 1) * world_size + 2 * (world_size - r - 1), total)",
          "warmup = min((v - 1) * world_size + (world_size - r - 1), total)",
          "interleaved warm-up of (v-1)P + P-r-1: a rank's first backward comes before its gradient can have arrived"),
    Plant(GEN, 'return Action((v - 1 - (k // world_size) % v) * world_size + r, "B", microbatch(k))',
          'return Action(((k // world_size) % v) * world_size + r, "B", microbatch(k))',
          "interleaved backwards visit a rank's chunks in forward order: the gradient flows from the last chunk back"),
    Plant(GEN, 'add(*[(down, "F")] * (2 * (world_size - r) - 1))', 'add(*[(down, "F")] * (2 * (world_size - r - 1)))',
          "ZB-V's first phase one forward short: 2(P-r)-1 forwards on the way down, not 2(P-r-1)"),
    Plant(GEN, "                order.append(queued.popleft()._replace(kind=\"W\"))",
          "                order.append(queued.pop()._replace(kind=\"W\"))",
          "DualPipeV runs the W of the newest I, not the oldest: its weight gradients come in another order"),
    Plant(GEN, "split = split or (i == (r + 1) // 2 and r % 2 == 1)", "split = split or (i == (r + 1) // 2 and r % 2 == 0)",
          "DualPipeV's cool-down splits B into I and W at the wrong point for odd ranks: the parity swapped"),
    Plant(GEN, 'orders = [[Action(r, "F", m) for m in range(n_microbatches)] + [Action(r, "B", m) for m in range(n_microbatches)]',
          'orders = [[Action(r, "F", m) for m in range(n_microbatches)] + [Action(r, "B", m) for m in reversed(range(n_microbatches))]',
          "GPipe's backwards newest first: valid, but not GPipe's order (torch's runs them oldest first)"),
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
    Plant(STAGE, "(layer.bias, dz.sum(0))", "(layer.bias, dz.mean(0))",
          "the bias gradient averaged over the microbatch's rows: the loss's 1/M scale is already in dz"),
    Plant(EXEC, "for action in schedule.orders[comms.pp.index]:",
          "for action in schedule.orders[comms.pp.ranks[comms.pp.index]]:",
          "a rank's list is at its place in the pipeline's group, not at its global rank: on a mesh they differ"),
]
