"""Kinds of malformed input (``tests/test_fuzz_cli.py``): prompt files and ``loomrl plan``'s arguments."""

from __future__ import annotations

import json
from pathlib import Path

from hypothesis import strategies as st

from fuzz_harness import FLOATS, JSON_SCALARS, NOT_UTF8, WORD, config_argv, kind, nested, quoted

# --- prompt files: task.prompt_file (task 'file') and task.eval_file --------------------------------------


ROWS = st.lists(
    st.fixed_dictionaries({"prompt": st.text(max_size=12)}, optional={"answer": st.text(max_size=4)}),
    min_size=1,
    max_size=4,
)


def _prompt_kind(make_content, suffix: str = ".jsonl"):
    """A prompt-file kind: ``make_content(data)`` → the file's bytes or text; it is given as the prompt file of
    task 'file' (train or sft) or as the eval file of a synthetic task; the error must name the file."""

    def make(data, files):
        path = files.write(suffix, make_content(data))
        where = data.draw(st.sampled_from(["train-prompts", "sft-prompts", "train-eval"]), label="as")
        if where == "train-eval":
            return config_argv("train", files, [f"task.eval_file={path}"]), (path,)
        command = where.partition("-")[0]
        reward = f"{files.root / 'rewards.py'}:score"
        task = ["task.name=file", f"task.prompt_file={path}", f"task.reward_fn={reward}", "task.reward_timeout_s=0"]
        return config_argv(command, files, task), (path,)

    make.__name__ = make_content.__name__
    return make


def _jsonl(rows) -> str:
    return "".join(json.dumps(row) + "\n" for row in rows)


@kind("prompt file")
@_prompt_kind
def prompt_column_missing(data):
    column = data.draw(WORD.filter(lambda w: w != "prompt"))
    return _jsonl({column: text} for text in data.draw(st.lists(st.text(max_size=8), min_size=1, max_size=3)))


@kind("prompt file")
@_prompt_kind
def prompt_of_the_wrong_type(data):
    rows = data.draw(ROWS)
    bad = data.draw(
        st.one_of(
            st.integers(),
            FLOATS,
            st.booleans(),
            st.none(),
            st.dictionaries(WORD, st.integers(), max_size=2),
            st.lists(st.integers(), min_size=1, max_size=3),
        )
    )
    rows.insert(data.draw(st.integers(0, len(rows))), {"prompt": bad})
    return _jsonl(rows)


@kind("prompt file")
@_prompt_kind
def empty_or_blank_lines_only(data):
    return data.draw(st.sampled_from(["", "\n", "\n\n\n", "   \n\t\n", "\r\n"]))


@kind("prompt file")
@_prompt_kind
def invalid_json_line(data):
    rows = [json.dumps(row) for row in data.draw(ROWS)]
    junk = data.draw(
        st.sampled_from(
            [
                "{",
                "}",
                "{prompt: x}",
                "{'prompt': 'x'}",
                '{"prompt": "x",}',
                "[1,",
                '{"prompt": "x"} trailing',
                "nan",
                '{"prompt": NaN',
            ]
        )
    )
    rows.insert(data.draw(st.integers(0, len(rows))), junk)
    return "\n".join(rows) + "\n"


@kind("prompt file")
@_prompt_kind
def invalid_utf8(data):
    text = _jsonl(data.draw(ROWS)).encode()
    at = data.draw(st.integers(0, len(text)))
    return text[:at] + data.draw(NOT_UTF8) + text[at:]


@kind("prompt file")
@_prompt_kind
def line_that_is_not_an_object(data):
    rows = [json.dumps(row) for row in data.draw(ROWS)]
    rows.insert(
        data.draw(st.integers(0, len(rows))),
        json.dumps(
            data.draw(st.one_of(st.integers(), st.text(max_size=5), st.lists(st.integers(), max_size=3), st.booleans()))
        ),
    )
    return "\n".join(rows) + "\n"


@kind("prompt file")
@_prompt_kind
def truncated_last_line(data):
    text = _jsonl(data.draw(ROWS)) + json.dumps({"prompt": data.draw(st.text(min_size=2, max_size=8))})
    return text[: len(text) - data.draw(st.integers(1, 4))]


@kind("prompt file")
@_prompt_kind
def key_given_twice_in_a_row(data):
    return _jsonl(data.draw(ROWS)) + '{"prompt": "a", "prompt": "b"}\n'


@kind("prompt file")
@_prompt_kind
def conversation_malformed(data):
    message = data.draw(
        st.sampled_from(
            [
                {"role": "user"},
                {"content": "hi"},
                {"role": 1, "content": "x"},
                {"role": "user", "content": ["x"]},
                "user: hi",
                None,
                5,
            ]
        )
    )
    turns = [{"role": "user", "content": "hi"}, message] if data.draw(st.booleans()) else [message]
    return _jsonl([{"prompt": turns}])


@kind("prompt file")
@_prompt_kind
def empty_conversation(data):
    return _jsonl([*data.draw(ROWS), {"prompt": []}])


@kind("prompt file")
@_prompt_kind
def nested_prompt_value(data):
    return _jsonl([{"prompt": nested(data.draw(st.integers(2, 200)), data.draw(st.text(max_size=3)))}])


@kind("prompt file")
def json_document_without_rows(data, files):
    content = data.draw(
        st.one_of(
            st.just("[]"),
            JSON_SCALARS.map(json.dumps).filter(lambda t: t not in ("{}",)),
            st.lists(JSON_SCALARS, min_size=1, max_size=3).map(json.dumps),
            ROWS.map(lambda rows: json.dumps([*rows, 7])),
        )
    )
    return _prompt_kind(lambda _: content, ".json")(data, files)


@kind("prompt file")
def unsupported_extension(data, files):
    suffix = data.draw(st.sampled_from([".csv", ".txt", ".tsv", ".yaml", "", ".JSONL.gz", ".xlsx"]))
    return _prompt_kind(lambda data: "prompt,answer\na,b\n", suffix)(data, files)


@kind("prompt file")
def corrupt_parquet(data, files):
    junk = data.draw(st.one_of(st.binary(max_size=64), st.just(b"PAR1"), st.just(b"PAR1junkPAR1")))
    return _prompt_kind(lambda data: junk, ".parquet")(data, files)


@kind("prompt file")
def prompt_file_missing_or_a_directory(data, files):
    path = data.draw(st.sampled_from([files.path(".jsonl"), files.path(".parquet"), str(files.root / "d.jsonl")]))
    if path.endswith("d.jsonl"):
        Path(path).mkdir(exist_ok=True)
    reward = f"{files.root / 'rewards.py'}:score"
    task = ["task.name=file", f"task.prompt_file={path}", f"task.reward_fn={reward}", "task.reward_timeout_s=0"]
    return config_argv("train", files, task), (path,)


@kind("prompt file")
def prompt_key_not_a_column(data, files):
    path = files.write(".jsonl", _jsonl(data.draw(ROWS)))
    key = data.draw(st.one_of(WORD.filter(lambda w: w not in ("prompt", "answer")), st.just("")))
    reward = f"{files.root / 'rewards.py'}:score"
    task = [
        "task.name=file",
        f"task.prompt_file={path}",
        f"task.reward_fn={reward}",
        "task.reward_timeout_s=0",
        f"task.prompt_key={quoted(key)}",
    ]
    return config_argv("train", files, task), (path,)


@kind("prompt file")
def reward_function_that_cannot_be_loaded(data, files):
    path = files.write(".jsonl", _jsonl(data.draw(ROWS)))
    spec = data.draw(
        st.sampled_from(
            [
                "nocolon",
                ":f",
                "m:",
                f"{files.root / 'rewards.py'}:missing",
                f"{files.path('.py')}:score",
                "no_such_module_x:f",
                f"{path}:score",
            ]
        )
    )
    task = ["task.name=file", f"task.prompt_file={path}", f"task.reward_fn={spec}"]
    return config_argv("train", files, task), (spec,)


# --- `loomrl plan` arguments ------------------------------------------------------------------------------


def _plan_command(files, *flags: str) -> list[str]:
    return ["plan", "--model", "llama-1m", "--search-steps", "5", *flags, "--out", files.path("-plan")]


@kind("plan command")
def cluster_malformed(data, files):
    cluster = data.draw(
        st.one_of(
            WORD,
            st.sampled_from(
                [
                    "h100",
                    "h100:",
                    ":8",
                    "h100:x8",
                    "h100:8x",
                    "h100:0",
                    "h100:0x8",
                    "h100:8x0",
                    "tpu:8",
                    "h100:-1",
                    "8x8",
                    "",
                    "h100:8 x8",
                    "cpu:1.5",
                ]
            ),
        )
    )
    return _plan_command(files, "--cluster", cluster), ("cluster",)


@kind("plan command")
def model_unknown(data, files):
    flag = data.draw(st.sampled_from(["--model", "--actor-model", "--critic-model", "--ref-model", "--reward-model"]))
    name = data.draw(WORD.filter(lambda w: w != "rule"))
    return _plan_command(files, flag, name), (name,)


@kind("plan command")
def response_lengths_malformed(data, files):
    text = data.draw(
        st.one_of(
            WORD,
            st.sampled_from(
                [
                    "-5",
                    "0",
                    "nan",
                    "inf",
                    "lognormal:",
                    "lognormal:mean=x",
                    "lognormal:mean=5,sigma=-1",
                    "lognormal:sigma=1",
                    "lognormal:mean=5,max=2",
                    "lognormal:mean=5,bogus=1",
                ]
            ),
        )
    )
    return _plan_command(files, "--response-len", text), ("response",)


@kind("plan command")
def response_length_file_malformed(data, files):
    content = data.draw(
        st.sampled_from(
            ["", "x\n", "-3\n", '{"length": "long"}\n', '{"other": 5}\n', "[0, 2]\n", "0\n", "nan\n", "[]\n"]
        )
    )
    path = files.write(".jsonl", content)
    return _plan_command(files, "--response-len", path), (path, "response")


@kind("plan command")
def count_flag_out_of_range(data, files):
    flag = data.draw(
        st.sampled_from(
            [
                "--prompts",
                "--responses-per-prompt",
                "--response-max",
                "--optimizer-steps",
                "--ppo-epochs",
                "--decode-slots",
                "--gen-max-seqs",
                "--gen-request-batch",
                "--expert-parallel",
            ]
        )
    )
    return _plan_command(files, flag, str(data.draw(st.integers(-(10**6), 0)))), (flag[2:].replace("-", "_"),)


@kind("plan command")
def number_flag_out_of_range_or_not_finite(data, files):
    flag, bad = data.draw(
        st.sampled_from(
            [
                ("--prompt-len", "-1"),
                ("--prompt-len", "nan"),
                ("--prompt-len", "inf"),
                ("--response-spread", "-0.5"),
                ("--response-spread", "nan"),
                ("--gen-memory-fraction", "1.5"),
                ("--gen-memory-fraction", "0"),
                ("--gen-memory-fraction", "nan"),
                ("--sync-tensor-s", "-1"),
                ("--time-budget", "0"),
                ("--time-budget", "-3"),
                ("--time-budget", "nan"),
                ("--time-budget", "inf"),
                ("--search-steps", "-1"),
            ]
        )
    )
    return ["plan", "--model", "llama-1m", flag, bad, "--out", files.path("-plan")], (flag[2:].replace("-", "_"), flag)


@kind("plan command")
def flag_value_of_the_wrong_type(data, files):
    flag = data.draw(
        st.sampled_from(
            [
                "--prompts",
                "--prompt-len",
                "--response-max",
                "--time-budget",
                "--search-steps",
                "--seed",
                "--gen-memory-fraction",
                "--decode-slots",
            ]
        )
    )
    return _plan_command(files, flag, data.draw(WORD)), (flag,)


@kind("plan command")
def flag_value_outside_its_choices(data, files):
    flag = data.draw(st.sampled_from(["--gen-precision", "--train-precision", "--logits"]))
    return _plan_command(files, flag, data.draw(WORD)), (flag,)


@kind("plan command")
def unknown_flag(data, files):
    flag = "--" + data.draw(WORD).replace("_", "-")
    return _plan_command(files, flag), (flag,)


@kind("plan command")
def output_directory_is_a_file(data, files):
    path = files.write(".txt", "not a directory")
    return ["plan", "--model", "llama-1m", "--out", path], (path,)


@kind("plan command")
def workload_file_malformed(data, files):
    content = data.draw(
        st.sampled_from(
            [
                "algo: [1\n",
                "- 1\n",
                "bogus_key: 1\n",
                "prompts: many\n",
                "algo: 5\n",
                "prompts: 0\n",
                "engine: {gen_memory_fraction: 2}\n",
                "models: x\n",
                "response_len: -1\n",
            ]
        )
    )
    path = files.write(".yaml", content)
    return _plan_command(files, "--workload", path), (path, "run.")


@kind("plan command")
def planner_file_not_text_or_nested_too_deeply(data, files):
    flag = data.draw(st.sampled_from(["--response-len", "--profile", "--corrections"]))
    content = data.draw(st.sampled_from([b"\xff\xfe1\n", b"\xff{}", b"[" * 100_000 + b"]" * 100_000]))
    path = files.write(".jsonl" if flag == "--response-len" else ".json", content)
    return _plan_command(files, flag, path), (path,)
