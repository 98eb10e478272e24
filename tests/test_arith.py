"""The arithmetic task for chat models and the final-number reward, on hand-written responses; GSM8K-style files in
verl's layout scored by it."""

from __future__ import annotations

import random

import pytest

from loomrl.config.schema import TaskConfig
from loomrl.data import FilePrompts, FunctionTask
from loomrl.data.arith import Arithmetic, final_number, reference_answer
from loomrl.data.sources import build_task, held_out
from loomrl.errors import DataError

Q = "What is 57 + 5? Reply with the number only."


@pytest.mark.parametrize(
    ("response", "reward"),
    [
        ("62", 1.0),
        ("62.", 1.0),
        ("57 + 5 = 62", 1.0),
        ("The answer is 62.0", 1.0),
        ("57 + 5 = 11.", 0.0),  # the last number counts, not the first right one
        ("62, or maybe 63", 0.0),
        ("sixty-two", 0.0),
        ("", 0.0),
    ],
)
def test_the_reward_reads_the_last_number(response, reward):
    assert Arithmetic().score(Q, response, None) == reward
    assert Arithmetic().score(Q, response, "62") == reward


def test_numbers_as_people_write_them():
    assert final_number("1,024 apples") == 1024
    assert final_number("it is -3 now") == -3
    assert final_number("57-5=52") == 52
    assert final_number("no digits") is None
    assert reference_answer("3 boxes of 4 is 12, plus 60 is 72.\n#### 72") == 72
    assert reference_answer("1,500") == 1500


@pytest.mark.parametrize("level", [1, 2, 3, 4])
def test_every_level_samples_answerable_questions(level):
    task, rng = Arithmetic(level=level), random.Random(level)
    for _ in range(200):
        example = task.sample(rng)
        assert example.prompt.endswith("Reply with the number only.")
        assert int(example.answer) >= 0
        assert task.score(example.prompt, f"So it is {example.answer}.", example.answer) == 1.0
        assert task.score(example.prompt, str(int(example.answer) + 1), example.answer) == 0.0
        if level < 4:  # the expression levels can be solved from the prompt alone
            assert task.solve(example.prompt) == example.answer


def test_levels_differ_in_difficulty():
    def largest(level):
        rng = random.Random(0)
        return max(int(Arithmetic(level=level).sample(rng).answer) for _ in range(300))

    assert largest(1) <= 108 < largest(2) <= 198 < largest(3)
    assert "How many" in Arithmetic(level=4).sample(random.Random(0)).prompt


def test_the_config_builds_it_and_refuses_a_bad_level():
    task = build_task(TaskConfig(name="arith", level=2))
    assert isinstance(task, Arithmetic) and task.level == 2
    examples = held_out(TaskConfig(name="arith"), task, seed=0, n=5)
    assert len({e.prompt for e in examples}) == 5
    with pytest.raises(DataError, match="level=5"):
        Arithmetic(level=5)


def test_gsm8k_rows_in_verls_layout_are_scored_by_the_final_number(tmp_path):
    from datasets import Dataset

    rows = [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": "Ann has 3 boxes of 4 pens and buys 60 more. How many pens?"}],
            "reward_model": {"style": "rule", "ground_truth": "72"},
        },
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": "What is 1000 + 500?"}],
            "reward_model": {"style": "rule", "ground_truth": "1500"},
        },
    ]
    Dataset.from_list(rows).to_parquet(str(tmp_path / "train.parquet"))
    source = FilePrompts(tmp_path / "train.parquet")
    task = FunctionTask("loomrl.data.arith:compute_score")
    examples = [source[0], source[1]]
    scores = task.score_batch(
        [e.prompt for e in examples],
        ["12 + 60 = 72", "It is 1,500."],
        [e.answer for e in examples],
        [e.row for e in examples],
    )
    assert scores.total == [1.0, 1.0]
    wrong = task.score_batch([examples[0].prompt], ["#### 71"], [None], [examples[0].row])
    assert wrong.total == [0.0]


def test_gsm8k_answers_with_their_reasoning_are_read_after_the_marks(tmp_path):
    (tmp_path / "gsm8k.jsonl").write_text(
        '{"question": "How many?", "answer": "3 * 4 = 12 and 12 + 60 = 72\\n#### 72"}\n'
    )
    example = FilePrompts(tmp_path / "gsm8k.jsonl", prompt_key="question")[0]
    task = FunctionTask("loomrl.data.arith:final_number_reward")
    assert task.score(example.prompt, "The total is 72.", example.answer) == 1.0
    assert task.score(example.prompt, "The total is 12.", example.answer) == 0.0
