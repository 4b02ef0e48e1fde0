"""Module 13's planted bugs (2-D sharding in named axes): see course/mutants/__init__.py."""
from course.mutants import Plant

AXES, LLAMA, COSTS = "m13_named_axes.py", "m13_llama_2d.py", "m13_costs.py"
PLANTS = [
    Plant(COSTS, """    weights = matrix * (2 * L * P + 3 * V * M) + norm * 2 * norms
    gradients = matrix * (L * P + 2 * V * M) + norm * norms""",
          """    weights = matrix * (2 * L * P + 3 * cfg.vocab_size * M) + norm * 2 * norms
    gradients = matrix * (L * P + 2 * cfg.vocab_size * M) + norm * norms""",
          "step_traffic with the unpadded vocabulary: the embedding and LM head are padded to split over t"),
    Plant(COSTS, "    matrix = (d - 1) / (d * t) * b\n", "    matrix = (d * t - 1) / (d * t) * b\n",
          "a matrix's all-gather counted over the whole mesh: its block is W/(dt), but it is gathered over d only"),
    Plant(COSTS, "    norms = 2 * L + 1\n", "    norms = 2 * L\n",
          "the final norm forgotten: 2L + 1 norm weights are gathered and reduced in a step"),
    Plant(COSTS, "    loss = 3 * 2 * (t - 1) / t * N * s + 2 * (d - 1) / d * s\n",
          "    loss = 3 * 2 * (t - 1) / t * N * s\n",
          "the loss's sum over d forgotten: a one-value all-reduce, but traffic all the same"),
    Plant(COSTS, "return StateBytes(values * b, values * b, 2 * values * b)", "return StateBytes(values * b, values * b, values * b)",
          "AdamW keeps two moments per value (exp_avg and exp_avg_sq), not one"),
    Plant(COSTS, "values = (L * (block_matrix_params(cfg) + 2 * M) + 2 * V * M + M) // (d * t)",
          "values = (L * block_matrix_params(cfg) + 2 * V * M) // (d * t)",
          "the norm weights left out of the state: they are sharded over the mesh like the matrices"),
    Plant(AXES, "    for axis in reversed(move.axes):\n", "    for axis in move.axes:\n",
          "the all-gather over the outer axis first: for M/t/d the d blocks of one M/t block must be joined first"),
    Plant(AXES, "    for axis in move.axes:\n        shape = list(block.shape)\n        shape[move.dim] //=",
          "    for axis in reversed(move.axes):\n        shape = list(block.shape)\n        shape[move.dim] //=",
          "the reduce-scatter over the inner axis first: blocks land in the wrong place of M/t/d"),
    Plant(AXES, "    total = x.tensor.clone()\n", "    total = x.tensor\n",
          "the all-reduce sums in place into its input: the caller's unreduced tensor is changed under it"),
    Plant(AXES, "unreduced = frozenset(axis for dim in contracted for axis in dim.axes)", "unreduced = frozenset()",
          "a contraction over a sharded dimension said to be reduced: it is a partial sum until it is reduced"),
    Plant(LLAMA, 'first=self.mesh.index["t"] * rows', 'first=self.mesh.index["d"] * rows',
          "the embedding's rows offset by the d index: the vocabulary is split over t, the wrong axis of the mesh"),
    Plant(LLAMA, """        dn2 = (einsum_unreduced("B/d T F/t, F/t M -> B/d T M", dg, w_gate)
               + einsum_unreduced("B/d T F/t, F/t M -> B/d T M", du, w_up))""",
          """        dn2 = einsum_unreduced("B/d T F/t, F/t M -> B/d T M", dg, w_gate)""",
          "n2 feeds the gate and the up projection: its gradient is the sum of both paths"),
    Plant(LLAMA, '        return dh + reduce_scatter("B/d T M {U_t} -> B/d T M/t", dxg)',
          '        return reduce_scatter("B/d T M {U_t} -> B/d T M/t", dxg)',
          "the attention half's backward drops the residual: dx is dh plus the gradient through the norm"),
    Plant(LLAMA, '        d_head = reduce_scatter("V/t M {U_d} -> V/t M/d", d_head)\n',
          '        d_head = reduce_scatter("V/t M {U_d} -> V/t M/d", d_head)\n        d_head.tensor.mul_(1 / self.mesh.sizes["d"])\n',
          "the head's gradient averaged over d: the loss is already a mean over all tokens, so the sum is right"),
]
