"""Logging backends: where a run's metrics go besides ``metrics.jsonl`` (TensorBoard, Weights & Biases, MLflow).

Each backend is an optional extra (``pip install 'loomrl[wandb]'``); none is needed by default. A backend named
in ``report.backends`` whose package is missing stops the run before it starts, with one line naming the extra
(:func:`check_backends`). Packages are imported only here and only when asked for.

- TensorBoard: scalars in ``RUN_DIR/tb``; a resumed run purges the steps after its checkpoint.
- wandb: one wandb run per loomrl run (its id kept in ``RUN_DIR/wandb_run_id``, so ``--resume`` continues it),
  the config as the run's config, files under ``RUN_DIR/wandb``; online or offline as
  :func:`loomrl.runtime.launch.wandb_mode` decides.
- MLflow: one MLflow run under the experiment ``report.project`` (its id in ``RUN_DIR/mlflow_run_id``), the
  config as flattened parameters, through an ``MlflowClient`` (no process-wide active run).
"""

from __future__ import annotations

import importlib
import re
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from loomrl.errors import ConfigError

__all__ = ["Backend", "check_backends", "open_backends"]

PACKAGES: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow"),
}
"""Backend → (the module it imports, the loomrl extra that installs it)."""

_MLFLOW_KEY = re.compile(r"[^\w\-. :/]")
"""Characters MLflow refuses in a metric or parameter name."""


class Backend(Protocol):
    """A destination for the per-iteration metrics."""

    def log(self, iteration: int, metrics: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


def check_backends(names: Sequence[str]) -> None:
    """Raise a one-line ConfigError for the first backend whose package cannot be imported."""
    for name in names:
        module, extra = PACKAGES[name]
        try:
            importlib.import_module(module)
        except ImportError:
            raise ConfigError(
                f"report.backends: '{name}' needs the {module} package, which is not installed "
                f"(pip install 'loomrl[{extra}]')"
            ) from None


def open_backends(
    names: Sequence[str], run_dir: Path, settings: Any, config: Mapping[str, Any], resume_from_iteration: int | None
) -> list[Backend]:
    """One backend per name (``settings`` is the run's ``report`` section, ``config`` the run's whole config as
    plain data); ``resume_from_iteration`` is the checkpoint's iteration when a run resumes."""
    check_backends(names)
    makers = {"tensorboard": TensorBoardBackend, "wandb": WandbBackend, "mlflow": MlflowBackend}
    opened: list[Backend] = []
    try:
        for name in names:
            opened.append(makers[name](run_dir, settings, config, resume_from_iteration))
    except BaseException:
        for backend in opened:
            backend.close()
        raise
    return opened


def _run_name(run_dir: Path, settings: Any) -> str:
    return settings.run_name or run_dir.resolve().name


def _previous_id(run_dir: Path, file: str, resume_from_iteration: int | None) -> str | None:
    """The backend's run id saved by the run being resumed (None for a fresh start)."""
    path = run_dir / file
    if resume_from_iteration is None or not path.is_file():
        return None
    return path.read_text().strip() or None


class TensorBoardBackend:
    """Scalars in ``RUN_DIR/tb``, one tag per metric."""

    def __init__(
        self, run_dir: Path, settings: Any, config: Mapping[str, Any], resume_from_iteration: int | None
    ) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # a fresh start purges every step (events of an earlier run in the same directory), a resume those after
        # its checkpoint, which the resumed run logs again
        purge = 0 if resume_from_iteration is None else resume_from_iteration + 1
        self.writer = SummaryWriter(log_dir=str(run_dir / "tb"), purge_step=purge)

    def log(self, iteration: int, metrics: Mapping[str, float]) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, global_step=iteration)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbBackend:
    """A Weights & Biases run; its id is kept so a resumed loomrl run continues it."""

    ID_FILE = "wandb_run_id"

    def __init__(
        self, run_dir: Path, settings: Any, config: Mapping[str, Any], resume_from_iteration: int | None
    ) -> None:
        import wandb

        from loomrl.runtime.launch import wandb_mode

        previous = _previous_id(run_dir, self.ID_FILE, resume_from_iteration)
        self.mode = wandb_mode(settings.wandb_mode)
        self.run = wandb.init(
            project=settings.project,
            name=_run_name(run_dir, settings),
            dir=str(run_dir),
            config=dict(config),
            mode=self.mode,
            id=previous,
            resume="allow" if previous else None,
        )
        (run_dir / self.ID_FILE).write_text(self.run.id + "\n")

    def log(self, iteration: int, metrics: Mapping[str, float]) -> None:
        self.run.log(dict(metrics), step=iteration)

    def close(self) -> None:
        self.run.finish()


class MlflowBackend:
    """An MLflow run in experiment ``report.project``; its id is kept so a resumed loomrl run continues it."""

    ID_FILE = "mlflow_run_id"

    def __init__(
        self, run_dir: Path, settings: Any, config: Mapping[str, Any], resume_from_iteration: int | None
    ) -> None:
        import mlflow
        from mlflow.entities import Param

        self.client = mlflow.MlflowClient(tracking_uri=settings.mlflow_tracking_uri)
        experiment = self.client.get_experiment_by_name(settings.project)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(settings.project)
        previous = _previous_id(run_dir, self.ID_FILE, resume_from_iteration)
        if previous:
            self.run_id = previous
        else:
            self.run_id = self.client.create_run(experiment_id, run_name=_run_name(run_dir, settings)).info.run_id
            params = [Param(_MLFLOW_KEY.sub("_", k), str(v)[:500]) for k, v in flatten(config).items()]
            for start in range(0, len(params), 100):  # MLflow takes at most 100 parameters per batch
                self.client.log_batch(self.run_id, params=params[start : start + 100])
        (run_dir / self.ID_FILE).write_text(self.run_id + "\n")

    def log(self, iteration: int, metrics: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(_MLFLOW_KEY.sub("_", k), float(v), now, iteration) for k, v in metrics.items()]
        for start in range(0, len(batch), 1000):  # MLflow's limit of metrics per batch
            self.client.log_batch(self.run_id, metrics=batch[start : start + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` → ``{"a.b": 1}``: nested settings as the flat parameters MLflow takes."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, path + "."))
        else:
            out[path] = value
    return out
