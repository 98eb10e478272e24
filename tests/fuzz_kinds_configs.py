"""Kinds of malformed input (``tests/test_fuzz_cli.py``): config overrides, cross-field checks and YAML config files."""

from __future__ import annotations

import json

import yaml
from hypothesis import strategies as st

from fuzz_harness import (
    COMMANDS,
    FLOATS,
    LEAVES,
    NONFINITE,
    NOT_UTF8,
    ROLES,
    SECTIONS,
    WORD,
    config_argv,
    kind,
    nested,
    pick,
)

# --- config overrides (key=value) -------------------------------------------------------------------------


@kind("config override")
def unknown_top_level_key(data, files):
    command = data.draw(st.sampled_from(sorted(COMMANDS)))
    top = {leaf.path.split(".")[0] for leaf in LEAVES[command]}
    key = data.draw(WORD.filter(lambda w: w not in top))
    return config_argv(command, files, [f"{key}=1"]), (key,)


@kind("config override")
def unknown_nested_key(data, files):
    command = data.draw(st.sampled_from(sorted(COMMANDS)))
    section = data.draw(st.sampled_from(SECTIONS[command]))
    known = {leaf.path for leaf in LEAVES[command]} | set(SECTIONS[command])
    key = data.draw(WORD.filter(lambda w: f"{section}.{w}" not in known))
    return config_argv(command, files, [f"{section}.{key}=1"]), (f"{section}.{key}",)


@kind("config override")
def int_field_gets_a_word(data, files):
    command, leaf = pick(data, int)
    return config_argv(command, files, [f"{leaf.path}={data.draw(WORD)}"]), (leaf.path,)


@kind("config override")
def int_field_gets_a_fraction(data, files):
    command, leaf = pick(data, int)
    value = data.draw(FLOATS.filter(lambda v: v != int(v)))
    return config_argv(command, files, [f"{leaf.path}={value!r}"]), (leaf.path,)


@kind("config override")
def int_field_gets_a_bool(data, files):
    command, leaf = pick(data, int)
    value = data.draw(st.sampled_from(["true", "false", "yes", "no", "on", "off"]))
    return config_argv(command, files, [f"{leaf.path}={value}"]), (leaf.path,)


@kind("config override")
def float_field_gets_a_word(data, files):
    command, leaf = pick(data, float)
    return config_argv(command, files, [f"{leaf.path}={data.draw(WORD)}"]), (leaf.path,)


@kind("config override")
def bounded_float_gets_nan_or_inf(data, files):
    command, leaf = pick(data, float, lambda leaf: bool(leaf.bounds))
    values = (
        [".nan", ".NaN"]
        + ([".inf", ".Inf"] if {"le", "lt"} & set(leaf.bounds) else [])
        + (["-.inf"] if {"ge", "gt"} & set(leaf.bounds) else [])
    )  # inf under a lower bound alone is valid: no limit
    return config_argv(command, files, [f"{leaf.path}={data.draw(st.sampled_from(values))}"]), (leaf.path,)


@kind("config override")
def bool_field_gets_a_number(data, files):
    command, leaf = pick(data, bool)
    value = data.draw(st.one_of(st.integers(-5, 5), FLOATS))
    return config_argv(command, files, [f"{leaf.path}={value!r}"]), (leaf.path,)


@kind("config override")
def bool_field_gets_a_word(data, files):
    command, leaf = pick(data, bool)
    return config_argv(command, files, [f"{leaf.path}={data.draw(WORD)}"]), (leaf.path,)


@kind("config override")
def str_field_gets_a_list_or_mapping(data, files):
    command, leaf = pick(data, str)
    value = data.draw(st.sampled_from(["[1, 2]", "{a: 1}", "[]", "{}", "[x, [y]]"]))
    return config_argv(command, files, [f"{leaf.path}={value}"]), (leaf.path,)


@kind("config override")
def required_str_field_gets_a_number_or_null(data, files):
    command, leaf = pick(data, str, lambda leaf: not leaf.optional)
    value = data.draw(st.one_of(st.integers(-99, 99).map(str), st.just("null"), st.just("~")))
    return config_argv(command, files, [f"{leaf.path}={value}"]), (leaf.path,)


@kind("config override")
def number_below_its_lower_bound(data, files):
    command = data.draw(st.sampled_from(sorted(COMMANDS)))
    leaves = [leaf for leaf in LEAVES[command] if leaf.kind in (int, float) and {"ge", "gt"} & set(leaf.bounds)]
    leaf = data.draw(st.sampled_from(leaves))
    low = leaf.bounds.get("ge", leaf.bounds.get("gt"))
    below = data.draw(st.integers(1 if "ge" in leaf.bounds else 0, 10**6))
    value = low - below if leaf.kind is int else low - below - data.draw(st.floats(0, 0.5))
    return config_argv(command, files, [f"{leaf.path}={value!r}"]), (leaf.path,)


@kind("config override")
def number_above_its_upper_bound(data, files):
    command = data.draw(st.sampled_from(sorted(COMMANDS)))
    leaves = [leaf for leaf in LEAVES[command] if leaf.kind in (int, float) and {"le", "lt"} & set(leaf.bounds)]
    leaf = data.draw(st.sampled_from(leaves))
    high = leaf.bounds.get("le", leaf.bounds.get("lt"))
    above = data.draw(st.integers(1 if "le" in leaf.bounds else 0, 10**6))
    value = high + above if leaf.kind is int else high + above + data.draw(st.floats(0, 0.5))
    return config_argv(command, files, [f"{leaf.path}={value!r}"]), (leaf.path,)


@kind("config override")
def word_outside_the_choices(data, files):
    command = data.draw(st.sampled_from(sorted(COMMANDS)))
    leaf = data.draw(st.sampled_from([leaf for leaf in LEAVES[command] if leaf.choices and leaf.kind is str]))
    value = data.draw(WORD.filter(lambda w: w not in leaf.choices))
    return config_argv(command, files, [f"{leaf.path}={value}"]), (leaf.path,)


@kind("config override")
def section_gets_a_scalar_or_list(data, files):
    command = data.draw(st.sampled_from(sorted(COMMANDS)))
    section = data.draw(st.sampled_from(SECTIONS[command]))
    value = data.draw(st.one_of(st.integers(-9, 9).map(str), WORD, st.just("[1, 2]")))
    return config_argv(command, files, [f"{section}={value}"]), (section,)


@kind("config override")
def list_field_gets_a_scalar(data, files):
    command = data.draw(st.sampled_from(sorted(COMMANDS)))
    leaf = data.draw(
        st.sampled_from(
            [
                leaf
                for leaf in LEAVES[command]
                if leaf.kind is None and not leaf.path.startswith(("runtime.layouts", "runtime.plan_changes"))
            ]
        )
    )
    value = data.draw(st.one_of(st.integers(-9, 9).map(str), WORD))
    return config_argv(command, files, [f"{leaf.path}={value}"]), (leaf.path,)


@kind("config override")
def betas_of_the_wrong_length(data, files):
    command = data.draw(st.sampled_from(sorted(COMMANDS)))
    leaf = data.draw(st.sampled_from([leaf for leaf in LEAVES[command] if leaf.path.endswith("betas")]))
    n = data.draw(st.sampled_from([0, 1, 3, 4]))
    return config_argv(command, files, [f"{leaf.path}={[0.5] * n}"]), (leaf.path,)


@kind("config override")
def betas_outside_zero_to_one(data, files):
    command = data.draw(st.sampled_from(sorted(COMMANDS)))
    leaf = data.draw(st.sampled_from([leaf for leaf in LEAVES[command] if leaf.path.endswith("betas")]))
    bad = data.draw(st.one_of(NONFINITE, st.floats(1, 10).map(repr), st.floats(-10, -1e-3).map(repr)))
    pair = [bad, "0.9"] if data.draw(st.booleans()) else ["0.9", bad]
    return config_argv(command, files, [f"{leaf.path}=[{', '.join(pair)}]"]), (leaf.path,)


@kind("config override")
def override_without_equals(data, files):
    command = data.draw(st.sampled_from(sorted(COMMANDS)))
    word = data.draw(WORD)
    return config_argv(command, files, ["seed=1", word]), (word,)


@kind("config override")
def override_with_a_malformed_key(data, files):
    key = data.draw(st.sampled_from(["", ".", "a..b", ".seed", "seed.", "a b", " "]))
    return config_argv("train", files, [f"{key}={data.draw(WORD)}"]), ("override",)


@kind("config override")
def override_value_is_broken_yaml(data, files):
    value = data.draw(
        st.sampled_from(
            [
                "[1, 2",
                "{a: 1",
                "'open",
                '"open',
                "a: b: c",
                "[}",
                "{]",
                "*alias",
                "!!python/name:os.system",
                "- [",
                "@x",
                "`x",
            ]
        )
    )
    field = data.draw(st.sampled_from(["seed", "loop.iterations", "run_dir", "algo.name"]))
    return config_argv("train", files, [f"{field}={value}"]), (field,)


@kind("config override")
def override_value_with_control_characters(data, files):
    char = data.draw(st.sampled_from([chr(c) for c in (*range(0, 9), 11, 12, *range(14, 32), 127)]))
    text = data.draw(WORD)
    position = data.draw(st.integers(1, len(text) - 1))  # inside: str.strip() takes \x0b, \x0c, \x1c-\x1f at the ends
    return config_argv("train", files, [f"run_dir={text[:position]}{char}{text[position:]}"]), ("run_dir",)


@kind("config override")
def override_value_nested_too_deeply(data, files):
    depth = data.draw(st.integers(51, 300))
    return config_argv("train", files, [f"seed={json.dumps(nested(depth))}"]), ("seed",)


@kind("config override")
def seed_out_of_range(data, files):
    command = data.draw(st.sampled_from(sorted(COMMANDS)))
    value = data.draw(st.one_of(st.integers(2**63, 2**200), st.integers(-(2**200), -1)))
    return config_argv(command, files, [f"seed={value}"]), ("seed",)


# --- cross-field checks of a config -----------------------------------------------------------------------


@kind("config cross-field")
def min_len_above_max_len(data, files):
    high = data.draw(st.integers(2, 32))
    low = data.draw(st.integers(1, high - 1))
    command = data.draw(st.sampled_from(sorted(COMMANDS)))
    return config_argv(command, files, [f"task.min_len={high}", f"task.max_len={low}"]), ("task.min_len",)


@kind("config cross-field")
def group_algorithm_with_a_group_of_one(data, files):
    algo = data.draw(st.sampled_from(["grpo", "rloo"]))
    return config_argv("train", files, [f"algo.name={algo}", "algo.group_size=1"]), ("algo.group_size",)


@kind("config cross-field")
def model_reward_without_a_model(data, files):
    source = data.draw(st.sampled_from(["model", "both"]))
    return config_argv("train", files, [f"reward.source={source}"]), ("reward.model",)


@kind("config cross-field")
def reward_weights_not_one_per_function(data, files):
    n = data.draw(st.integers(1, 4))
    weights = data.draw(st.lists(st.floats(-5, 5), min_size=0, max_size=6).filter(lambda w: w and len(w) != n))
    fns = [f"m{i}:f" for i in range(n)]
    return config_argv("train", files, [f"task.reward_fns={fns}", f"task.reward_weights={weights}"]), (
        "task.reward_weights",
    )


@kind("config cross-field")
def reward_fn_and_reward_fns_together(data, files):
    return config_argv("train", files, [f"task.reward_fn={data.draw(WORD)}:f", "task.reward_fns=[a:f]"]), (
        "task.reward_fns",
    )


@kind("config cross-field")
def file_task_without_its_prompt_file_or_reward(data, files):
    extra = data.draw(st.sampled_from([[], ["task.reward_fn=m:f"], [f"task.prompt_file={files.path('.jsonl')}"]]))
    command = data.draw(st.sampled_from(sorted(COMMANDS)))
    missing = "task.reward_fn" if extra and extra[0].startswith("task.prompt_file") else "task.prompt_file"
    return config_argv(command, files, ["task.name=file", *extra]), (missing,)


@kind("config cross-field")
def runtime_setting_that_needs_the_ray_executor(data, files):
    setting = data.draw(
        st.sampled_from(
            [
                "runtime.controllers=2",
                "runtime.placement=dynamic",
                "runtime.plan_changes={2: interleave}",
            ]
        )
    )
    return config_argv("train", files, ["runtime.executor=reference", setting]), ("runtime.",)


@kind("config cross-field")
def more_controllers_than_prompts(data, files):
    prompts = data.draw(st.integers(1, 8))
    controllers = data.draw(st.integers(prompts + 1, 64))
    return config_argv("train", files, [f"rollout.prompts_per_iter={prompts}", f"runtime.controllers={controllers}"]), (
        "runtime.controllers",
    )


@kind("config cross-field")
def overlong_buffer_longer_than_responses(data, files):
    tokens = data.draw(st.integers(1, 64))
    buffer = data.draw(st.integers(tokens + 1, 10**4))
    return config_argv("train", files, [f"rollout.max_new_tokens={tokens}", f"algo.overlong_buffer={buffer}"]), (
        "algo.overlong_buffer",
    )


@kind("config cross-field")
def layouts_of_an_unknown_role(data, files):
    role = data.draw(WORD.filter(lambda w: w not in ROLES))
    return config_argv("train", files, [f"runtime.layouts={{{role}: {{tp: 1}}}}"]), (f"runtime.layouts.{role}",)


@kind("config cross-field")
def layout_that_does_not_fill_the_devices(data, files):
    role = data.draw(st.sampled_from(ROLES))
    dp, tp, pp = (data.draw(st.integers(1, 9)) for _ in range(3))
    if dp * tp * pp == 4:
        dp += 1
    layout = f"{{dp: {dp}, tp: {tp}, pp: {pp}}}"
    return config_argv("train", files, [f"runtime.layouts={{{role}: {layout}}}"]), (f"runtime.layouts.{role}",)


@kind("config cross-field")
def sharding_a_frozen_role_or_fsdp_with_pipelines(data, files):
    layout = data.draw(
        st.sampled_from(
            [
                "{ref: {sharding: zero}}",
                "{reward: {sharding: fsdp}}",
                "{actor: {pp: 2, dp: 2, sharding: fsdp}}",
                "{critic: {pp: 4, sharding: fsdp}}",
            ]
        )
    )
    return config_argv("train", files, [f"runtime.layouts={layout}"]), ("runtime.layouts.",)


@kind("config cross-field")
def plan_change_at_a_bad_iteration(data, files):
    key = data.draw(st.one_of(st.integers(-(10**6), 0).map(str), WORD, st.just("1.5")))
    return config_argv("train", files, [f"runtime.plan_changes={{{key}: interleave}}"]), ("runtime.plan_changes",)


@kind("config cross-field")
def old_checkpoint_name_conflicting_with_the_new(data, files):
    old = data.draw(st.integers(3, 50))
    new = data.draw(st.integers(1, 50).filter(lambda n: n not in (old, 2)))
    return config_argv("train", files, [f"checkpoint.keep_last={new}", f"loop.keep_checkpoints={old}"]), (
        "loop.keep_checkpoints",
    )


@kind("config cross-field")
def backend_unknown_or_named_twice(data, files):
    value = data.draw(st.one_of(WORD.map(lambda w: f"[{w}]"), st.just("[tensorboard, tensorboard]")))
    return config_argv("train", files, [f"report.backends={value}"]), ("report.backends",)


# --- YAML config files ------------------------------------------------------------------------------------


def _yaml_kind(make_text):
    """A config-file kind: ``make_text(data)`` → the file's content; the error must name the file."""

    def make(data, files):
        command = data.draw(st.sampled_from(sorted(COMMANDS)))
        path = files.write(".yaml", make_text(data))
        return [command, path, f"{'run_dir' if command == 'train' else 'out_dir'}={files.path('-out')}"], (path,)

    make.__name__ = make_text.__name__
    return make


@kind("config file")
@_yaml_kind
def broken_yaml_syntax(data):
    good = "seed: 1\nloop:\n  iterations: 2\nalgo: {name: ppo}\n"
    junk = data.draw(
        st.sampled_from(
            ["{", "[", "]", "}", ": :", "\t", "'", '"', "- x\n", "? ", "%", "@", "`", "&", "*x", "!!binary 1"]
        )
    )
    at = data.draw(st.integers(0, len(good)))
    return good[:at] + junk + good[at:] if yaml_fails(good[:at] + junk + good[at:]) else good + "algo: {name: [\n"


def yaml_fails(text: str) -> bool:
    try:
        yaml.safe_load(text)
    except yaml.YAMLError:
        return True
    return False


@kind("config file")
@_yaml_kind
def top_level_not_a_mapping(data):
    return data.draw(
        st.sampled_from(
            ["- seed\n- 1\n", "42\n", "just words\n", "!!set {a, b}\n", "[1, 2]\n", "'quoted'\n", "3.5\n", "true\n"]
        )
    )


@kind("config file")
@_yaml_kind
def binary_junk(data):
    return data.draw(st.binary(max_size=64)) + data.draw(NOT_UTF8) + data.draw(st.binary(max_size=64))


@kind("config file")
@_yaml_kind
def control_characters(data):
    char = data.draw(st.sampled_from([chr(c) for c in (0, 1, 2, 7, 8, 11, 12, 27, 127)]))
    return f"seed: 1\nrun_dir: a{char}b\n"


@kind("config file")
@_yaml_kind
def duplicate_keys(data):
    key = data.draw(st.sampled_from(["seed", "algo", "loop", "task", "optim"]))
    return f"{key}: 1\nrun_dir: x\n{key}: 2\n"


@kind("config file")
@_yaml_kind
def nested_too_deeply(data):
    depth = data.draw(st.integers(51, 400))
    style = data.draw(st.sampled_from(["flow", "mapping"]))
    if style == "flow":
        return "seed: " + "[" * depth + "]" * depth + "\n"
    return "".join(f"{'  ' * i}k{i}:\n" for i in range(depth)) + "  " * depth + "1\n"


@kind("config file")
@_yaml_kind
def alias_inside_its_own_anchor(data):
    return data.draw(st.sampled_from(["seed: &a [*a]\n", "algo: &a {x: *a}\n", "loop: &b [1, [2, *b]]\n"]))


@kind("config file")
@_yaml_kind
def unknown_key_in_the_file(data):
    return f"seed: 1\n{data.draw(WORD.filter(lambda w: w not in {'seed', 'steps'}))}: 2\n"


@kind("config file")
@_yaml_kind
def section_of_the_wrong_type(data):
    return f"task: {data.draw(st.sampled_from(['5', 'word', '[1, 2]', 'true', '3.5']))}\n"


@kind("config file")
@_yaml_kind
def python_object_tags(data):
    return data.draw(
        st.sampled_from(
            [
                "seed: !!python/object/apply:os.system ['true']\n",
                "seed: !!python/name:os.system\n",
                "run_dir: !!python/tuple [1]\n",
            ]
        )
    )


@kind("config file")
@_yaml_kind
def several_documents(data):
    return "seed: 1\n---\nseed: 2\n" * data.draw(st.integers(1, 3))


@kind("config file")
@_yaml_kind
def undefined_alias(data):
    return f"seed: *{data.draw(WORD)}\n"


@kind("config file")
def config_path_missing_or_a_directory(data, files):
    path = data.draw(st.sampled_from([files.path(".yaml"), str(files.root)]))
    return ["train", path], (path,)
