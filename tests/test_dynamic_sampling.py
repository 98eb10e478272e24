"""Dynamic sampling (DAPO): waves of prompts until enough groups carry a learning signal, the same on every
executor, checkpointed and resumed exactly."""

import json

import pytest

from loomrl.algorithms.dynamic_sampling import DynamicSampler, equal_rewards, group_filter
from loomrl.algorithms.workflows import build_workflow
from loomrl.checkpoint.store import latest_checkpoint
from loomrl.config.schema import AlgoConfig, DynamicSamplingConfig, RolloutConfig, RuntimeConfig, TrainConfig
from loomrl.config.tools import load_config
from loomrl.errors import ConfigError, DataError
from loomrl.plan import ClusterSpec, make_plan
from loomrl.plan.from_config import plan_from_config
from loomrl.plan.schedule import Step, StepKind, build_schedule, split_for_sampling
from loomrl.train.rl import RLTrainer
from loomrl.workflow.batch import Batch
from test_rl import _crash_on_save, comparable, read_records, tiny_cfg

GRPO = build_workflow(AlgoConfig(name="grpo"), RolloutConfig())


# ------------------------------------------------------------------------------------------- the sampler


def _sampler(prompts=4, group=2, max_waves=4, factor=4.0, keep=None):
    def make_wave(cursor, n):
        return Batch([(cursor + i) * group + j for i in range(n) for j in range(group)])

    return DynamicSampler(
        DynamicSamplingConfig(True, max_waves=max_waves, max_wave_factor=factor), prompts, group, make_wave, keep
    )


def _scores(ids, kept_prompts, group=2):
    """Rewards that keep the groups of ``kept_prompts`` (data positions) under the default filter."""
    return [float(j) if i // group in kept_prompts else 0.5 for j, i in enumerate(ids)]


def test_waves_are_sized_from_the_kept_fraction_and_fill_the_batch_in_order():
    sampler = _sampler()
    waves = sampler.waves()
    first = waves.first()
    assert first.ids == list(range(8))  # 4 prompts x 2, from position 0
    second = waves.offer(first.ids, _scores(first.ids, {0, 2}))  # half kept: estimate 0.75
    assert sampler.estimate == pytest.approx(0.75)
    assert second.ids == list(range(8, 14))  # ceil(2 missing / 0.75) = 3 prompts, positions 4..6
    assert waves.offer(second.ids, _scores(second.ids, {5, 6, 4})) is None  # full: 5 kept, one discarded
    assert waves.kept() == [0, 1, 4, 5, 8, 9, 10, 11]  # kept groups, in generation order, cut at 4
    assert sampler.cursor == 7
    stats = waves.stats()
    assert stats["sampling/waves"] == 2 and stats["sampling/prompts"] == 7
    assert stats["sampling/kept_fraction"] == pytest.approx(5 / 7)
    assert stats["sampling/discarded_groups"] == 1 and stats["sampling/filled_groups"] == 0
    # the next iteration starts where this one stopped, with the estimate it left
    assert sampler.waves().first().ids[0] == 14
    assert sampler.wave_prompts(4) == 5


def test_spent_waves_fill_the_batch_with_dropped_groups_and_say_so():
    sampler = _sampler(max_waves=2, factor=2.0)
    waves = sampler.waves()
    first = waves.first()
    second = waves.offer(first.ids, _scores(first.ids, {1}))
    assert len(second.ids) == 2 * 5  # ceil(3 missing / estimate 0.625) = 5 prompts (under the cap of 2 x 4)
    assert waves.offer(second.ids, _scores(second.ids, set())) is None  # max_waves reached
    kept = waves.kept()
    assert kept[:2] == [2, 3] and kept[2:] == [0, 1, 4, 5, 6, 7]  # the kept group, then dropped ones in order
    assert waves.stats()["sampling/filled_groups"] == 3


def test_a_wave_is_capped_at_max_wave_factor_prompts():
    sampler = _sampler(factor=1.5)
    sampler.estimate = 0.01
    assert sampler.wave_prompts(4) == 6  # ceil(1.5 x 4)
    assert sampler.wave_prompts(0) == 1


def test_rewards_for_other_samples_are_refused():
    waves = _sampler().waves()
    first = waves.first()
    with pytest.raises(RuntimeError, match="expected the wave's 8"):
        waves.offer(first.ids[:4], [0.0] * 4)


def test_the_default_filter_and_user_filters(tmp_path):
    assert not equal_rewards([1.0, 1.0, 1.0]) and not equal_rewards([0.0, 1e-9])
    assert equal_rewards([0.0, 1.0])
    (tmp_path / "filters.py").write_text(
        "def high(rewards):\n    return max(rewards) > 0.5\n"
        "def broken(rewards):\n    return rewards[10]\n"
        "def numeric(rewards):\n    return 1\n"
    )
    assert group_filter(f"{tmp_path}/filters.py:high")([0.2, 0.9])
    with pytest.raises(DataError, match=r"filters.py:broken' raised IndexError: .* \(rewards \[0.1\]\)"):
        group_filter(f"{tmp_path}/filters.py:broken")([0.1])
    with pytest.raises(DataError, match="returned int 1; it must return True"):
        group_filter(f"{tmp_path}/filters.py:numeric")([0.1])
    with pytest.raises(DataError, match="algo.dynamic_sampling.filter: .*has no callable 'nope'"):
        group_filter(f"{tmp_path}/filters.py:nope")


def test_dynamic_sampling_is_checked_before_anything_runs():
    for extra, message in (
        (("algo.name=ppo",), "dynamic_sampling.enabled: dynamic sampling filters groups"),
        (("runtime.controllers=2",), "runs with one controller, not 2"),
        (("runtime.placement=dynamic",), "does not combine with runtime.placement"),
        (("algo.dynamic_sampling.filter=nocolon",), "neither 'equal_rewards' nor a function"),
    ):
        with pytest.raises(ConfigError, match=message):
            load_config(TrainConfig, None, ["algo.name=grpo", "algo.dynamic_sampling.enabled=true", *extra])


# ------------------------------------------------------------------------------------------- the schedule


@pytest.mark.parametrize(
    "text",
    [
        "colocate",
        "separate:1",
        "colocate; stream_fusion=on",
        "actor_gen=0:dp1; ref_inf=1:dp1; reward_inf=1:dp1; actor_train=0-1:dp2",
    ],
)
def test_the_schedule_splits_at_the_rewards(text):
    plan = plan_from_config(RuntimeConfig(), GRPO, ClusterSpec(nodes=1, devices_per_node=2), text)
    steps = build_schedule(GRPO, plan).steps
    head, again, tail = split_for_sampling(steps, "reward_inf")
    assert {s.id for s in head} | {s.id for s in tail} == {s.id for s in steps}
    assert "actor_train" in {s.id for s in tail}
    calls = {c.id for s in head for c in (s.members or (s,))}
    assert {"actor_gen", "reward_inf"} <= calls
    assert all(s.kind in (StepKind.CALL, StepKind.STREAM_FUSION) for s in again)
    assert [s.id for s in again] == [s.id for s in head if s.kind in (StepKind.CALL, StepKind.STREAM_FUSION)]
    for part in (again, tail):  # each list is runnable on its own
        ids = {s.id for s in part}
        assert all(d in ids for s in part for d in s.deps)
    if text.startswith("actor_gen=0"):  # the copy into generation's layout runs once, its free after the waves
        assert [s.id for s in head][0].startswith("copy actor") and any(s.kind is StepKind.FREE for s in tail)


def test_rewards_made_after_a_release_are_refused():
    steps = (
        Step("gen", StepKind.CALL, (0,)),
        Step("free x", StepKind.FREE, (0,), ("gen",)),
        Step("reward_inf", StepKind.CALL, (0,), ("free x",)),
    )
    with pytest.raises(ValueError, match="after 'free x', which releases a model"):
        split_for_sampling(steps, "reward_inf")


# ------------------------------------------------------------------------------------------------- runs


@pytest.fixture
def spread_filter(tmp_path):
    """Drops most groups of a random policy (whose rewards rarely tie), so the runs need several waves."""
    (tmp_path / "spread.py").write_text("def keep(rewards):\n    return max(rewards) - min(rewards) > 0.25\n")
    return f"algo.dynamic_sampling.filter={tmp_path / 'spread.py'}:keep"


SAMPLED = ("algo.name=grpo", "algo.group_size=4", "rollout.prompts_per_iter=4", "algo.dynamic_sampling.enabled=true")


def test_a_dynamic_sampling_run_logs_its_waves_and_trains_on_the_kept_groups(tmp_path, monkeypatch, spread_filter):
    trainer = RLTrainer(tiny_cfg(tmp_path, *SAMPLED, spread_filter, "loop.iterations=2"))
    batches = []
    run_iteration = trainer.executor.run_iteration

    def spy(iteration, batch, waves=None):
        result = run_iteration(iteration, batch, waves)
        batches.append(result.batch)
        return result

    monkeypatch.setattr(trainer.executor, "run_iteration", spy)
    trainer.run()
    records = read_records(tmp_path)
    assert all(r["sampling/waves"] > 1 for r in records), "the filter should need more than one wave"
    for record, batch in zip(records, batches):
        assert len(batch) == 16  # 4 groups of 4, whatever was generated
        scores = batch["score"].view(4, 4)
        kept = int(record["sampling/kept_fraction"] * record["sampling/prompts"] + 0.5)
        spread = (scores.max(dim=1).values - scores.min(dim=1).values > 0.25).tolist()
        assert spread == [True] * min(kept, 4) + [False] * (4 - min(kept, 4))  # kept groups first
        assert record["sampling/prompts"] >= 4 and "reward/mean" in record
    state = json.loads((latest_checkpoint(tmp_path) / "state.json").read_text())
    assert state["sampler"]["cursor"] == sum(r["sampling/prompts"] for r in records) == state["data_position"]


def test_a_resumed_dynamic_sampling_run_is_the_uninterrupted_run(tmp_path, monkeypatch, spread_filter):
    common = (*SAMPLED, spread_filter, "loop.save_every=2", "loop.iterations=4")
    RLTrainer(tiny_cfg(tmp_path / "a", *common)).run()
    crashed = RLTrainer(tiny_cfg(tmp_path / "b", *common))
    _crash_on_save(crashed, monkeypatch, crash_at=3)  # the checkpoint after iteration 1 is the last one written
    with pytest.raises(RuntimeError, match="simulated crash"):
        crashed.run()
    RLTrainer(tiny_cfg(tmp_path / "b", *common)).run(resume=True)
    a, b = read_records(tmp_path / "a"), read_records(tmp_path / "b")
    assert [r["iteration"] for r in b] == [0, 1, 2, 3]
    assert [comparable(r) for r in b] == [comparable(r) for r in a]
    assert len({r["sampling/prompts"] for r in a}) > 1 or len({r["sampling/waves"] for r in a}) > 1


def test_a_checkpoint_without_sampler_state_is_refused_in_one_line(tmp_path):
    RLTrainer(tiny_cfg(tmp_path, "algo.name=grpo", "loop.iterations=1")).run()
    with pytest.raises(ConfigError, match="written without dynamic sampling"):
        RLTrainer(tiny_cfg(tmp_path, *SAMPLED, "loop.iterations=2")).run(resume=True)


@pytest.mark.usefixtures("ray_session")
@pytest.mark.parametrize(
    "plan",
    ["actor_gen=0:dp1; ref_inf=1:dp1; reward_inf=1:dp1; actor_train=0-1:dp2", "colocate; stream_fusion=on"],
    ids=["copy", "fused"],
)
def test_the_ray_runtime_samples_as_the_reference_does(tmp_path, spread_filter, plan):
    from test_runtime import _assert_equivalent, _cfg

    def run(name, *extra):
        RLTrainer(_cfg(tmp_path, name, *SAMPLED, spread_filter, *extra)).run()
        return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]

    expected = run("ref")
    assert any(r["sampling/waves"] > 1 for r in expected)
    got = run("ray", "runtime.executor=ray", "runtime.devices=2", f"runtime.plan={plan}")
    _assert_equivalent(got, expected)
    for a, b in zip(got, expected):
        assert {k: v for k, v in a.items() if k.startswith("sampling/")} == {
            k: v for k, v in b.items() if k.startswith("sampling/")
        }


# ---------------------------------------------------------------------------------------------- the planner


def test_the_planner_prices_the_waves_generation_and_rewards(tmp_path, capsys):
    """Dynamic sampling's waves generate and score more samples than train: generation and the reward call
    cost that many times over, nothing else does; `loomrl plan --generated-per-kept` says how many."""
    from loomrl.cli import main
    from loomrl.config.tools import from_dict
    from loomrl.planner.describe import RunDescription, inputs_from_description

    run = {
        "algo": "grpo",
        "cluster": "h100:1x8",
        "models": {"actor": "llama3.1-8b", "reward": "llama3.1-8b"},
        "prompts": 32,
        "responses_per_prompt": 8,
        "prompt_len": 100,
        "response_len": 500,
        "response_max": 2000,
    }
    prices = []
    for scale in (1.0, 2.5):
        inputs = inputs_from_description(from_dict(RunDescription, {**run, "generated_per_kept": scale}, "run"))
        workflow, cluster, workload = inputs.workflow, inputs.cluster, inputs.workload
        assert workload.rollout_scale == scale
        cost = inputs.cost_model()
        plan = make_plan("colocate", workflow, cluster)
        prices.append({m.name: cost.mfc_time(m, plan[m.name]) for m in workflow.topological_order()})
    one, more = prices
    assert {name for name in one if more[name] != pytest.approx(one[name])} == {"actor_gen", "reward_inf"}
    assert more["actor_gen"] == pytest.approx(2.5 * one["actor_gen"])
    with pytest.raises(ConfigError, match="generated_per_kept"):
        from_dict(RunDescription, {**run, "generated_per_kept": 0.5}, "run")

    times = []
    for scale in ("1", "3"):
        assert (
            main(
                [
                    "plan",
                    "--cluster",
                    "h100:1x8",
                    "--model",
                    "llama2-7b",
                    "--prompts",
                    "64",
                    "--response-len",
                    "256",
                    "--plan",
                    "colocate",
                    "--generated-per-kept",
                    scale,
                    "--out",
                    str(tmp_path / scale),
                ]
            )
            == 0
        )
        times.append(capsys.readouterr().out)
    assert times[0] != times[1]
