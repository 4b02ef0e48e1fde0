"""Module 18, across nodes: module 17's job started as two torchrun agents on this machine (--nnodes 2,
a c10d rendezvous on 127.0.0.1, 4 ranks each), the way a learner starts it on two machines, trains
with the same losses as the same job on 8 forked ranks of one process group.

Both runs are one job of 8 ranks with the same mesh (p=2, d=2, t=2): each rank computes the same
sums in the same order whichever agent started it, so the losses are equal, bit for bit. What the
check adds over module 17's 8-rank test is the launch: two agents that find each other through the
rendezvous, ranks numbered across them (agent 0's ranks 0-3, agent 1's 4-7), and gloo connections
between processes that share no parent. A long check (`python -m pytest -m long`): two torchrun
agents and an 8-rank fork take about a minute on 2 cores.

This file is also the rank's script: `torchrun ... tests/test_18_nodes.py OUT` trains and writes
rank 0's losses to OUT.
"""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

SIZES = {"p": 2, "d": 2, "t": 2}
STEPS, BATCH, M, LR = 3, 8, 2, 3e-3


def train(sizes) -> list[float]:
    """Module 17's trainer (the reference: this checks the launch, not the learner's code) for a few steps
    of module 06's `fit` on this rank of the job; the same losses on every rank."""
    import torch

    from course.impl import reference
    from course.mesh import init_mesh

    torch.set_num_threads(1)
    trainer, given, m06 = reference("m17_trainer"), reference("m17_composition"), reference("m06_llama_model")
    mesh = init_mesh(given.full_sizes(sizes))
    model = trainer.ComposedLlama(given.CONFIG, mesh, M, "1f1b", 1, dtype=torch.float64)
    _, losses = m06.fit(model, STEPS, BATCH, LR, n_microbatches=M)
    return losses


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.long
@pytest.mark.given
def test_two_torchrun_agents_train_like_one_8_rank_job(tmp_path):
    from course import REPO
    from course.launch import run_ranks

    port, out = free_port(), tmp_path / "losses.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "4",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "m18-two-nodes",
               "--local-addr", "127.0.0.1", "--max-restarts", "0", str(Path(__file__).resolve()), str(out)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    agents = [subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True) for _ in range(2)]
    try:
        outputs = [agent.communicate(timeout=240)[0] for agent in agents]
    finally:
        for agent in agents:   # on a timeout or a failure: the agents and their ranks (their own sessions)
            if agent.poll() is None:
                os.killpg(agent.pid, 9)
                agent.wait()
    for i, (agent, output) in enumerate(zip(agents, outputs)):
        assert agent.returncode == 0, f"agent {i} exited with {agent.returncode}:\n{output[-3000:]}"
    two_agents = json.loads(out.read_text())
    one_job = run_ranks(train, 8, SIZES, timeout=240)[0]
    assert two_agents == one_job, f"two torchrun agents: losses {two_agents}; one 8-rank job: {one_job}"


if __name__ == "__main__":   # one rank of the two agents' job
    import torch.distributed as dist

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    dist.init_process_group("gloo")
    losses = train(SIZES)
    if dist.get_rank() == 0:
        Path(sys.argv[1]).write_text(json.dumps(losses))
    dist.destroy_process_group()
