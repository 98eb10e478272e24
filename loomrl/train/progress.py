"""Progress of a training loop, showing the metrics a person watches.

On a terminal it is a rich bar. When output is not a terminal (a log file, ``nohup``, ``ray job submit``, a batch
scheduler) a bar could only print its final state, so instead one plain line is printed every ``every``
iterations and at the last one, flushed at once::

    train 20/50 reward=0.412 kl=0.0031 dlogp=0.0012 len=5.2 samples/s=31.4 eval=0.25 | 1m02s elapsed, ~1m33s left
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from typing import TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

SHOWN = (
    ("reward/mean", "reward"),
    ("kl/mean", "kl"),
    ("mismatch/mean_abs_logp_diff", "dlogp"),
    ("response/length", "len"),
    ("perf/samples_per_s", "samples/s"),
    ("eval/exact_match", "eval"),
    ("loss", "loss"),
)


def format_duration(seconds: float) -> str:
    """``3725`` → ``1h02m05s``, ``62`` → ``1m02s``, ``4.2`` → ``4s``."""
    s = int(round(seconds))
    hours, rest = divmod(s, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m{secs:02d}s"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


class RunProgress:
    """Context manager; ``update(iteration, metrics)`` advances the bar (or prints a line) with the shown metrics."""

    def __init__(
        self,
        total: int,
        start: int = 0,
        enabled: bool = True,
        description: str = "train",
        every: int = 10,
        stream: TextIO | None = None,
    ):
        self.enabled = enabled
        self.total, self.start, self.description, self.every = total, start, description, max(1, every)
        self.stream = stream if stream is not None else sys.stdout
        self.shown: dict[str, float] = {}
        self.plain = enabled and not Console(file=self.stream).is_terminal
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[stats]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            disable=not enabled or self.plain,
        )

    def __enter__(self) -> RunProgress:
        self.t0 = time.monotonic()
        self.progress.__enter__()
        self.task = self.progress.add_task(self.description, total=self.total, completed=self.start, stats="")
        return self

    def __exit__(self, *exc) -> None:
        self.progress.__exit__(*exc)

    def stats(self) -> str:
        return " ".join(f"{label}={value:.3g}" for label, value in self.shown.items())

    def update(self, iteration: int, metrics: Mapping[str, float]) -> None:
        for key, label in SHOWN:
            if key in metrics:
                self.shown[label] = metrics[key]
        self.progress.update(self.task, completed=iteration + 1, stats=self.stats())
        done = iteration + 1
        if self.plain and ((done - self.start) % self.every == 0 or done == self.total):
            print(self.line(done, time.monotonic() - self.t0), file=self.stream, flush=True)

    def line(self, done: int, elapsed: float) -> str:
        """The plain progress line after ``done`` of ``total`` steps, ``elapsed`` seconds into this process."""
        ran = done - self.start
        left = elapsed / ran * (self.total - done) if ran > 0 else 0.0
        timing = f"{format_duration(elapsed)} elapsed" + (
            f", ~{format_duration(left)} left" if done < self.total else ""
        )
        return f"{self.description} {done}/{self.total} {self.stats()} | {timing}".replace("  ", " ")
