"""Why a process that forks CPU ranks hides the GPUs from itself.

On a CUDA build of torch that sees a GPU, the first backward a process runs starts autograd's
per-device threads, and from then on a backward in any child forked from it refuses to run
(AUTOGRAD_AFTER_FORK below). The course's forked ranks use gloo on CPU, so the processes that fork
them (pytest through conftest.py, and main.py unless a command asks for a CUDA device) hide the
GPUs before torch runs anything; a GPU check gets them back in a child process
(course/gpu_check.py). No torch import here: main.py calls this before it knows a command needs torch.
"""
import os

_SAVED = "COURSE_CUDA_VISIBLE_DEVICES"
AUTOGRAD_AFTER_FORK = "Unable to handle autograd's threading in combination with fork-based multiprocessing"


def hide_gpus_from_autograd() -> None:
    """Make CUDA show no device to this process and its children (call it before any backward)."""
    os.environ.setdefault(_SAVED, os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>"))
    os.environ["CUDA_VISIBLE_DEVICES"] = ""


def environment_with_gpus() -> dict:
    """This process's environment with CUDA_VISIBLE_DEVICES as it was before `hide_gpus_from_autograd`."""
    env = dict(os.environ)
    saved = env.pop(_SAVED, None)
    if saved == "<unset>":
        env.pop("CUDA_VISIBLE_DEVICES", None)
    elif saved is not None:
        env["CUDA_VISIBLE_DEVICES"] = saved
    return env
