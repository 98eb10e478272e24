"""Environments of multi-turn rollouts: tool-call parsing, the built-in environments, and loading by name."""

import textwrap

import pytest

from loomrl.envs import (
    Calculator,
    GuessingGame,
    PythonTool,
    StepResult,
    ToolCall,
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
    unclosed = r"^tool call format '\(unclosed': not one of hermes, json, mistral nor a valid regular"
    with pytest.raises(DataError, match=unclosed):
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
    env.reset({"prompt": "What is 6 * 7?", "answer": "42"})
    env.tool_format = r"<(?P<name>calculator)>(?P<arguments>.*?)</calculator>"
    assert env.step("<calculator>6 * 7</calculator>").messages == [{"role": "tool", "content": "42"}]
    assert env.step("42").reward == 1.0
    cfg = load_config(TrainConfig, None, ["rollout.env.name=calculator", f"rollout.env.tool_format={env.tool_format}"])
    assert cfg.rollout.env.tool_format == env.tool_format
    named = r"rollout\.env\.tool_format: '\(bad' is not one of 'auto', 'hermes', 'json', 'mistral' nor a regular"
    with pytest.raises(ConfigError, match=named):
        load_config(TrainConfig, None, ["rollout.env.tool_format=(bad"])


def test_each_convention_reads_what_it_writes_and_chat_templates_name_theirs():
    from loomrl.envs import CONVENTIONS, format_tool_call, template_convention

    for fmt in CONVENTIONS:
        written = format_tool_call("calculator", {"expression": "6 * 7"}, fmt)
        parsed = parse_tool_calls(written, fmt)
        assert parsed.calls == [ToolCall("calculator", {"expression": "6 * 7"})] and not parsed.errors, fmt
        assert parse_tool_calls("42", fmt).calls == [] and parse_tool_calls("42", fmt).content == "42"
    # the marks each family's chat template carries (excerpts of Qwen2.5's, Llama 3.1's and Mistral's templates)
    qwen = '{{- "<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call>" }}'
    llama = '{{- \'Respond in the format {"name": function name, "parameters": dictionary of argument name and its'
    assert template_convention(qwen) == "hermes" and template_convention(llama) == "json"
    assert template_convention("{{- '[TOOL_CALLS]' + tool_calls|tojson }}") == "mistral"
    assert template_convention("{{ '<|python_tag|>' + tool_call.arguments.code }}") == "json"
    assert template_convention("<|im_start|>{{ message['role'] }}") is None and template_convention(None) is None
    with pytest.raises(DataError, match=r"^tool call format '<c>\(\.\*\)</c>': a regular expression reads calls but"):
        format_tool_call("calculator", {}, "<c>(.*)</c>")


def test_llama_json_calls_lists_and_the_python_tag():
    json_calls = parse_tool_calls('<|python_tag|>{"name": "a", "parameters": {"x": 1}}', "json")
    assert json_calls.calls == [ToolCall("a", {"x": 1})] and json_calls.content == ""
    listed = parse_tool_calls('[{"name": "a", "arguments": "{\\"x\\": 2}"}, {"name": "b"}]', "json")
    assert listed.calls == [ToolCall("a", {"x": 2}), ToolCall("b", {})]
    broken = parse_tool_calls('{"name": "a", "parameters": {', "json")
    assert broken.calls == [] and broken.errors[0].startswith("tool call is not valid JSON")
    nameless = parse_tool_calls('[{"parameters": {}}]', "json")
    assert nameless.errors == ['tool call needs a "name" (a string)']


def test_mistral_calls_in_both_layouts():
    v3_text = 'Let me compute. [TOOL_CALLS][{"name": "calculator", "arguments": {"expression": "2+2"}}]'
    v3 = parse_tool_calls(v3_text, "mistral")
    assert v3.calls == [ToolCall("calculator", {"expression": "2+2"})] and v3.content == "Let me compute."
    v11_text = '[TOOL_CALLS]calculator[ARGS]{"expression": "1"}[TOOL_CALLS]python[ARGS]{"code": "2"}'
    v11 = parse_tool_calls(v11_text, "mistral")
    assert v11.calls == [ToolCall("calculator", {"expression": "1"}), ToolCall("python", {"code": "2"})]
    bad = parse_tool_calls("[TOOL_CALLS]calculator {}", "mistral")
    assert bad.calls == [] and bad.errors == ["tool call 'calculator {}' has no [ARGS] before its arguments"]
    hermes_list = parse_tool_calls('<tool_call>[{"name": "a"}, {"name": "b", "arguments": {"y": 0}}]</tool_call>')
    assert hermes_list.calls == [ToolCall("a", {}), ToolCall("b", {"y": 0})]


def test_an_episode_opens_in_the_chat_templates_convention_unless_the_run_sets_one():
    from types import SimpleNamespace

    from loomrl.algorithms.episode_ops import open_episode
    from loomrl.config.environment import EnvConfig
    from loomrl.data.tasks import Example

    ex = Example("What is 6 * 7? Reply with the number only.", "42", row={})
    mistral = SimpleNamespace(chat_template="{{ '[TOOL_CALLS]' }}")
    env, opening = open_episode(mistral, EnvConfig(name="calculator"), ex)
    assert env.tool_format == "mistral" and '[TOOL_CALLS][{"name": "calculator"' in opening[0]["content"]
    call = env.demonstrate({"prompt": ex.prompt, "answer": "42"})[0]
    assert call == '[TOOL_CALLS][{"name": "calculator", "arguments": {"expression": "6 * 7"}}]'
    assert env.step(call).messages == [{"role": "tool", "content": "42"}] and env.step("42").reward == 1.0
    plain = SimpleNamespace(chat_template="<|im_start|>")  # no convention: the environment's own (hermes)
    assert open_episode(plain, EnvConfig(name="calculator"), ex)[0].tool_format == "hermes"
    chosen, opening = open_episode(mistral, EnvConfig(name="calculator", tool_format="json"), ex)
    assert chosen.tool_format == "json" and '{"name": "calculator", "parameters"' in opening[0]["content"]
