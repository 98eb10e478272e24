"""Control-path time per iteration: one controller against K parallel controllers, as workers and payloads grow.

    .venv/bin/python benchmarks/controllers.py [--workers 8,16,32,48] [--controllers 1,2,4,8] [--iterations 5]
                                               [--part control|cluster|all]

**control**: the PPO workflow (generation, three scoring calls, advantages, two train calls) colocated on N
devices (dp = N), 4 prompts a device, run by the real executor and controllers (:mod:`loomrl.runtime.controller`,
:mod:`loomrl.runtime.controllers`) over light stand-in workers: each answers a step the way a device worker does
(a reference to an output shard, token counts, train statistics) without reading its inputs or computing, so
the table measures control alone. Each setting runs with token ids only, then with an image-sized per-sample
feature (3 × 224 × 224 fp32, 602 KB a sample) in the batch, held in the object store. The **critical-path
control time** is the CPU time of everything an iteration's control waits on in turn: the driver's (splitting the
batch, putting the shards in the object store, merging results, the metrics call; with one controller, the
controller itself runs in the driver's process), plus with K > 1 controllers the coordinator's and the busiest
controller's process CPU time (every thread of each process, Ray's messaging included). On this machine's two
cores the processes' wall-clock time is shared, while controllers on separate machines would each have their own,
so CPU time is the headline and wall-clock time is reported beside it, with the busiest controller's CPU time
alone. Median of ``--iterations`` after one warm-up iteration.

**cluster**: a real multi-process Ray cluster on this machine (``ray start --head`` and ``ray start --address``,
two nodes of two CPUs each), a tiny GRPO run of real device workers with 2 controllers on its 4 devices: where
each controller and worker ran, and the run's metrics against the reference executor's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from rich.console import Console  # noqa: E402

from loomrl.report import summary_table  # noqa: E402

IMAGE = (3, 224, 224)


class StandInWorker:
    """A device worker's replies without its work: output shards are tiny placeholders, every response has the
    same length, train calls report a zero loss."""

    def __init__(self, rank: int, world: int, spec):
        self.rank = rank

    def node_ip(self) -> str:
        return "127.0.0.1"

    def free_port(self) -> int:
        return 0

    def setup(self, master_addr, master_port, plan) -> dict:
        import ray

        self.steps = plan.steps()
        return {"rank": self.rank, "pid": os.getpid(), "node": ray.get_runtime_context().get_node_id()}

    def run_step(self, step_id: str, data=None) -> dict:
        import ray

        step = self.steps[step_id]
        start = time.time()
        out: dict = {}
        if step.kind.value == "call" and data.publish:
            mfc = step.mfc
            out["stats"] = {f"{step.role}/loss": 0.0} if mfc.kind.value == "train" else {}
            if mfc.outputs:
                out["shard"] = (ray.put(list(data.sample_ids)),)
            if "response_ids" in mfc.outputs:
                out["tokens"] = {sid: 16 for sid in data.sample_ids}
        return {"start": start, "end": time.time(), "rank": self.rank, **out}

    def metrics(self, ids, inputs, keys) -> dict:
        return {"reward/mean": 0.0}


def _config(devices: int, run_dir: Path, *extra: str):
    from loomrl.config.schema import TrainConfig
    from loomrl.config.tools import load_config

    return load_config(
        TrainConfig,
        None,
        [
            f"run_dir={run_dir}",
            "rollout.prompts_per_iter=4",
            "runtime.executor=ray",
            f"runtime.devices={devices}",
            "algo.minibatches=2",
            "runtime.timeout_s=600",
            *extra,
        ],
    )


def _batch(prompts: int, image: bool):
    import torch

    from loomrl.workflow.batch import Batch

    columns = {
        "prompt_ids": [[1, 2, 3, 4, 5, 6, 7, 8]] * prompts,
        "prompt_text": ["p"] * prompts,
        "answer": ["a"] * prompts,
        "row": [{}] * prompts,
    }
    if image:
        columns["image"] = torch.zeros(prompts, *IMAGE)
    return Batch(list(range(prompts)), columns)


def _use_controllers(executor, count: int, nodes: list[str]) -> None:
    """Switch a stand-in executor to ``count`` controllers (its workers re-install the plan as those would run it)."""
    import ray

    from loomrl.runtime.controllers import spawn_controllers

    for actor in [*executor.controllers, *([executor.coordinator] if executor.coordinator else [])]:
        ray.kill(actor, no_restart=True)
    executor.controllers, executor.coordinator = [], None
    executor.runtime = dataclasses.replace(executor.runtime, controllers=count)
    executor.worker_plan, executor.owned = executor.plan_for_workers(executor.plan)
    ray.get([w.setup.remote(None, None, executor.worker_plan) for w in executor.workers])
    executor.control.install(executor.worker_plan)
    if count > 1:
        executor.coordinator, executor.controllers = spawn_controllers(
            executor.workers,
            nodes,
            executor.runtime,
            executor.spec,
            executor.cluster,
            executor.worker_plan,
            executor.inputs,
            executor.owned,
        )


def _coordinator_cpu(executor) -> float:
    """The coordinator's process CPU time so far (0 without one: a single controller needs none)."""
    import ray

    return ray.get(executor.coordinator.cpu_s.remote()) if executor.coordinator else 0.0


def control_part(workers: list[int], counts: list[int], iterations: int) -> list[dict]:
    from loomrl.algorithms.workflows import build_workflow
    from loomrl.plan.strategies import make_plan
    from loomrl.runtime.ray_executor import RayExecutor
    from loomrl.train.rl import planner_inputs, run_cluster, worker_spec

    rows = []
    for n in workers:
        cfg = _config(n, Path(tempfile.mkdtemp()))
        workflow = build_workflow(cfg.algo, cfg.rollout)
        plan = make_plan("colocate", workflow, run_cluster(cfg))
        inputs = planner_inputs(cfg, workflow, plan.cluster, None)
        executor = RayExecutor(
            cfg.runtime, worker_spec(cfg, workflow), workflow, plan, inputs, worker_cls=StandInWorker
        )
        try:
            nodes = executor.nodes
            base: dict[str, float] = {}
            for count in (c for c in counts if n % c == 0):
                _use_controllers(executor, count, nodes)
                for payload in ("token ids", "+ image"):
                    batch = _batch(4 * n, payload != "token ids")
                    samples = []
                    for it in range(iterations + 1):
                        coordinator0 = _coordinator_cpu(executor)
                        t0, cpu0 = time.perf_counter(), time.process_time()
                        result = executor.run_iteration(it, batch)
                        wall, driver = time.perf_counter() - t0, time.process_time() - cpu0
                        coordinator = _coordinator_cpu(executor) - coordinator0
                        controller = result.stats["time/controller_cpu_s"]
                        # one controller runs in the driver's process: the driver's CPU time already holds it
                        end_to_end = driver + (coordinator + controller if count > 1 else 0.0)
                        samples.append((controller, wall, driver, coordinator, end_to_end))
                    cpu, wall, driver, coordinator, end_to_end = (
                        statistics.median(s[i] for s in samples[1:]) for i in range(5)
                    )
                    base.setdefault(payload, (cpu, end_to_end, wall))
                    rows.append(
                        {
                            "workers": n,
                            "controllers": count,
                            "payload": payload,
                            "busiest controller CPU ms": 1e3 * cpu,
                            "driver CPU ms": 1e3 * driver,
                            "coordinator CPU ms": 1e3 * coordinator,
                            "critical-path CPU ms": 1e3 * end_to_end,
                            "vs 1 controller": base[payload][1] / end_to_end,
                            "busiest controller alone vs 1": base[payload][0] / cpu,
                            "wall ms": 1e3 * wall,
                            "wall vs 1": base[payload][2] / wall,
                        }
                    )
                    print(json.dumps(rows[-1]), flush=True)
        finally:
            executor.close()
    return rows


# ---------------------------------------------------------------------------------------------- cluster
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN")}
    env.update(PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    return env


def _cluster_run(address: str, run_dir: str) -> None:
    """In a process joined to the cluster: a 2-controller GRPO run; prints where things ran and its metrics."""
    import ray

    from loomrl.runtime.launch import start_ray
    from loomrl.train.rl import RLTrainer

    start_ray(address, 0)  # joins with the cluster's token; the trainer then uses this connection
    deadline = time.monotonic() + 120
    while sum(n["Alive"] for n in ray.nodes()) < 2:  # the second node may still be joining
        if time.monotonic() > deadline:
            raise SystemExit(f"only {sum(n['Alive'] for n in ray.nodes())} node(s) joined the cluster")
        time.sleep(1)
    tiny = (
        "algo.name=grpo",
        "algo.group_size=2",
        "rollout.max_new_tokens=6",
        "loop.iterations=2",
        "loop.eval_every=0",
        "loop.save_every=0",
        "loop.progress=false",
        "report.html=false",
        "runtime.threads=1",
        "seed=3",
        "rollout.prompts_per_iter=8",
    )
    trainer = RLTrainer(_config(4, Path(run_dir), *tiny, "runtime.controllers=2", f"runtime.ray_address={address}"))
    executor = trainer.executor
    where = {"controllers": ray.get([c.node.remote() for c in executor.controllers]), "workers": executor.nodes}
    trainer.run()
    print("WHERE " + json.dumps(where), flush=True)


def cluster_part() -> list[dict]:
    tmp = Path(tempfile.mkdtemp(prefix="lrc", dir="/tmp"))
    port = _free_port()
    ray_bin = str(Path(sys.executable).parent / "ray")
    log = open(tmp / "cluster.log", "w")
    common = ["--block", "--num-cpus=2", "--disable-usage-stats"]
    head = subprocess.Popen(
        [
            ray_bin,
            "start",
            "--head",
            f"--port={port}",
            f"--temp-dir={tmp / 'ray'}",
            "--include-dashboard=false",
            *common,
        ],
        env=_env(),
        stdout=log,
        stderr=log,
        start_new_session=True,
    )
    nodes = [head]
    try:
        _wait_port(port, head, tmp)
        nodes.append(
            subprocess.Popen(
                [ray_bin, "start", f"--address=127.0.0.1:{port}", *common],
                env={**_env(), "RAY_AUTH_MODE": "token"},  # presents the head's token
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        )
        address = f"127.0.0.1:{port}"
        proc = subprocess.run(
            [sys.executable, __file__, "--part", "cluster-run", "--address", address, "--run-dir", str(tmp / "run")],
            env=_env(),
            capture_output=True,
            text=True,
            timeout=900,
        )
        if proc.returncode != 0:
            raise SystemExit(f"cluster run failed:\n{proc.stderr[-4000:]}")
        where = json.loads(next(line[6:] for line in proc.stdout.splitlines() if line.startswith("WHERE ")))
    finally:
        for node in reversed(nodes):
            _stop(node)
        log.close()
    reference = _reference_metrics(tmp / "ref")
    got = [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]
    shutil.rmtree(tmp, ignore_errors=True)
    node_ids = sorted(set(where["workers"]))
    name = {n: f"node {i}" for i, n in enumerate(node_ids)}
    rows = []
    for k, node in enumerate(where["controllers"]):
        own = [d for d, n in enumerate(where["workers"]) if n == node]
        rows.append({"controller": k, "node": name.get(node, node[:8]), "workers on that node": str(own)})
    for it, (a, b) in enumerate(zip(got, reference)):
        rows.append(
            {
                "controller": f"iteration {it}",
                "node": f"reward {a['reward/mean']:.4f} (ref {b['reward/mean']:.4f})",
                "workers on that node": f"pg_loss {a['actor/pg_loss']:.6f} (ref {b['actor/pg_loss']:.6f})",
            }
        )
    return rows


def _reference_metrics(run_dir: Path) -> list[dict]:
    from loomrl.train.rl import RLTrainer

    tiny = (
        "algo.name=grpo",
        "algo.group_size=2",
        "rollout.max_new_tokens=6",
        "loop.iterations=2",
        "loop.eval_every=0",
        "loop.save_every=0",
        "loop.progress=false",
        "report.html=false",
        "runtime.threads=1",
        "seed=3",
        "rollout.prompts_per_iter=8",
    )
    RLTrainer(_config(1, run_dir, *tiny, "runtime.executor=reference")).run()
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _wait_port(port: int, head: subprocess.Popen, tmp: Path) -> None:
    deadline = time.monotonic() + 90
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            if head.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the head node did not start:\n{(tmp / 'cluster.log').read_text()[-3000:]}") from None
            time.sleep(0.5)


def _stop(proc: subprocess.Popen) -> None:
    import signal

    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", default="8,16,32,48")
    ap.add_argument("--controllers", default="1,2,4,8")
    ap.add_argument("--iterations", type=int, default=5)
    ap.add_argument("--part", choices=("control", "cluster", "all", "cluster-run"), default="all")
    ap.add_argument("--address")
    ap.add_argument("--run-dir")
    args = ap.parse_args()
    if args.part == "cluster-run":
        _cluster_run(args.address, args.run_dir)
        return
    console = Console()
    if args.part in ("control", "all"):
        rows = control_part(
            [int(w) for w in args.workers.split(",")], [int(c) for c in args.controllers.split(",")], args.iterations
        )
        console.print(summary_table(rows, f"Control path per iteration (median of {args.iterations}), PPO colocated"))
    if args.part in ("cluster", "all"):
        console.print(
            summary_table(cluster_part(), "2 controllers on a 2-node Ray cluster (ray start), GRPO, 4 devices")
        )


if __name__ == "__main__":
    main()
