"""The capstone's text as characters (given): course/data/tinyshakespeare.txt's 62 distinct characters
are the vocabulary (V = 62: 16 rows a rank on t = 4, the last rank 14, so a checkpoint meets rows
that do not divide evenly), the first 90% of the text is for training, the last 10% for validation.
Batches are course/dataset.py's random windows of either part."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from course.dataset import TEXT

VALIDATION = 0.1  # the last tenth of the text, never trained on


@dataclass(frozen=True)
class CharText:
    """The text's vocabulary, and the text as token ids, cut into a training and a validation part."""
    chars: str                 # the vocabulary, sorted: id i is chars[i]
    train: torch.Tensor        # (n,) int64 ids
    validation: torch.Tensor   # (n_val,) int64 ids

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        unknown = sorted(set(text) - set(self.chars))
        if unknown:
            raise ValueError(f"characters outside the vocabulary: {''.join(unknown)!r}")
        index = {c: i for i, c in enumerate(self.chars)}
        return torch.tensor([index[c] for c in text], dtype=torch.long)

    def decode(self, ids) -> str:
        return "".join(self.chars[i] for i in torch.as_tensor(ids).tolist())


def load_chars(path: Path = TEXT, validation: float = VALIDATION) -> CharText:
    text = path.read_text()
    chars = "".join(sorted(set(text)))
    index = {c: i for i, c in enumerate(chars)}
    ids = torch.tensor([index[c] for c in text], dtype=torch.long)
    cut = int(len(ids) * (1 - validation))
    return CharText(chars, ids[:cut], ids[cut:])
