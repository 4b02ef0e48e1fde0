"""Module 08's planted bugs (CUDA streams and host weights): see course/mutants/__init__.py."""
from course.mutants import Plant

F = "m08_host_weights.py"
PLANTS = [
    Plant(F, "self.host = [runtime.pin(self.layout.flatten(b)) for b in blocks]",
          "self.host = [self.layout.flatten(b) for b in blocks]",
          "host blocks not pinned: a copy from pageable memory cannot run asynchronously on the side stream"),
    Plant(F, "runtime.new_event()) for _ in range(2)]", "runtime.new_event())]",
          "one device buffer, not two: the next block cannot be copied while this one computes"),
    Plant(F, "DeviceBuffer(runtime.empty(self.layout.padded_numel, dtype),", "DeviceBuffer(runtime.empty(self.layout.padded_numel, torch.float32),",
          "device buffers in float32 whatever the weights' dtype: bf16 blocks stream twice the bytes"),
    Plant(F, "            self.copy_stream.wait_event(buf.released)\n", "",
          "the copy does not wait for the buffer's release: it overwrites a block compute is still reading"),
    Plant(F, "            with self.rt.stream(self.copy_stream):\n                self.rt.copy(buf.flat, self.host[layer])\n",
          "            self.rt.copy(buf.flat, self.host[layer])\n",
          "the copy issued on the compute stream: it runs in line with compute, nothing overlaps"),
    Plant(F, "buf.ready.record(self.copy_stream)", "buf.ready.record(self.compute_stream)",
          "'ready' recorded on the compute stream: it does not mark the end of the copy"),
    Plant(F, "        self.compute_stream.wait_event(buf.ready)\n", "",
          "compute does not wait for the copy: the block may be read before it has arrived"),
    Plant(F, "buf.released.record(self.compute_stream)", "buf.released.record(self.copy_stream)",
          "'released' recorded on the copy stream: the next copy does not wait for compute to finish reading"),
    Plant(F, "        self.copy_stream.synchronize()\n        self.version += 1", "        self.version += 1",
          "invalidate does not wait for copies in flight: the optimizer may write host weights being read"),
    Plant(F, "        self.copy_stream.synchronize()\n        self.version += 1", "        self.copy_stream.synchronize()",
          "invalidate forgets nothing: a block still resident is reused after the optimizer changed it"),
]
