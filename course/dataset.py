"""The training text of the Llama modules (given): bytes of Shakespeare as tokens (vocabulary
256), and random windows of it as batches. course/data/README.md says what the text is."""
from __future__ import annotations

from pathlib import Path

import torch

TEXT = Path(__file__).resolve().parent / "data" / "tinyshakespeare.txt"


def load_text(path: Path = TEXT) -> torch.Tensor:
    """The text as a 1-D tensor of byte values (vocabulary 256)."""
    return torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8).long()


def random_batch(data: torch.Tensor, batch: int, seq_len: int, generator: torch.Generator):
    """`batch` random windows of the text: tokens and the same windows shifted by one (targets)."""
    starts = torch.randint(0, len(data) - seq_len - 1, (batch,), generator=generator)
    windows = torch.stack([data[s:s + seq_len + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]
