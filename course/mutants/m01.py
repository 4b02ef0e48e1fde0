"""Module 01's planted bugs (manual split): see course/mutants/__init__.py."""
from course.mutants import Plant

F = "m01_manual_split.py"
PLANTS = [
    Plant(F, "for _ in range(cfg.layers - cfg.layers // 2))", "for _ in range(cfg.layers // 2))",
          "part two counts 'half' again instead of 'the rest': an odd layer count loses a layer"),
    Plant(F, """        self.layers = nn.ModuleList(
            nn.Linear(cfg.hidden, cfg.hidden) for _ in range(cfg.layers - cfg.layers // 2))
        self.head = nn.Linear(cfg.hidden, cfg.classes)""",
          """        self.head = nn.Linear(cfg.hidden, cfg.classes)
        self.layers = nn.ModuleList(
            nn.Linear(cfg.hidden, cfg.hidden) for _ in range(cfg.layers - cfg.layers // 2))""",
          "the head created before the layers draws the random stream in another order: not the monolith's weights"),
    Plant(F, "    received = hidden.detach().requires_grad_()\n", "    received = hidden\n",
          "part two handed the activation itself, not a leaf: one graph, no cut a second device could have"),
    Plant(F, "    hidden.backward(received.grad)\n", "",
          "part one's backward never started from the gradient handed back: part one learns nothing"),
    Plant(F, "    hidden.backward(received.grad)\n", "    hidden.backward(torch.ones_like(hidden))\n",
          "part one's backward started from ones, not from dloss/dhidden: wrong gradients in part one"),
    Plant(F, "    loss = F.cross_entropy(part_two(received), y)\n",
          "    loss = F.cross_entropy(part_two(received), y, reduction=\"sum\")\n",
          "the loss summed over the batch, not averaged: every gradient is batch-size times the monolith's"),
    Plant(F, "        self.layers = nn.ModuleList(\n            nn.Linear(cfg.hidden, cfg.hidden) for _ in range(cfg.layers - cfg.layers // 2))",
          "        torch.manual_seed(cfg.seed)\n        self.layers = nn.ModuleList(\n"
          "            nn.Linear(cfg.hidden, cfg.hidden) for _ in range(cfg.layers - cfg.layers // 2))",
          "part two seeds again: its layers take the stream's first draws, part one's, not the monolith's layers k ..",
          new=True),
    Plant(F, "    received = hidden.detach().requires_grad_()\n", "    received = hidden.detach()\n",
          "the leaf part two receives does not require grad: no .grad to start part one's backward from", new=True),
    Plant(F, "        self.layers = nn.ModuleList(\n            nn.Linear(cfg.hidden, cfg.hidden) for _ in range(cfg.layers - cfg.layers // 2))",
          "        self.layers = [\n            nn.Linear(cfg.hidden, cfg.hidden) for _ in range(cfg.layers - cfg.layers // 2)]",
          "part two's layers in a plain list: not parameters, so the optimizer never updates them (TODO 2, not train_step)",
          new=True),
]
