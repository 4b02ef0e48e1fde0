"""Module 02's planted bugs (communication primitives): see course/mutants/__init__.py."""
from course.mutants import Plant

F = "m02_comms.py"
PLANTS = [
    Plant(F, "self.next = self.pp.ranks[index + 1] if index < size - 1 else None",
          "self.next = self.pp.ranks[index + 1] if index < size else None",
          "off by one at the end: the last stage gets a next neighbour past the group's members"),
    Plant(F, "self.prev = self.pp.ranks[index - 1] if index > 0 else None", "self.prev = self.pp.ranks[index - 1]",
          "neighbours as a ring: the first stage's prev is the group's last member, where a pipeline has no one"),
    Plant(F, "self.prev = self.pp.ranks[index - 1] if index > 0 else None",
          "self.prev = self.rank - 1 if index > 0 else None",
          "a place is not a rank: the neighbour is the group's previous member, not the global rank below"),
    Plant(F, """        buffer = torch.empty(shape, dtype=dtype or self.dtype, device=self.device)
        dist.recv(buffer, self._peer("prev", "recv_forward"))""",
          """        buffer = torch.empty(shape, dtype=self.dtype, device=self.device)
        dist.recv(buffer, self._peer("prev", "recv_forward"))""",
          "recv_forward ignores the dtype asked for: a bf16 message lands in a float32 buffer of the wrong byte size"),
    Plant(F, """        buffer = torch.empty(shape, dtype=dtype or self.dtype, device=self.device)
        dist.recv(buffer, self._peer("next", "recv_backward"))""",
          """        buffer = torch.empty(shape, dtype=dtype or self.dtype)
        dist.recv(buffer, self._peer("next", "recv_backward"))""",
          "recv_backward's buffer on the default device, not the comms' device: on a GPU rank nccl cannot receive into it"),
    Plant(F, 'dist.send(tensor.contiguous(), self._peer("prev", "send_backward"))',
          'dist.send(tensor.contiguous(), self._peer("next", "send_backward"))',
          "a gradient sent to the next stage instead of back to the previous one: the wrong neighbour"),
    Plant(F, 'dist.recv(buffer, self._peer("next", "recv_backward"))',
          'dist.recv(buffer, self._peer("prev", "recv_backward"))',
          "a gradient received from the previous stage: gradients flow backwards, from the next one"),
    Plant(F, 'return dist.isend(tensor.contiguous(), self._peer("next", "isend_forward"))',
          'return dist.send(tensor.contiguous(), self._peer("next", "isend_forward"))',
          "isend_forward blocks (dist.send) and returns no handle: the schedules cannot overlap or wait on it"),
    Plant(F, "timeout=timedelta(seconds=timeout_s))", ")",
          "the timeout argument dropped: a stuck rank waits torch's default 30 minutes, not timeout_s"),
    Plant(F, 'backend = backend or ("nccl" if gpus_for_everyone else "gloo")',
          'backend = "nccl" if gpus_for_everyone else "gloo"',
          "the backend asked for is ignored: a module that keeps its tensors in CPU memory gets nccl on a GPU machine"),
    Plant(F, '    if not dist.is_initialized():\n', '    if True:  # always join\n',
          "joins the process group even when one exists: init_process_group twice is an error under course.launch"),
    Plant(F, 'local_rank = int(os.environ.get("LOCAL_RANK", "0"))', 'local_rank = rank',
          "the GPU chosen by global rank, not LOCAL_RANK: on a second machine the rank asks for a GPU that is not there"),
]
