"""`python main.py run 03`: five round trips that check message order, then the round-trip time
of a small and a large message (`python main.py bench 03` measures a whole range)."""
import torch

from course.impl import load


def check_args(args):
    if args.world_size != 2:
        raise ValueError(f"ping-pong is a game for exactly 2 ranks, not {args.world_size}")


def demo(args):
    m02, m03 = load("m02_comms"), load("m03_ping_pong")
    rank, world_size, device = m02.init_distributed()
    comms = m02.PipelineComms(device=device)
    ball = m03.ping_pong(comms, torch.zeros(3, device=device), round_trips=5)
    print(f"rank {rank}: after 5 round trips holds {ball.tolist()} (expected {10 - rank})")
    for numel in (1, 1 << 20):
        seconds = m03.time_round_trip(comms, numel)
        if rank == 0:
            print(f"rank 0: {numel * 4 / 1e6:8.3f} MB round trip {seconds * 1e6:9.1f} us")
