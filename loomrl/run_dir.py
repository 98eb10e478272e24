"""A run's directory: the one place that names the files a run writes, and reads its metrics back.

``loomrl train`` writes everything of a run under ``run_dir``; the report, ``loomrl timeline``, ``loomrl
calibrate --from``, ``loomrl eval`` and a resumed run read them back by these names:

====================================  ==========================================================================
``config.yaml``                       the run's full config, as it ran
``plan.json``                         the plan in force, with the cluster it runs on (rewritten at each change)
``metrics.jsonl``                     one JSON object per iteration (``metrics.superseded.jsonl``: lines a
                                      resumed run replaced)
``traces.jsonl``                      each executed step's start and end per device (``traces.superseded.jsonl``:
                                      those of a run restarted from iteration 0)
``placement.jsonl``                   dynamic placement's decisions
``failures.jsonl``                    each recovery from a lost worker or controller
``checkpoints/``                      ``iter_N`` directories and ``latest``
``report.html``, ``reward_curve.png``  the run report and the reward curves
``timeline.png``, ``timeline.html``   ``loomrl timeline``'s drawing (``timeline.trace.json`` with ``--chrome``)
====================================  ==========================================================================
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from loomrl.errors import DataError

__all__ = ["RunDir", "parse_record", "read_metrics"]


class RunDir:
    """The files of the run in ``path`` (module docstring)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    @property
    def config(self) -> Path:
        return self.path / "config.yaml"

    @property
    def plan(self) -> Path:
        return self.path / "plan.json"

    @property
    def metrics(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def superseded_metrics(self) -> Path:
        return self.path / "metrics.superseded.jsonl"

    @property
    def traces(self) -> Path:
        return self.path / "traces.jsonl"

    @property
    def superseded_traces(self) -> Path:
        return self.path / "traces.superseded.jsonl"

    @property
    def placement(self) -> Path:
        return self.path / "placement.jsonl"

    @property
    def failures(self) -> Path:
        return self.path / "failures.jsonl"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def report(self) -> Path:
        return self.path / "report.html"

    @property
    def reward_curve(self) -> Path:
        return self.path / "reward_curve.png"

    @property
    def timeline(self) -> Path:
        """The PNG drawing; its HTML page is beside it (``.html``)."""
        return self.path / "timeline.png"

    @property
    def chrome_trace(self) -> Path:
        return self.path / "timeline.trace.json"

    def is_run(self) -> bool:
        """Whether the directory holds a run: its config and its metrics."""
        return self.config.is_file() and self.metrics.is_file()

    def read_metrics(self) -> list[dict[str, Any]]:
        """The run's metrics records (:func:`read_metrics`)."""
        return read_metrics(self.metrics)


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All records of a metrics JSONL file, in file order.

    A final line without its newline is a record torn by a crash and is skipped; any other line that is
    not a JSON object is an error.
    """
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise DataError(f"{path}: cannot read metrics ({exc.strerror or exc})") from None
    records = []
    lines = text.split("\n")
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        record = parse_record(line)
        if record is None:
            if lineno == len(lines):  # no newline after it: torn write
                continue
            raise DataError(f"{path}:{lineno}: not a JSON object with an 'iteration'")
        records.append(record)
    return records


def parse_record(line: str) -> dict[str, Any] | None:
    """One metrics line as a record, or None when it is not a JSON object with an integer ``iteration``."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    if not isinstance(record, dict) or not isinstance(record.get("iteration"), int):
        return None
    return record
