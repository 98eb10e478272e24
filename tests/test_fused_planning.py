"""Stream fusion in the planner: response-length distributions as ``loomrl plan`` reads them, the search's choice to
fuse,
and the lower bound over fused plans (:mod:`loomrl.planner.cost.lengths`, :mod:`loomrl.planner.search.search`,
:mod:`loomrl.planner.search.bounds`)."""

import dataclasses
import json

import pytest

from loomrl.algorithms.workflows import build_workflow
from loomrl.config.schema import AlgoConfig, RolloutConfig
from loomrl.errors import ConfigError
from loomrl.models.presets import model_config
from loomrl.plan import ClusterSpec, colocate, separate
from loomrl.plan.cluster import profile_for
from loomrl.plan.model_shape import ModelShape
from loomrl.plan.plan import StreamFusion
from loomrl.planner.cost.lengths import length_fields, observed_lengths
from loomrl.planner.cost.model import CostModel
from loomrl.planner.cost.stream_fusion import generation_floor, price_stream_fusion
from loomrl.planner.cost.workload import Workload, lengths_from_mean_max
from loomrl.planner.search.bounds import iteration_bound
from loomrl.planner.search.evaluate import plan_key
from loomrl.planner.search.search import search
from loomrl.planner.simulation.simulator import simulate

PPO = build_workflow(AlgoConfig(name="ppo", minibatches=4), RolloutConfig())
CLUSTER = ClusterSpec.parse("h100:1x8")
CONFIGS = {role: model_config("llama2-7b") for role in PPO.roles()}
LONG_TAIL = Workload(batch=512, prompt_len=128, response_lengths=lengths_from_mean_max(384, 2048, 1.0), minibatches=4)


def _cost(workload: Workload) -> CostModel:
    shapes = {role: ModelShape.from_config(cfg) for role, cfg in CONFIGS.items()}
    return CostModel(CLUSTER, profile_for(CLUSTER), shapes, workload)


# ---------------------------------------------------------------------------------------------- length forms


def test_length_forms_give_the_run_description_fields(tmp_path):
    assert length_fields("400") == {"response_len": 400.0}
    assert length_fields("lognormal:mean=400,sigma=1.0,max=4096") == {
        "response_len": 400.0,
        "response_spread": 1.0,
        "response_max": 4096,
    }
    lines = tmp_path / "lengths.jsonl"
    lines.write_text('{"length": 12}\n\n[3, 400]\n17\n{"response_length": 5.0}\n{"lengths": [1, 2]}\n')
    assert observed_lengths(lines) == (12, 3, 400, 17, 5, 1, 2)
    assert length_fields(str(lines)) == {"observed_lengths": [12, 3, 400, 17, 5, 1, 2]}


def test_a_run_directory_gives_lengths_from_its_metrics(tmp_path):
    records = [
        {"iteration": i, "response/length": 40.0, "response/length_p90": 90.0, "response/length_max": 120}
        for i in range(2)
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    lengths = length_fields(str(tmp_path))["observed_lengths"]
    assert len(lengths) == 200 and max(lengths) == 120
    assert sum(lengths) / len(lengths) == pytest.approx(40.0, abs=0.5)


@pytest.mark.parametrize(
    "text, named",
    [
        ("often", "neither a mean"),
        ("lognormal:mean=400", "sigma, max missing"),
        ("lognormal:mean=400,sigma=1,max=x", "max='x' is not a number"),
        ("lognormal:mu=1,sigma=1,max=9", "'mu=1' is not one of"),
    ],
)
def test_bad_length_forms_are_one_line_errors(text, named):
    with pytest.raises(ConfigError, match=named):
        length_fields(text)


def test_bad_observed_lengths_name_the_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"length": 3}\n{"length": 0}\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:2: 0 is not a response length"):
        observed_lengths(bad)
    bad.write_text("{not json\n")
    with pytest.raises(ConfigError, match=r"bad.jsonl:1: not JSON"):
        observed_lengths(bad)
    bad.write_text("\n")
    with pytest.raises(ConfigError, match="no response lengths"):
        observed_lengths(bad)


def test_plan_cli_reads_a_length_distribution(tmp_path, capsys):
    from loomrl.cli import main

    assert (
        main(
            [
                "plan",
                "--cluster",
                "h100:1x8",
                "--model",
                "llama2-7b",
                "--response-len",
                "lognormal:mean=384,sigma=1.0,max=2048",
                "--plan",
                "colocate",
            ]
        )
        == 0
    )
    assert "128 + 384 (max 2048) tokens" in " ".join(capsys.readouterr().out.split())
    lengths = tmp_path / "observed.jsonl"
    lengths.write_text("".join(f"{n}\n" for n in (10, 20, 300)))
    assert (
        main(
            [
                "plan",
                "--cluster",
                "h100:1x8",
                "--model",
                "llama2-7b",
                "--response-len",
                str(lengths),
                "--plan",
                "colocate",
            ]
        )
        == 0
    )
    assert "128 + 110 (max 300) tokens" in " ".join(capsys.readouterr().out.split())


# ------------------------------------------------------------------------------------------ fused floor, bound


def test_no_fused_stage_hands_samples_on_before_the_generation_floor():
    from loomrl.plan.schedule import StepKind, build_schedule

    cost = _cost(LONG_TAIL)
    plan = colocate(PPO, CLUSTER)
    floor = generation_floor(cost, "actor", plan["actor_gen"])
    assert floor.ready[0][1] == 1.0 and floor.ready[-1][1] < 0.05
    for fusion in (
        StreamFusion(migrate_at=0.0),
        StreamFusion(migrate_at=0.2),
        StreamFusion(migrate_at=0.5, migrate_to=2),
    ):
        schedule = build_schedule(PPO, dataclasses.replace(plan, stream_fusion=fusion))
        (step,) = [s for s in schedule if s.kind is StepKind.STREAM_FUSION]
        price = price_stream_fusion(cost, step)
        generating = [(start, end) for label, _, start, end in price.parts if label == "actor_gen"]
        assert max(end for _, end in generating) >= floor.ready[-1][0]
        assert sum(end - start for start, end in generating) >= floor.device_seconds


@pytest.mark.parametrize("lengths", [LONG_TAIL.response_lengths, (384,)], ids=["long_tail", "uniform"])
def test_the_bound_holds_for_fused_plans_and_merges_generation_with_its_readers(lengths):
    cost = _cost(dataclasses.replace(LONG_TAIL, response_lengths=lengths))
    bound = iteration_bound(PPO, CLUSTER, cost, profile_for(CLUSTER).memory_bytes, CONFIGS)
    if len(lengths) > 1:  # a long tail: the fused stage's bound is the lesser, so the segments merge
        assert bound.segments[0].calls == ("actor_gen", "ref_inf", "reward_inf", "critic_inf")
    for plan in (colocate(PPO, CLUSTER), separate(PPO, CLUSTER, 4)):
        for fusion in (None, StreamFusion(migrate_at="auto"), StreamFusion(migrate_at=0.3, migrate_to=2)):
            result = simulate(
                dataclasses.replace(plan, stream_fusion=fusion), PPO, cost, profile_for(CLUSTER).memory_bytes
            )
            assert result.iteration_time >= bound.seconds


# ---------------------------------------------------------------------------------------------------- search


def test_the_search_fuses_a_long_tailed_workload():
    cost = _cost(LONG_TAIL)
    found = search(
        PPO, CLUSTER, cost, profile_for(CLUSTER).memory_bytes, CONFIGS, seed=0, time_budget_s=300, max_steps=40
    )
    plan, result = found[0]
    assert plan.stream_fusion is not None and result.feasible
    unfused = simulate(dataclasses.replace(plan, stream_fusion=None), PPO, cost, profile_for(CLUSTER).memory_bytes)
    assert result.iteration_time < unfused.iteration_time
    assert plan_key(plan) != plan_key(dataclasses.replace(plan, stream_fusion=None))


def test_a_fused_stage_with_nothing_to_overlap_costs_its_calls_in_turn():
    # every response equally long and no migration: generation ends on every device at once, then each member
    # scores the whole batch, so the stage is priced like the unfused calls (the profile's stated factor too)
    from loomrl.plan.schedule import StepKind, build_schedule

    cost = _cost(dataclasses.replace(LONG_TAIL, response_lengths=(384,)))
    assert cost.profile.system_factor != 1.0
    plan = dataclasses.replace(colocate(PPO, CLUSTER), stream_fusion=StreamFusion(migrate_at=0.0))
    (step,) = [s for s in build_schedule(PPO, plan) if s.kind is StepKind.STREAM_FUSION]
    in_turn = sum(cost.mfc_time(PPO[m.id], m.alloc) for m in step.members)
    assert price_stream_fusion(cost, step).seconds == pytest.approx(in_turn, rel=0.05)
