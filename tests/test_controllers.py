"""Parallel controllers: K controllers compute the reference run, own consistent devices, and fail in one line.

Equivalence is held to the same tolerances as every other Ray plan (tests/test_runtime.py): the same samples
(so every sample-derived metric is identical) and losses within 1e-4 relative. With K controllers each data-
parallel rank of a generation or inference call serves rows of its controller's shard only, train calls take the
reference's minibatches over the whole batch, and PPO's advantage whitening sums its statistics over the shards:
none of it changes the math, only the order of a few sums.
"""

import asyncio
import json
import os
import re
import signal
import threading
import time

import pytest
import torch

from loomrl.algorithms.advantages import masked_whiten
from loomrl.config.schema import TrainConfig
from loomrl.config.tools import load_config
from loomrl.errors import ConfigError
from loomrl.plan import ClusterSpec
from loomrl.plan.plan_string import parse_plan_string
from loomrl.plan.schedule import build_schedule
from loomrl.plan.strategies import make_plan
from loomrl.runtime.controllers import Coordinator, controller_devices, plan_for_controllers, shard_batch
from loomrl.train.rl import RLTrainer
from loomrl.workflow.batch import Batch
from test_runtime import _alive

SAMPLE_KEYS = ("reward/mean", "reward/exact_match", "response/length", "response/length_max")
LOSS_KEYS = (
    "kl/mean",
    "actor/pg_loss",
    "critic/value_loss",
    "actor/clipfrac",
    "actor/approx_kl",
    "actor/grad_norm",
    "critic/grad_norm",
    "actor/entropy",
    "actor/kl_loss",
)
GRPO = ("algo.name=grpo", "algo.group_size=2")


def _cfg(tmp_path, name, *extra):
    return load_config(
        TrainConfig,
        None,
        [
            f"run_dir={tmp_path / name}",
            "seed=3",
            "rollout.prompts_per_iter=8",
            "rollout.max_new_tokens=6",
            "loop.iterations=2",
            "loop.eval_every=0",
            "loop.save_every=0",
            "loop.eval_prompts=8",
            "loop.progress=false",
            "report.html=false",
            "runtime.threads=1",
            "runtime.timeout_s=120",
            "algo.minibatches=2",
            "algo.ppo_epochs=2",
            "actor.optim.lr=0.001",
            *extra,
        ],
    )


def _metrics(tmp_path, name, *extra):
    RLTrainer(_cfg(tmp_path, name, *extra)).run()
    return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


def _assert_equivalent(got, reference):
    assert len(got) == len(reference)
    for it, (a, b) in enumerate(zip(got, reference)):
        for key in SAMPLE_KEYS:
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), (it, key)
        for key in (k for k in LOSS_KEYS if k in b):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (it, key, a[key], b[key])
        ignored = ("time", "perf", "eval/", "fusion/")
        assert {k for k in a if not k.startswith(ignored)} == {k for k in b if not k.startswith(ignored)}


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    root = tmp_path_factory.mktemp("refs")
    return {
        "ppo": _metrics(root, "ppo", "runtime.executor=reference"),
        "grpo": _metrics(root, "grpo", "runtime.executor=reference", *GRPO),
    }


SEPARATE_PP = (
    "actor_gen=0-1:dp2; actor_train=0-3:dp2pp2; ref_inf=2-3:dp2; reward_inf=2-3:dp2; "
    "critic_inf=0-3:dp4; critic_train=0-3:dp2pp2; advantages=0:dp1"
)
"""Generation on devices 0-1 (a shadow actor), reference and reward on 2-3, training in two pipelines of two stages
over all four: each controller owns one generation replica, one scoring replica and one training pipeline."""


PIPELINE_FUSION = (
    "actor_gen=0-3:dp4; actor_train=0-3:dp2pp2mb2; ref_inf=0-3:dp4; reward_inf=0-3:dp4; critic_inf=0-3:dp4; "
    "critic_train=0-3:dp2pp2revmb2; advantages=0:dp1; pipeline_fusion=on"
)
"""Intra-stage fusion under two controllers: each owns one fused pair of pipelines; the schedule is searched once."""


@pytest.mark.parametrize(
    "algo,devices,controllers,plan",
    [
        ("ppo", 2, 2, None),
        ("grpo", 2, 2, None),
        ("ppo", 4, 4, None),
        ("grpo", 4, 4, None),
        ("grpo", 4, 2, "separate"),
        ("ppo", 4, 2, SEPARATE_PP),
        ("ppo", 4, 2, PIPELINE_FUSION),
    ],
    ids=[
        "ppo-2dev-2",
        "grpo-2dev-2",
        "ppo-4dev-4",
        "grpo-4dev-4",
        "grpo-separate4-2",
        "ppo-pipelines4-2",
        "ppo-fused-train4-2",
    ],
)
@pytest.mark.usefixtures("ray_session")
def test_parallel_controllers_compute_the_reference_run(tmp_path, references, algo, devices, controllers, plan):
    extra = GRPO if algo == "grpo" else ()
    args = ["runtime.executor=ray", f"runtime.devices={devices}", f"runtime.controllers={controllers}", *extra]
    if plan is not None:
        args.append(f"runtime.plan={plan}")
    trainer = RLTrainer(_cfg(tmp_path, "run", *args))
    assert len(trainer.executor.controllers) == controllers
    trainer.run()
    got = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    _assert_equivalent(got, references[algo])
    assert all(m["time/controller_cpu_s"] > 0 for m in got)
    traces = [json.loads(line) for line in (tmp_path / "run" / "traces.jsonl").read_text().splitlines()]
    gen = [t for t in traces if t["step"] == "actor_gen" and t["phase"] == "iteration"]
    assert len(gen) == 2  # one trace per step, joined over every controller's devices
    expected = trainer.executor.schedule["actor_gen"].devices
    assert all(tuple(t["devices"]) == expected for t in gen)


# ------------------------------------------------------------------------------- ownership, without Ray
def _workflow(algo="ppo"):
    from loomrl.algorithms.workflows import build_workflow
    from loomrl.config.schema import AlgoConfig, RolloutConfig

    return build_workflow(AlgoConfig(name=algo), RolloutConfig())


def test_each_controller_owns_one_block_of_every_calls_replicas():
    workflow, cluster = _workflow(), ClusterSpec(nodes=1, devices_per_node=4, device_kind="cpu")
    colocated = build_schedule(workflow, make_plan("colocate", workflow, cluster))
    assert controller_devices(colocated, 2, 4) == [(0, 1), (2, 3)]
    assert controller_devices(colocated, 4, 4) == [(0,), (1,), (2,), (3,)]
    separate = parse_plan_string(SEPARATE_PP, workflow, cluster)
    assert controller_devices(build_schedule(workflow, separate), 2, 4) == [(0, 2), (1, 3)]
    plan, owned = plan_for_controllers(separate, workflow, 2)
    assert owned == [(0, 2), (1, 3)]
    assert plan["advantages"].text == "0-1:dp2"  # one device per controller, each its own shard
    assert plan_for_controllers(separate, workflow, 1) == (separate, [(0, 1, 2, 3)])


def test_plans_the_controllers_cannot_share_are_one_line_errors():
    workflow, cluster = _workflow(), ClusterSpec(nodes=1, devices_per_node=4, device_kind="cpu")
    pipelined = parse_plan_string(
        "actor_gen=0-3:dp4; actor_train=0-3:pp4; ref_inf=0-3:dp4; reward_inf=0-3:dp4; "
        "critic_inf=0-3:dp4; critic_train=0-3:dp4; advantages=0:dp1",
        workflow,
        cluster,
    )
    with pytest.raises(
        ConfigError,
        match=r"^runtime.controllers: 2 controllers cannot share the 1 data-parallel "
        r"replicas of actor_train \(0-3:dp1pp4\);[^\n]*divides",
    ):
        plan_for_controllers(pipelined, workflow, 2)
    tensor_parallel = parse_plan_string(
        "actor_gen=0-3:dp4; actor_train=0-3:dp2tp2; ref_inf=0-3:dp4; "
        "reward_inf=0-3:dp2tp2; critic_inf=0-3:dp4; critic_train=0-3:dp4; "
        "advantages=0:dp1",
        workflow,
        cluster,
    )
    assert plan_for_controllers(tensor_parallel, workflow, 2)[1] == [(0, 1), (2, 3)]
    interleaved = parse_plan_string(
        "actor_gen=0-3:dp4; actor_train=0-3:dp4; ref_inf=0,2:dp2; reward_inf=1,3:dp2; "
        "critic_inf=0-3:dp4; critic_train=0-3:dp4; advantages=0:dp1",
        workflow,
        cluster,
    )
    assert plan_for_controllers(interleaved, workflow, 2)[1] == [(0, 1), (2, 3)]  # one ref and one reward replica each
    crossed = parse_plan_string(
        "actor_gen=0-1:dp2; actor_train=0-3:dp2tp2; ref_inf=0-3:dp4; reward_inf=0-3:dp4; "
        "critic_inf=0-3:dp4; critic_train=0-3:dp4; advantages=0:dp1",
        workflow,
        cluster,
    )
    with pytest.raises(
        ConfigError,
        match=r"^runtime.controllers: this plan's devices cannot be split between 2 "
        r"controllers[^\n]*use fewer controllers",
    ):
        plan_for_controllers(crossed, workflow, 2)  # actor_train's first replica holds both generation replicas
    fused = make_plan("colocate; stream_fusion=on", workflow, cluster)
    with pytest.raises(ConfigError, match="runtime.controllers: 2 controllers cannot run stream fusion"):
        plan_for_controllers(fused, workflow, 2)


def test_more_controllers_than_prompts_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"runtime.controllers: 4 controllers need at least as many prompts"):
        _cfg(tmp_path, "x", "runtime.executor=ray", "runtime.controllers=4", "rollout.prompts_per_iter=2")
    with pytest.raises(ConfigError, match=r"controllers: 2 needs executor 'ray'"):
        _cfg(tmp_path, "x", "runtime.executor=reference", "runtime.controllers=2")


def test_shards_hold_whole_groups_in_batch_order():
    batch = Batch(list(range(10)), {"prompt_ids": [[i // 2] for i in range(10)]})  # 5 prompts, 2 samples each
    shards = shard_batch(batch, 2, 2)
    assert [s.ids for s in shards] == [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9]]
    assert [s.ids for s in shard_batch(batch, 5, 2)] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    with pytest.raises(ConfigError, match="6 controllers need at least 6 prompts"):
        shard_batch(batch, 6, 2)


def test_the_coordinator_returns_every_controllers_value_once_all_gave_theirs():
    async def main():
        coordinator = Coordinator(3)
        early = [asyncio.ensure_future(coordinator.exchange("k", i, v)) for i, v in ((2, "c"), (0, "a"))]
        await asyncio.sleep(0.01)
        assert not any(f.done() for f in early)  # nobody leaves before the last value arrives
        last = await coordinator.exchange("k", 1, "b")
        return [last, *await asyncio.gather(*early)], coordinator.rounds

    results, rounds = asyncio.run(main())
    assert results == [["a", "b", "c"]] * 3
    assert rounds == {}  # a finished round is forgotten


def test_whitening_over_shards_is_whitening_over_the_batch():
    torch.manual_seed(0)
    x, mask = torch.randn(6, 5), torch.rand(6, 5) > 0.3
    whole = masked_whiten(x, mask)
    barrier, box = threading.Barrier(2), {}

    def reduce(tensor, rank):  # a two-rank all-reduce between threads
        box[rank] = tensor
        barrier.wait()
        total = box[0] + box[1]
        barrier.wait()
        return total

    got = {}

    def shard(rank, rows):
        got[rank] = masked_whiten(x[rows], mask[rows], reduce=lambda t: reduce(t, rank))

    threads = [threading.Thread(target=shard, args=(r, slice(3 * r, 3 * r + 3))) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.testing.assert_close(torch.cat([got[0], got[1]]), whole, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------------------- failure


@pytest.mark.usefixtures("ray_session")
def test_a_failing_controller_stops_the_run_in_one_line_and_leaves_nothing(tmp_path):
    import ray

    from loomrl.runtime.ray_executor import RuntimeFailure

    trainer = RLTrainer(
        _cfg(
            tmp_path,
            "kill",
            "runtime.executor=ray",
            "runtime.devices=2",
            "runtime.controllers=2",
            "loop.iterations=50",
            "rollout.max_new_tokens=24",
            "rollout.prompts_per_iter=16",
        )
    )
    pids = list(trainer.executor.pids) + ray.get([c.pid.remote() for c in trainer.executor.controllers])
    killer = threading.Timer(4.0, lambda: os.kill(pids[1], signal.SIGKILL))  # worker 1: controller 1's
    killer.start()
    with pytest.raises(RuntimeFailure) as err:
        trainer.run()
    killer.cancel()
    message = str(err.value)
    assert "\n" not in message and message.startswith("controller 1 failed during iteration"), message
    # the kill lands in a model's call (named with its role) or in a call without a model (advantages, a sync)
    assert re.search(r"worker 1 died during (MFC|step) '[^']+'( \(role [^)]+\))?$", message), message
    deadline = time.monotonic() + 20
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in pids), "controller or worker processes left behind"


@pytest.mark.usefixtures("ray_session")
def test_a_peer_failure_yields_to_the_controller_that_lost_a_worker():
    """Controller 0 reports first, but only a symptom (its collective lost a peer); controller 1, a moment later,
    reports the death behind it: the run names controller 1. A failure with no death behind it is named as is."""
    import ray

    from loomrl.runtime.controller import RuntimeFailure
    from loomrl.runtime.controllers import wait_controllers

    @ray.remote
    class Shard:
        def fail(self, message, recoverable, delay_s):
            time.sleep(delay_s)
            raise RuntimeFailure(message, recoverable=recoverable)

        def ok(self):
            return 1

    a, b = Shard.remote(), Shard.remote()
    symptom = (a.fail.remote("worker 0 failed in MFC 'advantages': Connection reset by peer", False, 0.0),)
    with pytest.raises(RuntimeFailure) as err:
        wait_controllers([*symptom, b.fail.remote("worker 1 died during MFC 'advantages'", True, 1.0)], "iteration 3")
    assert str(err.value) == "controller 1 failed during iteration 3: worker 1 died during MFC 'advantages'"
    assert err.value.recoverable
    with pytest.raises(RuntimeFailure) as err:
        wait_controllers([a.fail.remote("reward function raised", False, 0.0), b.ok.remote()], "iteration 4")
    assert str(err.value) == "controller 0 failed during iteration 4: reward function raised"
    assert not err.value.recoverable


@pytest.mark.usefixtures("ray_session")
def test_a_dead_controller_is_named(tmp_path):
    import ray

    from loomrl.runtime.ray_executor import RuntimeFailure

    trainer = RLTrainer(
        _cfg(
            tmp_path,
            "dead",
            "runtime.executor=ray",
            "runtime.devices=2",
            "runtime.controllers=2",
            "loop.iterations=50",
            "rollout.max_new_tokens=24",
            "rollout.prompts_per_iter=16",
        )
    )
    pids = list(trainer.executor.pids)
    victim = trainer.executor.controllers[0]
    killer = threading.Timer(4.0, lambda: ray.kill(victim, no_restart=True))
    killer.start()
    with pytest.raises(RuntimeFailure, match=r"^controller 0 died during iteration \d+$"):
        trainer.run()
    killer.cancel()
    deadline = time.monotonic() + 20
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in pids), "worker processes left behind"
