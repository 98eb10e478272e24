"""Per-iteration training metrics: an append-only JSON-lines file, copied to the run's logging backends.

``RUN_DIR/metrics.jsonl`` is the record of a run: one line per ``log`` call,
``{"iteration": k, "time": <unix seconds>, "reward/mean": ..., ...}``, flushed as it is written so a crash
loses nothing already logged. The same values go to every backend the run opened (TensorBoard, wandb, MLflow:
:mod:`loomrl.report.backends`).

A run resumed from the checkpoint of iteration k re-does iterations k+1.. that the crashed run may
already have logged. Those lines are moved to ``metrics.superseded.jsonl`` (kept for forensics, never
deleted) so that ``metrics.jsonl`` reads like one uninterrupted run, and TensorBoard is told to purge
its events after k.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from loomrl.report.backends import Backend
from loomrl.run_dir import RunDir, parse_record

_RESERVED = ("iteration", "time")


class MetricsLogger:
    """Appends one record per iteration to ``RUN_DIR/metrics.jsonl`` and hands it to each backend (which the
    logger closes with itself)."""

    def __init__(
        self,
        run_dir: str | os.PathLike,
        backends: Sequence[Backend] = (),
        resume_from_iteration: int | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = RunDir(self.run_dir).metrics
        if resume_from_iteration is not None:
            supersede_after(self.path, resume_from_iteration)
        # Line-buffered text: every record reaches the OS as soon as its newline is written.
        self._file = open(self.path, "a", buffering=1)
        self._backends = list(backends)

    def log(self, iteration: int, metrics: Mapping[str, float]) -> None:
        """Record ``metrics`` for ``iteration``; values must convert to float."""
        clash = [k for k in metrics if k in _RESERVED]
        if clash:
            raise ValueError(f"MetricsLogger.log: metric names {clash} are reserved for the record itself")
        values = {name: float(value) for name, value in metrics.items()}
        record = {"iteration": int(iteration), "time": time.time(), **values}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        for backend in self._backends:
            backend.log(int(iteration), values)

    def close(self) -> None:
        """Close the JSONL file and every backend; safe to call twice."""
        if not self._file.closed:
            self._file.close()
        backends, self._backends = self._backends, []
        for backend in backends:
            backend.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def supersede_after(path: str | os.PathLike, iteration: int) -> int:
    """Move records with iteration > ``iteration`` from ``path`` to the superseded file beside it.

    Returns how many lines moved. Unparseable lines (a torn final write) move too, so nothing is lost.
    The superseded file is appended to and synced before ``path`` is replaced, so a crash in between
    can duplicate lines but never drop them.
    """
    path = Path(path)
    if not path.exists():
        return 0
    keep, moved = [], []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        record = parse_record(line)
        (keep if record is not None and record["iteration"] <= iteration else moved).append(line)
    if not moved:
        return 0
    with open(RunDir(path.parent).superseded_metrics, "a") as fh:
        fh.write("".join(line + "\n" for line in moved))
        fh.flush()
        os.fsync(fh.fileno())
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as fh:
        fh.write("".join(line + "\n" for line in keep))
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return len(moved)


def finite_series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(iterations, values) of ``key`` over the records that logged it; NaN/inf values are dropped."""
    xs, ys = [], []
    for record in records:
        value = record.get(key)
        if isinstance(value, (int, float)) and math.isfinite(value):
            xs.append(record["iteration"])
            ys.append(float(value))
    return xs, ys
