"""Generative reward models (judges): their training task, verdict readers, their calls in the workflow, runs on
both executors, and the planner placing them."""

import json
import random

import pytest

from loomrl.algorithms.workflows import build_workflow
from loomrl.config.schema import AlgoConfig, RolloutConfig, TaskConfig, TrainConfig
from loomrl.config.tools import load_config
from loomrl.data.judges import DEFAULT_TEMPLATE, JudgeTask, judge_prompt, verdict_reader, wrong_answer
from loomrl.data.sources import build_task, prompt_source
from loomrl.errors import ConfigError, DataError, LoomError
from loomrl.models.tokenizer import TASK_ALPHABET
from loomrl.train.rl import RLTrainer
from loomrl.workflow import MFCKind
from test_rl import read_records, tiny_cfg

TWO_JUDGES = "reward.judges=[{model: llama-1m}, {model: llama-1m, weight: 0.5, verdict: 'regex:([0-9])'}]"


def test_the_judge_task_is_half_right_answers_in_the_task_alphabet():
    task = build_task(TaskConfig(name="judge", judged="sort"))
    assert isinstance(task, JudgeTask)
    examples = [prompt_source(TaskConfig(name="judge"), task, 0, "train")[i] for i in range(400)]
    verdicts = [ex.answer for ex in examples]
    assert set(verdicts) == {"yes", "no"} and 0.4 < verdicts.count("yes") / len(verdicts) < 0.6
    for ex in examples:
        assert set(ex.prompt) <= set(TASK_ALPHABET)  # the char tokenizer encodes every judge prompt
        head, _, tail = ex.prompt[len("judge ") :].partition("=")
        response, _, answer = tail.rstrip(":").partition("|")
        assert (response == answer) == (ex.answer == "yes") and answer == "".join(sorted(head[len("sort ") :]))
    assert task.score(examples[0].prompt, examples[0].answer, examples[0].answer) == 1.0
    rng = random.Random(0)
    assert all(wrong_answer("123", "0123456789", rng) != "123" for _ in range(200))


def test_verdict_readers(tmp_path):
    yes_no = verdict_reader("yes-no")
    assert (yes_no(" yes"), yes_no("no!"), yes_no("maybe")) == (1.0, 0.0, None)
    regex = verdict_reader(r"regex:score=([0-9.]+)")
    assert (regex("score=0.75 ok"), regex("none"), regex("score=.")) == (0.75, None, None)
    (tmp_path / "read.py").write_text(
        "def grade(text):\n    return len(text) / 10\n"
        "def bad(text):\n    return 'high'\n"
        "def boom(text):\n    raise ValueError('no')\n"
    )
    assert verdict_reader(f"{tmp_path}/read.py:grade")("abcd") == pytest.approx(0.4)
    with pytest.raises(DataError, match=r"read.py:bad' returned 'high' for verdict 'x'; it must return"):
        verdict_reader(f"{tmp_path}/read.py:bad")("x")
    with pytest.raises(DataError, match=r"read.py:boom' raised ValueError: no \(verdict 'x'\)"):
        verdict_reader(f"{tmp_path}/read.py:boom")("x")
    assert judge_prompt(DEFAULT_TEMPLATE, "sort 31=", "13", "13") == "judge sort 31=13|13:"


def test_judges_are_checked_before_anything_runs():
    for extra, message in (
        (("reward.source=judge",), "needs at least one judge"),
        (("reward.judges=[{model: x}]",), "judges are given but reward.source is 'rule'"),
        (
            ("reward.source=judge", "reward.judges=[{model: x, template: '{score}'}]"),
            r"template: '\{score\}': placeholder \{score\} is not one of",
        ),
        (("reward.source=judge", "reward.judges=[{model: x, verdict: maybe}]"), "verdict: 'maybe' is none of 'yes-no'"),
        (
            ("reward.source=judge", "reward.judges=[{model: x}]", "runtime.layouts={judge1: {tp: 1}}"),
            "no such judge: reward.judges has 1 .valid: judge0.",
        ),
        (("reward.source=judge", "reward.judges=[{weight: 2}]"), "model: is empty"),
    ):
        with pytest.raises(LoomError, match=message):
            load_config(TrainConfig, None, ["algo.name=grpo", *extra])


def test_each_judge_is_a_generate_call_of_its_own_role():
    cfg = load_config(TrainConfig, None, ["algo.name=grpo", "reward.source=judge", TWO_JUDGES])
    workflow = build_workflow(cfg.algo, cfg.rollout, cfg.reward)
    assert workflow.roles() == ["actor", "ref", "judge0", "judge1"]
    for i in (0, 1):
        call = workflow[f"judge{i}_gen"]
        assert call.kind is MFCKind.GENERATE and call.role == f"judge{i}" and call.per_wave
        assert call.reads_response and call.max_new_tokens == 4 and "response_ids" in call.inputs
    reward = workflow["reward_inf"]
    assert reward.kind is MFCKind.COMPUTE and {"verdict0_ids", "verdict1_ids"} <= set(reward.inputs)
    assert workflow.ancestors("reward_inf") >= {"actor_gen", "judge0_gen", "judge1_gen"}
    with pytest.raises(ConfigError, match="remax's greedy baseline"):
        build_workflow(AlgoConfig(name="remax"), RolloutConfig(), cfg.reward)


def test_the_reward_is_the_judges_weighted_verdicts(tmp_path):
    (tmp_path / "read.py").write_text("def constant(text):\n    return 1.0\n")
    reader = f"{tmp_path}/read.py:constant"
    cfg = tiny_cfg(
        tmp_path / "run",
        "algo.name=grpo",
        "reward.source=judge",
        f"reward.judges=[{{model: llama-1m, weight: 0.5, verdict: '{reader}'}}, "
        f"{{model: llama-1m, weight: 2.0, verdict: '{reader}'}}]",
    )
    RLTrainer(cfg).run()
    records = read_records(tmp_path / "run")
    assert all(r["reward/mean"] == pytest.approx(2.5) for r in records)
    assert all(r["judge0/unreadable"] == 0.0 for r in records)
    assert "reward/exact_match" in records[-1]  # measured by the task's own rule, whatever the judges say


@pytest.mark.usefixtures("ray_session")
def test_a_judge_run_on_the_ray_runtime_is_the_reference_run(tmp_path):
    """Two judges of their own roles: one alone on device 1, the other over both devices."""
    from test_runtime import _assert_equivalent, _cfg

    common = ("algo.name=grpo", "algo.group_size=4", "rollout.prompts_per_iter=4", "reward.source=judge", TWO_JUDGES)

    def run(name, *extra):
        RLTrainer(_cfg(tmp_path, name, *common, *extra)).run()
        return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]

    expected = run("ref")
    assert 0 < expected[-1]["judge1/unreadable"] < 1  # a random judge writes digits now and then
    plan = (
        "actor_gen=0:dp1; ref_inf=0-1:dp2; judge0_gen=1:dp1; judge1_gen=0-1:dp2; reward_inf=0:dp1; actor_train=0-1:dp2"
    )
    got = run("ray", "runtime.executor=ray", "runtime.devices=2", f"runtime.plan={plan}")
    _assert_equivalent(got, expected)
    for a, b in zip(got, expected):
        assert (a["judge0/unreadable"], a["judge1/unreadable"]) == (b["judge0/unreadable"], b["judge1/unreadable"])


def test_the_planner_places_a_judge_of_another_size(tmp_path, capsys):
    """G-Core's setup: a policy and its reference of one size, a generative reward model of another."""
    from loomrl.cli import main

    assert (
        main(
            [
                "plan",
                "algo.name=grpo",
                "--cluster",
                "h100:1x8",
                "--model",
                "llama3.1-8b",
                "--judge-model",
                "qwen3-32b",
                "--prompts",
                "64",
                "--responses-per-prompt",
                "4",
                "--response-len",
                "512",
                "--search-steps",
                "20",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "judge0_gen" in out
    plan = json.loads((tmp_path / "best_plan.json").read_text())
    assert "judge0_gen" in plan["allocations"] and "reward_inf" in plan["allocations"]
