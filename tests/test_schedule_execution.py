"""The runtime executes exactly the schedule the simulator prices: the same steps, on the same devices, in a
valid order (colocate, interleave, separate and a searched plan, on 2 and 4 devices).

Each run's ``traces.jsonl`` records every executed step with each device's start and end; the simulator's
prediction of the same run (its config, models and measured workload) is built from the same schedule, so its
timeline names the same step ids on the same devices. :func:`oracles.check_trace` then checks, per
iteration, that the executed steps are exactly the schedule's and that none started on a device before a step
it waits for had ended there (or, unless it was sent with it, anywhere).
"""

import dataclasses
import json
from collections import defaultdict

import pytest

from loomrl.algorithms.workflows import build_workflow
from loomrl.config.schema import TrainConfig
from loomrl.config.tools import load_config
from loomrl.models.presets import model_config
from loomrl.plan import ClusterSpec, format_plan_string
from loomrl.plan.hardware import PROFILES
from loomrl.plan.model_shape import ModelShape
from loomrl.plan.schedule import Schedule, Step, StepKind
from loomrl.planner.cost.model import CostModel
from loomrl.planner.cost.workload import Workload
from loomrl.planner.search.search import search
from loomrl.report.run_timeline import predicted_run, read_traces
from loomrl.train.rl import RLTrainer
from oracles import check_trace

pytestmark = pytest.mark.usefixtures("ray_session")


def _cfg(tmp_path, devices: int) -> TrainConfig:
    return load_config(
        TrainConfig,
        None,
        [
            f"run_dir={tmp_path / 'run'}",
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
            "runtime.executor=ray",
            f"runtime.devices={devices}",
        ],
    )


def searched_plan(cfg: TrainConfig, devices: int) -> str:
    """The fastest plan a short, step-bounded (hence deterministic) search finds for this run on this machine."""
    workflow = build_workflow(cfg.algo, cfg.rollout)
    cluster = ClusterSpec.parse(f"cpu:{devices}")
    configs = {role: model_config(cfg.actor.model) for role in workflow.roles()}
    shapes = {role: ModelShape.from_config(c) for role, c in configs.items()}
    workload = Workload(
        cfg.rollout.prompts_per_iter,
        6.0,
        (cfg.rollout.max_new_tokens,),
        ppo_epochs=cfg.algo.ppo_epochs,
        minibatches=cfg.algo.minibatches,
    )
    cost = CostModel(cluster, PROFILES["local"], shapes, workload)
    found = search(
        workflow,
        cluster,
        cost,
        PROFILES["local"].memory_bytes,
        configs,
        seed=0,
        time_budget_s=120,
        chains=2,
        max_steps=40,
    )
    return format_plan_string(found[0][0], workflow)


def executed(traces: list[dict], iteration: int, phase: str) -> list[tuple[str, dict[int, tuple[float, float]]]]:
    """(step id, device → (start, end)) of one iteration's (or the prologue's) executed steps, in trace order."""
    return [
        (t["step"], {d: (s, e) for d, s, e in zip(t["devices"], t["start"], t["end"])})
        for t in traces
        if t["iteration"] == iteration and t["phase"] == phase
    ]


@pytest.mark.parametrize(
    "plan,devices",
    [
        ("colocate", 2),
        ("interleave", 2),
        ("separate", 2),
        ("searched", 2),
        ("colocate", 4),
        ("interleave", 4),
        ("separate", 4),
        ("searched", 4),
    ],
    ids=lambda v: str(v),
)
def test_the_runtime_executes_the_schedule_the_simulator_priced(tmp_path, plan, devices):
    cfg = _cfg(tmp_path, devices)
    text = searched_plan(cfg, devices) if plan == "searched" else plan
    trainer = RLTrainer(dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, plan=text)))
    schedule: Schedule = trainer.executor.schedule
    trainer.run()
    traces = read_traces(tmp_path / "run")
    for iteration in (0, 1):
        check_trace(schedule.steps, executed(traces, iteration, "iteration"))
    check_trace(schedule.prologue, executed(traces, 0, "prologue"))
    if plan == "separate":
        assert [s.kind for s in schedule.prologue] == [StepKind.SYNC]  # the shadow is filled before iteration 0
    if plan in ("interleave", "separate"):
        assert any(s.kind is not StepKind.CALL for s in schedule), "the plan should move a model somewhere"
    # the simulator's prediction of this very run prices the same steps, on the same devices
    predicted = predicted_run(tmp_path / "run", PROFILES["local"], iterations=2)
    priced: dict[tuple[int, str], set[int]] = defaultdict(set)
    for interval in predicted.timeline:
        priced[(interval.iteration, interval.label)].add(interval.device)
    for iteration in (0, 1):
        got = {step: devices for (it, step), devices in priced.items() if it == iteration}
        for fused in (s for s in schedule if s.kind is StepKind.STREAM_FUSION):
            # a fused stage is drawn as its parts: generation on all its devices, each member on some of its own
            gen, *members = fused.members
            assert got.pop(gen.id) == set(gen.devices)
            for member in members:
                assert got.pop(member.id) <= set(member.devices)
            got.pop("migrate", None)
        assert got == {s.id: set(s.devices) for s in schedule if s.kind is not StepKind.STREAM_FUSION}


def test_a_trace_out_of_order_or_off_schedule_is_caught():
    """The checker itself: a step started before what it waits for ended, a missing or extra step, a step on
    other devices, or a step sent with its dependency but started early on a shared device."""
    copy = Step("copy a→1", StepKind.COPY, (0, 1))
    call = Step("gen", StepKind.CALL, (1,), ("copy a→1",))
    free = Step("free a@1", StepKind.FREE, (1,), ("gen",))
    other = Step("ref", StepKind.CALL, (2,), ("copy a→1",))  # not on the copy's devices: not sent with it
    steps = (copy, call, free, other)
    good = [
        ("copy a→1", {0: (0, 1), 1: (0, 2)}),
        ("gen", {1: (2, 3)}),
        ("free a@1", {1: (3, 3)}),
        ("ref", {2: (2.5, 4)}),
    ]
    check_trace(steps, good)
    with pytest.raises(AssertionError, match="'gen' started on device 1 before 'copy a→1'"):
        check_trace(steps, [good[0], ("gen", {1: (1.5, 3)}), *good[2:]])  # sent with it, yet early on device 1
    with pytest.raises(AssertionError, match="'ref' started on device 2 before 'copy a→1'"):
        check_trace(steps, [*good[:3], ("ref", {2: (1.5, 4)})])  # not sent with it: waits for it everywhere
    with pytest.raises(AssertionError, match="missing \\['free a@1'\\]"):
        check_trace(steps, [good[0], good[1], good[3]])
    with pytest.raises(AssertionError, match="ran on \\[0\\], scheduled on \\(1,\\)"):
        check_trace(steps, [good[0], ("gen", {0: (2, 3)}), *good[2:]])
    with pytest.raises(AssertionError, match="executed twice"):
        check_trace(steps, [*good, good[1]])


def test_traces_name_schedule_steps_in_the_run_directory(tmp_path):
    """What a run writes is what `loomrl timeline` and the check above read: one line per step."""
    cfg = _cfg(tmp_path, 2)
    plan = (
        "actor_gen=0-1:tp2; actor_train=0-1:dp2; ref_inf=0:dp1; reward_inf=1:dp1; critic_inf=0-1:dp2; "
        "critic_train=0-1:dp2; advantages=0:dp1"
    )
    RLTrainer(dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, plan=plan))).run()
    lines = [json.loads(line) for line in (tmp_path / "run" / "traces.jsonl").read_text(encoding="utf-8").splitlines()]
    first = [t["step"] for t in lines if t["iteration"] == 0 and t["phase"] == "iteration"]
    assert first[:3] == ["copy actor→0-1:dp1tp2", "actor_gen", "free actor@0-1:dp1tp2"]
    assert {t["kind"] for t in lines} == {"call", "copy", "free", "evaluate"}  # the final iteration evaluates
    assert [t["step"] for t in lines if t["phase"] == "evaluation"] == [
        "copy actor→0-1:dp1tp2",
        "evaluate",
        "free actor@0-1:dp1tp2",
    ]
    assert all(len(t["start"]) == len(t["end"]) == len(t["devices"]) for t in lines)
