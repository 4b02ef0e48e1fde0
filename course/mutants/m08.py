"""Module 08's planted bugs (CUDA streams and host weights): see course/mutants/__init__.py."""
from course.mutants import Plant

F = "m08_host_weights.py"
PLANTS = [
    Plant(F, "\n        self.host = [runtime.pin(self.layout.flatten(b)) for b in blocks]",
          "\n        self.host = [self.layout.flatten(b) for b in blocks]",
          "host blocks not pinned: a copy from pageable memory cannot run asynchronously on the side stream"),
    Plant(F, "runtime.new_event()) for _ in range(2)]", "runtime.new_event())]",
          "one device buffer, not two: the next block cannot be copied while this one computes"),
    Plant(F, "\n        self.buffers = [DeviceBuffer(runtime.empty(self.layout.padded_numel, dtype),",
          "\n        self.buffers = [DeviceBuffer(runtime.empty(self.layout.padded_numel, torch.float32),",
          "device buffers in float32 whatever the weights' dtype: bf16 blocks stream twice the bytes"),
    Plant(F, "            self.copy_stream.wait_event(buf.released)\n", "",
          "the copy does not wait for the buffer's release: it overwrites a block compute is still reading"),
    Plant(F, "            with self.rt.stream(self.copy_stream):\n                self.rt.copy(buf.flat, self.host[layer])\n",
          "            self.rt.copy(buf.flat, self.host[layer])\n",
          "the copy issued on the compute stream: it runs in line with compute, nothing overlaps"),
    Plant(F, "\n            buf.ready.record(self.copy_stream)", "\n            buf.ready.record(self.compute_stream)",
          "'ready' recorded on the compute stream: it does not mark the end of the copy"),
    Plant(F, "        self.compute_stream.wait_event(buf.ready)\n", "",
          "compute does not wait for the copy: the block may be read before it has arrived"),
    Plant(F, "\n        buf.released.record(self.compute_stream)", "\n        buf.released.record(self.copy_stream)",
          "'released' recorded on the copy stream: the next copy does not wait for compute to finish reading"),
    Plant(F, "        self.copy_stream.synchronize()\n        self.version += 1", "        self.version += 1",
          "invalidate does not wait for copies in flight: the optimizer may write host weights being read"),
    Plant(F, "        self.copy_stream.synchronize()\n        self.version += 1", "        self.copy_stream.synchronize()",
          "invalidate forgets nothing: a block still resident is reused after the optimizer changed it"),
    # Issue 37: mistakes found while rewriting module 08 to the rule (each blamed on its own TODO by the unit checks
    # that run before the whole step).
    Plant(F, "\n        self.buffers = [DeviceBuffer(runtime.empty(self.layout.padded_numel, dtype), runtime.new_event(),\n"
             "                                     runtime.new_event()) for _ in range(2)]",
          "\n        events = runtime.new_event(), runtime.new_event()\n"
          "        self.buffers = [DeviceBuffer(runtime.empty(self.layout.padded_numel, dtype), *events) for _ in range(2)]",
          "both buffers share one ready and one released event: a copy into one waits for the other's compute too",
          new=True),
    Plant(F, "\n            with self.rt.stream(self.copy_stream):\n                self.rt.copy(buf.flat, self.host[layer])\n"
             "            buf.ready.record(self.copy_stream)\n",
          "\n            buf.ready.record(self.copy_stream)\n            with self.rt.stream(self.copy_stream):\n"
          "                self.rt.copy(buf.flat, self.host[layer])\n",
          "ready recorded before the copy is queued: it completes without waiting for the copy", new=True),
    Plant(F, "\n        self.compute_stream.wait_event(buf.ready)\n", "\n        buf.ready.synchronize()\n",
          "the host waits for the copy instead of the compute stream: right numbers, but the host stalls every layer",
          new=True),
    Plant(F, "\n        buf.released.record(self.compute_stream)\n        buf.state = FREE\n",
          "\n        buf.released.record(self.compute_stream)\n        buf.state = FREE\n        buf.layer = -1\n",
          "release forgets which layer the buffer holds: the turn from forward to backward copies both blocks again",
          new=True),
    Plant(F, "        self.copy_stream.synchronize()\n        self.version += 1",
          "        self.compute_stream.synchronize()\n        self.version += 1",
          "the host waits for the compute stream, not the copies: a copy no compute waited for may still read the "
          "weights the optimizer writes (a learner run)", new=True),
]
