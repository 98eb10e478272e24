"""`loomrl eval`: the unbiased pass@k estimator against hand-computed values, sampled evaluation's wiring, what the
command accepts as CHECKPOINT_OR_RUN, and a subprocess smoke test."""

from __future__ import annotations

import json
import random

import pytest
import torch

from loomrl.algorithms.evaluate import evaluate_pass_at_k, evaluate_policy, pass_at_k
from loomrl.config.schema import EvalConfig, TaskConfig
from loomrl.config.tools import load_config
from loomrl.data.sources import held_out
from loomrl.data.tasks import Example, Task
from loomrl.errors import ConfigError, DataError
from loomrl.models.tokenizer import build_char_tokenizer
from loomrl.models.zoo import build_causal_lm
from loomrl.rollout import SamplingParams
from loomrl.train.evaluation import eval_config, resolve_target
from test_cli import assert_ok, run_cli


def test_pass_at_k_by_hand():
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)  # c / n
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    assert pass_at_k(5, 2, 3) == pytest.approx(1 - 1 / 10)  # 1 - C(3,3)/C(5,3)
    assert pass_at_k(5, 2, 4) == 1.0  # only three wrong: any four samples hold a right one
    assert pass_at_k(8, 0, 8) == 0.0 and pass_at_k(8, 8, 1) == 1.0
    assert pass_at_k(10, 1, 5) == pytest.approx(0.5)  # 1 - C(9,5)/C(10,5) = 1 - 126/252
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


class EvenLength(Task):
    """Right when the response has an even number of characters; remembers every response it judged."""

    name = "even"

    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []

    def sample(self, rng: random.Random) -> Example:
        raise NotImplementedError

    def solve(self, prompt: str) -> str:
        raise NotImplementedError

    def score(self, prompt: str, response: str, answer: str | None) -> float:
        return float(len(response) % 2 == 0)

    def exact(self, prompt: str, response: str, answer: str | None) -> bool:
        self.seen.append((prompt, response))
        return super().exact(prompt, response, answer)


@pytest.fixture(scope="module")
def policy():
    torch.manual_seed(0)
    tok = build_char_tokenizer()
    return build_causal_lm("llama-1m", tok, seed=3), tok


def test_sampled_pass_at_k_counts_each_prompts_own_samples(policy):
    model, tok = policy
    examples = [Example(f"sort {d}=", None) for d in ("31", "542", "7", "90", "1234")]
    params = SamplingParams(max_new_tokens=5, temperature=1.0)
    task = EvenLength()
    result = evaluate_pass_at_k(model, tok, task, examples, params, samples=6, ks=(1, 6), seed=5, batch_size=7)
    judged = task.seen
    assert len(judged) == 30 and [p for p, _ in judged] == [ex.prompt for ex in examples for _ in range(6)]
    right = [len(r) % 2 == 0 for _, r in judged]
    assert result["pass@1"] == pytest.approx(sum(right) / 30)  # pass@1 is the mean over samples
    anyone = [any(right[i * 6 : (i + 1) * 6]) for i in range(5)]
    assert result["pass@6"] == pytest.approx(sum(anyone) / 5)  # pass@n: the prompts with at least one right
    assert 0 < sum(right) < 30  # the random policy is neither always right nor always wrong here
    again = evaluate_pass_at_k(model, tok, EvenLength(), examples, params, samples=6, ks=(1, 6), seed=5, batch_size=128)
    assert again == result  # each sample owns its random stream: batching changes nothing


def test_greedy_evaluation_is_batch_independent(policy):
    model, tok = policy
    task_cfg = TaskConfig()
    from loomrl.data.sources import build_task

    task = build_task(task_cfg)
    examples = held_out(task_cfg, task, 0, 12)
    assert evaluate_policy(model, tok, task, examples, 6, batch_size=5) == evaluate_policy(
        model, tok, task, examples, 6
    )


def test_checkpoint_or_run_resolution(tmp_path):
    run = tmp_path / "run"
    actor = run / "checkpoints" / "iter_000003" / "actor"
    actor.mkdir(parents=True)
    (actor / "config.json").write_text("{}")
    (actor.parent / "state.json").write_text("{}")
    (run / "config.yaml").write_text("task:\n  name: add\n  max_digits: 2\nrollout:\n  max_new_tokens: 5\n")
    for given in (run, actor.parent, actor):
        target = resolve_target(given)
        assert target.model == actor and target.run == run
    cfg = eval_config(resolve_target(run), ["samples=2", "pass_k=[1,2]"])
    assert (cfg.task.name, cfg.task.max_digits, cfg.max_new_tokens, cfg.samples) == ("add", 2, 5, 2)
    alone = resolve_target(actor)  # a model directory outside a run: its own settings
    assert eval_config(resolve_target(actor), ["task.name=reverse"]).task.name == "reverse" and alone.out_dir == actor
    with pytest.raises(DataError, match="neither a run directory"):
        resolve_target(tmp_path / "nothing")
    (tmp_path / "empty_run").mkdir()
    (tmp_path / "empty_run" / "config.yaml").write_text("seed: 1\n")
    with pytest.raises(DataError, match="no complete checkpoint"):
        resolve_target(tmp_path / "empty_run")


def test_pass_k_beyond_samples_is_a_config_error():
    with pytest.raises(ConfigError, match="pass_k: k=8 needs 1 <= k <= samples"):
        load_config(EvalConfig, None, ["model=x", "samples=4"])
    assert load_config(EvalConfig, None, ["model=x", "samples=0"]).samples == 0  # greedy only: pass_k unused


def test_all_prompts_needs_a_file(tmp_path):
    from loomrl.train.evaluation import run_eval

    with pytest.raises(ConfigError, match="prompts: 0 means every prompt of a file"):
        run_eval(load_config(EvalConfig, None, ["model=llama-1m", "prompts=0"]), tmp_path)


def test_eval_command_writes_json_and_prints_a_table(tmp_path):
    model_dir = tmp_path / "policy"
    tok = build_char_tokenizer()
    build_causal_lm("llama-1m", tok, seed=0).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    proc = run_cli(
        "eval",
        model_dir,
        "prompts=6",
        "samples=3",
        "pass_k=[1,3]",
        "max_new_tokens=4",
        f"out={tmp_path / 'results.json'}",
        timeout=120,
    )
    assert_ok(proc)
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["prompts"] == 6 and results["samples"] == 3
    assert {"greedy/exact_match", "greedy/score", "pass@1", "pass@3", "sampled_score"} <= results.keys()
    assert 0 <= results["pass@1"] <= results["pass@3"] <= 1
    assert "pass@3" in proc.stdout and "greedy/exact_match" in proc.stdout and "results.json" in proc.stdout
