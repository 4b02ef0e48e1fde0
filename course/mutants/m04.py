"""Module 04's planted bugs (the sharded model): see course/mutants/__init__.py."""
from course.mutants import Plant

F = "m04_sharded.py"
PLANTS = [
    Plant(F, "\n    return range(stage * per_stage, (stage + 1) * per_stage)", "\n    return range(stage, cfg.layers, n_stages)",
          "round-robin layers (rank, rank + P, ...): not consecutive, so the relay applies them out of order"),
    Plant(F, "\n    return range(stage * per_stage, (stage + 1) * per_stage)",
          "\n    return range(stage * per_stage, (stage + 1) * per_stage + 1)",
          "one layer too many per rank, off by one at the end: neighbouring ranks both apply a layer"),
    Plant(F, "self.head = nn.Linear(cfg.hidden, cfg.classes) if self.is_last else None",
          "self.head = nn.Linear(cfg.hidden, cfg.classes)",
          "a head on every rank: parameters no rank uses, so a rank's memory is not its share of the model"),
    Plant(F, """        kept = []
        for index in range(cfg.layers):
            layer = nn.Linear(cfg.hidden, cfg.hidden)  # every rank draws every layer's weights
            if index in mine:
                kept.append(layer)""",
          """        kept = [nn.Linear(cfg.hidden, cfg.hidden) for _ in mine]""",
          "each rank draws only its own layers: they take the first draws of the stream, not the monolith's weights"),
    Plant(F, "        torch.manual_seed(cfg.seed)\n        kept = []\n", "        kept = []\n",
          "no seed: each rank's layers start from whatever the random stream holds, not the monolith's weights"),
    Plant(F, "torch.manual_seed(cfg.seed)\n        kept = []", "torch.manual_seed(cfg.seed + pp.index)\n        kept = []",
          "a seed per rank: different random streams, so the layers are not the monolith's"),
    Plant(F, "        x = comms.recv_forward((x.shape[0], model.hidden))\n", "        x = comms.recv_forward(x.shape)\n",
          "the receive sized from x: later ranks may be handed only the batch's rows, so the shape is wrong"),
    Plant(F, "    out = model(x)\n    if not model.is_last:\n        comms.send_forward(out)\n    return out\n",
          "    out = model(x)\n    if not model.is_last:\n        comms.send_forward(out)\n        return None\n    return out\n",
          "the middle ranks return None: each rank must return its output (its stage's activations)"),
    Plant(F, "    out = model(x)\n    if not model.is_last:\n        comms.send_forward(out)\n    return out\n",
          "    out = model(x)\n    comms.send_forward(out)\n    return out\n",
          "the last rank sends its logits on too: there is no next stage (the comms raise their clear error)", new=True),
    Plant(F, """        torch.manual_seed(cfg.seed)
        kept = []
        for index in range(cfg.layers):
            layer = nn.Linear(cfg.hidden, cfg.hidden)  # every rank draws every layer's weights
            if index in mine:
                kept.append(layer)
        self.layers = nn.ModuleList(kept)
        self.head = nn.Linear(cfg.hidden, cfg.classes) if self.is_last else None""",
          """        torch.manual_seed(cfg.seed)
        self.head = nn.Linear(cfg.hidden, cfg.classes) if self.is_last else None
        kept = []
        for index in range(cfg.layers):
            layer = nn.Linear(cfg.hidden, cfg.hidden)  # every rank draws every layer's weights
            if index in mine:
                kept.append(layer)
        self.layers = nn.ModuleList(kept)""",
          "the head drawn first on the last rank: its layers and its head take other draws than the monolith's",
          new=True),
]
