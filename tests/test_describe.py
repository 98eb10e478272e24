"""Runs described for the planner, fixed plans stage by stage, and the planning time budget."""

from __future__ import annotations

import math
import time

import pytest

from loomrl.cli import main
from loomrl.config.tools import from_dict
from loomrl.errors import ConfigError
from loomrl.plan import ExecutionPlan, make_plan
from loomrl.planner.describe import RunDescription, inputs_from_description, simulate_fixed, stage_seconds
from loomrl.planner.search.bounds import iteration_bound
from loomrl.planner.search.candidates import candidate_allocations
from loomrl.planner.search.evaluate import CachedCost
from loomrl.planner.search.heuristics import best_heuristic_plans
from loomrl.planner.simulation.simulator import Interval, SimResult

GRPO = {
    "algo": "grpo",
    "cluster": "h100:1x8",
    "models": {"actor": "llama3.1-8b", "reward": "rule"},
    "prompts": 32,
    "responses_per_prompt": 8,
    "prompt_len": 100,
    "response_len": 500,
    "response_max": 2000,
    "optimizer_steps": 2,
    "recompute_logprobs": True,
}


def test_a_run_description_gives_the_planners_inputs():
    run = from_dict(RunDescription, GRPO, "run")
    inputs = inputs_from_description(run)
    workflow, cluster, configs, workload, settings = (
        inputs.workflow,
        inputs.cluster,
        inputs.configs,
        inputs.workload,
        inputs.settings,
    )
    assert cluster.n_devices == 8 and configs["reward"] is None and configs["ref"] is configs["actor"]
    assert "actor_inf" in workflow and workload.batch == 256 and workload.minibatches == 2
    assert workload.max_response == 2000 and workload.mean_response == pytest.approx(500, rel=0.01)
    assert settings.gen_memory_fraction is None  # loomrl's runtime unless told otherwise
    only_mean = from_dict(RunDescription, {**GRPO, "response_max": None}, "run")
    assert only_mean.response_lengths() == (500,)


@pytest.mark.parametrize(
    "change, words",
    [
        ({"response_len": 3000}, ("response_len", "3000", "response_max")),
        ({"responses_per_prompt": 1}, ("responses_per_prompt", "grpo")),
        ({"cluster": "tpu:8"}, ("tpu",)),
        ({"system": {"gen_memory_fraction": 1.5}}, ("gen_memory_fraction", "1.5")),
        ({"models": {"actor": "rule"}}, ("actor", "rule")),
        ({"system": {"partial_rollout": True}}, ("system.partial_rollout", "asynchronous plan")),
    ],
)
def test_a_bad_description_fails_in_one_line(change, words):
    with pytest.raises(ConfigError) as err:
        inputs_from_description(from_dict(RunDescription, {**GRPO, **change}, "run"))
    assert "\n" not in str(err.value) and all(w in str(err.value) for w in words)


def test_a_run_without_kl_has_no_reference_and_partial_rollouts_need_an_async_plan():
    run = from_dict(RunDescription, {**GRPO, "kl": False}, "run")
    assert "ref_inf" not in run.workflow() and "ref_inf" in from_dict(RunDescription, GRPO, "run").workflow()
    synchronous = from_dict(RunDescription, {**GRPO, "plan": "colocate", "system": {"partial_rollout": True}}, "run")
    inputs = inputs_from_description(synchronous)
    plan = make_plan("colocate", inputs.workflow, inputs.cluster)
    with pytest.raises(ConfigError, match="system.partial_rollout: needs an asynchronous plan"):
        simulate_fixed(plan, inputs)


def test_stage_seconds_count_overlapping_steps_once():
    timeline = [
        Interval(0, 0, 5, "actor_gen", "generate", 1),
        Interval(1, 1, 4, "actor_gen", "generate", 1),
        Interval(0, 5, 6, "ref_inf", "inference", 1),
        Interval(1, 5.5, 7, "reward_inf", "inference", 1),
        Interval(0, 7, 9, "actor_train", "train", 1),
        Interval(0, 9, 9.5, "mystery", "copy", 1),
        Interval(0, 0, 100, "actor_gen", "generate", 0),
    ]  # another iteration: left out
    result = SimResult(9.5, {}, {}, timeline, True, iteration_ends=[0, 9.5, 19])
    assert stage_seconds(result) == {"generation": 5, "weight sync": 0.0, "scoring": 2, "training": 2, "other": 0.5}


def test_a_fixed_plan_is_simulated_as_given_and_read_back_by_stage():
    run = from_dict(RunDescription, {**GRPO, "system": {"gen_memory_fraction": 0.6}}, "run")
    inputs = inputs_from_description(run)
    workflow, cluster, _configs, _workload, _settings = (
        inputs.workflow,
        inputs.cluster,
        inputs.configs,
        inputs.workload,
        inputs.settings,
    )
    plan = make_plan(
        "actor_gen=0-7:dp8; actor_inf=0-7:dp4tp2mb2; ref_inf=0-7:dp4tp2mb2; reward_inf=0; "
        "actor_train=0-7:dp4tp2mb4zero; offload=actor,ref",
        workflow,
        cluster,
    )
    report = simulate_fixed(plan, inputs)
    assert report.result.feasible
    stages = report.stages
    assert stages["generation"] == pytest.approx(report.calls["actor_gen"])
    assert stages["training"] == pytest.approx(report.calls["actor_train"])
    assert stages["weight sync"] >= report.calls["offload actor state for actor_gen"] > 0  # asleep while generating
    assert sum(stages.values()) == pytest.approx(report.result.iteration_time, rel=0.01)


def test_loomrl_plan_prints_a_given_plans_stages_from_a_workload_file(tmp_path, capsys):
    workload = tmp_path / "run.yaml"
    workload.write_text(
        "algo: grpo\ncluster: h100:1x8\nmodels: {actor: qwen3-8b, reward: rule}\nprompts: 16\n"
        "responses_per_prompt: 4\nprompt_len: 64\nresponse_len: 300\nresponse_max: 1000\n"
        "system: {gen_memory_fraction: 0.5}\n"
    )
    out = tmp_path / "out"
    plan = "actor_gen=0-7:dp8; ref_inf=0-7:dp8; reward_inf=0; actor_train=0-7:dp8zero"
    assert main(["plan", "--workload", str(workload), "--plan", plan, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "the given plan" in printed and "generation" in printed and "actor_train" in printed
    assert ExecutionPlan.load(out / "best_plan.json").cluster.n_devices == 8
    assert main(["plan", "--workload", str(workload), "--plan", "actor_gen=0-7", "--out", str(out)]) == 2
    assert "not placed" in capsys.readouterr().err


def _small_search_inputs():
    run = from_dict(RunDescription, {**GRPO, "cluster": "h100:2x8", "models": {"actor": "llama3.1-8b"}}, "run")
    inputs = inputs_from_description(run)
    workflow, cluster, configs, _workload, _settings = (
        inputs.workflow,
        inputs.cluster,
        inputs.configs,
        inputs.workload,
        inputs.settings,
    )
    return workflow, cluster, configs, CachedCost(inputs.cost_model()), inputs.profile


def test_scoring_calls_are_micro_batched_in_the_search():
    workflow, cluster, configs, _, _ = _small_search_inputs()
    scoring = candidate_allocations(workflow["ref_inf"], workflow, cluster, configs)
    assert {a.micro_batches for a in scoring} == {1, 2, 4, 8}
    assert not any(a.recompute or a.zero or a.fsdp for a in scoring)


def test_past_deadlines_the_heuristics_and_the_bound_stop_with_what_they_have():
    """A deadline already passed: each strategy tunes its first plan's first layout options only (at least one
    simulated plan each) and the bound falls back to its rule for unenumerated placements, which is looser."""
    workflow, cluster, configs, cost, profile = _small_search_inputs()
    began = time.monotonic()
    rushed = best_heuristic_plans(workflow, cluster, cost, profile.memory_bytes, configs, deadline=began)
    assert set(rushed) == {"colocate", "interleave", "separate"}
    full = iteration_bound(workflow, cluster, cost, profile.memory_bytes, configs)
    quick = iteration_bound(workflow, cluster, cost, profile.memory_bytes, configs, deadline=time.monotonic())
    assert full.training and not quick.training and math.isfinite(quick.seconds)
    assert quick.seconds <= full.seconds
