"""A rich progress bar for training loops, showing the metrics a person watches."""

from __future__ import annotations

from typing import Mapping

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

SHOWN = (("reward/mean", "reward"), ("kl/mean", "kl"), ("response/length", "len"),
         ("perf/samples_per_s", "samples/s"), ("eval/exact_match", "eval"), ("loss", "loss"))


class RunProgress:
    """Context manager; ``update(iteration, metrics)`` advances the bar and refreshes the shown metrics."""

    def __init__(self, total: int, start: int = 0, enabled: bool = True, description: str = "train"):
        self.enabled = enabled
        self.total, self.start, self.description = total, start, description
        self.shown: dict[str, float] = {}
        self.progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[stats]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                                 disable=not enabled)

    def __enter__(self) -> "RunProgress":
        self.progress.__enter__()
        self.task = self.progress.add_task(self.description, total=self.total, completed=self.start, stats="")
        return self

    def __exit__(self, *exc) -> None:
        self.progress.__exit__(*exc)

    def update(self, iteration: int, metrics: Mapping[str, float]) -> None:
        for key, label in SHOWN:
            if key in metrics:
                self.shown[label] = metrics[key]
        stats = " ".join(f"{label}={value:.3g}" for label, value in self.shown.items())
        self.progress.update(self.task, completed=iteration + 1, stats=stats)
