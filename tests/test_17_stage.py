"""Module 17 stage: each piece of one pipeline stage checked on its own, before the trainer puts them
together (tests/test_17_trainer.py), so that a failure names the piece at fault. On two meshes of 4
ranks with one stage (p = 1): d2 t2 (FSDP over d, tensor and sequence parallelism over t) and d2 c2
(FSDP over d x c, the zig-zag ring over c). The constructor first, in this process, for every place of the
mesh; then each rank builds the composed model and runs, in order:

  LlamaStage.__init__          (in this process) the shards, read back by this test's own reading of the
                               layouts (module 07's flat layout of module 12's t slice; the outer group of the
                               vocabulary rows), for stages 0 to 3 of 4 (first, middle, last): the model's weights
  LlamaStage.gather            each block's t slice whole (what module 12's block computes with), and zeroed
                               whole gradient buffers in the accumulators' dtype
  LlamaStage.gather_outer      the stage's embedding rows, final norm and LM head rows, their zeroed buffer
  LlamaStage.forward           each microbatch's loss share, summed over the ranks of d and c that split it:
                               module 06's single process on the same rows, divided by the step's real tokens
  LlamaStage.backward          the whole gradient buffers after the step's microbatches, summed over c (and
                               the norms over t, which each normed T/t positions): module 06's gradients of
                               the rank's rows, cut by module 12 and laid out by module 07
  LlamaStage.reduce_scatter    each gradient shard: this rank's slice of the sum, over its fsdp group, of the
  (and reduce_scatter_outer)   whole buffers the backward filled (whatever they hold)
  finish_gradients             a second step from the same weights, ending in ComposedLlama.finish_gradients:
                               every gradient shard is this rank's piece of module 06's whole gradient

Tolerance: float64, the same sums in another order: within 1e-10 relative to each tensor's largest entry
(measured 4e-16); the copies (shards, gathers) are compared bit for bit.
"""
import dataclasses
import functools
import tempfile
from pathlib import Path

import pytest
import torch

from composed_checks import m06, whole_model
from course.dataset import load_text, random_batch
from course.impl import load, reference
from course.late_collectives import LateCollectives
from course.launch import RankFailed, RankTimeout, run_ranks
from course.mesh import Group, group_of, init_mesh

trainer = load("m17_trainer")
stage_module = load("m17_stage")
given = reference("m17_composition")
m07 = reference("m07_flat_shards")
m12 = reference("m12_tp_block")
vocab = reference("m12_vocab_parallel")
grad_dtype = reference("m12_tp_linear").grad_dtype

f64 = torch.float64
CFG = given.CONFIG
BATCH, M, TOLERANCE = 8, 2, 1e-10
MESHES = {"d2 t2": {"d": 2, "t": 2}, "d2 c2": {"d": 2, "c": 2}}
# Every check after the constructor's runs the same pieces on the ranks: a rank that raises stops them all, and the
# error names the piece (and where, its frames), so every marker lists every piece, its own first.
PIECES = ("LlamaStage.gather", "LlamaStage.gather_outer", "LlamaStage.forward",
          "LlamaStage.backward", "LlamaStage.reduce_scatter_outer", "LlamaStage.reduce_scatter",
          "ComposedLlama.finish_gradients", "compose_groups", "LlamaStage.__init__")


def batch():
    """The step's global batch: what module 06's fit draws first from seed 0."""
    return random_batch(load_text(), BATCH, CFG.max_seq_len, torch.Generator().manual_seed(0))


def stages_on_one_process(sizes):
    """LlamaStage.__init__ of stages 0 to 3 of 4 at every (fsdp index, t index) of a mesh, built in this process:
    the constructor only cuts and copies (groups made without torch.distributed, course/mesh.py's group_of)."""
    t, n = sizes.get("t", 1), sizes.get("d", 1) * sizes.get("c", 1)
    one = lambda axis: group_of(axis, 0, (0,))  # noqa: E731
    built = {}
    for i_fsdp in range(n):
        for i_t in range(t):
            groups = given.Groups(pp=one("p"), data=one("d"), cp=group_of("c", 0, range(sizes.get("c", 1))),
                                  tp=group_of("t", i_t, range(t)), fsdp=group_of("dc", i_fsdp, range(n)),
                                  replicas=group_of("dc", i_fsdp, range(n)))
            built[i_fsdp, i_t] = [stage_module.LlamaStage(CFG, groups, s, 4, whole()) for s in range(4)]
    return built


def _pieces(sizes, progress):
    """The pieces of a step on one stage, each called on its own: a piece that raises is named in the error (the
    launcher adds where, the learner's frames first), and the ranks stop there. Each rank notes in `progress` the
    piece it is in: a rank that dies without a Python error (gloo aborts on messages that differ between ranks)
    is then named by the piece it died in."""
    def piece(name, fn):
        (Path(progress) / f"rank {torch.distributed.get_rank()}").write_text(name)
        try:
            return fn()
        except Exception as error:
            raise RuntimeError(f"your {name} raised {type(error).__name__}: {error}") from error

    mesh = init_mesh(given.full_sizes(sizes))
    model = trainer.ComposedLlama(CFG, mesh, M, "1f1b", 1, dtype=f64, whole=whole_model(CFG))
    g = model.groups
    out = {"place": {"d": g.data.index, "c": g.cp.index, "t": g.tp.index, "fsdp": g.fsdp.index}}
    [stage] = model.stages.values()
    tokens, targets = batch()
    rows, ys = model.share(tokens).chunk(M), model.share(targets).chunk(M)

    def late(fn) -> list[str]:
        """fn run with the fsdp group's collectives delivered late (course/late_collectives.py: a result is NaN
        until waited for), and the labels of those it never waited for."""
        on_time, fsdp = stage.groups, stage.groups.fsdp
        stage.groups = dataclasses.replace(on_time, fsdp=Group(fsdp.axis, fsdp.index, fsdp.ranks, LateCollectives(
            fsdp.collectives.group, fsdp.axis, fsdp.ranks)))
        try:
            fn()
            return stage.groups.fsdp.collectives.never_waited()
        finally:
            stage.groups = on_time

    def one_pass():
        stage.begin_step(m06.real_tokens(targets), BATCH)
        stage.gather_outer = lambda: None  # gather() ends by calling it: called on its own below
        out["unwaited"] = late(lambda: piece("LlamaStage.gather", stage.gather))
        del stage.gather_outer
        piece("LlamaStage.gather_outer", stage.gather_outer)
        buffers = {"weights": [copies(w.tensors()) for w in stage.weights], "full_grads": copies(stage.full_grads),
                   "outer": copies([stage.embedding, stage.final_norm, stage.lm_head]),
                   "outer_full_grad": stage.outer_full_grad.clone()}
        losses = []
        for i, (x, y) in enumerate(zip(rows, ys, strict=True)):
            losses.append(piece("LlamaStage.forward", lambda: stage.forward(x, i, y)).item())
            piece("LlamaStage.backward", lambda: stage.backward(i))
        return buffers, losses

    out["gathered"], out["losses"] = one_pass()
    out["full_grads"], out["outer_full_grad"] = copies(stage.full_grads), stage.outer_full_grad.clone()
    piece("LlamaStage.reduce_scatter_outer", stage.reduce_scatter_outer)
    out["outer_grad"] = stage.outer_grad.clone()
    out["outer_dropped"] = [name for name in ("outer_full", "outer_full_grad", "outer_grads", "embedding",
                                              "final_norm", "lm_head") if getattr(stage, name) is not None]
    stage.reduce_scatter_outer = lambda: None  # reduce_scatter() starts by calling it: done above
    piece("LlamaStage.reduce_scatter", stage.reduce_scatter)
    del stage.reduce_scatter_outer
    out["grad_shards"] = copies(stage.grad_shards)
    out["dropped"] = [name for name in ("full", "weights", "full_grads", "block_grads") if getattr(stage, name) is not None]
    # A second step from the same weights (no optimizer): its buffers are new ones, and it ends with the trainer's sums.
    out["regathered"], _ = one_pass()
    piece("ComposedLlama.finish_gradients", model.finish_gradients)
    out["finished"] = copies(stage.grad_shards) + [stage.outer_grad.clone()]
    return out


def copies(tensors):
    return None if tensors is None else [t.clone() for t in tensors]


@functools.cache
def run_pieces(name):
    """Every rank's pieces, or the error that stopped a rank: a rank raises (or waits forever) where its code went
    wrong, and the launcher names that rank and where it was (the learner's frames first), which the checks'
    markers read to name the piece."""
    with tempfile.TemporaryDirectory() as progress:
        try:
            return run_ranks(_pieces, 4, MESHES[name], progress, timeout=90), None
        except RankFailed as error:
            if "died without a result" not in str(error):
                return None, error
            where = {path.name: path.read_text() for path in sorted(Path(progress).iterdir())}
            return None, RankFailed(f"{error}; when it died, each rank was in: " +
                                    ", ".join(f"{rank}: your {name}" for rank, name in where.items()))
        except RankTimeout as error:
            return None, error


def pieces(name):
    results, error = run_pieces(name)
    if error is not None:
        raise error
    return results


@functools.cache
def one_process(name):
    """Module 06 on each data rank's rows: {i_d: (the microbatches' losses, the summed LlamaGrads)}, every
    piece divided by the step's real tokens."""
    model, d = whole(), MESHES[name].get("d", 1)
    tokens, targets = batch()
    n_tokens = m06.real_tokens(targets)
    per_rank = {}
    for i_d, (rows, ys) in enumerate(zip(tokens.chunk(d), targets.chunk(d), strict=True)):
        losses, total = [], None
        for x, y in zip(rows.chunk(M), ys.chunk(M), strict=True):
            loss, grads = model.forward_backward(x, y, n_tokens)
            losses.append(loss.item())
            total = grads if total is None else summed(total, grads)
        per_rank[i_d] = (losses, total)
    return per_rank


def summed(a, b):
    """Two LlamaGrads added."""
    blocks = [type(x)(*(p + q for p, q in zip(x.tensors(), y.tensors(), strict=True)))
              for x, y in zip(a.blocks, b.blocks, strict=True)]
    return m06.LlamaGrads(a.embedding + b.embedding, blocks, a.final_norm + b.final_norm, a.lm_head + b.lm_head)


class OneRankOf:
    """A group of `size` as rank `index` of it sees it (module 12's slicing reads only these)."""

    def __init__(self, size, index):
        self.size, self.index = size, index


@functools.cache
def whole():
    return whole_model(CFG)


def block_layout(t):
    return m07.FlatLayout(m12.shard_block_weights(whole().blocks[0], CFG, OneRankOf(t, 0)), fsdp_size(t))


def fsdp_size(t):
    return 4 // t


def t_slice_flat(block, t, i_t):
    """Module 07's padded flat buffer of module 12's slice i_t of `block` (weights or their gradients)."""
    return block_layout(t).flatten(m12.shard_block_weights(block, CFG, OneRankOf(t, i_t)))


def outer_layout(first, last, t):
    return m07.FlatLayout(outer_weights(whole(), first, last, t, 0), fsdp_size(t))


def outer_weights(model_or_grads, first, last, t, i_t):
    """The stage's outer group (module 07's OuterWeights) of rank i_t: the padded vocabulary rows it computes with."""
    padded = vocab.padded_vocab_size(CFG.vocab_size, t)
    rows = lambda w: vocab.vocab_rows(w, padded, OneRankOf(t, i_t))  # noqa: E731
    e, n, h = model_or_grads.embedding, model_or_grads.final_norm, model_or_grads.lm_head
    return m07.OuterWeights(rows(e) if first else e[:0], n if last else n[:0], rows(h) if last else h[:0])


def outer_flat(grads, t, i_t):
    return outer_layout(True, True, t).flatten(outer_weights(grads, True, True, t, i_t))


def norm_mask(layout):
    mask = torch.zeros(layout.padded_numel, dtype=torch.bool)
    offset = 0
    for name, numel in zip(layout.names, layout.numels, strict=True):
        mask[offset:offset + numel] = name in ("ln1", "ln2", "final_norm")
        offset += numel
    return mask


def relative(got, want):
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-300)).item()


def by_place(results, key):
    """{(i_d, i_c, i_t): that rank's `key`}."""
    return {(r["place"]["d"], r["place"]["c"], r["place"]["t"]): r[key] for r in results}


@pytest.mark.exercises("LlamaStage.__init__")
@pytest.mark.parametrize("name", MESHES)
def test_each_stage_holds_its_blocks_t_slices_flat_over_fsdp_and_its_vocabulary_rows(name):
    t, model = MESHES[name].get("t", 1), whole()
    built = stages_on_one_process(MESHES[name])
    for s in range(4):
        first, last = s == 0, s == 3
        for i_t in range(t):
            ranks = [built[i_fsdp, tt][s] for i_fsdp, tt in sorted(built) if tt == i_t]
            layers = list(ranks[0].layers)
            assert layers == [s], f"{name}: stage {s} of 4 holds blocks {layers}, expected [{s}] (stage_layers, given)"
            want = t_slice_flat(model.blocks[s], t, i_t)
            shard_numel = block_layout(t).shard_numel
            for i_fsdp, stage in enumerate(ranks):
                shard = stage.shards[0]
                assert shard.shape == (shard_numel,), \
                    (f"{name}, the rank at fsdp {i_fsdp}, t {i_t}: your LlamaStage.__init__ made stage {s}'s block "
                     f"shard of shape {tuple(shard.shape)}, expected ({shard_numel},): 1/{fsdp_size(t)} of the block's "
                     f"t slice ({block_layout(t).numel} values, padded), the slice module 12 computes with on t rank "
                     f"{i_t}")
            for i_fsdp, stage in enumerate(ranks):
                for what, shard in (("block shard", stage.shards[0]), ("outer shard", stage.outer_shard)):
                    held = shard.untyped_storage().nbytes()
                    assert held == shard.nbytes, \
                        (f"{name}, the rank at fsdp {i_fsdp}, t {i_t}: stage {s}'s {what} keeps {held} bytes alive "
                         f"for its {shard.nbytes}: a view of the whole flat buffer, not a tensor of its own (your "
                         f"LlamaStage.__init__: what does a slice keep alive of the tensor it was taken from?)")
            got = torch.cat([stage.shards[0] for stage in ranks])
            assert torch.equal(got, want), \
                (f"{name}: stage {s}'s block shards of the fsdp ranks with t index {i_t}, end to end, are not "
                 f"module 07's flat buffer of module 12's t slice {i_t} of block {s}: first differing value at "
                 f"{(got != want).nonzero()[0].item()} (your LlamaStage.__init__: which tensors are laid out, cut "
                 f"over which group, and which shard does a rank keep?)")
            layout = outer_layout(first, last, t)
            want = layout.flatten(outer_weights(model, first, last, t, i_t))
            got = torch.cat([stage.outer_shard for stage in ranks])
            assert got.shape == want.shape and torch.equal(got, want), \
                (f"{name}: stage {s} of 4 (first {first}, last {last}): the outer shards of the fsdp ranks with t "
                 f"index {i_t}, end to end ({tuple(got.shape)}), are not the flat buffer of its outer weights "
                 f"({tuple(want.shape)}): the embedding's rows (first stage) and the final norm and LM head's rows "
                 f"(last), as t rank {i_t} computes with them (your LlamaStage.__init__)")


@pytest.mark.exercises("LlamaStage.gather", *PIECES)
@pytest.mark.parametrize("name", MESHES)
def test_gather_gives_each_block_its_t_slice_whole_and_zeroed_buffers_for_its_gradient(name):
    results = pieces(name)
    t, model = MESHES[name].get("t", 1), whole()
    for r in results:
        where = f"{name}, rank at d {r['place']['d']}, c {r['place']['c']}, t {r['place']['t']}"
        assert not r["unwaited"], \
            (f"{where}: your LlamaStage.gather returned while the all-gathers {r['unwaited']} were still in flight "
             f"(never waited for): on a slow network their buffers are not filled yet when the first forward reads "
             f"them")
        for key in [k for k in ("gathered", "regathered") if k in r]:
            buffers = r[key]
            assert len(buffers["weights"]) == CFG.n_layers, f"{where}: {len(buffers['weights'])} blocks gathered"
            for layer, tensors in enumerate(buffers["weights"]):
                want = m12.shard_block_weights(model.blocks[layer], CFG, OneRankOf(t, r["place"]["t"])).tensors()
                for field, a, b in zip(m07.NAMES, tensors, want, strict=True):
                    assert a.shape == b.shape and torch.equal(a, b), \
                        (f"{where}: after your LlamaStage.gather, block {layer}'s {field} is not module 12's slice "
                         f"of it on this t rank (shape {tuple(a.shape)}, expected {tuple(b.shape)}): gathered over "
                         f"which group, into which buffer?")
            padded = block_layout(t).padded_numel
            for layer, g in enumerate(buffers["full_grads"]):
                assert g.shape == (padded,) and g.dtype == grad_dtype(f64), \
                    (f"{where}: your LlamaStage.gather made block {layer}'s whole gradient buffer {tuple(g.shape)} "
                     f"{g.dtype}, expected ({padded},) {grad_dtype(f64)}")
                assert not g.any(), \
                    (f"{where}: {'a later step' if key == 'regathered' else 'the step'}'s whole gradient buffer of "
                     f"block {layer} holds {int(g.count_nonzero())} non-zero values before any backward (your "
                     f"LlamaStage.gather): every microbatch's backward adds into it")


@pytest.mark.exercises("LlamaStage.gather_outer", *PIECES)
@pytest.mark.parametrize("name", MESHES)
def test_gather_outer_gives_the_stage_its_vocabulary_rows_and_final_norm_whole(name):
    results = pieces(name)
    t = MESHES[name].get("t", 1)
    for r in results:
        where = f"{name}, rank at d {r['place']['d']}, c {r['place']['c']}, t {r['place']['t']}"
        want = outer_weights(whole(), True, True, t, r["place"]["t"]).tensors()
        for key in [k for k in ("gathered", "regathered") if k in r]:
            for field, a, b in zip(("embedding", "final_norm", "lm_head"), r[key]["outer"], want, strict=True):
                assert a.shape == b.shape and torch.equal(a, b), \
                    (f"{where}: after your LlamaStage.gather_outer, self.{field} is not this t rank's padded rows "
                     f"(shape {tuple(a.shape)}, expected {tuple(b.shape)})")
            g, padded = r[key]["outer_full_grad"], outer_layout(True, True, t).padded_numel
            assert g.shape == (padded,) and g.dtype == grad_dtype(f64) and not g.any(), \
                (f"{where}: your LlamaStage.gather_outer made the outer gradient buffer {tuple(g.shape)} {g.dtype} "
                 f"with {int(g.count_nonzero())} non-zero values; expected ({padded},) {grad_dtype(f64)}, zeroed")


class GatherInOneProcess:
    """The fsdp group's all-gather for stages built in this process: every member's outer shard, end to end, into a
    buffer that must hold exactly all of them (as gloo's all-gather demands)."""

    def __init__(self):
        self.stages = []

    def all_gather(self, output, shard, label="", async_op=False):
        whole = torch.cat([stage.outer_shard for stage in self.stages])
        if output.shape != whole.shape:
            raise RuntimeError(f"all-gather of {len(self.stages)} shards of {shard.numel()} values into a buffer of "
                               f"shape {tuple(output.shape)}: it must hold {whole.numel()}")
        output.copy_(whole)


@pytest.mark.exercises("LlamaStage.gather_outer", "LlamaStage.__init__")
def test_gather_outer_fills_the_whole_padded_buffer_when_the_fsdp_group_does_not_divide_it():
    # The meshes above divide the outer group evenly; over 3 fsdp ranks the last stage's final norm and LM head
    # (V M + M = 8,224 values) need 2 zeros of padding, so a buffer of the unpadded size cannot receive the shards.
    n, collectives = 3, GatherInOneProcess()
    one = lambda axis: group_of(axis, 0, (0,))  # noqa: E731
    for i_fsdp in range(n):
        fsdp = Group("dc", i_fsdp, tuple(range(n)), collectives)
        groups = given.Groups(pp=one("p"), data=one("d"), cp=one("c"), tp=one("t"), fsdp=fsdp, replicas=fsdp)
        collectives.stages.append(stage_module.LlamaStage(CFG, groups, 3, 4, whole()))
    last = outer_weights(whole(), False, True, 1, 0)
    layout, want = m07.FlatLayout(last, n), last.tensors()
    assert layout.padded_numel != layout.numel, "the check needs an outer group that 3 ranks do not divide"
    for i_fsdp, stage in enumerate(collectives.stages):
        try:
            stage.gather_outer()
        except RuntimeError as error:
            raise AssertionError(f"over {n} fsdp ranks (the outer group padded to {layout.padded_numel} values), "
                                 f"your LlamaStage.gather_outer raised: {error}") from error
        assert stage.outer_full.shape == (layout.padded_numel,), \
            (f"over {n} fsdp ranks, your LlamaStage.gather_outer made outer_full of shape {tuple(stage.outer_full.shape)}, "
             f"expected ({layout.padded_numel},): the outer group's whole padded flat buffer")
        for field, a, b in zip(("embedding", "final_norm", "lm_head"), (stage.embedding, stage.final_norm,
                                                                         stage.lm_head), want, strict=True):
            assert a.shape == b.shape and torch.equal(a, b), \
                (f"over {n} fsdp ranks, fsdp rank {i_fsdp}: after your LlamaStage.gather_outer, self.{field} is not "
                 f"the last stage's (shape {tuple(a.shape)}, expected {tuple(b.shape)})")


@pytest.mark.exercises("LlamaStage.forward", *PIECES)
@pytest.mark.parametrize("name", MESHES)
def test_forward_gives_each_rank_its_share_of_the_microbatch_loss(name):
    results = pieces(name)
    want = one_process(name)
    losses = by_place(results, "losses")
    t = MESHES[name].get("t", 1)
    for i_d, (expected, _) in want.items():
        for i_t in range(t):
            got = [sum(v[i] for (d, _, tt), v in losses.items() if d == i_d and tt == i_t) for i in range(M)]
            gap = max(abs(a - b) for a, b in zip(got, expected, strict=True))
            ratio = got[0] / expected[0]
            assert gap <= TOLERANCE * abs(expected[0]), \
                (f"{name}: data rank {i_d}'s microbatch losses, summed over its c ranks (t index {i_t}), are {got}; "
                 f"module 06 on the same rows {expected} (ratio {ratio:.3g}): your LlamaStage.forward (which "
                 f"positions of the tokens and targets, which weights, divided by self.n_tokens alone?)")


@pytest.mark.exercises("LlamaStage.backward", *PIECES)
@pytest.mark.parametrize("name", MESHES)
def test_backward_adds_each_microbatch_into_the_whole_gradient_buffers(name):
    results = pieces(name)
    t, want = MESHES[name].get("t", 1), one_process(name)
    full, outer = by_place(results, "full_grads"), by_place(results, "outer_full_grad")
    layout_mask, outer_mask = norm_mask(block_layout(t)), norm_mask(outer_layout(True, True, t))
    for i_d, (_, grads) in want.items():
        sums = {i_t: [sum(v[k] for (d, _, tt), v in full.items() if d == i_d and tt == i_t) for k in range(CFG.n_layers)]
                for i_t in range(t)}
        outer_sums = {i_t: sum(v for (d, _, tt), v in outer.items() if d == i_d and tt == i_t) for i_t in range(t)}
        for i_t in range(t):
            for layer in range(CFG.n_layers):
                expected = t_slice_flat(grads.blocks[layer], t, i_t)
                got = sums[i_t][layer].clone()
                got[layout_mask] = sum(sums[j][layer] for j in range(t))[layout_mask]
                error = relative(got, expected)
                assert error <= TOLERANCE, \
                    (f"{name}: block {layer}'s whole gradient after the step's {M} microbatches, data rank {i_d}, t "
                     f"index {i_t} (summed over c, the norms also over t): relative error {error:.1e} against module "
                     f"06's gradient of the same rows (your LlamaStage.backward: every block, added into "
                     f"self.block_grads?)")
            expected = outer_flat(grads, t, i_t)
            got = outer_sums[i_t].clone()
            got[outer_mask] = sum(outer_sums[j] for j in range(t))[outer_mask]
            parts = outer_layout(True, True, t).views(got - expected)
            worst = {f: p.abs().max().item() for f, p in zip(("embedding", "final_norm", "lm_head"), parts.tensors())}
            error = relative(got, expected)
            assert error <= TOLERANCE, \
                (f"{name}: the outer weights' whole gradient, data rank {i_d}, t index {i_t}: relative error "
                 f"{error:.1e} against module 06's (largest gaps {worst}): your LlamaStage.backward (the LM head, "
                 f"the final norm and the embedding, each added into its accumulator in self.outer_grads?)")


def check_reduce_scattered(name, results, key, shard_key, layout, what, todo):
    t = MESHES[name].get("t", 1)
    for i_t in range(t):
        members = [r for r in results if r["place"]["t"] == i_t]
        for k in range(len(members[0][key]) if isinstance(members[0][key], list) else 1):
            pick = (lambda v: v[k]) if isinstance(members[0][key], list) else (lambda v: v)
            total = sum(pick(r[key]) for r in members)
            for r in members:
                want = layout.shard(total, r["place"]["fsdp"])
                got = pick(r[shard_key])
                error = relative(got, want) if got.shape == want.shape else float("inf")
                assert error <= TOLERANCE, \
                    (f"{name}, rank at fsdp {r['place']['fsdp']}, t {i_t}: {what(k)} gradient shard "
                     f"{tuple(got.shape)} is not this rank's slice of the sum of the whole buffers over its fsdp group "
                     f"({tuple(want.shape)}; relative error {error:.1e}): your {todo}")


@pytest.mark.exercises("LlamaStage.reduce_scatter_outer", *PIECES)
@pytest.mark.parametrize("name", MESHES)
def test_reduce_scatter_outer_sums_the_outer_buffer_over_fsdp_into_the_shard(name):
    results = pieces(name)
    t = MESHES[name].get("t", 1)
    check_reduce_scattered(name, results, "outer_full_grad", "outer_grad", outer_layout(True, True, t),
                           lambda k: "the outer weights'", "LlamaStage.reduce_scatter_outer")
    for r in results:
        assert not r["outer_dropped"], (f"{name}: after your LlamaStage.reduce_scatter_outer the stage still holds "
                                        f"{r['outer_dropped']}: the next step gathers anew")


@pytest.mark.exercises("LlamaStage.reduce_scatter", *PIECES)
@pytest.mark.parametrize("name", MESHES)
def test_reduce_scatter_sums_each_block_over_fsdp_into_its_shard(name):
    results = pieces(name)
    t = MESHES[name].get("t", 1)
    check_reduce_scattered(name, results, "full_grads", "grad_shards", block_layout(t), lambda k: f"block {k}'s",
                           "LlamaStage.reduce_scatter")
    for r in results:
        assert not r["dropped"], (f"{name}: after your LlamaStage.reduce_scatter the stage still holds {r['dropped']}: "
                                  f"the next step gathers anew (the optimizer changes the shards)")


@pytest.mark.exercises("ComposedLlama.finish_gradients", *PIECES)
@pytest.mark.parametrize("name", MESHES)
def test_finish_gradients_leaves_every_shard_with_its_piece_of_the_whole_gradient(name):
    results = pieces(name)
    t, want = MESHES[name].get("t", 1), one_process(name)
    total = functools.reduce(summed, [g for _, g in want.values()])
    layout, outer = block_layout(t), outer_layout(True, True, t)
    for r in results:
        i_t, j = r["place"]["t"], r["place"]["fsdp"]
        where = f"{name}, rank at d {r['place']['d']}, c {r['place']['c']}, t {i_t}"
        for layer in range(CFG.n_layers):
            expected = layout.shard(t_slice_flat(total.blocks[layer], t, i_t), j)
            got = r["finished"][layer]
            mask = layout.shard(norm_mask(layout), j)
            error, norms = relative(got[~mask], expected[~mask]), relative(got[mask], expected[mask]) if mask.any() else 0
            ratio = (got[mask].abs().sum() / expected[mask].abs().sum()).item() if mask.any() else 1.0
            assert error <= TOLERANCE and norms <= TOLERANCE, \
                (f"{where}: after your ComposedLlama.finish_gradients block {layer}'s gradient shard is off by "
                 f"{error:.1e} (relative) outside the norms and {norms:.1e} at the norms (ln1, ln2; their size "
                 f"{ratio:.2f} times the whole gradient's) against module 06's gradient of the whole batch")
        expected = outer.shard(outer_flat(total, t, i_t), j)
        got, mask = r["finished"][-1], outer.shard(norm_mask(outer), j)
        error = relative(got, expected)
        ratio = (got[mask].abs().sum() / expected[mask].abs().sum()).item() if mask.any() else 1.0
        assert error <= TOLERANCE, \
            (f"{where}: after your ComposedLlama.finish_gradients the outer gradient shard is off by {error:.1e} "
             f"(relative) against module 06's gradient of the whole batch (its final norm's part {ratio:.2f} times "
             f"the whole gradient's)")
