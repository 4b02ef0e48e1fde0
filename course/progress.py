"""A progress bar for training runs (given): steps done, the loss, tokens a second, time left.

On a terminal it redraws one line in place; otherwise (a log, a notebook, a test) it prints a line
every `every` steps, so a captured output stays readable."""
from __future__ import annotations

import sys
import time


class ProgressBar:
    def __init__(self, total: int, tokens_per_step: int, start: int = 0, width: int = 24, every: int = 25,
                 stream=None):
        self.total, self.tokens_per_step, self.start = total, tokens_per_step, start
        self.width, self.every, self.stream = width, every, stream or sys.stdout
        self.began = time.perf_counter()
        self.interactive = self.stream.isatty()
        self.extra = ""

    def note(self, text: str):
        """Something to show after the bar until the next note (e.g. the last validation loss)."""
        self.extra = text

    def line(self, step: int, loss: float) -> str:
        done = step + 1
        elapsed = time.perf_counter() - self.began
        rate = (done - self.start) * self.tokens_per_step / elapsed if elapsed > 0 else 0.0
        left = elapsed / max(1, done - self.start) * (self.total - done)
        filled = self.width * done // max(1, self.total)
        bar = "#" * filled + "." * (self.width - filled)
        return (f"[{bar}] {done:4d}/{self.total}  loss {loss:.4f}  {rate:8,.0f} tokens/s  "
                f"{elapsed:6.1f} s, {left:5.0f} s left{('  ' + self.extra) if self.extra else ''}")

    def update(self, step: int, loss: float):
        done = step + 1
        if self.interactive:
            end = "\n" if done == self.total else ""
            print("\r" + self.line(step, loss), end=end, file=self.stream, flush=True)
        elif done % self.every == 0 or done == self.total or done == self.start + 1:
            print(self.line(step, loss), file=self.stream, flush=True)
