"""Plans that change between iterations: the run ends as the single-process reference run does.

``runtime.plan_changes`` switches the Ray runtime to another plan before an iteration; every role's training
state (weights, Adam's moments, master weights) moves to the new layouts with the reallocation machinery
(:mod:`loomrl.runtime.plan_change`). Four iterations, fp32: colocate (FSDP actor, ZeRO-1 critic) → separate:1 →
interleave → a plan string with the shardings swapped (and, on 4 devices, tensor and pipeline parallelism). The
metrics of every iteration are held to the reference's with the tolerances of ``test_runtime.py`` (same
samples; losses within 1e-4 relative), and so are the final weights (each tensor within 1e-4 relative, by its
norm: summing in another order moves single entries of a weight by up to a few hundredths of a step, 1e-5 here,
while a state moved wrong moves whole tensors by a step or more, 1e-3) and the optimizers' step counts.
"""

import dataclasses
import json

import pytest

from loomrl.algorithms.workflows import build_workflow
from loomrl.checkpoint.shards import read_role
from loomrl.config.schema import AlgoConfig, OptimConfig, RolloutConfig
from loomrl.errors import ConfigError
from loomrl.plan import ClusterSpec, make_plan
from loomrl.plan.schedule import build_schedule
from loomrl.role.spec import RoleSpec
from loomrl.runtime.plan_change import plan_moves
from loomrl.runtime.spec import WorkerPlan
from loomrl.train.rl import RLTrainer
from test_runtime import _assert_equivalent, _cfg

CHANGES = {
    2: {
        1: "separate:1",
        2: "interleave",
        3: "actor_gen=0-1:dp2; actor_train=0-1:dp2zero; ref_inf=0-1:dp2; reward_inf=0-1:dp2; critic_inf=0-1:dp2; "
        "critic_train=0-1:dp2fsdp; advantages=0:dp1",
    },
    4: {
        1: "separate:1",
        2: "interleave",
        3: "actor_gen=0-3:dp4; actor_train=0-3:dp2tp2fsdp; ref_inf=0-1:dp2; reward_inf=2-3:dp2; critic_inf=0-3:dp4; "
        "critic_train=0-3:pp2dp2zero; advantages=0:dp1",
    },
}
SHARDED = "runtime.layouts={actor: {sharding: fsdp}, critic: {sharding: zero}}"


pytestmark = pytest.mark.usefixtures("ray_session")


def _run(tmp_path, name: str, *extra, changes=None) -> list[dict]:
    cfg = _cfg(tmp_path, name, "loop.iterations=4", *extra)
    if changes:
        cfg = dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, plan_changes=changes))
    RLTrainer(cfg).run()
    return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = tmp_path_factory.mktemp("ref")
    return _run(path, "ref"), path / "ref"


@pytest.mark.parametrize("devices", [2, 4])
def test_a_run_whose_plan_changes_is_the_reference_run(tmp_path, reference, devices):
    expected, ref_dir = reference
    got = _run(
        tmp_path,
        "ray",
        "runtime.executor=ray",
        f"runtime.devices={devices}",
        SHARDED,
        "runtime.verify_reallocation=true",
        changes=CHANGES[devices],
    )
    _assert_equivalent(got, expected)
    assert got[-1]["eval/exact_match"] == expected[-1]["eval/exact_match"]
    for role in ("actor", "critic"):
        (ours, ours_opt), (theirs, theirs_opt) = (
            read_role(d / "checkpoints" / "iter_000003", role) for d in (tmp_path / "ray", ref_dir)
        )
        assert ours.keys() == theirs.keys()
        for key, tensor in theirs.items():  # 1e-4 relative, as for the losses, on each tensor as a whole
            assert (ours[key] - tensor).norm() <= 1e-4 * tensor.norm(), (role, key)
        steps = {float(st["step"]) for st in ours_opt["state"].values()}
        assert steps == {float(st["step"]) for st in theirs_opt["state"].values()} == {16.0}
    traces = [json.loads(line) for line in (tmp_path / "ray" / "traces.jsonl").read_text().splitlines()]
    assert [t["iteration"] for t in traces if t["phase"] == "plan change"] == [1, 2, 3]


def test_moves_name_what_each_role_carries():
    """Pure: the moves between two plans, per role and kind (fp32 and 16-bit weights, before and after a step)."""
    workflow = build_workflow(AlgoConfig(), RolloutConfig())
    cluster = ClusterSpec.parse("cpu:2")

    def plan(text):
        schedule = build_schedule(workflow, make_plan(text, workflow, cluster))
        return WorkerPlan(schedule, {t: None for t in schedule.transfers()})  # transfer plans play no part

    colocate = "actor_gen=0-1; actor_train=0-1:dp2zero; ref_inf=0-1; reward_inf=0-1; critic_inf=0-1; critic_train=0-1"
    moved = "actor_gen=0-1; actor_train=0-1:dp2fsdp; ref_inf=0; reward_inf=0-1; critic_inf=0-1; critic_train=0-1"
    specs = {
        r: RoleSpec(r, "llama-1m", f"{r}.model", optim=OptimConfig() if r in ("actor", "critic") else None)
        for r in workflow.roles()
    }
    calls = []

    def transfer(role, src, dst, state):
        calls.append((role, src.text, dst.text, state))
        return object()

    moves = plan_moves(plan(colocate), plan(moved), specs, False, {"actor": 3, "critic": 3}, transfer)
    assert [(m.role, m.src.text, m.dst.text, m.kinds, m.step) for m in moves] == [
        ("actor", "0-1:dp2zero", "0-1:dp2fsdp", ("weights", "exp_avg", "exp_avg_sq"), 3),
        ("ref", "0-1:dp2", "0:dp1", ("weights",), 0),
    ]
    assert calls == [
        ("actor", "0-1:dp2zero", "0-1:dp2fsdp", False),
        ("actor", "0-1:dp2zero", "0-1:dp2fsdp", True),
        ("ref", "0-1:dp2", "0:dp1", False),
    ]
    # 16-bit weights: the fp32 masters move too, into FSDP's fp32 shards (which are the weights); no step yet
    moves = plan_moves(plan(colocate), plan(moved), specs, True, {}, transfer)
    assert moves[0].kinds == ("master",) and moves[0].weights is None and moves[0].state is not None
    assert plan_moves(plan(colocate), plan(colocate), specs, True, {}, transfer) == []


def test_plan_changes_are_checked_before_anything_runs(tmp_path):
    cfg = _cfg(tmp_path, "x", "runtime.executor=ray", "runtime.devices=2")
    with pytest.raises(ConfigError, match="runtime.plan_changes.2: .*unknown MFC 'actor_gn'"):
        RLTrainer(dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, plan_changes={2: "actor_gn=0-1"})))
    with pytest.raises(ConfigError, match="plan_changes.0: iterations of plan changes start at 1"):
        _cfg(tmp_path, "x", "runtime.executor=ray", "runtime.plan_changes={0: interleave}")
    with pytest.raises(ConfigError, match="plan_changes.3: needs executor 'ray'"):
        _cfg(tmp_path, "x", "runtime.plan_changes={3: interleave}")
