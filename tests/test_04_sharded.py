"""Module 04: each rank holds exactly the monolith's slice, and the relay reproduces its logits."""
import pytest
import torch
import torch.distributed as dist

from course.impl import load, reference
from course.launch import run_ranks

m04 = load("m04_sharded")
m00 = reference("m00_monolith")
ReferenceComms = reference("m02_comms").PipelineComms  # grade this module, not module 02
cfg = m00.MLPConfig()
WORLD_SIZES = [1, 2, 4, 8, 16]  # every world size that divides 16 layers


@pytest.mark.exercises("layer_range")
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_layer_ranges_split_the_layers_evenly_and_in_order(world_size):
    ranges = [list(m04.layer_range(cfg, rank, world_size)) for rank in range(world_size)]
    assert sum(ranges, []) == list(range(cfg.layers)), f"ranges {ranges} do not cover 0..15 in order"
    assert {len(r) for r in ranges} == {cfg.layers // world_size}


@pytest.mark.given
def test_uneven_split_is_rejected_with_a_clear_error():
    with pytest.raises(ValueError, match="16 layers cannot be split evenly over 3 ranks"):
        m04.layer_range(cfg, 0, 3)


@pytest.mark.exercises("layer_range", "ShardedMLP.__init__")
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_every_rank_starts_from_its_slice_of_the_monolith(world_size):
    monolith = m00.build_model(cfg)
    for rank in range(world_size):
        torch.manual_seed(1234 + rank)  # whatever the rank drew before must not matter
        shard = m04.ShardedMLP(cfg, rank, world_size)
        first = rank * cfg.layers // world_size
        assert len(shard.layers) == cfg.layers // world_size, f"rank {rank} holds {len(shard.layers)} layers"
        for i, layer in enumerate(shard.layers):
            reference_layer = monolith.layers[first + i]
            assert torch.equal(layer.weight, reference_layer.weight) and torch.equal(layer.bias, reference_layer.bias), \
                f"world {world_size}, rank {rank}: layer {first + i} does not equal the monolith's"
        if rank == world_size - 1:
            assert torch.equal(shard.head.weight, monolith.head.weight) and torch.equal(shard.head.bias, monolith.head.bias), \
                "last rank's head differs from the monolith's"
        else:
            assert shard.head is None, f"rank {rank} must not hold the head"
    total = sum(p.numel() for p in monolith.parameters())
    held = sum(sum(p.numel() for p in m04.ShardedMLP(cfg, r, world_size).parameters()) for r in range(world_size))
    assert held == total, f"the ranks hold {held} parameters together, the monolith {total}"


def _forward(world_size):
    rank = dist.get_rank()
    model = m04.ShardedMLP(cfg, rank, world_size)
    x, _ = m00.make_batch(cfg)
    with torch.no_grad():
        return m04.sharded_forward(model, ReferenceComms(rank, world_size), x)


@pytest.mark.exercises("layer_range", "ShardedMLP.__init__", "sharded_forward")
@pytest.mark.parametrize("world_size", [2, 4])
def test_relay_reproduces_the_monolith_logits_bit_for_bit(world_size):
    outputs = run_ranks(_forward, world_size, world_size, timeout=30)
    x, _ = m00.make_batch(cfg)
    with torch.no_grad():
        expected = m00.build_model(cfg)(x)
    logits = outputs[-1]
    assert logits.shape == expected.shape, f"last rank returned shape {tuple(logits.shape)}"
    assert torch.equal(logits, expected), f"max |difference| {(logits - expected).abs().max().item():.3e}; expected 0"
    assert all(o.shape == (cfg.batch, cfg.hidden) for o in outputs[:-1]), "middle ranks return activations"
