"""Module 17, part 6 - checkpoints with torch.distributed.checkpoint (DCP): saved in the model's own
shapes, loaded onto any mesh, never half-written.

FSDP's flat shards are no layout for a checkpoint: a shard is a run of a block's flattened t slice
(one tensor's end, the next one's start, cut where d c and t put the cut), readable only on the mesh
that wrote it. DCP saves each tensor as one global tensor of its logical shape, every rank writing
the chunks it holds with their offsets, and loads onto any other cut by reading, for each rank's new
pieces, the saved chunks they overlap. So every weight (and AdamW's two moments of it) is saved the
way the model reads it, a per-parameter layout: the logical shape is the weight's own (module 06's:
wq (H D, M), wo (M, H D), the embedding (V, M) without module 12's padding rows), and each rank's
piece is what its model computes with.

A `DTensor` is a rank's piece with one placement per dimension of the device mesh,
DTensor.from_local(piece, mesh, placements, shape=..., stride=...): Shard(k) where the ranks along
that dimension hold consecutive parts of the weight cut along its dimension k, Replicate() where
they hold the same copy (DCP writes each chunk once). A stage's weights are only on its ranks, under
names no other stage has, and DCP merges every rank's names into one checkpoint. A plain tensor is,
to DCP, a replicated copy: it keeps one of the ranks' tensors, so pieces that differ, saved as plain
tensors, silently lose every piece but one.

A MoE stage's experts (module 16: each rank E/e of them, the same ones on every rank of its expert-data
group) are saved one expert at a time, under the expert's own number (layers.1.experts.5.gate): each
is whole on the ranks that hold it, so a replicated copy is what it is, and another e finds its
experts by their numbers.

One directory per step, step_000100/, made visible by a rename only once DCP's save has returned on
every rank (its metadata, written last, is then on disk): a run killed in the middle of a save
leaves step_000100.partial/, which no load ever reads, and the last complete checkpoint. Beside the
weights: the step, the losses so far and the batch generator's state (the data position), so a
resumed run draws the batches the uninterrupted one would have drawn.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor, Replicate, Shard

from .m06_llama_block import BlockWeights, LlamaConfig
from .m07_flat_shards import NAMES, OuterWeights

COLUMN_PARALLEL, ROW_PARALLEL = ("wq", "wk", "wv", "w_gate", "w_up"), ("wo", "w_down")
STEP_DIR = re.compile(r"step_(\d{6})")


class CheckpointError(ValueError):
    """A checkpoint this run cannot load (one line, before any step runs)."""

    def __init__(self, message: str):
        super().__init__(message)


def to_dtensor(name: str, piece: torch.Tensor, shape: tuple[int, ...], device_mesh) -> DTensor:
    """This rank's `piece` of the weight `name` ('embedding', 'layers.3.wq', 'final_norm', ...; its field is the
    last part of the name), whose logical shape is `shape`, as a DTensor on `device_mesh` (the mesh's, with
    dimensions named p, d, c, t)."""
    # >>> TODO(m17): the DTensor of a rank's piece of a weight: its placement on every axis of the mesh
    # Contract: return DTensor.from_local(piece, device_mesh, placements, run_check=False, shape=shape, stride=the
    #   contiguous strides of `shape`), with one placement per dimension of the device mesh (device_mesh.mesh_dim_names
    #   gives their names, in order). The tests save on one mesh, resume on others (t = 4, d = 2) and compare the
    #   losses.
    # The question, for each kind of weight (the field decides): along which axes of the mesh do the ranks hold
    #   different parts of it (Shard(k): cut along which of the weight's dimensions?), and along which the same copy
    #   (Replicate)? The piece is what the model computes with: after FSDP's gather, the whole of what module 12 gives
    #   the rank.
    # Pitfalls: what does DCP make of pieces marked Shard that are in fact copies, and of pieces marked Replicate that
    #   differ? The vocabulary's padding rows are no part of the weight: the caller passes the unpadded rows, so `shape`
    #   is the real (V, M).
    # Hint 1: after the gather, which ranks hold the same piece of a weight, and along which dimension does module 12
    #         cut each kind of weight over t? (docs/17, "Checkpoints with torch.distributed.checkpoint": wq's row
    #         worked.)
    # Hint 2: over t: Shard(0) for the column-parallel weights (wq, wk, wv, w_gate, w_up) and the vocabulary rows
    #         (embedding, lm_head), cut along dimension 0; Shard(1) for the row-parallel wo and w_down (dimension 1);
    #         Replicate for the norms (whole on every t rank). Over p, d and c: Replicate (after the gather the d c
    #         ranks hold copies; a stage's weights are under names no other stage has).
    # Hint 3: field = name.split(".")[-1]
    #         over_t = Shard(0) if field in COLUMN_PARALLEL or field in ("embedding", "lm_head") else Shard(1) if field
    #                  in ROW_PARALLEL else Replicate()
    #         placements = [over_t if axis == "t" else Replicate() for axis in device_mesh.mesh_dim_names]
    #         return DTensor.from_local(piece, device_mesh, placements, run_check=False, shape=torch.Size(shape),
    #                                   stride=torch.empty(shape, device="meta").stride())
    field = name.split(".")[-1]
    if field in COLUMN_PARALLEL or field in ("embedding", "lm_head"):
        over_t = Shard(0)
    elif field in ROW_PARALLEL:
        over_t = Shard(1)
    else:
        over_t = Replicate()
    placements = [over_t if axis == "t" else Replicate() for axis in device_mesh.mesh_dim_names]
    return DTensor.from_local(piece, device_mesh, placements, run_check=False, shape=torch.Size(shape),
                              stride=torch.empty(shape, device="meta").stride())
    # <<<


# ---------------------------------------------------------------------------------------------
# A rank's pieces in the logical layout, and back (given)
# ---------------------------------------------------------------------------------------------
def whole_slices(stage, flats: list[torch.Tensor], layout=None) -> list[BlockWeights | OuterWeights]:
    """The stage's blocks' t slices from flat shards laid out as its weights' (the weights themselves, or one
    of AdamW's moments of them): all-gathered over fsdp, cut into the block's tensors (copies); with
    `layout`, the groups it lays out (stage.outer_layout: the outer weights, this rank's vocabulary rows)."""
    fsdp, layout, slices = stage.groups.fsdp, layout or stage.layout, []
    for flat in flats:
        whole = torch.empty(layout.padded_numel, dtype=flat.dtype)
        fsdp.collectives.all_gather(whole, flat, label="checkpoint")
        slices.append(layout.kind(*(t.clone() for t in layout.views(whole).tensors())))
    return slices


def vocab_piece(rows: torch.Tensor, vocab_size: int, index: int) -> torch.Tensor:
    """This t rank's unpadded rows of an embedding or LM head it holds padded (rows V'/t of them)."""
    per_rank = rows.shape[0]
    real = max(0, min(per_rank, vocab_size - index * per_rank))
    return rows[:real]


def whole_shape(field: str, piece: torch.Size, t: int) -> tuple[int, ...]:
    """A block tensor's logical shape from this rank's t slice of it: t slices side by side (module 12):
    wq (H D / t, M) -> (H D, M), wo (M, H D / t) -> (M, H D); the norms are whole."""
    if field in COLUMN_PARALLEL:
        return (piece[0] * t, *piece[1:])
    if field in ROW_PARALLEL:
        return (piece[0], piece[1] * t)
    return tuple(piece)


def expert_names(stage) -> list[tuple[str, torch.Tensor, int]]:
    """(name, the stage's expert tensor, index in its leading axis) for every expert weight this rank holds
    (a MoE stage's; none for a dense one): layers.L.experts.K.gate for global expert K."""
    if not hasattr(stage, "moe_weights"):
        return []
    names = []
    for layer, weights in zip(stage.layers, stage.moe_weights, strict=True):
        for field, tensor in zip(("gate", "up", "down"), weights.experts.tensors(), strict=True):
            names += [(f"layers.{layer}.experts.{k}.{field}", tensor, i) for i, k in enumerate(stage.mine)]
    return names


def logical_pieces(stage, tensors: dict) -> dict[str, tuple[torch.Tensor, tuple[int, ...]]]:
    """{name: (this rank's piece, logical shape)} for one stage's weights, or for one of AdamW's moments
    (`tensors`: parameter -> its moment, for each of stage.parameters(); the weights: p -> p)."""
    cfg, t = stage.cfg, stage.groups.tp
    pieces = {}
    for layer, block in zip(stage.layers, whole_slices(stage, [tensors[s] for s in stage.shards]), strict=True):
        for name, piece in zip(NAMES, block.tensors(), strict=True):
            pieces[f"layers.{layer}.{name}"] = (piece, whole_shape(name, piece.shape, t.size))
    for name, tensor, i in expert_names(stage):
        piece = tensors[tensor][i].clone()
        pieces[name] = (piece, tuple(piece.shape))
    if stage.outer_layout.numel:  # the stage's embedding, or final norm and LM head: whole rows, not fsdp shards
        [outer] = whole_slices(stage, [tensors[stage.outer_shard]], stage.outer_layout)
        for name, value in zip(("embedding", "final_norm", "lm_head"), outer.tensors(), strict=True):
            if name == "final_norm" and value.shape[0]:
                pieces[name] = (value, tuple(value.shape))
            elif value.shape[0]:
                pieces[name] = (vocab_piece(value, cfg.vocab_size, t.index).clone(), (cfg.vocab_size, cfg.dim))
    for name, weight in stage.replicated.items():
        value = tensors[weight]
        pieces[name] = (value.clone(), tuple(value.shape))
    return pieces


def put_back(stage, tensors: dict, loaded: dict[str, torch.Tensor]):
    """The inverse of logical_pieces: each loaded piece (this rank's, of the new mesh) into the stage's own
    layout, in place: blocks flattened and this rank's fsdp shard kept, vocabulary rows padded with zeros."""
    for i, layer in enumerate(stage.layers):
        block = BlockWeights(*(loaded[f"layers.{layer}.{name}"] for name in NAMES))
        flat = stage.layout.flatten(block)
        tensors[stage.shards[i]].copy_(stage.layout.shard(flat, stage.groups.fsdp.index))
    if stage.outer_layout.numel:
        flat = torch.zeros(stage.outer_layout.padded_numel, dtype=tensors[stage.outer_shard].dtype)
        outer = stage.outer_layout.views(flat)  # zeros where a stage holds no rows, and in the vocabulary's padding
        for name, target in zip(("embedding", "final_norm", "lm_head"), outer.tensors(), strict=True):
            if target.shape[0]:
                target[:loaded[name].shape[0]] = loaded[name]
        tensors[stage.outer_shard].copy_(stage.outer_layout.shard(flat, stage.groups.fsdp.index))
    for name, weight in stage.replicated.items():
        tensors[weight].copy_(loaded[name])
    for name, tensor, i in expert_names(stage):
        tensors[tensor][i].copy_(loaded[name])


def moments(optimizer, params: list[torch.Tensor], key: str) -> dict:
    """parameter -> AdamW's state `key` ("exp_avg", "exp_avg_sq") for it, made (zeros) if it has none yet."""
    for p in params:
        state = optimizer.state[p]
        if key not in state:
            state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return {p: optimizer.state[p][key] for p in params}


def state_dict(model, optimizer, device_mesh, train_state: dict) -> dict:
    """Everything a checkpoint holds, by name: the weights and AdamW's moments as DTensors, AdamW's step
    count and the training's state (step, losses, data position) as plain tensors (the same on every rank)."""
    state = {}
    for stage in model.stages.values():
        params = stage.parameters()
        sources = {"model": {p: p for p in params}, "optim.exp_avg": moments(optimizer, params, "exp_avg"),
                   "optim.exp_avg_sq": moments(optimizer, params, "exp_avg_sq")}
        for prefix, tensors in sources.items():
            for name, (piece, shape) in logical_pieces(stage, tensors).items():
                state[f"{prefix}.{name}"] = to_dtensor(name, piece, shape, device_mesh)
    steps = [optimizer.state[p].get("step") for p in model.parameters()]
    state["optim.step"] = (steps[0] if steps and steps[0] is not None else torch.tensor(0.0)).clone()
    state.update({f"train.{key}": value for key, value in train_state.items()})
    return state


# ---------------------------------------------------------------------------------------------
# Directories: one per step, committed by a rename
# ---------------------------------------------------------------------------------------------
def step_directory(root, step: int) -> Path:
    return Path(root) / f"step_{step:06d}"


def latest_checkpoint(root) -> Path | None:
    """The complete checkpoint of the highest step under `root` (step_NNNNNN/, never a .partial one), or None."""
    root = Path(root)
    steps = sorted(int(m[1]) for d in (root.iterdir() if root.is_dir() else ()) if (m := STEP_DIR.fullmatch(d.name)))
    return step_directory(root, steps[-1]) if steps else None


def describe(cfg: LlamaConfig, vocab: str = "", moe=None) -> dict:
    """What a checkpoint must match to be loaded: the model's configuration, its vocabulary, and for a MoE
    model module 16's MoEConfig."""
    return {"model": asdict(cfg), "vocab": vocab, **({"moe": asdict(moe)} if moe is not None else {})}


def check_checkpoint(directory, cfg: LlamaConfig, vocab: str = "", moe=None):
    """One line unless `directory` is a complete checkpoint of this model (given): said before any step runs."""
    directory = Path(directory)
    if not (directory / ".metadata").exists() or not (directory / "config.json").exists():
        raise CheckpointError(f"{directory} is not a complete checkpoint (no .metadata or config.json): --resume takes "
                              f"a run's directory (its --checkpoint-dir) and continues from its latest step_NNNNNN; "
                              f"remove a damaged step to continue from the one before")
    config = directory / "config.json"
    try:
        saved = json.loads(config.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{config} cannot be read as JSON ({exc}); remove {directory} to continue from the step "
                              f"before it") from None
    if not (isinstance(saved, dict) and isinstance(saved.get("model"), dict) and isinstance(saved.get("vocab"), str)):
        raise CheckpointError(f"{config} is not a checkpoint's description ({{\"model\": {{...}}, \"vocab\": \"...\"}}); "
                              f"remove {directory} to continue from the step before it")
    mine = describe(cfg, vocab, moe)
    different = [f"{key}={saved['model'].get(key)!r} (this run: {value!r})" for key, value in mine["model"].items()
                 if saved["model"].get(key) != value]
    if saved.get("moe") != mine.get("moe"):
        different.append(f"experts {saved.get('moe')} (this run: {mine.get('moe')})")
    if saved["vocab"] != mine["vocab"]:
        different.append(f"a vocabulary of {len(saved['vocab'])} characters (this run: {len(mine['vocab'])})")
    if different:
        raise CheckpointError(f"{directory} was saved for another model: {', '.join(different)}; run with the "
                              f"checkpoint's settings, or use another --checkpoint-dir")
    try:
        dcp.FileSystemReader(directory).read_metadata()  # what every rank reads first to load (a pickle)
    except Exception as exc:  # cut short, or not DCP's: every rank would fail in its own traceback
        raise CheckpointError(f"{directory / '.metadata'} cannot be read ({type(exc).__name__}: {exc}); remove "
                              f"{directory} to continue from the step before it") from None


def save(model, optimizer, train_state: dict, root, step: int, description: dict, make_writer=None) -> Path:
    """Write the checkpoint of `step` under `root` on every rank together; return its directory.
    `make_writer(directory)` makes DCP's storage writer (default: dcp.FileSystemWriter; a test's kills a rank)."""
    final = step_directory(root, step)
    partial = final.with_name(final.name + ".partial")
    state = state_dict(model, optimizer, model.mesh.device_mesh, train_state)
    # >>> TODO(m17): save into a partial directory, make it visible by a rename once the save has returned
    # Contract: when this returns on any rank, `final` is a complete checkpoint (DCP's files, its .metadata, and
    #   config.json holding `description` as JSON); until the moment it is complete, nothing under the name `final`
    #   exists, so a run killed at any instant leaves either no `final` or a complete one. A `partial` left by an
    #   earlier, killed run is removed first. Every rank calls save; the directory operations are one rank's (rank 0),
    #   the others wait for them. The storage writer is make_writer(directory), or dcp.FileSystemWriter(directory)
    #   without one.
    # The question: in which order do the ranks write, wait and publish, so that the name `final` can only ever name a
    #   complete checkpoint? (A rename within one file system is atomic.)
    # Pitfalls: what does a rank killed mid-save leave under a complete-looking name if the files go straight into
    #   `final`? What does a rename publish while another rank is still writing?
    # Hint 1: which of the ranks' operations must be finished, on every rank, before the next may start, and which one
    #         act makes the checkpoint visible? (docs/17, "Checkpoints with torch.distributed.checkpoint", the last
    #         paragraph.)
    # Hint 2: three phases with a barrier between each: rank 0 makes an empty partial directory with config.json in it;
    #         every rank's dcp.save into partial; rank 0 renames partial to final; a last barrier before any rank
    #         returns.
    # Hint 3: if dist.get_rank() == 0: shutil.rmtree(partial, ignore_errors=True); partial.mkdir(parents=True);
    #             (partial / "config.json").write_text(json.dumps(description))
    #         dist.barrier()
    #         dcp.save(state, storage_writer=(make_writer or dcp.FileSystemWriter)(partial));  dist.barrier()
    #         if dist.get_rank() == 0: os.rename(partial, final)
    #         dist.barrier();  return final
    if dist.get_rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        (partial / "config.json").write_text(json.dumps(description))
    dist.barrier()
    dcp.save(state, storage_writer=(make_writer or dcp.FileSystemWriter)(partial))
    dist.barrier()
    if dist.get_rank() == 0:
        os.rename(partial, final)
    dist.barrier()
    return final
    # <<<


def load(model, optimizer, train_state: dict, directory, description: dict):
    """Read the checkpoint in `directory` into this rank's pieces of `model` (on any mesh) and `optimizer`,
    and `train_state`'s tensors (same names and shapes as saved) in place (given)."""
    saved = json.loads((Path(directory) / "config.json").read_text())
    if saved != description:
        raise CheckpointError(f"{directory} was saved for another model or vocabulary: {saved['model']}")
    state = state_dict(model, optimizer, model.mesh.device_mesh, train_state)  # this mesh's pieces, to fill
    try:
        dcp.load(state, storage_reader=dcp.FileSystemReader(directory))
    except dcp.CheckpointException as error:  # every rank's traceback at once: the first rank's error says what
        rank = min(error.failures)
        raise CheckpointError(f"{directory} does not fit this run's state (rank {rank}: {error.failures[rank][0]})"
                              ) from None
    for stage in model.stages.values():
        params = stage.parameters()
        for prefix, tensors in (("model", {p: p for p in params}), ("optim.exp_avg", moments(optimizer, params, "exp_avg")),
                                ("optim.exp_avg_sq", moments(optimizer, params, "exp_avg_sq"))):
            loaded = {name[len(prefix) + 1:]: value.to_local() if isinstance(value, DTensor) else value
                      for name, value in state.items() if name.startswith(prefix + ".")}
            put_back(stage, tensors, loaded)
    for p in model.parameters():
        optimizer.state[p]["step"] = state["optim.step"].clone()


def load_into_one_process(directory, cfg: LlamaConfig, dtype=torch.float32):
    """Module 06's single-process LlamaModel with the weights of the checkpoint in `directory` (given): the
    resharding of DCP, down to one process and no process group at all (e.g. to sample text)."""
    from .m06_llama_model import LlamaModel
    model = LlamaModel(cfg, 0, dtype)
    state = {"model.embedding": model.embedding, "model.final_norm": model.final_norm, "model.lm_head": model.lm_head}
    for layer, block in enumerate(model.blocks):
        state.update({f"model.layers.{layer}.{name}": getattr(block, name) for name in NAMES})
    with warnings.catch_warnings():  # DCP warns that it loads in a single process: that is the point here
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=dcp.FileSystemReader(directory), no_dist=True)
    return model
