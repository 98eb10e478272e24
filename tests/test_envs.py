"""Environments of multi-turn rollouts: tool-call parsing, the built-in environments, and loading by name."""

import textwrap

import pytest

from loomrl.envs import (
    Calculator,
    GuessingGame,
    PythonTool,
    StepResult,
    ToolEnvironment,
    calculate,
    env_row,
    load_environment,
    parse_tool_calls,
)
from loomrl.errors import DataError
from loomrl.models.tokenizer import TASK_ALPHABET


def _call(name, **arguments):
    import json

    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


# ------------------------------------------------------------------------------------------------ tool calls


def test_hermes_calls_are_read_and_taken_out_of_the_content():
    parsed = parse_tool_calls(f"Let me compute. {_call('calculator', expression='2+3')} ok")
    assert [(c.name, c.arguments) for c in parsed.calls] == [("calculator", {"expression": "2+3"})]
    assert parsed.errors == [] and parsed.content == "Let me compute.  ok"
    two = parse_tool_calls(_call("a", x=1) + "\n" + _call("b"))
    assert [c.name for c in two.calls] == ["a", "b"] and two.calls[1].arguments == {}
    assert parse_tool_calls('<tool_call>{"name": "a", "arguments": "{\\"x\\": 2}"}</tool_call>').calls[0].arguments == {
        "x": 2
    }


@pytest.mark.parametrize(
    "text, error",
    [
        ("<tool_call>{not json}</tool_call>", "not valid JSON"),
        ('<tool_call>{"arguments": {}}</tool_call>', 'needs a "name"'),
        ('<tool_call>{"name": "a", "arguments": [1]}</tool_call>', "must be a JSON object"),
        ('answer <tool_call>{"name": "a"', "not closed"),
    ],
)
def test_malformed_hermes_calls_are_errors_not_exceptions(text, error):
    parsed = parse_tool_calls(text)
    assert parsed.calls == [] and len(parsed.errors) == 1 and error in parsed.errors[0]
    assert "<tool_call>" not in parsed.content


def test_a_regular_expression_reads_calls_by_its_groups():
    named = parse_tool_calls("x <(?P<name>\\w+)>", r"<(?P<name>\w+)>(?P<arguments>.*?)</\1>")
    assert named.calls == []
    parsed = parse_tool_calls('so <calc>2*4</calc> and <calc>{"expression": "1"}</calc>', r"<calc>(.*?)</calc>")
    assert [c.arguments for c in parsed.calls] == [{"input": "2*4"}, {"expression": "1"}]
    assert parsed.content == "so  and" and all(c.name == "" for c in parsed.calls)
    by_name = parse_tool_calls("CALL sum(1 2)", r"CALL (?P<name>\w+)\((?P<arguments>[^)]*)\)")
    assert by_name.calls[0].name == "sum" and by_name.calls[0].arguments == {"input": "1 2"}
    with pytest.raises(DataError, match=r"^tool call format '\(unclosed': not 'hermes' nor a valid regular"):
        parse_tool_calls("x", "(unclosed")


# ------------------------------------------------------------------------------------------------ calculator


def test_the_calculator_computes_arithmetic_and_refuses_anything_else():
    assert calculate("57 + 5") == "62" and calculate("(3 - 10) * 2") == "-14" and calculate("7 / 2") == "3.5"
    assert calculate("-4 * -2") == "8"
    for bad in ("__import__('os').system('ls')", "x + 1", "2 ** 10", "1; 2", "a" * 300):
        with pytest.raises(ValueError):
            calculate(bad)


def test_the_calculator_environment_answers_calls_and_scores_the_final_answer():
    env = Calculator()
    messages = env.reset(env_row("What is 57 + 5? Reply with the number only.", "62", {}))
    assert messages[0]["role"] == "system" and "<tool_call>" in messages[0]["content"]
    assert messages[1] == {"role": "user", "content": "What is 57 + 5? Reply with the number only."}
    result = env.step(_call("calculator", expression="57 + 5"))
    assert result.messages == [{"role": "tool", "content": "62"}] and not result.done and result.reward == 0
    assert result.metrics == {"tool_calls": 1.0, "tool_errors": 0.0}
    bad = env.step(_call("calculator", expression="__import__('os')") + _call("shell", cmd="ls") + "<tool_call>{x")
    assert [m["content"].split(":")[0] for m in bad.messages] == ["error", "error", "error"]
    assert "no tool named 'shell'" in bad.messages[2]["content"] and bad.metrics["tool_errors"] == 3
    wrong_args = env.step(_call("calculator", expr="1"))
    assert wrong_args.messages[0]["content"].startswith("error: wrong arguments for calculator")
    assert env.step("57 + 5 = 62.") == StepResult([], 1.0, True)
    assert env.step("It is 61").reward == 0.0


def test_the_python_tool_runs_code_in_the_sandbox():
    env = PythonTool()
    env.reset({"prompt": "What is 3 + 4?", "answer": "7"})
    result = env.step(_call("python", code="print(3 + 4)"))
    assert result.messages[0]["content"].strip() == "7"
    assert env.step("7").reward == 1.0


def test_the_guessing_game_speaks_the_character_alphabet():
    env = GuessingGame()
    start = env.reset({"prompt": "", "answer": "6"})
    replies = [env.step(g) for g in ("3", "9", "no idea", "6")]
    assert [r.messages[0]["content"] if r.messages else "" for r in replies] == [
        " higher:",
        " lower:",
        " no guess:",
        "",
    ]
    assert replies[-1].done and replies[-1].reward == 1.0 and not any(r.done for r in replies[:-1])
    for text in [start[0]["content"], *(m["content"] for r in replies for m in r.messages)]:
        assert set(text) <= set(TASK_ALPHABET), text


# ------------------------------------------------------------------------------------------------ loading


def test_environments_load_by_built_in_name_module_or_file(tmp_path, monkeypatch):
    assert load_environment("calculator") is Calculator and load_environment("guess") is GuessingGame
    (tmp_path / "my_envs.py").write_text(
        textwrap.dedent(
            """
            class Echo:
                def reset(self, row):
                    return [{"role": "user", "content": row["prompt"]}]

                def step(self, text):
                    return None

            class Half:
                def reset(self, row):
                    return []

            NOT_A_CLASS = 3
            """
        )
    )
    assert load_environment(f"{tmp_path / 'my_envs.py'}:Echo")().reset({"prompt": "hi"})[0]["content"] == "hi"
    monkeypatch.chdir(tmp_path)
    assert load_environment("my_envs:Echo").__name__ == "Echo"
    for spec, message in [
        ("calculater", r"^environment 'calculater': not a built-in \(calculator, guess, python\) nor of the form"),
        ("my_envs:Nope", r"^environment 'my_envs:Nope': module 'my_envs' has no class 'Nope'$"),
        ("my_envs:Half", r"'Half' has no step method"),
        ("my_envs:NOT_A_CLASS", r"'NOT_A_CLASS' is not a class"),
        ("nowhere.py:Echo", r"^environment 'nowhere.py:Echo': cannot import module 'nowhere.py'"),
    ]:
        with pytest.raises(DataError, match=message):
            load_environment(spec)


def test_a_tool_environment_needs_only_tools_a_start_and_a_score():
    class Shout(ToolEnvironment):
        def __init__(self):
            super().__init__()
            self.tools = {"upper": lambda text: text.upper(), "boom": lambda: 1 / 0}

        def reset(self, row):
            return [{"role": "user", "content": "shout"}]

        def score(self, answer):
            return float(answer == "HI")

    env = Shout()
    assert env.step(_call("upper", text="hi")).messages == [{"role": "tool", "content": "HI"}]
    assert env.step(_call("boom")).messages[0]["content"] == "error: ZeroDivisionError: division by zero"
    assert env.step("HI").reward == 1.0


def test_a_configured_regex_reads_a_tool_environments_calls():
    from loomrl.config.schema import TrainConfig
    from loomrl.config.tools import load_config
    from loomrl.errors import ConfigError

    env = Calculator()
    env.tool_format = r"<(?P<name>calculator)>(?P<arguments>.*?)</calculator>"
    env.reset({"prompt": "What is 6 * 7?", "answer": "42"})
    assert env.step("<calculator>6 * 7</calculator>").messages == [{"role": "tool", "content": "42"}]
    assert env.step("42").reward == 1.0
    cfg = load_config(TrainConfig, None, ["rollout.env.name=calculator", f"rollout.env.tool_format={env.tool_format}"])
    assert cfg.rollout.env.tool_format == env.tool_format
    with pytest.raises(ConfigError, match=r"rollout\.env\.tool_format: '\(bad' is not 'auto', 'hermes' nor a regular"):
        load_config(TrainConfig, None, ["rollout.env.tool_format=(bad"])
