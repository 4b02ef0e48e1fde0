"""`python main.py run 02`: a tensor goes down the pipeline (each rank adds its rank) and back up
(each rank doubles it), through the learner's PipelineComms."""
import torch

from course.impl import load


def demo(args):
    m02 = load("m02_comms")
    rank, world_size, device = m02.init_distributed()
    comms = m02.PipelineComms(device=device)  # the pipeline is every rank of the job, in rank order
    first, last = comms.prev is None, comms.next is None
    x = torch.zeros(4, device=device) if first else comms.recv_forward((4,))
    x = x + rank
    if last:
        print(f"rank {rank}: forward pass arrived as {x.tolist()}, expected {sum(range(world_size))}")
    else:
        comms.send_forward(x)
        x = comms.recv_backward((4,))
    x = x * 2
    if first:
        expected = sum(range(world_size)) * 2 ** world_size
        print(f"rank {rank}: backward pass arrived as {x.tolist()}, expected {expected}")
    else:
        comms.send_backward(x)
