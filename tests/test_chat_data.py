"""Real tokenizers and chat data: prompts with and without bos, chat templates, `messages` columns, held-out files,
and a checkpoint without a tokenizer (tests/chat_model.py builds the tiny Qwen2 chat checkpoint)."""

from __future__ import annotations

import json

import pytest

from chat_model import CHATML, build_chat_tokenizer, save_chat_model
from loomrl.config.schema import TaskConfig
from loomrl.data.prompts import FilePrompts
from loomrl.data.sources import build_task, held_out, prompt_source
from loomrl.errors import DataError
from loomrl.models.tokenizer import build_char_tokenizer, encode_prompt, task_tokenizer, tokenizer_for


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    return save_chat_model(tmp_path_factory.mktemp("qwen2-chat"))


def _one_line(exc: pytest.ExceptionInfo) -> str:
    assert "\n" not in str(exc.value)
    return str(exc.value)


def _write_jsonl(path, rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_a_prompt_starts_with_bos_only_when_the_tokenizer_has_one():
    char = build_char_tokenizer()
    assert encode_prompt(char, "ab") == [char.bos_token_id, *char.encode("ab", add_special_tokens=False)]
    bpe = build_chat_tokenizer()
    assert bpe.bos_token_id is None
    bpe.chat_template = None
    ids = encode_prompt(bpe, "sort 312=")
    assert None not in ids and ids == bpe.encode("sort 312=", add_special_tokens=False)


def test_the_chat_template_renders_a_prompt_as_one_user_turn_with_the_generation_prompt(chat_dir):
    tok = tokenizer_for(str(chat_dir))
    assert tok.bos_token_id is None and tok.chat_template == CHATML
    expected = tok.encode("<|im_start|>user\nsort 312=<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    ids = encode_prompt(tok, "sort 312=")
    assert ids == expected
    im_start, im_end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert ids[0] == im_start and ids.count(im_end) == 1 and im_end == tok.eos_token_id  # specials, not bytes
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "sort 21="}]
    assert tok.decode(encode_prompt(tok, conversation)) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nsort 21=<|im_end|>\n<|im_start|>assistant\n"
    )


def test_chat_template_none_and_a_template_file(chat_dir, tmp_path):
    plain = tokenizer_for(str(chat_dir), chat_template="none")
    assert encode_prompt(plain, "sort 312=") == plain.encode("sort 312=", add_special_tokens=False)
    template = tmp_path / "tiny.jinja"
    template.write_text(
        "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}|{% endfor %}"
        "{% if add_generation_prompt %}a:{% endif %}"
    )
    char = tokenizer_for("llama-1m", chat_template=str(template))  # a zoo model: the built-in tokenizer
    assert char.decode(encode_prompt(char, "sort 12=")) == "u:sort 12=|a:"
    with pytest.raises(DataError) as exc:
        tokenizer_for("llama-1m", chat_template=str(tmp_path / "missing.jinja"))
    assert "task.chat_template" in _one_line(exc) and "missing.jinja" in str(exc.value)
    with pytest.raises(DataError) as exc:
        encode_prompt(build_char_tokenizer(), [{"role": "user", "content": "x"}])
    assert "chat template" in _one_line(exc)


def test_a_checkpoint_without_a_tokenizer_is_an_error_unless_the_task_tokenizer_is_asked_for(chat_dir, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((chat_dir / "config.json").read_text())
    with pytest.raises(DataError) as exc:
        tokenizer_for(str(bare))
    msg = _one_line(exc)
    assert str(bare) in msg and "task.tokenizer=task" in msg
    assert len(tokenizer_for(str(bare), tokenizer="task")) == len(build_char_tokenizer())
    other = tokenizer_for(str(bare), tokenizer=str(chat_dir))  # a tokenizer saved elsewhere
    assert other.eos_token == "<|im_end|>"
    with pytest.raises(DataError) as exc:
        tokenizer_for(str(bare), tokenizer=str(tmp_path / "nowhere"))
    assert _one_line(exc).startswith("task.tokenizer: ")
    cfg = TaskConfig(tokenizer="task", chat_template="none")
    assert task_tokenizer(cfg, str(bare)).bos_token_id == build_char_tokenizer().bos_token_id


def test_a_tokenizer_without_pad_pads_with_eos(tmp_path):
    tok = build_chat_tokenizer()
    tok.pad_token = None
    tok.save_pretrained(tmp_path)
    loaded = tokenizer_for(None, tokenizer=str(tmp_path))
    assert loaded.pad_token_id == loaded.eos_token_id is not None


def test_messages_columns_are_conversations_and_a_final_assistant_turn_is_the_answer(tmp_path):
    path = tmp_path / "chat.jsonl"
    _write_jsonl(
        path,
        [
            {"messages": [{"role": "system", "content": "Sort."}, {"role": "user", "content": "sort 31="}]},
            {"messages": [{"role": "user", "content": "sort 21="}, {"role": "assistant", "content": "12"}]},
            {
                "messages": [{"role": "user", "content": "sort 5="}, {"role": "assistant", "content": "5"}],
                "answer": "5",
            },
        ],
    )
    rows = FilePrompts(path, prompt_key="messages")
    assert [(e.prompt, e.answer) for e in rows] == [("sort 31=", None), ("sort 21=", "12"), ("sort 5=", "5")]
    assert rows[0].model_input == [{"role": "system", "content": "Sort."}, {"role": "user", "content": "sort 31="}]
    assert rows[1].model_input == [{"role": "user", "content": "sort 21="}]  # the answer is not in the prompt
    with pytest.raises(DataError) as exc:
        FilePrompts(path)  # the default column 'prompt' is absent: the error says which column to name
    assert "task.prompt_key=messages" in _one_line(exc)
    _write_jsonl(path, [{"messages": [{"role": "user"}]}])
    with pytest.raises(DataError) as exc:
        FilePrompts(path, prompt_key="messages")
    assert "row 0" in _one_line(exc) and "role" in str(exc.value)


def test_a_file_without_an_answer_column_has_no_answers(tmp_path):
    path = tmp_path / "p.jsonl"
    _write_jsonl(path, [{"prompt": "sort 21="}])
    assert FilePrompts(path)[0].answer is None


def test_eval_file_is_the_held_out_set_and_is_not_repeated(tmp_path):
    train, held = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    _write_jsonl(train, [{"prompt": f"sort {d}=", "answer": d} for d in ("21", "43", "65")])
    _write_jsonl(held, [{"prompt": "sort 98=", "answer": "89"}, {"prompt": "sort 76=", "answer": "67"}])
    cfg = TaskConfig(name="file", prompt_file=str(train), eval_file=str(held), reward_fn="x.py:f")
    task = build_task(TaskConfig())  # the rule does not matter here
    assert [e.prompt for e in prompt_source(cfg, task, 0, "train").batch(0, 3)] == ["sort 21=", "sort 43=", "sort 65="]
    assert [e.prompt for e in held_out(cfg, task, 0, 128)] == ["sort 98=", "sort 76="]  # two rows, not 128
    synthetic = TaskConfig(eval_file=str(held))  # a synthetic task evaluated on a fixed file
    assert [e.answer for e in held_out(synthetic, task, 0, 1)] == ["89"]
    assert len(held_out(TaskConfig(), task, 0, 5)) == 5  # without a file: the task's own eval stream


def _chat_rows(n: int, seed: int, with_answer_turn: bool) -> list[dict]:
    """Sort prompts as chat conversations: a system turn, the user's prompt, and (for SFT) the assistant's answer."""
    import random

    from loomrl.data.tasks import SortDigits

    rng, task, rows = random.Random(seed), SortDigits(min_len=3, max_len=4), []
    for _ in range(n):
        ex = task.sample(rng)
        messages = [{"role": "system", "content": "You sort digits."}, {"role": "user", "content": ex.prompt}]
        if with_answer_turn:
            rows.append({"messages": [*messages, {"role": "assistant", "content": ex.answer}]})
        else:
            rows.append({"messages": messages, "answer": ex.answer})
    return rows


def test_a_qwen2_chat_model_goes_through_sft_grpo_and_eval(chat_dir, tmp_path):
    """The acceptance path for a user's own model: a Qwen2 checkpoint whose BPE tokenizer has a chat template and
    no bos, chat data (a `messages` column; SFT conversations end with the answer), a held-out file, the Ray
    runtime on two devices, and `loomrl eval` of the run."""
    from test_cli import assert_ok, run_cli

    sft_file, rl_file, held_file = tmp_path / "sft.jsonl", tmp_path / "rl.jsonl", tmp_path / "held.jsonl"
    _write_jsonl(sft_file, _chat_rows(64, 0, with_answer_turn=True))
    _write_jsonl(rl_file, _chat_rows(32, 1, with_answer_turn=False))
    _write_jsonl(held_file, _chat_rows(6, 2, with_answer_turn=False))
    task = (
        "task.name=file",
        "task.prompt_key=messages",
        "task.reward_fn=examples/user_task/reward.py:score",
        f"task.eval_file={held_file}",
    )
    sft_dir = tmp_path / "sft"
    proc = run_cli(
        "sft",
        f"model={chat_dir}",
        f"out_dir={sft_dir}",
        f"task.prompt_file={sft_file}",
        *task,
        "steps=4",
        "batch_size=8",
        "eval_prompts=6",
        "--quiet",
        timeout=180,
    )
    assert_ok(proc)
    saved = tokenizer_for(str(sft_dir))  # the policy keeps its BPE tokenizer and chat template
    assert saved.bos_token_id is None and saved.chat_template == CHATML and len(saved) == len(build_chat_tokenizer())
    run_dir = tmp_path / "grpo"
    proc = run_cli(
        "train",
        "examples/grpo_user_task.yaml",
        f"actor.model={sft_dir}",
        f"run_dir={run_dir}",
        f"task.prompt_file={rl_file}",
        *task,
        "runtime.devices=2",
        "runtime.threads=1",
        "loop.iterations=2",
        "loop.eval_every=1",
        "loop.eval_prompts=6",
        "rollout.prompts_per_iter=4",
        "algo.group_size=2",
        "algo.minibatches=1",
        "loop.progress=false",
        timeout=300,
    )
    assert_ok(proc)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [0, 1] and all("eval/score" in r for r in records)
    # iteration 1's prompts (rows 4-7) went through the chat template of the checkpoint's own tokenizer
    rows = [json.loads(line)["messages"] for line in rl_file.read_text().splitlines()[4:8]]
    expected = sum(len(encode_prompt(saved, messages)) for messages in rows) / 4
    assert records[-1]["prompt/length"] == pytest.approx(expected) and expected > 20  # plain text: ~6 tokens
    proc = run_cli("eval", run_dir, "samples=4", "pass_k=[1,4]", timeout=180)
    assert_ok(proc)
    results = json.loads((run_dir / "eval.json").read_text())
    assert results["prompts"] == 6  # the held-out file, from the run's own task settings
    assert {"greedy/exact_match", "pass@1", "pass@4"} <= results.keys() and 0 <= results["pass@1"] <= results["pass@4"]
