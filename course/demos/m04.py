"""`python main.py run 04`: the batch relayed through the sharded model; the last rank checks the
monolith's logits."""
import torch

from course.impl import load
from course.pipeline_options import check_one_stage_per_rank


def check_args(args):
    check_one_stage_per_rank(args.world_size)


def demo(args):
    m00, m02, m04 = load("m00_monolith"), load("m02_comms"), load("m04_sharded")
    rank, world_size, device = m02.init_distributed()
    cfg = m00.MLPConfig()
    comms = m02.PipelineComms(device=device)  # the pipeline is every rank of the job: comms.pp
    model = m04.ShardedMLP(cfg, comms.pp).to(device)
    x, y = m00.make_batch(cfg)
    out = m04.sharded_forward(model, comms, x.to(device))
    params = sum(p.numel() for p in model.parameters())
    print(f"rank {rank}: layers {list(m04.layer_range(cfg, comms.pp.index, comms.pp.size))}, {params} parameters")
    if model.is_last:
        expected = m00.build_model(cfg)(x)
        same = torch.equal(out.cpu(), expected)
        print(f"rank {rank}: logits equal the monolith's bit for bit: {same}; "
              f"loss {model.loss(out, y.to(device)).item():.6f}")
