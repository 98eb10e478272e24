"""The plan simulator against schedules computed by hand, and the Gantt renderers.

A fake cost estimator makes every number checkable: a call takes ``work / devices`` seconds (plus
``comm · (devices − 1)``), a reallocation a fixed time, a role's resident memory is a table entry (times 3 when
trainable, divided by tp·pp) and a call's transient memory another entry. Each test's docstring or comments
give the schedule the assertions expect.
"""

import math
from pathlib import Path

import pytest

from loomrl.algorithms.workflows import build_workflow
from loomrl.config.schema import AlgoConfig, RolloutConfig
from loomrl.errors import ConfigError
from loomrl.plan import GB, Allocation, ClusterSpec, ExecutionPlan, colocate
from loomrl.planner.cost.estimator import CostEstimator
from loomrl.planner.simulation.simulator import SimResult, format_bytes, simulate
from loomrl.report.timeline import render_html, render_timeline
from loomrl.workflow import MFC, MFCKind, Workflow

GEN, INF, TRAIN = MFCKind.GENERATE, MFCKind.INFERENCE, MFCKind.TRAIN


class FakeCost(CostEstimator):
    """Hand-computable costs (see the module docstring)."""

    def __init__(
        self,
        work: dict[str, float],
        comm: float = 0.0,
        realloc: float = 1.0,
        static: dict[str, float] | None = None,
        transient: dict[str, float] | None = None,
    ) -> None:
        self.work, self.comm, self.realloc = work, comm, realloc
        self.static, self.transient = static or {}, transient or {}
        self.realloc_calls: list[tuple[str, str, str]] = []

    def mfc_time(self, mfc: MFC, alloc: Allocation) -> float:
        n = len(alloc.mesh)
        return self.work[mfc.name] / n + self.comm * (n - 1)

    def mfc_memory(self, mfc: MFC, alloc: Allocation, trainable: bool) -> float:
        return self.transient.get(mfc.name, 0.0)

    def static_memory(self, role: str, alloc: Allocation, trainable: bool) -> float:
        return self.static.get(role, 0.0) * (3 if trainable else 1) / (alloc.layout.tp * alloc.layout.pp)

    def realloc_time(self, role: str, src: Allocation, dst: Allocation) -> float:
        self.realloc_calls.append((role, src.text, dst.text))
        return self.realloc


def plan_of(n: int, placement: dict[str, str], kind: str = "cpu", **choices) -> ExecutionPlan:
    """A plan on ``n`` devices of ``kind`` (cpu devices keep every role resident; accelerators offload)."""
    cluster = ClusterSpec.parse(f"{kind}:{n}")
    return ExecutionPlan(cluster, {name: Allocation.parse(text) for name, text in placement.items()}, **choices)


def spans(result: SimResult, label: str, device: int) -> list[tuple[float, float]]:
    """(start, end) of ``label`` on ``device``, one per iteration."""
    return [(iv.start, iv.end) for iv in result.timeline if iv.label == label and iv.device == device]


# gen → inf → train on one role pair: the smallest RL loop.
CHAIN = Workflow(
    [
        MFC("gen", "actor", GEN, ("p",), ("r",)),
        MFC("inf", "ref", INF, ("r",), ("l",)),
        MFC("train", "actor", TRAIN, ("r", "l"), ()),
    ],
    ["p"],
)
# gen, then two independent inference calls, then train.
FORK = Workflow(
    [
        MFC("gen", "actor", GEN, ("p",), ("r",)),
        MFC("ref_inf", "ref", INF, ("r",), ("a",)),
        MFC("reward_inf", "reward", INF, ("r",), ("b",)),
        MFC("train", "actor", TRAIN, ("r", "a", "b"), ()),
    ],
    ["p"],
)
# generation and training only: for reallocations.
GEN_TRAIN = Workflow([MFC("gen", "actor", GEN, ("p",), ("r",)), MFC("train", "actor", TRAIN, ("r",), ())], ["p"])


def test_chain_runs_back_to_back_and_iterations_follow_the_train_step():
    # Times 4/2, 2/2, 6/2 = 2, 1, 3 s on two devices: gen 0-2, inf 2-3, train 3-6, then the same from 6 and 12.
    plan = plan_of(2, {"gen": "0-1", "inf": "0-1", "train": "0-1"})
    result = simulate(plan, CHAIN, FakeCost({"gen": 4, "inf": 2, "train": 6}), 24 * GB)
    assert spans(result, "gen", 0) == [(0, 2), (6, 8), (12, 14)]
    assert spans(result, "inf", 1) == [(2, 3), (8, 9), (14, 15)]
    assert spans(result, "train", 0) == [(3, 6), (9, 12), (15, 18)]
    assert result.iteration_ends == [6, 12, 18] and result.iteration_time == 6 and result.makespan == 18
    assert result.busy_fraction == {0: 1.0, 1: 1.0}
    assert result.feasible and result.reason == ""
    assert [iv.iteration for iv in result.timeline if iv.device == 0] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    # the totals the search ranks by are computed without building the timeline, and agree with it
    assert result.device_seconds == sum(iv.end - iv.start for iv in result.timeline) == 36


def test_an_estimator_with_a_whole_iteration_correction_adjusts_the_iteration_time_only():
    class Corrected(FakeCost):
        def iteration_time(self, seconds: float) -> float:
            return 1.5 * seconds + 0.25

    plan = plan_of(2, {"gen": "0-1", "inf": "0-1", "train": "0-1"})
    result = simulate(plan, CHAIN, Corrected({"gen": 4, "inf": 2, "train": 6}), 24 * GB)
    assert result.iteration_time == 1.5 * 6 + 0.25
    assert result.iteration_ends == [6, 12, 18]  # the schedule itself is unchanged


def test_parameter_version_edge_holds_the_next_generation_until_training_ends():
    # gen (2 s) and train (1 s) on device 0, ref inference (3 s) on device 1. Device 0 is idle while ref runs,
    # yet gen of iteration 1 must wait for train of iteration 0: 0-2 gen, 2-5 ref, 5-6 train, then 6-8 gen.
    plan = plan_of(2, {"gen": "0", "inf": "1", "train": "0"})
    result = simulate(plan, CHAIN, FakeCost({"gen": 2, "inf": 3, "train": 1}), 24 * GB)
    assert spans(result, "gen", 0) == [(0, 2), (6, 8), (12, 14)]
    assert spans(result, "inf", 1) == [(2, 5), (8, 11), (14, 17)]
    assert spans(result, "train", 0) == [(5, 6), (11, 12), (17, 18)]
    assert result.iteration_time == 6
    # Steady-state window 6-18: device 0 runs gen + train (3 s) twice, device 1 ref (3 s) twice.
    assert result.busy_fraction == {0: 0.5, 1: 0.5}
    one_iteration = simulate(plan, CHAIN, FakeCost({"gen": 2, "inf": 3, "train": 1}), 24 * GB, iterations=1)
    assert one_iteration.iteration_time == 6 and one_iteration.busy_fraction == {0: 0.5, 1: 0.5}


# generation, then the actor's and a critic's training side by side.
TWO_TRAIN = Workflow(
    [
        MFC("gen", "actor", GEN, ("p",), ("r",)),
        MFC("actor_train", "actor", TRAIN, ("r",), ()),
        MFC("critic_train", "critic", TRAIN, ("r",), ()),
    ],
    ["p"],
)


def test_an_iteration_starts_once_the_previous_one_has_ended():
    # gen (2 s) and actor_train (1 s) on device 0, critic_train (5 s) on device 1. The version edges alone would
    # start the next gen at 3 while the critic still trains; the trainer runs iterations one after another, so
    # it starts at 7: gen 0-2, 7-9, 14-16; actor_train 2-3, 9-10, 16-17; critic_train 2-7, 9-14, 16-21.
    plan = plan_of(2, {"gen": "0", "actor_train": "0", "critic_train": "1"})
    result = simulate(plan, TWO_TRAIN, FakeCost({"gen": 2, "actor_train": 1, "critic_train": 5}), 24 * GB)
    assert spans(result, "gen", 0) == [(0, 2), (7, 9), (14, 16)]
    assert spans(result, "actor_train", 0) == [(2, 3), (9, 10), (16, 17)]
    assert spans(result, "critic_train", 1) == [(2, 7), (9, 14), (16, 21)]
    assert result.iteration_ends == [7, 14, 21] and result.iteration_time == 7
    # a copy waits too: the critic's training of the previous iteration ends before the actor's copy starts
    plan = plan_of(3, {"gen": "2", "actor_train": "0", "critic_train": "1"}, shadow=())
    result = simulate(plan, TWO_TRAIN, FakeCost({"gen": 2, "actor_train": 1, "critic_train": 5}, realloc=1.0), 24 * GB)
    assert spans(result, "copy actor→2:dp1", 2) == [(0, 1), (8, 9), (16, 17)]
    assert spans(result, "critic_train", 1) == [(3, 8), (11, 16), (19, 24)]
    assert result.iteration_time == 8


def test_independent_calls_on_disjoint_meshes_overlap():
    # gen 0-2 on both devices; ref (3 s) on device 0 and reward (2 s) on device 1 both start at 2; train 5-7.
    plan = plan_of(2, {"gen": "0-1", "ref_inf": "0", "reward_inf": "1", "train": "0-1"})
    result = simulate(plan, FORK, FakeCost({"gen": 4, "ref_inf": 3, "reward_inf": 2, "train": 4}), 24 * GB)
    assert spans(result, "ref_inf", 0)[0] == (2, 5) and spans(result, "reward_inf", 1)[0] == (2, 4)
    assert spans(result, "train", 1)[:2] == [(5, 7), (12, 14)]
    assert result.iteration_time == 7
    assert result.busy_fraction[0] == 1.0 and result.busy_fraction[1] == pytest.approx(6 / 7)


def test_independent_calls_on_a_shared_mesh_serialise():
    # Same calls, both inference calls on device 0: ref 2-5, then reward 5-7, then train 7-9.
    plan = plan_of(2, {"gen": "0-1", "ref_inf": "0", "reward_inf": "0", "train": "0-1"})
    result = simulate(plan, FORK, FakeCost({"gen": 4, "ref_inf": 3, "reward_inf": 2, "train": 4}), 24 * GB)
    assert spans(result, "ref_inf", 0)[0] == (2, 5) and spans(result, "reward_inf", 0)[0] == (5, 7)
    assert spans(result, "train", 0)[0] == (7, 9)
    assert result.iteration_time == 9
    assert result.busy_fraction[0] == 1.0 and result.busy_fraction[1] == pytest.approx(4 / 9)


def test_copy_reallocation_occupies_both_meshes_before_the_call():
    # Training on 0-1, generation on 2-3 without a shadow: copy (1 s) on 0-3, gen 1-3 on 2-3, train 3-5 on 0-1;
    # the next copy waits for train (its call's version edge): 5-6.
    plan = plan_of(4, {"gen": "2-3", "train": "0-1"}, shadow=())
    cost = FakeCost({"gen": 4, "train": 4}, realloc=1.0)
    result = simulate(plan, GEN_TRAIN, cost, 24 * GB)
    for d in range(4):
        assert spans(result, "copy actor→2-3:dp2", d) == [(0, 1), (5, 6), (10, 11)]
    assert [iv.kind for iv in result.timeline if iv.label == "copy actor→2-3:dp2"] == ["copy"] * 12
    for d in (2, 3):  # the copy is dropped once generation has used it: a step that takes no time
        assert spans(result, "free actor@2-3:dp2", d) == [(3, 3), (8, 8), (13, 13)]
    assert spans(result, "gen", 2) == [(1, 3), (6, 8), (11, 13)]
    assert spans(result, "train", 0) == [(3, 5), (8, 10), (13, 15)]
    assert result.iteration_time == 5
    assert set(cost.realloc_calls) == {("actor", "0-1:dp2", "2-3:dp2")}  # the free back costs nothing


def test_sync_follows_training_and_holds_the_next_shadow_call():
    # Separated generation (default shadow): gen 0-2 on 2-3, train 2-4 on 0-1, sync 4-5 on 0-3, gen again 5-7.
    plan = plan_of(4, {"gen": "2-3", "train": "0-1"})
    assert plan.shadow_roles(GEN_TRAIN) == ("actor",)
    result = simulate(plan, GEN_TRAIN, FakeCost({"gen": 4, "train": 4}, realloc=1.0), 24 * GB)
    assert spans(result, "gen", 3) == [(0, 2), (5, 7), (10, 12)]
    assert spans(result, "train", 1) == [(2, 4), (7, 9), (12, 14)]
    for d in range(4):
        assert spans(result, "sync actor→2-3:dp2", d) == [(4, 5), (9, 10), (14, 15)]
    assert result.iteration_ends == [5, 10, 15] and result.iteration_time == 5


def test_memory_is_resident_plus_the_running_call():
    # Shared mesh 0-1: actor trained (10 GB × 3 = 30 GB), gen 2 GB, inf 1 GB, train 4 GB transient; the calls
    # run one after another, so the transient parts never add up: peak 30 + 6 (ref, not offloaded) + 4.
    static = {"actor": 10 * GB, "ref": 6 * GB}
    cost = FakeCost(
        {"gen": 4, "inf": 2, "train": 6}, static=static, transient={"gen": 2 * GB, "inf": 1 * GB, "train": 4 * GB}
    )
    plan = plan_of(2, {"gen": "0-1", "inf": "0-1", "train": "0-1"}, offload=())
    result = simulate(plan, CHAIN, cost, 48 * GB)
    assert result.peak_memory == {0: 40 * GB, 1: 40 * GB} and result.feasible
    # Offloaded (the default for a frozen role sharing devices that hold memory of their own), ref's 6 GB are
    # there only from its reload (taking no time here) to its offload after inf.
    offloaded = simulate(plan_of(2, {"gen": "0-1", "inf": "0-1", "train": "0-1"}, "h100"), CHAIN, cost, 48 * GB)
    assert offloaded.peak_memory == {0: 37 * GB, 1: 37 * GB}
    # CPU devices are their host's memory: nothing is offloaded there, whatever the plan says
    assert simulate(plan_of(2, {"gen": "0-1", "inf": "0-1", "train": "0-1"}), CHAIN, cost, 48 * GB).peak_memory == {
        0: 40 * GB,
        1: 40 * GB,
    }
    # Tensor parallelism over both devices halves the resident memory (15 + 3 GB), not the transient.
    sharded = plan_of(2, {"gen": "0-1:tp2", "inf": "0-1:tp2", "train": "0-1:tp2"}, offload=())
    assert simulate(sharded, CHAIN, cost, 48 * GB).peak_memory[0] == 15 * GB + 3 * GB + 4 * GB


class ReloadingCost(FakeCost):
    """FakeCost reloading a role at 1 s per GB of its shard."""

    def reload_time(self, role: str, alloc: Allocation, trainable: bool = False) -> float:
        return self.static_memory(role, alloc, False) / GB


def test_an_offloaded_role_reloads_before_each_call_where_devices_offload():
    # CHAIN on 0-1 of an accelerator: gen 2 s, reload of ref's 6 GB shard 6 s, inf 1 s, train 3 s → 12 s.
    static = {"actor": 10 * GB, "ref": 6 * GB}
    shared = {"gen": "0-1", "inf": "0-1", "train": "0-1"}
    cost = ReloadingCost({"gen": 4, "inf": 2, "train": 6}, static=static)
    offloaded = simulate(plan_of(2, shared, "h100"), CHAIN, cost, 48 * GB)
    assert offloaded.iteration_time == pytest.approx(12) and spans(offloaded, "inf", 0)[0] == (8, 9)
    assert spans(offloaded, "reload ref for inf", 0)[0] == (2, 8)
    assert spans(offloaded, "offload ref after inf", 1)[0] == (9, 9)
    assert offloaded.peak_memory[0] == 30 * GB + 6 * GB
    resident = simulate(plan_of(2, shared, "h100", offload=()), CHAIN, cost, 48 * GB)
    assert resident.iteration_time == pytest.approx(6) and resident.peak_memory[0] == 36 * GB
    # on CPU devices the plan's offloaded role is resident and reloads nothing: the schedule has no such steps
    cpu = simulate(plan_of(2, shared), CHAIN, cost, 48 * GB)
    assert cpu.iteration_time == pytest.approx(6) and cpu.peak_memory[0] == 36 * GB
    assert {iv.label for iv in cpu.timeline} == {"gen", "inf", "train"}


class MovingCost(FakeCost):
    """FakeCost moving a shard to or from the host at 10 GB/s (a trained role's whole state when trainable)."""

    def reload_time(self, role: str, alloc: Allocation, trainable: bool = False) -> float:
        return self.static_memory(role, alloc, trainable) / GB / 10

    def offload_time(self, role: str, alloc: Allocation, trainable: bool = False) -> float:
        return self.reload_time(role, alloc, True) if trainable else 0.0


def test_a_trained_role_offloaded_sleeps_through_generation_and_its_later_steps_wait_for_it():
    """The actor's training state (10 GB of weights × 3 = 30 GB over dp2) leaves devices 0-1 while its
    generation runs there in another layout (a 5 GB tp2 copy), and comes back before training. Copy 1 s;
    offload of the 30 GB at 10 GB/s 3 s, after the copy (which reads it); gen 2 s; the reload (3 s) right after
    gen, the copy's free sent with gen; inf (1 s, ref resident: explicitly not offloaded) waits behind the
    reload in dispatch order, train (3 s) for both: 0-1 copy, 1-4 offload, 4-6 gen, 6-9 reload, 9-10 inf,
    10-13 train. Memory: 30 + 5 + 6 (ref) = 41 GB until the offload ends, then 5 + 2 + 6 during gen; resident
    throughout it would need 43 GB."""
    cost = MovingCost(
        {"gen": 4, "inf": 2, "train": 6},
        static={"actor": 10 * GB, "ref": 6 * GB},
        transient={"gen": 2 * GB, "train": 4 * GB},
    )
    placement = {"gen": "0-1:tp2", "inf": "0-1", "train": "0-1"}
    asleep = simulate(plan_of(2, placement, "h100", offload=("actor",)), CHAIN, cost, 42 * GB)
    for label, want in (
        ("copy actor→0-1:dp1tp2", (0, 1)),
        ("offload actor state for gen", (1, 4)),
        ("gen", (4, 6)),
        ("reload actor state after gen", (6, 9)),
        ("inf", (9, 10)),
        ("train", (10, 13)),
    ):
        assert spans(asleep, label, 0)[0] == want, label
    assert asleep.iteration_time == pytest.approx(13) and asleep.feasible
    assert asleep.peak_memory[0] == 41 * GB
    awake = simulate(plan_of(2, placement, "h100", offload=()), CHAIN, cost, 42 * GB)
    assert not awake.feasible and awake.peak_memory[0] == 43 * GB and awake.iteration_time == pytest.approx(7)
    # CPU devices hold their host's memory: the schedule has no such steps there
    cpu = simulate(plan_of(2, placement, offload=("actor",)), CHAIN, cost, 48 * GB)
    assert not any("state" in iv.label for iv in cpu.timeline)


def test_copy_memory_lives_from_the_copy_to_the_end_of_its_call():
    # Copy of the actor (10 GB) onto 2-3 plus gen's 2 GB there; training state 30 GB + train's 4 GB on 0-1.
    cost = FakeCost({"gen": 4, "train": 4}, static={"actor": 10 * GB}, transient={"gen": 2 * GB, "train": 4 * GB})
    result = simulate(plan_of(4, {"gen": "2-3", "train": "0-1"}, shadow=()), GEN_TRAIN, cost, 40 * GB)
    assert result.peak_memory == {0: 34 * GB, 1: 34 * GB, 2: 12 * GB, 3: 12 * GB}
    # On a device holding both the training state and the copy (copy onto 0-3 with another layout) they add up.
    both = simulate(plan_of(4, {"gen": "0-3:dp2tp2", "train": "0-1"}), GEN_TRAIN, cost, 48 * GB)
    assert both.peak_memory[0] == 30 * GB + 5 * GB + 2 * GB  # during gen; the copy is freed before train (34)
    assert both.peak_memory[2] == 5 * GB + 2 * GB


def test_infeasible_plan_is_rejected_with_device_and_sizes():
    cost = FakeCost({"gen": 4, "train": 4}, static={"actor": 10 * GB}, transient={"gen": 2 * GB, "train": 4 * GB})
    result = simulate(plan_of(4, {"gen": "2-3", "train": "0-1"}, shadow=()), GEN_TRAIN, cost, 32 * GB)
    assert not result.feasible
    assert result.reason.startswith("device 0 needs 34.0 GB"), result.reason
    assert "but has 32.0 GB" in result.reason
    assert "actor weights 30.0 GB" in result.reason and "train running 4.0 GB" in result.reason
    assert "\n" not in result.reason
    assert result.iteration_time == 5  # the schedule is still reported
    tight = simulate(plan_of(4, {"gen": "2-3", "train": "0-1"}, shadow=()), GEN_TRAIN, cost, 34 * GB)
    assert tight.feasible  # exactly full fits


def test_invalid_inputs_raise():
    plan = plan_of(2, {"gen": "0-1", "inf": "0-1"})  # train is not placed
    with pytest.raises(ConfigError, match="train"):
        simulate(plan, CHAIN, FakeCost({"gen": 1, "inf": 1, "train": 1}), GB)
    full = plan_of(2, {"gen": "0-1", "inf": "0-1", "train": "0-1"})
    with pytest.raises(ConfigError, match="iterations"):
        simulate(full, CHAIN, FakeCost({"gen": 1, "inf": 1, "train": 1}), GB, iterations=0)
    with pytest.raises(ValueError, match="mfc_time"):
        simulate(full, CHAIN, FakeCost({"gen": -1, "inf": 1, "train": 1}), GB)


def test_colocated_ppo_serialises_every_call():
    # All calls share device 0 (advantages runs there), so an iteration is the sum of the call times.
    ppo = build_workflow(AlgoConfig(name="ppo"), RolloutConfig())
    work = {
        "actor_gen": 8,
        "ref_inf": 2,
        "reward_inf": 2,
        "critic_inf": 2,
        "advantages": 0.25,
        "actor_train": 6,
        "critic_train": 6,
    }
    plan = colocate(ppo, ClusterSpec.parse("cpu:4"))
    result = simulate(plan, ppo, FakeCost(work), 24 * GB)
    expected = sum(w / 4 for name, w in work.items() if name != "advantages") + 0.25
    assert result.iteration_time == pytest.approx(expected)
    assert result.busy_fraction[0] == pytest.approx(1.0)
    assert result.busy_fraction[1] == pytest.approx((expected - 0.25) / expected)
    assert isinstance(FakeCost(work), CostEstimator)


def test_format_bytes():
    assert [format_bytes(x) for x in (512, 3 * 2**20, 80 * GB)] == ["512 B", "3.0 MB", "80.0 GB"]


def test_gantt_png_and_html(tmp_path: Path):
    plan = plan_of(4, {"gen": "2-3", "train": "0-1"})
    result = simulate(plan, GEN_TRAIN, FakeCost({"gen": 4, "train": 4}), 24 * GB)
    png, page = tmp_path / "gantt.png", tmp_path / "out" / "gantt.html"
    render_timeline(result, png, page, title="separate <gen>")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000
    text = page.read_text()
    assert text.count('class="interval"') == len(result.timeline) == 24  # gen 2 + train 2 + sync 4 devices, × 3
    assert "separate &lt;gen&gt;" in text and "<script" not in text and "http://www.w3.org/2000/svg" in text
    assert "sync actor→2-3:dp2 (sync), iteration 2" in text
    assert render_html(result).count("<rect") == len(result.timeline)
    assert not math.isnan(result.iteration_time)


def test_device_classes_give_the_per_device_simulation(monkeypatch: pytest.MonkeyPatch):
    """Devices every mesh treats alike are simulated once per class: on random PPO plans of 16 devices (the
    real cost model, llama2-7b; some infeasible) every result equals the one simulated device by device."""
    import random

    from loomrl.models.presets import model_config
    from loomrl.plan.hardware import PROFILES
    from loomrl.plan.model_shape import ModelShape
    from loomrl.planner.cost.model import CostModel
    from loomrl.planner.cost.workload import Workload
    from loomrl.planner.search.candidates import candidate_allocations
    from loomrl.planner.simulation import simulator

    ppo = build_workflow(AlgoConfig(name="ppo"), RolloutConfig())
    cluster = ClusterSpec.parse("h100:2x8")
    configs = {role: model_config("llama2-7b") for role in ppo.roles()}
    cost = CostModel(
        cluster,
        PROFILES["h100-80g"],
        {r: ModelShape.from_config(c) for r, c in configs.items()},
        Workload(batch=256, prompt_len=128, response_lengths=(64, 256)),
    )
    options = {m.name: candidate_allocations(m, ppo, cluster, configs) for m in ppo}
    rng = random.Random(0)
    plans = []
    while len(plans) < 40:
        chosen = {name: rng.choice(allocs) for name, allocs in options.items()}
        plan = ExecutionPlan(cluster, chosen)
        try:
            plan.validate(ppo)
        except ConfigError:
            continue
        plans.append(plan)
    fields = (
        "iteration_time",
        "busy_fraction",
        "peak_memory",
        "feasible",
        "reason",
        "iteration_ends",
        "device_seconds",
        "makespan",
        "timeline",
    )
    grouped = [simulate(plan, ppo, cost, 80 * GB) for plan in plans]
    real_classes = simulator._DeviceClasses
    monkeypatch.setattr(
        simulator, "_DeviceClasses", lambda meshes, n, identity=False: real_classes(meshes, n, identity=True)
    )
    classes_seen = 0
    for plan, result in zip(plans, grouped):
        alone = simulate(plan, ppo, cost, 80 * GB)
        for name in fields:
            assert getattr(result, name) == getattr(alone, name), name
        # a class's overflow is multiplied by its size rather than added per device: the same up to rounding
        assert result.overflow_byte_seconds == pytest.approx(alone.overflow_byte_seconds, rel=1e-12)
        classes_seen += len(real_classes([a.mesh.devices for a in plan.allocations.values()], 16).members) < 16
    assert classes_seen > 30 and not all(r.feasible for r in grouped) and any(r.feasible for r in grouped)


def test_a_trained_role_generating_on_its_training_shards_stays_awake():
    """Generation in the training layout has no copy to run on: the state the plan offloads stays resident."""
    cost = MovingCost({"gen": 4, "inf": 2, "train": 6}, static={"actor": 10 * GB, "ref": 6 * GB})
    result = simulate(
        plan_of(2, {"gen": "0-1", "inf": "0-1", "train": "0-1"}, "h100", offload=("actor",)), CHAIN, cost, 48 * GB
    )
    assert not any("actor state" in iv.label for iv in result.timeline) and result.iteration_time == pytest.approx(6)
