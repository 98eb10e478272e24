"""Logging backends (wandb and MLflow through fake modules in ``sys.modules``: neither is installed here), the
choice of wandb's mode, the one-line error for a backend that is not installed, and plain progress lines."""

from __future__ import annotations

import io
import socket
import sys
import types
from collections import namedtuple

import pytest

from loomrl.config.schema import ReportConfig, TrainConfig
from loomrl.config.tools import load_config
from loomrl.errors import ConfigError
from loomrl.report.backends import MlflowBackend, WandbBackend, check_backends, flatten, open_backends
from loomrl.runtime.launch import wandb_mode
from loomrl.train.progress import RunProgress, format_duration


class FakeWandb(types.ModuleType):
    """Records what loomrl asks of wandb."""

    def __init__(self) -> None:
        super().__init__("wandb")
        self.inits: list[dict] = []
        self.runs: list = []

    def init(self, **kwargs):
        self.inits.append(kwargs)
        run = types.SimpleNamespace(id=kwargs["id"] or f"run{len(self.runs)}", logged=[], finished=False)
        run.log = lambda values, step: run.logged.append((step, values))
        run.finish = lambda: setattr(run, "finished", True)
        self.runs.append(run)
        return run


@pytest.fixture
def fake_wandb(monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    return fake


@pytest.fixture
def fake_mlflow(monkeypatch):
    """An in-memory MLflow: experiments and runs held by one client class."""
    Metric = namedtuple("Metric", "key value timestamp step")
    Param = namedtuple("Param", "key value")
    store = {"experiments": {}, "runs": {}, "batches": []}

    class MlflowClient:
        def __init__(self, tracking_uri=None):
            store["uri"] = tracking_uri

        def get_experiment_by_name(self, name):
            eid = store["experiments"].get(name)
            return None if eid is None else types.SimpleNamespace(experiment_id=eid)

        def create_experiment(self, name):
            store["experiments"][name] = f"e{len(store['experiments'])}"
            return store["experiments"][name]

        def create_run(self, experiment_id, run_name=None):
            run_id = f"r{len(store['runs'])}"
            store["runs"][run_id] = {
                "experiment": experiment_id,
                "name": run_name,
                "params": [],
                "metrics": [],
                "terminated": False,
            }
            return types.SimpleNamespace(info=types.SimpleNamespace(run_id=run_id))

        def log_batch(self, run_id, metrics=(), params=()):
            store["batches"].append((len(metrics), len(params)))
            store["runs"][run_id]["metrics"] += list(metrics)
            store["runs"][run_id]["params"] += list(params)

        def set_terminated(self, run_id):
            store["runs"][run_id]["terminated"] = True

    mlflow = types.ModuleType("mlflow")
    mlflow.MlflowClient = MlflowClient
    entities = types.ModuleType("mlflow.entities")
    entities.Metric, entities.Param = Metric, Param
    mlflow.entities = entities
    monkeypatch.setitem(sys.modules, "mlflow", mlflow)
    monkeypatch.setitem(sys.modules, "mlflow.entities", entities)
    return store


def test_wandb_logs_every_iteration_at_its_step_and_a_resume_continues_the_same_run(fake_wandb, tmp_path):
    settings = ReportConfig(backends=("wandb",), project="proj", wandb_mode="offline")
    config = {"algo": {"name": "grpo"}, "seed": 3}
    [backend] = open_backends(["wandb"], tmp_path, settings, config, None)
    backend.log(0, {"reward/mean": 0.5})
    backend.log(1, {"reward/mean": 0.75})
    backend.close()
    first = fake_wandb.inits[0]
    assert (first["project"], first["name"], first["dir"], first["mode"]) == (
        "proj",
        tmp_path.name,
        str(tmp_path),
        "offline",
    )
    assert first["config"] == config and first["id"] is None and first["resume"] is None
    run = fake_wandb.runs[0]
    assert run.logged == [(0, {"reward/mean": 0.5}), (1, {"reward/mean": 0.75})] and run.finished
    assert (tmp_path / "wandb_run_id").read_text().strip() == run.id
    WandbBackend(tmp_path, settings, config, resume_from_iteration=1).close()  # --resume after iteration 1
    assert fake_wandb.inits[1]["id"] == run.id and fake_wandb.inits[1]["resume"] == "allow"
    WandbBackend(tmp_path, settings, config, resume_from_iteration=None).close()  # a fresh start: a new run
    assert fake_wandb.inits[2]["id"] is None


def test_mlflow_logs_flattened_params_once_and_metrics_by_step(fake_mlflow, tmp_path):
    settings = ReportConfig(backends=("mlflow",), project="exp", run_name="r", mlflow_tracking_uri="sqlite:///x.db")
    config = {
        "algo": {"name": "ppo", "clip_eps": 0.2},
        "runtime": {"layouts": {}},
        "tags": [1, 2],
        **{f"k{i}": i for i in range(150)},
    }
    backend = MlflowBackend(tmp_path, settings, config, None)
    backend.log(4, {"reward/mean": 0.25, "eval/pass@1": 1.0})
    backend.close()
    assert fake_mlflow["uri"] == "sqlite:///x.db" and fake_mlflow["experiments"] == {"exp": "e0"}
    run = fake_mlflow["runs"]["r0"]
    params = dict(run["params"])
    assert params["algo.name"] == "ppo" and params["algo.clip_eps"] == "0.2" and params["runtime.layouts"] == "{}"
    assert len(params) == 3 + 1 + 150 and max(p for _, p in fake_mlflow["batches"]) <= 100  # MLflow's batch limit
    assert sorted((m.key, m.value, m.step) for m in run["metrics"]) == [
        ("eval/pass_1", 1.0, 4),
        ("reward/mean", 0.25, 4),
    ]
    assert run["terminated"] and run["name"] == "r"
    MlflowBackend(tmp_path, settings, config, resume_from_iteration=4).close()
    assert list(fake_mlflow["runs"]) == ["r0"]  # the resumed run logs into the same MLflow run, params once


def test_flatten_nests_with_dots():
    assert flatten({"a": {"b": 1, "c": {"d": "x"}}, "e": [1], "f": {}}) == {"a.b": 1, "a.c.d": "x", "e": [1], "f": {}}


def test_a_backend_that_is_not_installed_is_one_line_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with pytest.raises(ConfigError) as exc:
        check_backends(["wandb"])
    assert str(exc.value) == (
        "report.backends: 'wandb' needs the wandb package, which is not installed (pip install 'loomrl[wandb]')"
    )
    with pytest.raises(ConfigError, match="'neptune' is not a backend"):
        load_config(TrainConfig, None, ["report.backends=[neptune]"])


def test_wandb_mode(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    assert wandb_mode("online") == "online" and wandb_mode("offline") == "offline"
    assert wandb_mode("auto") == "offline"  # no API key: offline, without trying the network
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # bound, never listening: connections are refused
        monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{port}")
        assert wandb_mode("auto") == "offline"
    with socket.create_server(("127.0.0.1", 0)) as server:
        monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{server.getsockname()[1]}")
        assert wandb_mode("auto") == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_mode("auto") is None  # wandb reads WANDB_MODE itself


def test_a_run_logs_each_iteration_to_its_backends(fake_wandb, tmp_path):
    from loomrl.train.rl import RLTrainer

    cfg = load_config(
        TrainConfig,
        None,
        [
            "runtime.executor=reference",
            "loop.iterations=2",
            "rollout.prompts_per_iter=2",
            "rollout.max_new_tokens=4",
            "loop.eval_prompts=2",
            "loop.progress=false",
            "report.html=false",
            "report.backends=[wandb]",
            "report.wandb_mode=offline",
            f"run_dir={tmp_path / 'run'}",
            "algo.minibatches=1",
        ],
    )
    RLTrainer(cfg).run()
    run = fake_wandb.runs[0]
    assert [step for step, _ in run.logged] == [0, 1] and "reward/mean" in run.logged[0][1] and run.finished
    assert fake_wandb.inits[0]["config"]["algo"]["name"] == "ppo"


def test_format_duration_by_hand():
    assert [format_duration(s) for s in (4.2, 62, 3725)] == ["4s", "1m02s", "1h02m05s"]


def test_progress_prints_plain_lines_when_output_is_not_a_terminal():
    out = io.StringIO()  # not a terminal, as under nohup or `ray job submit`
    with RunProgress(5, start=0, every=2, stream=out) as progress:
        for it in range(5):
            progress.update(it, {"reward/mean": 0.5 + it / 10, "kl/mean": 0.01})
    lines = out.getvalue().splitlines()
    assert [line.split(" ")[1] for line in lines] == ["2/5", "4/5", "5/5"]  # every 2nd and the last
    assert lines[0].startswith("train 2/5 reward=0.6 kl=0.01 | ") and "left" in lines[0]
    assert "elapsed" in lines[-1] and "left" not in lines[-1]
    resumed = io.StringIO()
    with RunProgress(6, start=3, every=2, stream=resumed) as progress:
        for it in range(3, 6):
            progress.update(it, {})
    assert [line.split(" ")[1] for line in resumed.getvalue().splitlines()] == ["5/6", "6/6"]
    quiet = io.StringIO()
    with RunProgress(3, enabled=False, stream=quiet) as progress:
        progress.update(2, {})
    assert quiet.getvalue() == ""


def test_progress_shows_the_training_inference_mismatch():
    out = io.StringIO()
    with RunProgress(1, stream=out) as progress:
        progress.update(0, {"reward/mean": 0.5, "kl/mean": 0.01, "mismatch/mean_abs_logp_diff": 0.0012})
    assert out.getvalue().startswith("train 1/1 reward=0.5 kl=0.01 dlogp=0.0012 | ")
