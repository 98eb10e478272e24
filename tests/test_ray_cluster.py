"""Ray clusters: the embedded default never joins a cluster it was not given (not a stale one either), joining a
`ray start --head` cluster works as the README says (token authentication on, as Ray 2.60 starts it), devices
are counted from the cluster's resources, and a relative run_dir is the driver's.

The cluster test starts its own head node (`ray start --head --block`) in its own session and temp directory, on
a free port, and always stops it in `finally` (SIGTERM to its process group, then SIGKILL): nothing is left, and
no other test's Ray instance (nor Ray's default /tmp/ray) is touched. Every run goes through a subprocess, so no
environment variable of this process changes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from loomrl.errors import ConfigError
from loomrl.runtime.launch import cluster_from_nodes

REPO = Path(__file__).resolve().parents[1]
TINY = (
    "algo.name=grpo",
    "algo.group_size=2",
    "algo.minibatches=1",
    "loop.iterations=2",
    "loop.save_every=1",
    "loop.eval_prompts=4",
    "rollout.prompts_per_iter=3",
    "rollout.max_new_tokens=4",
    "loop.progress=false",
    "runtime.threads=1",
    "runtime.timeout_s=180",
)


def test_devices_are_counted_from_the_clusters_nodes():
    head = {"alive": True, "resources": {"CPU": 16.0}}
    gpu = {"alive": True, "resources": {"CPU": 64.0, "GPU": 8.0}}
    dead = {"alive": False, "resources": {"CPU": 64.0, "GPU": 8.0}}
    cluster = cluster_from_nodes([head, gpu, gpu, dead], 0, "auto")
    assert (cluster.nodes, cluster.devices_per_node, cluster.device_kind) == (2, 8, "cuda")
    assert (
        cluster_from_nodes([head, gpu, gpu], 4, "auto").nodes,
        cluster_from_nodes([head, gpu, gpu], 4, "auto").n_devices,
    ) == (1, 4)
    assert cluster_from_nodes([head, gpu, gpu], 16, "cuda").nodes == 2
    cpu = cluster_from_nodes([head, gpu, gpu], 0, "cpu")  # CPU workers: each node's CPUs, the smallest node's count
    assert (cpu.nodes, cpu.devices_per_node, cpu.device_kind) == (3, 16, "cpu")
    with pytest.raises(ConfigError, match=r"runtime.devices: 12 does not fill whole nodes .*2 nodes of 8 GPUs"):
        cluster_from_nodes([head, gpu, gpu], 12, "auto")
    with pytest.raises(ConfigError, match="runtime.device: 'cuda' requested but there has no GPUs"):
        cluster_from_nodes([head], 0, "cuda", "there")


@pytest.fixture
def short_tmp():
    """A temp directory with a short path: Ray's unix sockets live under it and must stay under 108 bytes."""
    path = Path(tempfile.mkdtemp(prefix="lr", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra: str) -> dict[str, str]:
    """This process's environment without any Ray address or auth mode, this checkout first on the path."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN")}
    env.update(
        PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        HF_HUB_OFFLINE="1",
        OMP_NUM_THREADS="1",
        **extra,
    )
    return env


def _train(cwd: Path, env: dict[str, str], *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "loomrl.cli", "train", str(REPO / "examples" / "grpo_sort.yaml"), *TINY, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"


def _one_line_error(proc: subprocess.CompletedProcess, *expected: str) -> None:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert lines and lines[-1].startswith("loomrl: error: "), proc.stderr
    assert all(text in lines[-1] for text in expected), lines[-1]


def test_the_embedded_default_never_follows_a_stale_ray_start_cluster(short_tmp):
    """Ray's file of the last `ray start` cluster names a dead address: `loomrl train` starts its own instance."""
    (short_tmp / "ray").mkdir()
    (short_tmp / "ray" / "ray_current_cluster").write_text(f"127.0.0.1:{_free_port()}")
    proc = _train(
        short_tmp, _env(TMPDIR=str(short_tmp)), "runtime.devices=1", "loop.iterations=1", f"run_dir={short_tmp / 'run'}"
    )
    _ok(proc)
    assert "existing Ray cluster" not in proc.stderr and "Started a local Ray instance" in proc.stderr


def test_the_local_instance_runs_its_workers_at_the_drivers_priority(short_tmp):
    """Ray starts workers at niceness 15; beside any ordinary CPU-bound process they would get almost no CPU. The
    instance loomrl starts runs them at the driver's priority."""
    script = (
        "import os, ray\n"
        "from loomrl.runtime.launch import start_ray\n"
        "start_ray(None, 1)\n"
        "print('niceness', ray.get(ray.remote(lambda: os.nice(0)).remote()), os.nice(0))\n"
        "ray.shutdown()\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        env=_env(TMPDIR=str(short_tmp)),
        capture_output=True,
        text=True,
        timeout=180,
    )
    _ok(proc)
    worker, driver = proc.stdout.split("niceness")[-1].split()
    assert worker == driver, proc.stdout


def test_an_address_where_nothing_answers_is_one_line():
    proc = _train(REPO, _env(), f"--ray-address=127.0.0.1:{_free_port()}", timeout=120)
    _one_line_error(proc, "runtime.ray_address: nothing answers at 127.0.0.1:", "ray start --head")


def test_train_joins_a_ray_start_cluster_with_token_authentication(short_tmp):
    port = _free_port()
    head_dir, work = short_tmp / "head", short_tmp / "work"
    head_dir.mkdir()
    work.mkdir()
    log = open(short_tmp / "head.log", "w")
    # three CPUs, where this machine has two: the run's devices must come from the cluster, not from the driver
    head = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "ray"),
            "start",
            "--head",
            "--block",
            f"--port={port}",
            "--num-cpus=3",
            f"--temp-dir={short_tmp / 'ray'}",
            "--include-dashboard=false",
            "--disable-usage-stats",
        ],
        cwd=head_dir,
        env=_env(),
        stdout=log,
        stderr=log,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 90
        while not _answers(port):
            assert head.poll() is None and time.monotonic() < deadline, (short_tmp / "head.log").read_text()
            time.sleep(0.5)
        proc = _train(work, _env(), "run_dir=runs/grpo", f"--ray-address=127.0.0.1:{port}")
        _ok(proc)
        assert "InvalidAuthToken" not in proc.stderr and "Connecting to existing Ray cluster" in proc.stderr
        run = work / "runs" / "grpo"  # relative to the driver, though the workers start in head_dir
        assert (run / "checkpoints" / "latest").read_text().strip() == "iter_000001"
        assert not (head_dir / "runs").exists()
        cluster = json.loads((run / "plan.json").read_text())["cluster"]
        assert (cluster["nodes"], cluster["devices_per_node"], cluster["device_kind"]) == (1, 3, "cpu")
        # a driver without the cluster's token: one line saying where the token goes
        stranger = _train(
            work, _env(HOME=str(short_tmp)), "run_dir=runs/x", f"--ray-address=127.0.0.1:{port}", timeout=240
        )
        _one_line_error(
            stranger, f"cannot join the Ray cluster at 127.0.0.1:{port} without its token", "~/.ray/auth_token"
        )
        assert "InvalidAuthToken" not in stranger.stderr  # said at once, not after Ray's retries
    finally:
        _stop(head)
        log.close()


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def _stop(head: subprocess.Popen) -> None:
    """SIGTERM the head's process group (the `ray start` process, GCS, raylet, workers), SIGKILL what is left."""
    try:
        os.killpg(head.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        head.wait(timeout=20)
    except subprocess.TimeoutExpired:
        pass
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.killpg(head.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.5)
    try:
        os.killpg(head.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    head.wait(timeout=10)


def test_a_run_dir_that_some_worker_cannot_see_is_one_line(tmp_path):
    """On a cluster without shared storage, worker 0's checkpoints would land on its own machine: refused."""
    from types import SimpleNamespace

    from loomrl.runtime.ray_executor import RayExecutor, RuntimeFailure

    def worker(sees):
        return SimpleNamespace(sees=SimpleNamespace(remote=sees))

    here, elsewhere = worker(os.path.exists), worker(lambda path: False)
    controller = SimpleNamespace(workers=[here, here], _wait=lambda refs, what, role: refs)
    RayExecutor.check_shared_dir(controller, tmp_path)  # every worker sees it
    controller.workers = [here, elsewhere, here]
    with pytest.raises(RuntimeFailure, match=r"run_dir: '.*' is not visible to worker\(s\) \[1\].*every node mounts"):
        RayExecutor.check_shared_dir(controller, tmp_path)
    assert list(tmp_path.iterdir()) == []  # the marker file is gone either way


def test_a_finished_run_is_predicted_on_the_devices_it_ran_on(tmp_path):
    """`loomrl timeline` and the report simulate a run on the devices its plan.json records (a cluster's), not
    on the machine that reads it."""
    from loomrl.planner.calibration.runs import _recorded_devices

    assert _recorded_devices(tmp_path) is None  # a run from before plan.json: this machine's count is used
    (tmp_path / "plan.json").write_text(json.dumps({"cluster": {"nodes": 2, "devices_per_node": 4}}))
    assert _recorded_devices(tmp_path) == 8
