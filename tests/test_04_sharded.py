"""Module 04: each rank holds exactly the monolith's slice, and the relay reproduces its logits.

The pipeline's ranks are a group (course/mesh.py's `Group`): a stage's place is its index in it."""
import pytest
import torch
import torch.distributed as dist

from course.impl import load, reference
from course.launch import run_ranks
from course.mesh import group_of

m04 = load("m04_sharded")
m00 = reference("m00_monolith")
ReferenceComms = reference("m02_comms").PipelineComms  # grade this module, not module 02
cfg = m00.MLPConfig()
WORLD_SIZES = [1, 2, 4, 8, 16]  # every pipeline size that divides 16 layers
# A small model whose sizes differ from the course's (16 layers, width 128, 2 classes), so that a
# number copied from the course's model shows: 12 layers split over 3 or 6 ranks.
SMALL = m00.MLPConfig(layers=12, hidden=8, classes=3)


def pipeline(world_size, rank):
    """Member `rank` of a pipeline over ranks 0 .. world_size - 1 (no process group needed)."""
    return group_of("p", rank, range(world_size))


@pytest.mark.exercises("layer_range")
@pytest.mark.parametrize("cfg, n_stages", [*((cfg, p) for p in WORLD_SIZES), (SMALL, 3), (SMALL, 6)],
                         ids=[*(f"S={p}" for p in WORLD_SIZES), "12 layers, S=3", "12 layers, S=6"])
def test_layer_ranges_split_the_layers_evenly_and_in_order(cfg, n_stages):
    ranges = [list(m04.layer_range(cfg, stage, n_stages)) for stage in range(n_stages)]
    expected = [list(range(s * cfg.layers // n_stages, (s + 1) * cfg.layers // n_stages)) for s in range(n_stages)]
    assert ranges == expected, \
        (f"{cfg.layers} layers in {n_stages} stages: your layer_range gave the ranges {ranges}, expected consecutive blocks of "
         f"cfg.layers // n_stages = {cfg.layers // n_stages}: {expected}")


@pytest.mark.given
def test_uneven_split_is_rejected_with_a_clear_error():
    with pytest.raises(ValueError, match="16 layers cannot be split evenly into 3 stages"):
        m04.layer_range(cfg, 0, 3)


@pytest.mark.exercises("ShardedMLP.__init__", "layer_range")
@pytest.mark.parametrize("cfg, world_size", [*((cfg, p) for p in WORLD_SIZES), (SMALL, 3)],
                         ids=[*(f"p={p}" for p in WORLD_SIZES), "12 layers, width 8, 3 classes, p=3"])
def test_every_rank_starts_from_its_slice_of_the_monolith(cfg, world_size):
    monolith = m00.build_model(cfg)
    for rank in range(world_size):
        torch.manual_seed(1234 + rank)  # whatever the rank drew before must not matter
        shard = m04.ShardedMLP(cfg, pipeline(world_size, rank))
        first = rank * cfg.layers // world_size
        assert len(shard.layers) == cfg.layers // world_size, \
            (f"world {world_size}, rank {rank}: your ShardedMLP.__init__ keeps {len(shard.layers)} layers, expected "
             f"{cfg.layers // world_size} (the indices in `mine`)")
        for i, layer in enumerate(shard.layers):
            reference_layer = monolith.layers[first + i]
            assert torch.equal(layer.weight, reference_layer.weight) and torch.equal(layer.bias, reference_layer.bias), \
                (f"world {world_size}, rank {rank}: layer {first + i} built by your ShardedMLP.__init__ does not equal "
                 f"the monolith's" + (" (rank 0's layers do: they are the first draws after the seed)"
                                      if rank > 0 else " (whatever the process drew before must not matter)"))
        if rank == world_size - 1:
            assert shard.head is not None, \
                f"rank {rank} is the last of {world_size}: your ShardedMLP.__init__ must give it the head"
            assert torch.equal(shard.head.weight, monolith.head.weight) and torch.equal(shard.head.bias, monolith.head.bias), \
                (f"your ShardedMLP.__init__: the last rank's head differs from the monolith's (weight shape {tuple(shard.head.weight.shape)}, expected "
                 f"{tuple(monolith.head.weight.shape)}): hidden to classes, created after all the layers")
        else:
            assert shard.head is None, f"rank {rank} of {world_size}: your ShardedMLP.__init__ gives it a head; only the last rank holds one"
    total = sum(p.numel() for p in monolith.parameters())
    held = sum(sum(p.numel() for p in m04.ShardedMLP(cfg, pipeline(world_size, r)).parameters()) for r in range(world_size))
    assert held == total, \
        (f"the shards your ShardedMLP.__init__ builds hold {held} parameters together, the monolith {total}: are the layers "
         "registered as parameters (a plain list is not)?")


def _forward(cfg, world_size):
    comms = ReferenceComms()  # every rank of the job, in rank order
    model = m04.ShardedMLP(cfg, comms.pp)
    x, _ = m00.make_batch(cfg)
    if dist.get_rank() > 0:  # the contract: the other ranks only read the batch's number of rows from x
        x = x[:, :1]
    with torch.no_grad():
        return m04.sharded_forward(model, comms, x)


@pytest.mark.exercises("sharded_forward", "ShardedMLP.__init__", "layer_range")
@pytest.mark.parametrize("cfg, world_size", [(cfg, 1), (cfg, 2), (cfg, 4), (SMALL, 3)],
                         ids=["p=1", "p=2", "p=4", "12 layers, width 8, 3 classes, p=3"])
def test_relay_reproduces_the_monolith_logits_bit_for_bit(cfg, world_size):
    outputs = run_ranks(_forward, world_size, cfg, world_size, timeout=30)
    x, _ = m00.make_batch(cfg)
    monolith = m00.build_model(cfg)
    with torch.no_grad():
        expected = monolith(x)
    logits = outputs[-1]
    assert isinstance(logits, torch.Tensor) and logits.shape == expected.shape, \
        (f"your sharded_forward on the last rank returned {tuple(logits.shape) if isinstance(logits, torch.Tensor) else repr(logits)}, "
         f"expected logits of shape {tuple(expected.shape)} (batch, classes)")
    assert torch.equal(logits, expected), \
        (f"the logits of your sharded_forward differ from the monolith's: max |difference| "
         f"{(logits - expected).abs().max().item():.3e}; expected 0")
    # Every other rank returns its own output, the activation it sent on: the monolith's after that rank's layers.
    per_rank, hidden = cfg.layers // world_size, x
    for rank, got in enumerate(outputs[:-1]):
        with torch.no_grad():
            for layer in monolith.layers[rank * per_rank:(rank + 1) * per_rank]:
                hidden = torch.relu(layer(hidden))
        assert isinstance(got, torch.Tensor) and torch.equal(got, hidden), \
            (f"your sharded_forward on rank {rank} of {world_size} returned {'a tensor' if isinstance(got, torch.Tensor) else repr(got)} "
             f"{tuple(got.shape) if isinstance(got, torch.Tensor) else ''}, expected its output: the activation "
             f"after layers {rank * per_rank}..{(rank + 1) * per_rank - 1}, shape {tuple(hidden.shape)} "
             "(not the input it received)")
