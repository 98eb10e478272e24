"""Run reporting: JSONL metrics survive crashes and resumes, TensorBoard gets the scalars, plots render."""

import json

import pytest
from rich.console import Console
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from loomrl.errors import DataError
from loomrl.report import MetricsLogger, plot_metrics, plot_reward_curve, read_metrics, summary_table
from loomrl.report.backends import TensorBoardBackend

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def tb_scalars(run_dir, tag):
    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_lines_are_appended_and_flushed_before_close(tmp_path):
    logger = MetricsLogger(tmp_path)
    logger.log(1, {"reward/mean": 0.5, "kl/mean": 0.01})
    # Read while the logger is still open: a crash right now must not lose the line.
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 1
    record = json.loads(lines[0])
    assert record["iteration"] == 1 and record["reward/mean"] == 0.5 and record["kl/mean"] == 0.01
    assert record["time"] > 1e9
    logger.log(2, {"reward/mean": 0.75})
    logger.close()
    logger.close()
    assert [r["iteration"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]


def test_reserved_names_rejected(tmp_path):
    with MetricsLogger(tmp_path) as logger, pytest.raises(ValueError, match="reserved"):
        logger.log(1, {"iteration": 3.0})


def tensorboard(run_dir, resume_from_iteration=None):
    return [TensorBoardBackend(run_dir, None, {}, resume_from_iteration)]


def test_tensorboard_event_file_has_scalars(tmp_path):
    with MetricsLogger(tmp_path, tensorboard(tmp_path)) as logger:
        logger.log(1, {"reward/mean": 0.25})
        logger.log(2, {"reward/mean": 0.5})
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert tb_scalars(tmp_path, "reward/mean") == [(1, 0.25), (2, 0.5)]


def test_resume_moves_later_lines_to_superseded(tmp_path):
    with MetricsLogger(tmp_path, tensorboard(tmp_path)) as logger:
        for it in range(1, 6):
            logger.log(it, {"reward/mean": float(it)})
    # Simulate a crash that tore the last write in half.
    with open(tmp_path / "metrics.jsonl", "a") as fh:
        fh.write('{"iteration": 6, "rew')

    with MetricsLogger(tmp_path, tensorboard(tmp_path, 3), resume_from_iteration=3) as logger:  # checkpoint at 3
        logger.log(4, {"reward/mean": 40.0})

    assert [(r["iteration"], r["reward/mean"]) for r in read_metrics(tmp_path / "metrics.jsonl")] == [
        (1, 1.0),
        (2, 2.0),
        (3, 3.0),
        (4, 40.0),
    ]
    superseded = (tmp_path / "metrics.superseded.jsonl").read_text().splitlines()
    assert [json.loads(line)["iteration"] for line in superseded[:2]] == [4, 5]
    assert superseded[2] == '{"iteration": 6, "rew'  # moved, not deleted
    assert tb_scalars(tmp_path, "reward/mean") == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]


def test_read_metrics_rejects_corrupt_middle_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"iteration": 1}\nnot json\n{"iteration": 2}\n')
    with pytest.raises(DataError, match=r"metrics.jsonl:2"):
        read_metrics(path)
    with pytest.raises(DataError, match="cannot read"):
        read_metrics(tmp_path / "absent.jsonl")


def test_plot_writes_png_and_skips_missing_keys(tmp_path):
    with MetricsLogger(tmp_path) as logger:
        for it in range(1, 4):
            logger.log(it, {"reward/mean": it * 0.1, "response/length": 10.0 + it})
    out = plot_metrics(
        tmp_path / "metrics.jsonl",
        tmp_path / "plots" / "m.png",
        ["reward/mean", "not/logged", "response/length"],
        title="t",
    )
    assert out.read_bytes().startswith(PNG_MAGIC) and out.stat().st_size > 1000
    only_missing = plot_metrics(tmp_path / "metrics.jsonl", tmp_path / "none.png", ["not/logged"])
    assert only_missing.read_bytes().startswith(PNG_MAGIC)
    curve = plot_reward_curve(tmp_path)
    assert curve == tmp_path / "reward_curve.png" and curve.read_bytes().startswith(PNG_MAGIC)


def test_summary_table_renders_union_of_columns():
    table = summary_table([{"name": "ppo", "reward": 0.123456}, {"name": "grpo", "time_s": 3}], "Results")
    assert [c.header for c in table.columns] == ["name", "reward", "time_s"]
    console = Console(width=80, record=True)
    console.print(table)
    text = console.export_text()
    assert "Results" in text and "0.1235" in text and "grpo" in text
