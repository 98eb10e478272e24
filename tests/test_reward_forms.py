"""Reward functions in the three forms users write them (loomrl's per sample, TRL's batched with the prompt file's
columns, verl's ``compute_score``): told apart by their signatures, weighted into one reward, reported one by one
in the metrics, and stopped with one line when they return something that is not a finite number, raise or hang."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
import torch

from loomrl.config.schema import TaskConfig, TrainConfig
from loomrl.config.tools import load_config
from loomrl.data.prompts import FilePrompts, FunctionTask
from loomrl.data.reward_forms import reward_form
from loomrl.data.sources import build_task
from loomrl.errors import ConfigError, DataError
from loomrl.train.rl import RLTrainer
from test_reward_code import _one_line

REWARDS = """
import math, time

def length_penalty(prompt, response, answer):
    return -0.1 * len(response)

def digits(prompts, completions, level, **kwargs):
    for prompt, tag in zip(prompts, level):
        if tag != "level of " + prompt:  # the columns must be aligned with the batch
            raise ValueError(f"column level not aligned: {tag!r} for {prompt!r}")
    if "answer" not in kwargs:
        raise ValueError("no answer column")
    return [float(c.strip().isdigit()) for c in completions]

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    right = float(solution_str.strip() == str(ground_truth))
    return {"score": right, "acc": right, "from_arith": float(data_source == "arith"),
            "has_index": float("index" in extra_info), "pred": solution_str}

def echo_verl(data_source, solution_str, ground_truth, extra_info):
    return {"score": 0.0, "source": float(data_source == "mine"), "truth": float(ground_truth)}

def returns_nan(prompt, response, answer):
    return float("nan")

def returns_inf(prompts, completions, **kwargs):
    return [1.0] + [-math.inf] * (len(completions) - 1)

def returns_text(data_source, solution_str, ground_truth, extra_info):
    return "high"

def returns_short(prompts, completions, **kwargs):
    return [1.0] * (len(completions) - 1)

def returns_no_score(data_source, solution_str, ground_truth):
    return {"acc": 1.0}

def raises(prompts, completions, **kwargs):
    raise RuntimeError("judge service\\nunavailable")

def hangs(prompts, completions, **kwargs):
    time.sleep(60)
    return [0.0] * len(completions)

def two_args(prompt, response):
    return 1.0

def needs_column(prompts, completions, difficulty):
    return [0.0] * len(completions)

def negative(completions):
    return [-3.5 for _ in completions]
"""


@pytest.fixture
def rewards(tmp_path) -> str:
    path = tmp_path / "rewards.py"
    path.write_text(REWARDS)
    return str(path)


# --- forms ------------------------------------------------------------------------------------------------


def test_the_form_is_read_from_the_signature(rewards):
    kinds = {
        name: FunctionTask(f"{rewards}:{name}").functions[0].form.kind
        for name in ("length_penalty", "digits", "compute_score", "negative", "returns_no_score")
    }
    assert kinds == {
        "length_penalty": "loomrl",
        "digits": "trl",
        "compute_score": "verl",
        "negative": "trl",
        "returns_no_score": "verl",
    }
    assert reward_form(lambda p, r, a: 0.0, "lambda").kind == "loomrl"
    assert reward_form(lambda prompts, completions, **kw: [], "lambda").kind == "trl"


@pytest.mark.parametrize("make", [lambda rewards: f"{rewards}:two_args", lambda rewards: lambda x, *, y: 0.0])
def test_a_function_of_no_form_is_one_line_naming_it_and_the_three_forms(rewards, make):
    fn = make(rewards)
    with pytest.raises(DataError) as info:
        FunctionTask(fn)
    message = _one_line(info)
    assert ("two_args(prompt, response)" in message) if isinstance(fn, str) else ("(x, *, y)" in message)
    assert "fits none of the accepted forms" in message
    for signature in (
        "score(prompt, response, answer) -> float",
        "f(prompts, completions, **columns) -> list[float]",
        "compute_score(data_source, solution_str, ground_truth, extra_info) -> float | dict",
    ):
        assert signature in message
    with pytest.raises(DataError, match="fits none"):  # from the config too, before any call
        build_task(TaskConfig(name="file", prompt_file="unused.jsonl", reward_fn=f"{rewards}:two_args"))


# --- scoring a batch --------------------------------------------------------------------------------------


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.mark.parametrize("timeout_s", [0.0, 10.0])
def test_trl_functions_get_the_prompt_files_columns_by_name_aligned_with_the_batch(rewards, tmp_path, timeout_s):
    rows = [
        {"prompt": f"add {i}+1=", "answer": i + 1, "level": f"level of add {i}+1=", "data_source": "arith"}
        for i in range(3)
    ]
    examples = FilePrompts(_write_jsonl(tmp_path / "p.jsonl", rows)).examples
    assert examples[0].row == {"answer": 1, "level": "level of add 0+1=", "data_source": "arith"}  # as read
    task = FunctionTask(f"{rewards}:digits", timeout_s=timeout_s)
    picked = [examples[2], examples[0], examples[2]]  # any order, repeats (a group)
    scores = task.score_batch(
        [e.prompt for e in picked], ["3", "x", " 7 "], [e.answer for e in picked], [e.row for e in picked]
    )
    assert scores.total == [1.0, 0.0, 1.0] and scores.parts == [{"digits": 1.0}, {"digits": 0.0}, {"digits": 1.0}]
    with pytest.raises(DataError) as info:  # rows out of step with the prompts: the function says so
        task.score_batch(["add 0+1="], ["1"], ["1"], [examples[1].row])
    assert "column level not aligned" in _one_line(info)
    needs = FunctionTask(f"{rewards}:needs_column", timeout_s=timeout_s)
    with pytest.raises(DataError) as info:
        needs.score_batch(["p"], ["r"], ["a"], [examples[0].row])
    assert _one_line(info) == (
        f"reward function '{rewards}:needs_column': its argument 'difficulty' is not a column "
        "of the prompt file (columns: answer, level, data_source)"
    )
    task.close()


def test_verl_functions_get_data_source_ground_truth_and_extra_info(rewards):
    task = FunctionTask(f"{rewards}:echo_verl", name="mine")
    rows = [
        {"reward_model": {"ground_truth": "7", "style": "rule"}, "extra_info": {"index": 0}},
        {"ground_truth": "8", "data_source": "theirs"},
        {"ground_truth": "9"},
    ]
    scores = task.score_batch(["p", "q", "r"], ["x", "y", "z"], [None, None, "5"], rows)
    assert scores.total == [0.0, 0.0, 0.0]
    assert [p["echo_verl/truth"] for p in scores.parts] == [7.0, 8.0, 5.0]  # answer first, then verl's columns
    assert [p["echo_verl/source"] for p in scores.parts] == [1.0, 0.0, 1.0]  # the row's data_source, else the task's
    verl = FunctionTask(f"{rewards}:compute_score").score_batch(["p"], [" 4"], ["4"], [{"extra_info": {"index": 3}}])
    assert verl.total == [1.0] and verl.parts == [
        {
            "compute_score": 1.0,
            "compute_score/acc": 1.0,
            "compute_score/from_arith": 0.0,
            "compute_score/has_index": 1.0,
        }
    ]


def test_the_reward_is_the_weighted_sum_of_the_functions_any_sign(rewards):
    task = FunctionTask(
        [f"{rewards}:length_penalty", f"{rewards}:negative", f"{rewards}:length_penalty"], weights=[2.0, -0.5, 1.0]
    )
    scores = task.score_batch(["p", "q"], ["abc", ""], [None, None], [{}, {}])
    assert scores.total == pytest.approx([2 * -0.3 + 1.75 - 0.3, 1.75])
    assert scores.parts[0] == pytest.approx({"length_penalty_0": -0.3, "negative": -3.5, "length_penalty_2": -0.3})
    assert task.score("p", "abc", None) == pytest.approx(scores.total[0])
    with pytest.raises(DataError, match="one weight per function"):
        FunctionTask([f"{rewards}:negative"], weights=[1.0, 2.0])


def test_reward_weights_are_checked_in_the_config(rewards):
    base = ["task.name=file", "task.prompt_file=p.jsonl"]
    fns = f'task.reward_fns=["{rewards}:negative", "{rewards}:digits"]'
    cfg = load_config(TrainConfig, None, [*base, fns])
    assert cfg.task.reward_functions == (f"{rewards}:negative", f"{rewards}:digits") and cfg.task.reward_weights == ()
    with pytest.raises(ConfigError) as info:
        load_config(TrainConfig, None, [*base, fns, "task.reward_weights=[1.0]"])
    assert "task.reward_weights" in _one_line(info) and "1 weights for 2 functions" in str(info.value)
    with pytest.raises(ConfigError) as info:
        load_config(TrainConfig, None, [*base, fns, f"task.reward_fn={rewards}:negative"])
    assert "task.reward_fns" in _one_line(info) and "not both" in str(info.value)


# --- what a function may not do ---------------------------------------------------------------------------

BAD = [
    ("returns_nan", "returned nan (must be a finite number) (sample: prompt 'p0', response 'r0')"),
    ("returns_inf", "returned -inf (must be a finite number) (sample: prompt 'p1', response 'r1')"),
    ("returns_text", "returned 'high' (must be a finite number) (sample: prompt 'p0', response 'r0')"),
    (
        "returns_short",
        "returned a list of 1 for a batch of 2 samples (must be a list of 2 finite numbers, one per "
        "completion) (batch of 2 samples, the first: prompt 'p0', response 'r0')",
    ),
    ("returns_no_score", "returned a dict without a 'score' key (keys: acc) (sample: prompt 'p0', response 'r0')"),
    (
        "raises",
        "raised RuntimeError: judge service unavailable (batch of 2 samples, the first: prompt 'p0', response 'r0')",
    ),
]


@pytest.mark.parametrize("timeout_s", [0.0, 10.0])
@pytest.mark.parametrize("name, expected", BAD, ids=[b[0] for b in BAD])
def test_a_bad_value_or_an_exception_is_one_line_naming_function_and_sample(rewards, name, expected, timeout_s):
    task = FunctionTask(f"{rewards}:{name}", timeout_s=timeout_s)
    with pytest.raises(DataError) as info:
        task.score_batch(["p0", "p1"], ["r0", "r1"], ["a", "a"], [{}, {}])
    assert _one_line(info) == f"reward function '{rewards}:{name}': {expected}"
    task.close()


def test_a_batched_call_past_the_limit_is_killed_with_one_line(rewards):
    task = FunctionTask(f"{rewards}:hangs", timeout_s=1)
    start = time.monotonic()
    with pytest.raises(DataError) as info:
        task.score_batch(["p0", "p1"], ["r0", "r1"], [None, None], [{}, {}])
    assert time.monotonic() - start < 30
    assert _one_line(info) == (
        f"reward function '{rewards}:hangs': took longer than task.reward_timeout_s=1 s "
        "(batch of 2 samples, the first: prompt 'p0', response 'r0')"
    )
    assert task.process._proc is None, "the stuck process was kept"
    task.close()


# --- end to end -------------------------------------------------------------------------------------------


def test_a_run_scores_with_all_three_forms_and_reports_each_function(rewards, tmp_path):
    rows = [
        {
            "prompt": f"add {i}+1=",
            "answer": str(i + 1),
            "level": f"level of add {i}+1=",
            "data_source": "arith" if i % 2 else None,
            "extra_info": {"index": i},
        }
        for i in range(6)
    ]
    prompts = _write_jsonl(tmp_path / "prompts.jsonl", rows)
    fns = f'task.reward_fns=["{rewards}:digits", "{rewards}:compute_score", "{rewards}:length_penalty"]'
    cfg = load_config(
        TrainConfig,
        None,
        [
            "task.name=file",
            f"task.prompt_file={prompts}",
            fns,
            "task.reward_weights=[2.0, 1.0, -0.5]",
            "task.reward_timeout_s=20",
            "algo.name=grpo",
            "algo.group_size=2",
            "algo.minibatches=1",
            "rollout.prompts_per_iter=4",
            "rollout.max_new_tokens=4",
            "loop.iterations=1",
            "loop.eval_prompts=4",
            "loop.progress=false",
            "report.html=false",
            "runtime.threads=1",
            "runtime.executor=reference",
            f"run_dir={tmp_path / 'run'}",
        ],
    )
    threads = torch.get_num_threads()
    try:
        metrics = RLTrainer(cfg).run()
    finally:
        torch.set_num_threads(threads)
    parts = {k: metrics[k] for k in ("reward/digits", "reward/compute_score", "reward/length_penalty")}
    assert metrics["reward/mean"] == pytest.approx(
        2.0 * parts["reward/digits"] + parts["reward/compute_score"] - 0.5 * parts["reward/length_penalty"], abs=1e-5
    )
    assert parts["reward/length_penalty"] <= 0.0 and 0.0 <= parts["reward/digits"] <= 1.0
    assert metrics["reward/compute_score/has_index"] == 1.0
    assert metrics["reward/compute_score/from_arith"] == 0.5  # rows 0-3: two of them name their source
    assert "reward/compute_score/pred" not in metrics  # not a number
    assert all(math.isfinite(v) for v in metrics.values()) and "eval/score" in metrics
