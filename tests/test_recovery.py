"""Automatic recovery (runtime.max_failures): a lost worker is replaced and the run continues from its latest
checkpoint (or from the start without one), computing the run it would have computed without the failure; an
error a model call raises itself is never retried.

A worker is killed (SIGKILL) between two iterations, so the next iteration's first call finds it dead: the same
failure every time, unlike a kill at a wall-clock moment. The recovered run is held to the reference executor's
metrics with the tolerances of tests/test_runtime.py.
"""

import json
import os
import signal

import pytest

from loomrl.config.schema import TrainConfig
from loomrl.config.tools import load_config
from loomrl.run_dir import RunDir
from loomrl.train.rl import RLTrainer
from test_runtime import _alive, failing_reward

SAMPLE_KEYS = ("reward/mean", "reward/exact_match", "response/length")
LOSS_KEYS = ("kl/mean", "actor/pg_loss", "critic/value_loss", "actor/grad_norm", "critic/grad_norm")

pytestmark = pytest.mark.usefixtures("ray_session")


def _cfg(tmp_path, name, *extra):
    return load_config(
        TrainConfig,
        None,
        [
            f"run_dir={tmp_path / name}",
            "seed=3",
            "rollout.prompts_per_iter=8",
            "rollout.max_new_tokens=6",
            "loop.iterations=4",
            "loop.eval_every=0",
            "loop.eval_prompts=8",
            "loop.progress=false",
            "report.html=false",
            "runtime.threads=1",
            "runtime.timeout_s=120",
            "actor.optim.lr=0.001",
            *extra,
        ],
    )


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


DYNAMIC = (
    "runtime.placement=dynamic",
    "runtime.dynamic.min_gain=0",
    "runtime.dynamic.confirm=1",
    "runtime.dynamic.dwell=1",
)
"""Dynamic placement free to switch after every iteration: recovery must re-point it at the new executor."""


@pytest.mark.parametrize(
    "save_every,extra", [(1, ()), (0, ()), (1, DYNAMIC)], ids=["from-checkpoint", "from-start", "dynamic-placement"]
)
def test_a_lost_worker_is_replaced_and_the_run_is_the_reference_run(tmp_path, save_every, extra):
    reference = _cfg(tmp_path, "ref", "runtime.executor=reference", "loop.save_every=0")
    RLTrainer(reference).run()
    expected = _lines(tmp_path / "ref" / "metrics.jsonl")

    trainer = RLTrainer(
        _cfg(
            tmp_path,
            "run",
            "runtime.executor=ray",
            "runtime.devices=2",
            "runtime.max_failures=1",
            f"loop.save_every={save_every}",
            *extra,
        )
    )
    original = trainer.write_traces
    first_pids, first_placement = list(trainer.executor.pids), trainer.placement

    def write_traces(traces):  # the last thing an iteration does before logging: kill worker 1 after iteration 1
        original(traces)
        if trainer.running == 1 and trainer.executor.pids == first_pids:
            os.kill(first_pids[1], signal.SIGKILL)

    trainer.write_traces = write_traces
    trainer.run()
    got = _lines(tmp_path / "run" / "metrics.jsonl")
    assert [m["iteration"] for m in got] == [0, 1, 2, 3]  # the replayed iterations superseded, not repeated
    for it, (a, b) in enumerate(zip(got, expected)):
        for key in SAMPLE_KEYS:
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), (it, key)
        for key in LOSS_KEYS:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (it, key, a[key], b[key])
    (failure,) = _lines(RunDir(tmp_path / "run").failures)
    # with checkpoints, iteration 1's own save finds the worker dead (iteration 0's checkpoint is the latest);
    # without, iteration 2's first call does, and the run starts again
    failed_at, resumes_after, replayed = (1, 0, 1) if save_every else (2, -1, 2)
    assert (failure["failure"], failure["iteration"], failure["resumes_after"]) == (1, failed_at, resumes_after)
    assert "worker 1 died during" in failure["error"]
    first = got[resumes_after + 1]  # the first iteration after the recovery reports it
    assert first["recovery/failures"] == 1 and first["recovery/replayed_iterations"] == replayed
    assert not any("recovery/failures" in m for m in got if m is not first)
    assert not any(_alive(p) for p in first_pids)
    if extra:  # decisions after the recovery were made anew, from the new executor's own iterations
        assert trainer.placement is not first_placement
        assert [r.iteration for r in trainer.placement.records] == [resumes_after + 1, 2]
        assert [d["iteration"] for d in _lines(tmp_path / "run" / "placement.jsonl")][-1] == 2


def test_an_error_raised_by_a_call_is_not_retried(tmp_path):
    from loomrl.runtime.ray_executor import RuntimeFailure

    cfg = _cfg(
        tmp_path,
        "boom",
        "runtime.executor=ray",
        "runtime.devices=2",
        "runtime.max_failures=3",
        *failing_reward(tmp_path),
        "loop.save_every=0",
    )
    with pytest.raises(RuntimeFailure, match="reward service unavailable"):
        RLTrainer(cfg).run()
    assert not RunDir(tmp_path / "boom").failures.exists()


def lose_devices(trainer: RLTrainer, monkeypatch, rank: int = 3, left: int = 2) -> list[int]:
    """Kill worker ``rank`` once iteration 1 has written its traces, as if its device went with it: the devices
    counted after the failure are ``left`` (monkeypatched). Returns the workers' first pids."""
    from loomrl.plan import ClusterSpec
    from loomrl.train import rl

    original, first_pids = trainer.write_traces, list(trainer.executor.pids)

    def write_traces(traces):
        original(traces)
        if trainer.running == 1 and trainer.executor.pids == first_pids:
            os.kill(first_pids[rank], signal.SIGKILL)

    trainer.write_traces = write_traces
    monkeypatch.setattr(rl, "surviving_cluster", lambda cfg, cluster: ClusterSpec(nodes=1, devices_per_node=left))
    return first_pids


def test_a_run_that_lost_devices_continues_on_those_left(tmp_path, monkeypatch):
    """A worker lost with its device (a GPU or a node; simulated: the devices counted after the failure are 2 of 4):
    the run continues on a plan for the devices left, from the checkpoint, and computes the same run."""
    reference = _cfg(tmp_path, "ref", "runtime.executor=reference", "loop.save_every=0")
    RLTrainer(reference).run()
    expected = _lines(tmp_path / "ref" / "metrics.jsonl")

    trainer = RLTrainer(
        _cfg(
            tmp_path,
            "run",
            "runtime.executor=ray",
            "runtime.devices=4",
            "runtime.max_failures=1",
            "loop.save_every=1",
            "runtime.plan=separate:1",
        )
    )
    assert trainer.plan.cluster.n_devices == 4
    first_pids = lose_devices(trainer, monkeypatch)
    trainer.run()
    assert trainer.plan.cluster.n_devices == 2 and len(trainer.executor.pids) == 2
    got = _lines(tmp_path / "run" / "metrics.jsonl")
    assert [m["iteration"] for m in got] == [0, 1, 2, 3]
    for it, (a, b) in enumerate(zip(got, expected)):
        for key in SAMPLE_KEYS:
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), (it, key)
        for key in LOSS_KEYS:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (it, key, a[key], b[key])
    assert got[1]["recovery/devices"] == 2 and got[1]["recovery/failures"] == 1
    assert not any(_alive(p) for p in first_pids)


def test_devices_on_this_machines_cpus_are_never_lost(tmp_path):
    from loomrl.plan import ClusterSpec
    from loomrl.train.rl import surviving_cluster

    cluster = ClusterSpec(nodes=1, devices_per_node=4)
    assert surviving_cluster(_cfg(tmp_path, "x", "runtime.executor=ray", "runtime.devices=4"), cluster) == cluster
