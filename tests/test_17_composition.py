"""Module 17 composition: which group each kind of message runs over, on meshes of 4 ranks, against the
mesh's own arithmetic (rank = ((i_p d + i_d) c + i_c) t + i_t, course/mesh.py); and the given checks
that refuse, in one line before any rank starts, a mesh the model cannot be cut over."""
import functools
import itertools

import pytest

from course.impl import load, reference
from course.launch import run_ranks
from course.mesh import MeshError, check_mesh, init_mesh

composition = load("m17_composition")
given = reference("m17_composition")
moe_stage = reference("m17_moe_stage")
MoEConfig = reference("m16_router").MoEConfig

MESHES = {"p2 d2": {"p": 2, "d": 2}, "p2 t2": {"p": 2, "t": 2}, "d2 c2, e2": {"d": 2, "c": 2, "e": 2},
          "c2 t2": {"c": 2, "t": 2}}
FIELDS = ("pp", "data", "cp", "tp", "fsdp", "replicas", "experts", "expert_data")


def _groups(meshes):
    out = {}
    for name, sizes in meshes.items():
        groups = composition.compose_groups(init_mesh(given.full_sizes(sizes)))
        out[name] = {f: None if getattr(groups, f) is None else getattr(groups, f).ranks for f in FIELDS}
    return out


@functools.cache
def groups_on_4_ranks():
    return run_ranks(_groups, 4, MESHES, timeout=60)


def expected_groups(sizes: dict, rank: int) -> dict:
    """Each field's ranks, from the rank formula: the ranks that differ from this one only along its axes."""
    full = given.full_sizes(sizes)
    axes = ("p", "d", "c", "t")
    grid = list(itertools.product(*(range(full[a]) for a in axes)))  # row-major: the rank is the position
    me = dict(zip(axes, grid[rank]))

    def along(*free):
        return tuple(r for r, place in enumerate(grid) if all(place[i] == me[a] for i, a in enumerate(axes)
                                                             if a not in free))
    groups = {"pp": along("p"), "data": along("d"), "cp": along("c"), "tp": along("t"), "fsdp": along("d", "c"),
              "replicas": along("d", "c"), "experts": None, "expert_data": None}
    if "e" in sizes:
        pool, e = along("d", "c"), sizes["e"]
        j = pool.index(rank)
        groups["experts"] = pool[j // e * e:(j // e + 1) * e]
        groups["expert_data"] = pool[j % e::e]
    return groups


WHY = {"pp": "the pipeline's neighbours: the ranks that differ only along p (same rows, positions and slice)",
       "data": "the ranks that split the batch's rows", "cp": "the ranks that split each sequence's positions",
       "tp": "the ranks that split the heads and FFN units", "fsdp": "the d x c ranks that hold the same t slice "
       "of the same stage's blocks", "replicas": "the d x c ranks that hold the same copy and saw other tokens",
       "experts": "the expert group (module 16's e)", "expert_data": "the ranks holding the same experts (ed)"}


@pytest.mark.exercises("compose_groups")
@pytest.mark.parametrize("name", MESHES)
def test_each_message_runs_over_the_ranks_that_share_what_it_combines(name):
    for rank, per_mesh in enumerate(groups_on_4_ranks()):
        want = expected_groups(MESHES[name], rank)
        for field in FIELDS:
            assert per_mesh[name][field] == want[field], \
                (f"mesh {name}, rank {rank}: groups.{field} has ranks {per_mesh[name][field]}, expected {want[field]}: "
                 f"{WHY[field]}")


@pytest.mark.given
@pytest.mark.parametrize("sizes, kwargs, message", [
    ({"p": 3}, {}, "p x v = 3 does not divide n_layers L=4"),
    ({"p": 2}, {"stages_per_rank": 4}, "p x v = 8 does not divide n_layers L=4"),
    ({"t": 3}, {}, "t=3 does not divide n_heads H=8, n_kv_heads K=4, ffn_dim F=64"),
    ({"c": 3}, {}, "c=3 does not divide sequence length T=16"),
    ({"c": 8, "t": 4}, {}, "c x t = 32 does not divide sequence length T=16"),
    ({"d": 3}, {"batch": 8}, "d x m = 6 does not divide batch B=8"),
    ({"d": 4, "e": 4}, {"n_experts": 6}, "e=4 does not divide experts E=6"),
])
def test_a_mesh_that_does_not_fit_the_model_is_one_line_naming_what_to_change(sizes, kwargs, message):
    with pytest.raises(ValueError) as refused:
        given.check_composition(given.CONFIG, sizes, kwargs.pop("batch", 8), 2, **kwargs)
    assert message in str(refused.value) and "\n" not in str(refused.value), str(refused.value)


@pytest.mark.given
def test_a_mesh_that_is_not_the_job_and_a_moe_mesh_with_t_are_refused():
    with pytest.raises(MeshError, match="the mesh p=2 x d=2 x t=2 has 8 ranks, the job has 4"):
        check_mesh({"p": 2, "d": 2, "t": 2}, 4)
    with pytest.raises(ValueError, match="the MoE model runs with t=1 and c=1"):
        moe_stage.check_moe_mesh({"d": 2, "t": 2}, MoEConfig())


def demo_args(*argv, world_size=8):
    """`python main.py run 17`'s options as main.py parses them (the demo's own parser), before any rank starts."""
    import argparse

    from course.demos import m17 as demo
    parser = argparse.ArgumentParser()
    demo.add_args(parser)
    args = parser.parse_args(list(argv))
    args.world_size = world_size
    return demo, args


@pytest.mark.given
@pytest.mark.parametrize("argv, world_size, message", [
    ((), 4, "the mesh p=2 x d=2 x t=2 has 8 ranks, the job has 4"),
    (("--mesh", "p=3,d=1,t=2",), 6, "p x v = 3 does not divide n_layers L=4"),
    (("--mesh", "d=2,t=4", "--dim", "36"), 8, "--dim 36: the model has 4 heads"),
    (("--mesh", "t=8",), 8, "t=8 does not divide n_heads H=4"),
    (("--mesh", "d=2,c=4", "--seq-len", "34"), 8, "c=4 does not divide sequence length T=34"),
    (("--mesh", "d=2,c=4", "--seq-len", "36"), 8, "the zigzag layout cuts the sequence into 2c = 8 equal pieces"),
    (("--mesh", "d=8",), 8, "d x m = 32 does not divide batch B=16"),
    (("--mesh", "d=8,e=8", "--experts", "6"), 8, "e=8 does not divide experts E=6"),
    (("--mesh", "d=8,e=8", "--experts", "8", "--recompute"), 8,
     "the MoE model runs without recompute"),
    (("--schedule", "zbh1",), 8, "the zero-bubble schedules need the backward split into I and W"),
])
def test_the_run_refuses_a_bad_mesh_in_one_line_before_any_rank_starts(argv, world_size, message):
    demo, args = demo_args(*argv, world_size=world_size)
    with pytest.raises(ValueError) as refused:
        demo.check_args(args)
    assert message in str(refused.value) and "\n" not in str(refused.value), str(refused.value)


@pytest.mark.given
def test_the_run_refuses_a_checkpoint_of_another_model_before_any_rank_starts(tmp_path):
    import json

    from course.chars import load_chars
    checkpoint = reference("m17_checkpoint")
    demo, args = demo_args("--resume", str(tmp_path), "--dim", "64")
    other = demo.config(args, load_chars().vocab_size)
    saved = tmp_path / "step_000200"
    saved.mkdir()
    (saved / ".metadata").write_bytes(b"")
    (saved / "config.json").write_text(json.dumps(checkpoint.describe(other, load_chars().chars)))
    demo, args = demo_args("--resume", str(tmp_path))  # the default --dim 128
    with pytest.raises(ValueError) as refused:
        demo.check_args(args)
    assert "dim=64 (this run: 128)" in str(refused.value) and "\n" not in str(refused.value), str(refused.value)
    demo, args = demo_args("--checkpoint-dir", str(tmp_path))
    with pytest.raises(ValueError, match="holds an earlier run's checkpoints: continue it with --resume"):
        demo.check_args(args)
