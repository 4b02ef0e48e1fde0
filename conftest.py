"""Root pytest configuration: choose the implementation to grade, and warm up before forking.

`pytest` grades solutions/ (what CI runs); `pytest --impl steps` (or COURSE_IMPL=steps) grades
the learner's steps/. The option must live in the root conftest for a bare `pytest` to accept it.
"""
import os

from course.fork_safety import hide_gpus_from_autograd

# Every multi-rank test forks its ranks from this process, so autograd here must never see a GPU
# (course/fork_safety.py says why); a test's CUDA part runs in a child that gets the GPUs back.
hide_gpus_from_autograd()

pytest_plugins = ["course.grading"]


def pytest_addoption(parser):
    parser.addoption("--impl", choices=("solutions", "steps"), default=None,
                     help="implementation to grade (default: $COURSE_IMPL, else solutions)")


def pytest_configure(config):
    os.environ["COURSE_IMPL"] = config.getoption("--impl") or os.environ.get("COURSE_IMPL", "solutions")


def pytest_report_header(config):
    return f"grading: {os.environ['COURSE_IMPL']}/  (switch with --impl steps|solutions)"


def pytest_sessionstart(session):
    # Do once in the parent what every forked rank would otherwise pay for: one thread (ranks
    # share the cores, and forking after a multi-threaded matmul can hang the child), the
    # distributed module, the ~500 imports of the first assert_close, and torch._dynamo, which the
    # first optimizer imports (4-9 s per rank when two ranks import it at once on 2 cores).
    import torch
    import torch.distributed  # noqa: F401

    torch.set_num_threads(1)
    torch.testing.assert_close(torch.ones(2) @ torch.ones(2), torch.tensor(2.0))
    torch.optim.Adam([torch.zeros(1, requires_grad=True)])
