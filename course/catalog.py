"""The course's modules, one row each (given). Adding a module is adding a row here, its files in
solutions/ (steps/ is generated), its tests, its chapter and its demo in course/demos/mNN.py.

Reading this file imports nothing heavy, so `python main.py list` answers at once.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from course import REPO
from course.impl import steps_dir
from course.skeleton import count_todos, has_solution_blocks, todo_blocks


@dataclass(frozen=True)
class Module:
    number: str              # "05"
    title: str
    world_size: int          # ranks `run` forks by default; 1 is a single-process module
    files: tuple[str, ...]   # its files in solutions/ and steps/, in reading (and build) order
    torchrun_ranks: int = 0  # ranks its demo starts under torchrun itself (module 19's default mesh), else 0

    @property
    def ranks(self) -> int:
        """The ranks `python main.py run NN` trains on by default, however they are started."""
        return self.torchrun_ranks or self.world_size

    @property
    def demo(self) -> str:
        """The given code behind `python main.py run NN`: options, checks and the demo itself."""
        return f"course.demos.m{self.number}"

    def is_given(self) -> bool:
        """Nothing for the learner to write (module 00)."""
        return not any(has_solution_blocks((REPO / "solutions" / f"{f}.py").read_text()) for f in self.files)

    def missing_steps(self, steps: Path | None = None) -> list[str]:
        """Its files that are not in steps/ (deleted), e.g. ["m05_schedules"]."""
        steps = steps or steps_dir()
        return [f for f in self.files if not (steps / f"{f}.py").exists()]

    def todos_left(self, steps: Path | None = None) -> int:
        """Unfinished TODOs in steps/; a missing file has all of its TODOs left, never none."""
        steps = steps or steps_dir()
        return sum(count_todos((steps / f"{f}.py").read_text()) if (steps / f"{f}.py").exists()
                   else len(todo_blocks((REPO / "solutions" / f"{f}.py").read_text())) for f in self.files)

    def status(self, steps: Path | None = None) -> str:
        """What `python main.py list` says of the learner's progress: given, done, 3 left, or which file is missing."""
        if self.is_given():
            return "given"
        missing = self.missing_steps(steps)
        if missing:
            return "missing " + ", ".join(f"steps/{f}.py" for f in missing)
        left = self.todos_left(steps)
        return "done" if left == 0 else f"{left} left"

    def test_files(self) -> list[Path]:
        """tests/test_NN_*.py, those of the files the others build on first (06: ops, block, model),
        so a scorecard's first failure is the root cause, not a symptom further up."""
        def build_order(test: Path) -> int:
            stem = "m" + test.stem.removeprefix("test_")
            return self.files.index(stem) if stem in self.files else len(self.files)
        return sorted((REPO / "tests").glob(f"test_{self.number}_*.py"), key=lambda p: (build_order(p), p.name))


MODULES = {m.number: m for m in [
    Module("00", "Monolith: the 16-layer MLP that every split must reproduce", 1, ("m00_monolith",)),
    Module("01", "Manual split: two halves and a hand-made backward hand-off", 1, ("m01_manual_split",)),
    Module("02", "Communication primitives: init_distributed and PipelineComms", 4, ("m02_comms",)),
    Module("03", "Ping-pong: message order, latency and bandwidth between two ranks", 2, ("m03_ping_pong",)),
    Module("04", "Sharded model: each rank holds its own layers; forward as a relay", 4, ("m04_sharded",)),
    Module("05", "Pipeline schedules: naive, GPipe and 1F1B, and the bubble they leave", 4, ("m05_schedules",)),
    Module("06", "Llama block: explicit forward and backward, trained on Shakespeare", 1,
           ("m06_llama_ops", "m06_llama_block", "m06_llama_model")),
    Module("07", "FSDP: sharded blocks, all-gathered just in time, gradients reduce-scattered", 2,
           ("m07_flat_shards", "m07_payload", "m07_sharded_weights", "m07_fsdp")),
    Module("08", "CUDA streams: weights streamed from pinned host memory, overlapping compute", 1,
           ("m08_host_weights",)),
    Module("09", "FP8 matmuls: scaled e4m3/e5m2 linears, forward and backward", 1,
           ("m09_fp8_scaling", "m09_fp8_matmul")),
    Module("10", "Recompute: trade activation memory for forward work in the backward", 1, ("m10_recompute",)),
    Module("11", "Schedules as data: interleaved 1F1B, zero bubble (ZB-H1, ZB-V) and DualPipeV", 4,
           ("m11_actions", "m11_generators", "m11_stage", "m11_executor")),
    Module("12", "Tensor and sequence parallelism: the block split by heads and FFN width, the vocabulary too", 2,
           ("m12_tp_linear", "m12_tp_block", "m12_vocab_parallel", "m12_tp_model", "m12_tp_costs")),
    Module("13", "2-D sharding in named axes: the Llama over a d x t mesh, FSDP over d and Megatron over t", 4,
           ("m13_specs", "m13_named_axes", "m13_llama_2d", "m13_costs")),
    Module("14", "Data parallelism: gradient buckets overlapped with the backward, accumulation, ZeRO-1 and ZeRO-2", 2,
           ("m14_buckets", "m14_data_parallel", "m14_train_step", "m14_zero", "m14_costs")),
    Module("15", "Context parallelism: ring attention, zig-zag balancing, all-gather KV and Ulysses over the sequence",
           4, ("m15_layout", "m15_ring_attention", "m15_allgather_kv", "m15_ulysses", "m15_cp_model", "m15_costs")),
    Module("16", "Mixture of experts: top-k routing, capacity, load balancing, experts over ranks by all-to-all", 4,
           ("m16_router", "m16_dispatch", "m16_expert_parallel", "m16_moe_layer", "m16_moe_model", "m16_costs")),
    Module("17", "Composition: pipeline, data, tensor, context and expert parallelism on one mesh; DCP checkpoints",
           8, ("m17_composition", "m17_stage", "m17_moe_stage", "m17_trainer", "m17_costs", "m17_checkpoint",
               "m17_run")),
    Module("18", "Planning: every layout of a real cluster costed with the modules' formulas, checked against runs",
           1, ("m18_presets", "m18_layout", "m18_costs", "m18_step_time", "m18_search")),
    Module("19", "Training through failures: detect a dead, hung or slow rank, restart without losing or repeating data, "
           "save asynchronously, checkpoint at the interval that maximises goodput", 1,
           ("m19_detect", "m19_data", "m19_async_checkpoint", "m19_resilient", "m19_goodput"), torchrun_ranks=4),
]}
