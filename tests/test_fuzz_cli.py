"""Fuzzing the `loomrl` command with hypothesis: every kind of malformed input ends with status 2 and one line.

Each entry of :data:`KINDS` is one kind of malformed input (a config override of the wrong type, a broken YAML
file, a plan string with a reversed device range, a truncated plan file, a prompt file with invalid UTF-8, ...),
grouped by category; hypothesis draws the junk that makes each example of it. Every example goes through
``loomrl.cli.main`` in this process and must end the way the command promises for a user error: status 2 and
exactly one stderr line, ``loomrl: error: ...``, naming the field or the file (no traceback, no progress bar).
The commands are chosen to fail while the config, plan or data is validated; should an input be accepted, the
model building, planning and executor steps that would follow are replaced by a sentinel that fails the test, so
no example builds a model or starts Ray. A few examples run in a real process as well.

Examples per kind: ``LOOMRL_FUZZ_EXAMPLES`` (default 6); the examples are the same on every run unless
``LOOMRL_FUZZ_RANDOM=1`` lets hypothesis draw new ones.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import itertools
import json
import os
import subprocess
import sys
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loomrl.cli import main
from loomrl.config.schema import RMConfig, SFTConfig, TrainConfig

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = int(os.environ.get("LOOMRL_FUZZ_EXAMPLES", "6"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    derandomize=os.environ.get("LOOMRL_FUZZ_RANDOM") != "1",
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.function_scoped_fixture,
        HealthCheck.data_too_large,
        HealthCheck.filter_too_much,
    ],
)
RUNTIME = ["runtime.device=cpu", "runtime.devices=4"]
"""A 'ray' run on four CPU devices (cpu:1x4): plans are resolved against it; Ray itself never starts."""
MFCS = ("actor_gen", "ref_inf", "reward_inf", "critic_inf", "actor_train", "critic_train")
"""The model calls of the default (PPO) workflow, which a plan string must all place."""
ROLES = ("actor", "critic", "ref", "reward")


class Accepted(Exception):
    """Raised where a run would build models, plan or start workers: the input passed validation."""


# ------------------------------------------------------------------------------------------ the harness


class Files:
    """Writes each example's files under one directory, every one under a new name."""

    def __init__(self, root: Path) -> None:
        self.root, self.count = root, itertools.count()

    def write(self, suffix: str, data: str | bytes) -> str:
        path = self.root / f"f{next(self.count)}{suffix}"
        path.write_bytes(data if isinstance(data, bytes) else data.encode("utf-8"))
        return str(path)

    def path(self, suffix: str = "") -> str:
        return str(self.root / f"f{next(self.count)}{suffix}")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    (root / "rewards.py").write_text("def score(prompt, response, answer):\n    return 0.0\n")
    return Files(root)


@pytest.fixture(scope="module", autouse=True)
def sentinels(tmp_path_factory):
    """Past validation every command would build models, plan or start Ray: each of those raises Accepted."""
    import datasets.config
    from transformers.utils import logging as hf_logging

    import loomrl.planner.describe
    import loomrl.planner.planning
    import loomrl.train.evaluation
    import loomrl.train.rl
    import loomrl.train.rm
    import loomrl.train.sft

    def accepted(*args, **kwargs):
        raise Accepted("the malformed input passed validation")

    verbosity, bar = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    with pytest.MonkeyPatch.context() as patch:
        for module, name in (
            (loomrl.train.rl, "make_executor"),
            (loomrl.train.sft, "build_causal_lm"),
            (loomrl.train.rm, "build_value_model"),
            (loomrl.train.evaluation, "build_causal_lm"),
            (loomrl.planner.planning, "compare_plans"),
            (loomrl.planner.describe, "simulate_fixed"),
        ):
            patch.setattr(module, name, accepted)
        # prompt files are converted by datasets into its cache: keep the fuzzer's thousands of them out of ~/.cache
        patch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("datasets-cache")))
        yield
    hf_logging.set_verbosity(verbosity)  # main() quiets transformers for the process; leave it as it was
    (hf_logging.enable_progress_bar if bar else hf_logging.disable_progress_bar)()


def run_main(argv: list[str]) -> tuple[int | None, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as stop:  # argparse's errors
            code = stop.code
    return code, out.getvalue(), err.getvalue()


def assert_one_line_error(code: Any, stderr: str, names: tuple[str, ...], argv: list[str]) -> str:
    lines = stderr.splitlines()
    assert code == 2, f"exit {code!r} for {argv!r}; stderr:\n{stderr}"
    assert "Traceback" not in stderr, stderr
    assert len(lines) == 1, f"expected one stderr line for {argv!r}, got {len(lines)}:\n{stderr}"
    assert lines[0].startswith("loomrl: error: "), lines[0]
    assert any(name in lines[0] for name in names), f"none of {names!r} named in {lines[0]!r}"
    return lines[0]


# ---------------------------------------------------------------------------------------- junk strategies


WORD = st.from_regex(r"[a-z][a-z_]{0,9}x", fullmatch=True)
"""A bare word that YAML reads as a string (never a number, bool or null) and no float literal."""
FLOATS = st.floats(allow_nan=False, allow_infinity=False, min_value=-1e6, max_value=1e6)
NONFINITE = st.sampled_from([".nan", ".inf", "-.inf", ".NaN", ".Inf"])
NOT_UTF8 = st.sampled_from([b"\xff", b"\xfe\xff", b"\xc3\x28", b"\x80", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80"])
JSON_SCALARS = st.one_of(st.integers(-(10**6), 10**6), FLOATS, st.booleans(), st.none(), st.text(max_size=8))


def quoted(text: str) -> str:
    """``text`` as a single-quoted YAML scalar (an override value that YAML must not read as anything else)."""
    return "'" + text.replace("'", "''") + "'"


def nested(depth: int, leaf: Any = 1) -> Any:
    for _ in range(depth):
        leaf = [leaf]
    return leaf


# -------------------------------------------------------------------------------- the configs' leaf fields


@dataclasses.dataclass(frozen=True)
class Leaf:
    path: str
    kind: type | None
    """int, float, bool or str (also for ``X | None``); None for lists, tuples and mappings."""
    optional: bool
    bounds: dict[str, float]
    choices: tuple[Any, ...] | None


def _leaves(cls: type, prefix: str = "") -> list[Leaf]:
    hints = typing.get_type_hints(cls)
    out: list[Leaf] = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        hint, path = hints[f.name], prefix + f.name
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            out.extend(_leaves(hint, path + "."))
            continue
        args = typing.get_args(hint)
        optional = type(None) in args
        members = [a for a in args if a is not type(None)] if optional else [hint]
        kind = members[0] if len(members) == 1 and members[0] in (int, float, bool, str) else None
        spec = next((m for m in f.metadata.values() if hasattr(m, "choices")), None)
        bounds = (
            {}
            if spec is None
            else {k: getattr(spec, k) for k in ("ge", "gt", "le", "lt") if getattr(spec, k) is not None}
        )
        out.append(Leaf(path, kind, optional, bounds, None if spec is None else spec.choices))
    return out


def _sections(cls: type, prefix: str = "") -> list[str]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            out.append(prefix + f.name)
            out.extend(_sections(hint, prefix + f.name + "."))
    return out


COMMANDS = {"train": TrainConfig, "sft": SFTConfig, "rm": RMConfig}
LEAVES = {name: _leaves(cls) for name, cls in COMMANDS.items()}
SECTIONS = {name: _sections(cls) for name, cls in COMMANDS.items()}


def _pick(data, kind: type, want: Callable[[Leaf], bool] = lambda leaf: True) -> tuple[str, Leaf]:
    """A command and one of its leaf fields of ``kind`` that ``want`` accepts."""
    command = data.draw(st.sampled_from(sorted(COMMANDS)), label="command")
    leaves = [leaf for leaf in LEAVES[command] if leaf.kind is kind and want(leaf)]
    if not leaves:
        command, leaves = "train", [leaf for leaf in LEAVES["train"] if leaf.kind is kind and want(leaf)]
    return command, data.draw(st.sampled_from(leaves), label="field")


def _config_argv(command: str, files: Files, overrides: list[str]) -> list[str]:
    where = {"train": "run_dir", "sft": "out_dir", "rm": "out_dir"}[command]
    return [command, f"{where}={files.path('-out')}", *(RUNTIME if command == "train" else []), *overrides]


# --------------------------------------------------------------------------------------------- the kinds


@dataclasses.dataclass(frozen=True)
class Kind:
    name: str
    category: str
    make: Callable[[Any, Files], tuple[list[str], tuple[str, ...]]]
    """(data, files) → (argv, strings of which the error line must name one)."""


KINDS: list[Kind] = []


def kind(category: str):
    def register(make):
        KINDS.append(Kind(make.__name__.replace("_", "-"), category, make))
        return make

    return register


# --- config overrides (key=value) -------------------------------------------------------------------------


@kind("config override")
def unknown_top_level_key(data, files):
    command = data.draw(st.sampled_from(sorted(COMMANDS)))
    top = {leaf.path.split(".")[0] for leaf in LEAVES[command]}
    key = data.draw(WORD.filter(lambda w: w not in top))
    return _config_argv(command, files, [f"{key}=1"]), (key,)


@kind("config override")
def unknown_nested_key(data, files):
    command = data.draw(st.sampled_from(sorted(COMMANDS)))
    section = data.draw(st.sampled_from(SECTIONS[command]))
    known = {leaf.path for leaf in LEAVES[command]} | set(SECTIONS[command])
    key = data.draw(WORD.filter(lambda w: f"{section}.{w}" not in known))
    return _config_argv(command, files, [f"{section}.{key}=1"]), (f"{section}.{key}",)


@kind("config override")
def int_field_gets_a_word(data, files):
    command, leaf = _pick(data, int)
    return _config_argv(command, files, [f"{leaf.path}={data.draw(WORD)}"]), (leaf.path,)


@kind("config override")
def int_field_gets_a_fraction(data, files):
    command, leaf = _pick(data, int)
    value = data.draw(FLOATS.filter(lambda v: v != int(v)))
    return _config_argv(command, files, [f"{leaf.path}={value!r}"]), (leaf.path,)


@kind("config override")
def int_field_gets_a_bool(data, files):
    command, leaf = _pick(data, int)
    value = data.draw(st.sampled_from(["true", "false", "yes", "no", "on", "off"]))
    return _config_argv(command, files, [f"{leaf.path}={value}"]), (leaf.path,)


@kind("config override")
def float_field_gets_a_word(data, files):
    command, leaf = _pick(data, float)
    return _config_argv(command, files, [f"{leaf.path}={data.draw(WORD)}"]), (leaf.path,)


@kind("config override")
def bounded_float_gets_nan_or_inf(data, files):
    command, leaf = _pick(data, float, lambda leaf: bool(leaf.bounds))
    values = (
        [".nan", ".NaN"]
        + ([".inf", ".Inf"] if {"le", "lt"} & set(leaf.bounds) else [])
        + (["-.inf"] if {"ge", "gt"} & set(leaf.bounds) else [])
    )  # inf under a lower bound alone is valid: no limit
    return _config_argv(command, files, [f"{leaf.path}={data.draw(st.sampled_from(values))}"]), (leaf.path,)


@kind("config override")
def bool_field_gets_a_number(data, files):
    command, leaf = _pick(data, bool)
    value = data.draw(st.one_of(st.integers(-5, 5), FLOATS))
    return _config_argv(command, files, [f"{leaf.path}={value!r}"]), (leaf.path,)


@kind("config override")
def bool_field_gets_a_word(data, files):
    command, leaf = _pick(data, bool)
    return _config_argv(command, files, [f"{leaf.path}={data.draw(WORD)}"]), (leaf.path,)


@kind("config override")
def str_field_gets_a_list_or_mapping(data, files):
    command, leaf = _pick(data, str)
    value = data.draw(st.sampled_from(["[1, 2]", "{a: 1}", "[]", "{}", "[x, [y]]"]))
    return _config_argv(command, files, [f"{leaf.path}={value}"]), (leaf.path,)


@kind("config override")
def required_str_field_gets_a_number_or_null(data, files):
    command, leaf = _pick(data, str, lambda leaf: not leaf.optional)
    value = data.draw(st.one_of(st.integers(-99, 99).map(str), st.just("null"), st.just("~")))
    return _config_argv(command, files, [f"{leaf.path}={value}"]), (leaf.path,)


@kind("config override")
def number_below_its_lower_bound(data, files):
    command = data.draw(st.sampled_from(sorted(COMMANDS)))
    leaves = [leaf for leaf in LEAVES[command] if leaf.kind in (int, float) and {"ge", "gt"} & set(leaf.bounds)]
    leaf = data.draw(st.sampled_from(leaves))
    low = leaf.bounds.get("ge", leaf.bounds.get("gt"))
    below = data.draw(st.integers(1 if "ge" in leaf.bounds else 0, 10**6))
    value = low - below if leaf.kind is int else low - below - data.draw(st.floats(0, 0.5))
    return _config_argv(command, files, [f"{leaf.path}={value!r}"]), (leaf.path,)


@kind("config override")
def number_above_its_upper_bound(data, files):
    command = data.draw(st.sampled_from(sorted(COMMANDS)))
    leaves = [leaf for leaf in LEAVES[command] if leaf.kind in (int, float) and {"le", "lt"} & set(leaf.bounds)]
    leaf = data.draw(st.sampled_from(leaves))
    high = leaf.bounds.get("le", leaf.bounds.get("lt"))
    above = data.draw(st.integers(1 if "le" in leaf.bounds else 0, 10**6))
    value = high + above if leaf.kind is int else high + above + data.draw(st.floats(0, 0.5))
    return _config_argv(command, files, [f"{leaf.path}={value!r}"]), (leaf.path,)


@kind("config override")
def word_outside_the_choices(data, files):
    command = data.draw(st.sampled_from(sorted(COMMANDS)))
    leaf = data.draw(st.sampled_from([leaf for leaf in LEAVES[command] if leaf.choices and leaf.kind is str]))
    value = data.draw(WORD.filter(lambda w: w not in leaf.choices))
    return _config_argv(command, files, [f"{leaf.path}={value}"]), (leaf.path,)


@kind("config override")
def section_gets_a_scalar_or_list(data, files):
    command = data.draw(st.sampled_from(sorted(COMMANDS)))
    section = data.draw(st.sampled_from(SECTIONS[command]))
    value = data.draw(st.one_of(st.integers(-9, 9).map(str), WORD, st.just("[1, 2]")))
    return _config_argv(command, files, [f"{section}={value}"]), (section,)


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
    return _config_argv(command, files, [f"{leaf.path}={value}"]), (leaf.path,)


@kind("config override")
def betas_of_the_wrong_length(data, files):
    command = data.draw(st.sampled_from(sorted(COMMANDS)))
    leaf = data.draw(st.sampled_from([leaf for leaf in LEAVES[command] if leaf.path.endswith("betas")]))
    n = data.draw(st.sampled_from([0, 1, 3, 4]))
    return _config_argv(command, files, [f"{leaf.path}={[0.5] * n}"]), (leaf.path,)


@kind("config override")
def betas_outside_zero_to_one(data, files):
    command = data.draw(st.sampled_from(sorted(COMMANDS)))
    leaf = data.draw(st.sampled_from([leaf for leaf in LEAVES[command] if leaf.path.endswith("betas")]))
    bad = data.draw(st.one_of(NONFINITE, st.floats(1, 10).map(repr), st.floats(-10, -1e-3).map(repr)))
    pair = [bad, "0.9"] if data.draw(st.booleans()) else ["0.9", bad]
    return _config_argv(command, files, [f"{leaf.path}=[{', '.join(pair)}]"]), (leaf.path,)


@kind("config override")
def override_without_equals(data, files):
    command = data.draw(st.sampled_from(sorted(COMMANDS)))
    word = data.draw(WORD)
    return _config_argv(command, files, ["seed=1", word]), (word,)


@kind("config override")
def override_with_a_malformed_key(data, files):
    key = data.draw(st.sampled_from(["", ".", "a..b", ".seed", "seed.", "a b", " "]))
    return _config_argv("train", files, [f"{key}={data.draw(WORD)}"]), ("override",)


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
    return _config_argv("train", files, [f"{field}={value}"]), (field,)


@kind("config override")
def override_value_with_control_characters(data, files):
    char = data.draw(st.sampled_from([chr(c) for c in (*range(0, 9), 11, 12, *range(14, 32), 127)]))
    text = data.draw(WORD)
    position = data.draw(st.integers(1, len(text) - 1))  # inside: str.strip() takes \x0b, \x0c, \x1c-\x1f at the ends
    return _config_argv("train", files, [f"run_dir={text[:position]}{char}{text[position:]}"]), ("run_dir",)


@kind("config override")
def override_value_nested_too_deeply(data, files):
    depth = data.draw(st.integers(51, 300))
    return _config_argv("train", files, [f"seed={json.dumps(nested(depth))}"]), ("seed",)


@kind("config override")
def seed_out_of_range(data, files):
    command = data.draw(st.sampled_from(sorted(COMMANDS)))
    value = data.draw(st.one_of(st.integers(2**63, 2**200), st.integers(-(2**200), -1)))
    return _config_argv(command, files, [f"seed={value}"]), ("seed",)


# --- cross-field checks of a config -----------------------------------------------------------------------


@kind("config cross-field")
def min_len_above_max_len(data, files):
    high = data.draw(st.integers(2, 32))
    low = data.draw(st.integers(1, high - 1))
    command = data.draw(st.sampled_from(sorted(COMMANDS)))
    return _config_argv(command, files, [f"task.min_len={high}", f"task.max_len={low}"]), ("task.min_len",)


@kind("config cross-field")
def group_algorithm_with_a_group_of_one(data, files):
    algo = data.draw(st.sampled_from(["grpo", "rloo"]))
    return _config_argv("train", files, [f"algo.name={algo}", "algo.group_size=1"]), ("algo.group_size",)


@kind("config cross-field")
def model_reward_without_a_model(data, files):
    source = data.draw(st.sampled_from(["model", "both"]))
    return _config_argv("train", files, [f"reward.source={source}"]), ("reward.model",)


@kind("config cross-field")
def reward_weights_not_one_per_function(data, files):
    n = data.draw(st.integers(1, 4))
    weights = data.draw(st.lists(st.floats(-5, 5), min_size=0, max_size=6).filter(lambda w: w and len(w) != n))
    fns = [f"m{i}:f" for i in range(n)]
    return _config_argv("train", files, [f"task.reward_fns={fns}", f"task.reward_weights={weights}"]), (
        "task.reward_weights",
    )


@kind("config cross-field")
def reward_fn_and_reward_fns_together(data, files):
    return _config_argv("train", files, [f"task.reward_fn={data.draw(WORD)}:f", "task.reward_fns=[a:f]"]), (
        "task.reward_fns",
    )


@kind("config cross-field")
def file_task_without_its_prompt_file_or_reward(data, files):
    extra = data.draw(st.sampled_from([[], ["task.reward_fn=m:f"], [f"task.prompt_file={files.path('.jsonl')}"]]))
    command = data.draw(st.sampled_from(sorted(COMMANDS)))
    missing = "task.reward_fn" if extra and extra[0].startswith("task.prompt_file") else "task.prompt_file"
    return _config_argv(command, files, ["task.name=file", *extra]), (missing,)


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
    return _config_argv("train", files, ["runtime.executor=reference", setting]), ("runtime.",)


@kind("config cross-field")
def more_controllers_than_prompts(data, files):
    prompts = data.draw(st.integers(1, 8))
    controllers = data.draw(st.integers(prompts + 1, 64))
    return _config_argv(
        "train", files, [f"rollout.prompts_per_iter={prompts}", f"runtime.controllers={controllers}"]
    ), ("runtime.controllers",)


@kind("config cross-field")
def overlong_buffer_longer_than_responses(data, files):
    tokens = data.draw(st.integers(1, 64))
    buffer = data.draw(st.integers(tokens + 1, 10**4))
    return _config_argv("train", files, [f"rollout.max_new_tokens={tokens}", f"algo.overlong_buffer={buffer}"]), (
        "algo.overlong_buffer",
    )


@kind("config cross-field")
def layouts_of_an_unknown_role(data, files):
    role = data.draw(WORD.filter(lambda w: w not in ROLES))
    return _config_argv("train", files, [f"runtime.layouts={{{role}: {{tp: 1}}}}"]), (f"runtime.layouts.{role}",)


@kind("config cross-field")
def layout_that_does_not_fill_the_devices(data, files):
    role = data.draw(st.sampled_from(ROLES))
    dp, tp, pp = (data.draw(st.integers(1, 9)) for _ in range(3))
    if dp * tp * pp == 4:
        dp += 1
    layout = f"{{dp: {dp}, tp: {tp}, pp: {pp}}}"
    return _config_argv("train", files, [f"runtime.layouts={{{role}: {layout}}}"]), (f"runtime.layouts.{role}",)


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
    return _config_argv("train", files, [f"runtime.layouts={layout}"]), ("runtime.layouts.",)


@kind("config cross-field")
def plan_change_at_a_bad_iteration(data, files):
    key = data.draw(st.one_of(st.integers(-(10**6), 0).map(str), WORD, st.just("1.5")))
    return _config_argv("train", files, [f"runtime.plan_changes={{{key}: interleave}}"]), ("runtime.plan_changes",)


@kind("config cross-field")
def old_checkpoint_name_conflicting_with_the_new(data, files):
    old = data.draw(st.integers(3, 50))
    new = data.draw(st.integers(1, 50).filter(lambda n: n not in (old, 2)))
    return _config_argv("train", files, [f"checkpoint.keep_last={new}", f"loop.keep_checkpoints={old}"]), (
        "loop.keep_checkpoints",
    )


@kind("config cross-field")
def backend_unknown_or_named_twice(data, files):
    value = data.draw(st.one_of(WORD.map(lambda w: f"[{w}]"), st.just("[tensorboard, tensorboard]")))
    return _config_argv("train", files, [f"report.backends={value}"]), ("report.backends",)


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


# --- plan strings: runtime.plan=..., train --plan, plan --plan ---------------------------------------------


def _plan_argv(data, files, text: str) -> list[str]:
    """``text`` as runtime.plan, as train --plan, or as plan --plan on the same four CPU devices."""
    channel = data.draw(st.sampled_from(["override", "train-flag", "plan-flag"]), label="channel")
    if channel == "override":
        return _config_argv("train", files, [f"runtime.plan={quoted(text)}"])
    if channel == "train-flag":
        return [*_config_argv("train", files, []), "--plan", text]
    return ["plan", "--cluster", "cpu:1x4", "--model", "llama-1m", "--plan", text, "--out", files.path("-plan")]


def _placement(**items: str) -> str:
    """A plan string placing every call on all four devices, with ``items`` replacing or adding items."""
    placed = {name: "0-3" for name in MFCS}
    placed.update(items)
    return "; ".join(f"{name}={value}" for name, value in placed.items())


@kind("plan string")
def unknown_strategy(data, files):
    word = data.draw(WORD.filter(lambda w: w.partition(":")[0] not in ("colocate", "interleave", "separate")))
    return _plan_argv(data, files, word), ("plan",)


@kind("plan string")
def separate_with_a_bad_device_count(data, files):
    count = data.draw(
        st.one_of(WORD, st.integers(-99, 0).map(str), st.integers(4, 10**30).map(str), st.just("1.5"), st.just("2x"))
    )  # 'separate:' alone means separate
    return _plan_argv(data, files, f"separate:{count}"), ("separate", "gen_devices", "plan")


@kind("plan string")
def argument_to_a_strategy_without_one(data, files):
    strategy = data.draw(st.sampled_from(["colocate", "interleave"]))
    return _plan_argv(data, files, f"{strategy}:{data.draw(st.integers(0, 9))}"), ("plan",)


@kind("plan string")
def placement_after_a_strategy(data, files):
    strategy = data.draw(st.sampled_from(["colocate", "interleave", "separate:1"]))
    return _plan_argv(data, files, f"{strategy}; {data.draw(st.sampled_from(MFCS))}=0-3"), ("plan item",)


@kind("plan string")
def fusion_item_malformed(data, files):
    value = data.draw(
        st.one_of(
            WORD,
            st.floats(1.0001, 1e9).map(lambda v: f"migrate_at:{v}"),
            st.floats(-1e9, -1e-6).map(lambda v: f"migrate_at:{v}"),
            st.sampled_from(
                [
                    "migrate_at:nan",
                    "migrate_at:inf",
                    "migrate_at:x",
                    "migrate_to:0",
                    "migrate_to:-1",
                    "migrate_to:x",
                    "chunk:-1",
                    "chunk:1.5",
                    "chunk:",
                    "migrate_at",
                    ":",
                    "migrate_to:99",
                ]
            ),
        )
    )
    strategy = data.draw(st.sampled_from(["colocate", "interleave", "separate:2", _placement()]))
    return _plan_argv(data, files, f"{strategy}; stream_fusion={value}"), ("stream_fusion",)


@kind("plan string")
def fuse_train_neither_on_nor_off(data, files):
    value = data.draw(WORD.filter(lambda w: w not in ("on", "off")))
    return _plan_argv(data, files, f"colocate; pipeline_fusion={value}"), ("pipeline_fusion",)


@kind("plan string")
def unknown_model_call(data, files):
    name = data.draw(
        WORD.filter(lambda w: w not in MFCS and w not in ("shadow", "offload", "stream_fusion", "advantages"))
    )
    return _plan_argv(data, files, _placement(**{name: "0-3"})), (name,)


@kind("plan string")
def item_without_name_or_equals(data, files):
    item = data.draw(st.sampled_from(["=0-3", " = 0-3", "=", "=:dp4"]))
    return _plan_argv(data, files, f"{_placement()}; {item}"), ("plan item",)


@kind("plan string")
def device_list_malformed(data, files):
    devices = data.draw(st.sampled_from(["", "a", "0-", "-3", "0--3", "0,,1", "0-3-5", "0.5", "0:3", "x-y", "1e2"]))
    mfc = data.draw(st.sampled_from(MFCS))
    return _plan_argv(data, files, _placement(**{mfc: devices})), (mfc, "plan")


@kind("plan string")
def device_range_reversed(data, files):
    first = data.draw(st.integers(1, 3))
    last = data.draw(st.integers(0, first - 1))
    mfc = data.draw(st.sampled_from(MFCS))
    return _plan_argv(data, files, _placement(**{mfc: f"{first}-{last}"})), (mfc,)


@kind("plan string")
def device_outside_the_cluster(data, files):
    mfc = data.draw(st.sampled_from(MFCS))
    high = data.draw(st.integers(4, 10**6))
    devices = data.draw(st.sampled_from([f"0-{4 + high % 1000}", f"{high}", f"0,{high}"]))
    return _plan_argv(data, files, _placement(**{mfc: devices})), (mfc,)


@kind("plan string")
def overlapping_ranges_in_one_mesh(data, files):
    mfc = data.draw(st.sampled_from(MFCS))
    a = data.draw(st.integers(0, 3))
    return _plan_argv(data, files, _placement(**{mfc: f"0-3,{a}"})), (mfc,)


@kind("plan string")
def device_range_of_astronomical_size(data, files):
    mfc = data.draw(st.sampled_from(MFCS))
    end = data.draw(st.integers(2**20, 10**40))
    return _plan_argv(data, files, _placement(**{mfc: f"0-{end}"})), (mfc,)


def _bad_layout(data, files, layouts: list[str]):
    """One call placed on devices 0-3 with one of ``layouts``; the error must name the call."""
    mfc = data.draw(st.sampled_from(MFCS))
    return _plan_argv(data, files, _placement(**{mfc: f"0-3:{data.draw(st.sampled_from(layouts))}"})), (mfc,)


@kind("plan string")
def layout_with_junk_tokens(data, files):
    return _bad_layout(data, files, ["x", "dp", "tp", "dp4x", "d4", "DP4", "dp-1", "dp4 tp1", "4", "dp4,", "pp"])


@kind("plan string")
def layout_degree_zero(data, files):
    return _bad_layout(data, files, ["dp0", "tp0", "pp0", "mb0", "dp00", "tp1pp0"])


@kind("plan string")
def layout_not_matching_its_mesh(data, files):
    mfc = data.draw(st.sampled_from(MFCS))
    dp, tp = data.draw(st.integers(1, 9)), data.draw(st.integers(1, 9))
    if dp * tp == 4:
        dp += 1
    return _plan_argv(data, files, _placement(**{mfc: f"0-3:dp{dp}tp{tp}"})), (mfc,)


@kind("plan string")
def layout_token_given_twice(data, files):
    return _bad_layout(data, files, ["dp2dp2", "tp1tp1", "mb2mb2", "rcrc", "zerozero", "pp2revrev"])


@kind("plan string")
def call_placed_twice(data, files):
    mfc = data.draw(st.sampled_from(MFCS))
    return _plan_argv(data, files, f"{_placement()}; {mfc}=0-1"), (mfc,)


@kind("plan string")
def call_not_placed(data, files):
    missing = data.draw(st.sets(st.sampled_from(MFCS), min_size=1, max_size=len(MFCS) - 1))
    text = "; ".join(f"{name}=0-3" for name in MFCS if name not in missing)
    return _plan_argv(data, files, text), tuple(missing)


@kind("plan string")
def unknown_role_in_shadow_or_offload(data, files):
    key = data.draw(st.sampled_from(["shadow", "offload"]))
    role = data.draw(WORD.filter(lambda w: w not in ROLES))
    return _plan_argv(data, files, f"colocate; {key}={role}"), (role,)


@kind("plan string")
def incompatible_call_options(data, files):
    mfc, layout = data.draw(
        st.sampled_from(
            [
                ("actor_train", "dp4zerofsdp"),
                ("critic_train", "pp2dp2fsdp"),
                ("actor_gen", "dp4rc"),
                ("ref_inf", "dp4rc"),
                ("actor_gen", "dp2rev"),
                ("critic_inf", "dp1pp4rcrev"),
            ]
        )
    )
    return _plan_argv(data, files, _placement(**{mfc: f"0-3:{layout}"})), (mfc,)


@kind("plan string")
def compute_step_sharded(data, files):
    layout = data.draw(st.sampled_from(["0-3:tp4", "0-3:pp4", "0-3:dp2tp2", "0-1:tp2"]))
    return _plan_argv(data, files, _placement(advantages=layout)), ("advantages",)


@kind("plan string")
def plan_change_to_a_malformed_plan(data, files):
    text = data.draw(
        st.sampled_from(["colocatee", "separate:0", "actor_gen=0-9", "colocate; stream_fusion=x", "interleave:2"])
    )
    iteration = data.draw(st.integers(1, 10**6))
    argv = _config_argv("train", files, [f"runtime.plan_changes={{{iteration}: {quoted(text)}}}"])
    return argv, (f"runtime.plan_changes.{iteration}",)


# --- plan files (as `loomrl plan --out` and a run's plan file write them) ---------------------------------


def _plan_file_text(data) -> str:
    """A valid plan file for cpu:1x4, of a strategy drawn, as ExecutionPlan.save writes it."""
    from loomrl.algorithms.workflows import build_workflow
    from loomrl.plan import make_plan
    from loomrl.plan.cluster import ClusterSpec

    cfg = TrainConfig()
    strategy = data.draw(st.sampled_from(["colocate", "interleave", "separate:1", "separate:2", "separate:3"]))
    plan = make_plan(strategy, build_workflow(cfg.algo, cfg.rollout), ClusterSpec.parse("cpu:1x4"))
    return json.dumps(plan.to_dict(), indent=2) + "\n"


def _plan_file_kind(mutate):
    """A plan-file kind: ``mutate(data, plan_dict)`` → the file's content (str or bytes) or a mutated dict."""

    def make(data, files):
        text = _plan_file_text(data)
        content = mutate(data, json.loads(text)) if mutate.__code__.co_argcount == 2 else mutate(data, text, None)
        if isinstance(content, dict):
            content = json.dumps(content)
        path = files.write(".json", content)
        return _plan_argv(data, files, path), (path, "plan.")

    make.__name__ = mutate.__name__
    return make


@kind("plan file")
@_plan_file_kind
def truncated(data, text, _):
    return text[: data.draw(st.integers(0, len(text) - 3))]


@kind("plan file")
@_plan_file_kind
def not_json_at_all(data, text, _):
    return data.draw(st.one_of(st.binary(max_size=40).map(lambda b: b + b"\xff"), WORD, st.just("colocate")))


@kind("plan file")
@_plan_file_kind
def top_level_not_an_object(data, text, _):
    return json.dumps(data.draw(st.one_of(JSON_SCALARS, st.lists(JSON_SCALARS, max_size=3))))


@kind("plan file")
@_plan_file_kind
def key_given_twice(data, text, _):
    key = data.draw(st.sampled_from(["cluster", "allocations", "shadow"]))
    return text.rstrip().rstrip("}") + f', "{key}": null}}'


@kind("plan file")
@_plan_file_kind
def plan_nested_too_deeply(data, text, _):
    depth = data.draw(st.integers(2000, 100_000))
    return '{"cluster": ' + "[" * depth + "]" * depth + "}" if data.draw(st.booleans()) else "[" * depth + "]" * depth


@kind("plan file")
@_plan_file_kind
def nan_or_infinity_in_a_number(data, text, _):
    value = data.draw(st.sampled_from(["NaN", "Infinity", "-Infinity"]))
    return text.replace('"memory_gb": 24.0', f'"memory_gb": {value}')


@kind("plan file")
@_plan_file_kind
def field_of_the_wrong_type(data, plan):
    name = data.draw(st.sampled_from(sorted(plan["allocations"])))
    alloc = plan["allocations"][name]
    target, key = data.draw(
        st.sampled_from(
            [
                (plan["cluster"], "nodes"),
                (plan["cluster"], "devices_per_node"),
                (plan["cluster"], "memory_gb"),
                (plan["cluster"], "profile"),
                (alloc, "devices"),
                (alloc, "dp"),
                (alloc, "tp"),
                (alloc, "pp"),
                (alloc, "micro_batches"),
                (plan, "shadow"),
                (plan, "offload"),
                (plan, "stream_fusion"),
                (plan, "allocations"),
                (plan, "cluster"),
            ]
        )
    )
    wrong = {
        "nodes": ["x", 1.5, True, [1]],
        "devices_per_node": ["4", 4.0, False, None],
        "memory_gb": ["lots", True, [1], {}],
        "profile": [1, None, ["local"]],
        "devices": [1.5, True, {"a": 1}, None, ["0"], [0.5]],
        "dp": ["2", 2.0, True, [2], None],
        "tp": ["1", 1.0, None],
        "pp": ["1", False, {}],
        "micro_batches": ["1", 1.5, []],
        "shadow": ["actor", 1, {"a": 1}, [1]],
        "offload": ["ref", 2, [None]],
        "stream_fusion": ["on", 1, [1]],
        "allocations": [[], "x", 1, None],
        "cluster": ["cpu:4", 4, [], None],
    }[key]
    target[key] = data.draw(st.sampled_from(wrong))
    return plan


@kind("plan file")
@_plan_file_kind
def unknown_key(data, plan):
    where = data.draw(st.sampled_from(["top", "cluster", "allocation", "stream_fusion"]))
    key = data.draw(WORD)
    if where == "top":
        plan[key] = 1
    elif where == "cluster":
        plan["cluster"][key] = 1
    elif where == "stream_fusion":
        plan["stream_fusion"] = {key: 1}
    else:
        plan["allocations"][data.draw(st.sampled_from(sorted(plan["allocations"])))][key] = 1
    return plan


@kind("plan file")
@_plan_file_kind
def required_field_missing(data, plan):
    where = data.draw(st.sampled_from(["cluster", "allocations", "nodes", "devices_per_node", "devices"]))
    if where in ("cluster", "allocations"):
        del plan[where]
    elif where == "devices":
        del plan["allocations"][data.draw(st.sampled_from(sorted(plan["allocations"])))]["devices"]
    else:
        del plan["cluster"][where]
    return plan


@kind("plan file")
@_plan_file_kind
def device_index_out_of_range(data, plan):
    name = data.draw(st.sampled_from(sorted(plan["allocations"])))
    bad = data.draw(st.one_of(st.integers(4, 10**30), st.integers(-(10**6), -1)))
    alloc = plan["allocations"][name]
    alloc["devices"] = [bad] if data.draw(st.booleans()) else (str(bad) if bad >= 0 else [bad])
    alloc.update(dp=1, tp=1, pp=1)
    return plan


@kind("plan file")
@_plan_file_kind
def overlapping_devices_in_one_mesh(data, plan):
    name = data.draw(st.sampled_from(sorted(plan["allocations"])))
    d = data.draw(st.integers(0, 3))
    plan["allocations"][name]["devices"] = data.draw(st.sampled_from([[d, d], f"{d},{d}", f"0-3,{d}"]))
    return plan


@kind("plan file")
@_plan_file_kind
def unknown_model_call_name(data, plan):
    names = sorted(plan["allocations"])
    old = data.draw(st.sampled_from(names))
    new = data.draw(WORD.filter(lambda w: w not in names))
    plan["allocations"][new] = plan["allocations"].pop(old) if data.draw(st.booleans()) else plan["allocations"][old]
    return plan


@kind("plan file")
@_plan_file_kind
def model_call_missing(data, plan):
    names = sorted(plan["allocations"])
    for name in data.draw(st.sets(st.sampled_from(names), min_size=1, max_size=len(names) - 1)):
        del plan["allocations"][name]
    return plan


@kind("plan file")
@_plan_file_kind
def degrees_not_matching_the_mesh(data, plan):
    name = data.draw(st.sampled_from(sorted(plan["allocations"])))
    alloc = plan["allocations"][name]
    key = data.draw(st.sampled_from(["dp", "tp", "pp"]))
    alloc[key] = (
        alloc[key] + data.draw(st.integers(1, 64)) if data.draw(st.booleans()) else data.draw(st.integers(-64, 0))
    )
    return plan


@kind("plan file")
@_plan_file_kind
def cluster_not_the_runs(data, plan):
    key, value = data.draw(
        st.sampled_from(
            [
                ("devices_per_node", 8),
                ("nodes", 2),
                ("memory_gb", 80.0),
                ("profile", "h100-80g"),
                ("device_kind", "h100"),
                ("memory_gb", -1.0),
                ("profile", "tpu-v9"),
                ("device_kind", ""),
            ]
        )
    )
    plan["cluster"][key] = value
    return plan


@kind("plan file")
@_plan_file_kind
def unknown_role_or_bad_fusion(data, plan):
    key = data.draw(st.sampled_from(["shadow", "offload", "stream_fusion"]))
    if key == "stream_fusion":
        plan["stream_fusion"] = data.draw(
            st.sampled_from(
                [{"migrate_at": 2.0}, {"migrate_at": "soon"}, {"migrate_to": 0}, {"chunk": -1}, {"migrate_to": 99}]
            )
        )
    else:
        plan[key] = [data.draw(WORD.filter(lambda w: w not in ROLES))]
    return plan


@kind("plan file")
def plan_file_missing_or_of_an_unknown_suffix(data, files):
    path = data.draw(
        st.sampled_from(
            [
                files.path(".json"),
                files.path(".yaml"),
                files.write(".txt", "{}"),
                files.write(".jsn", "{}"),
                str(files.root) + "/",
            ]
        )
    )
    return _plan_argv(data, files, path), (path.rstrip("/"), "plan")


@kind("plan file")
def yaml_plan_file_broken(data, files):
    content = data.draw(
        st.sampled_from(
            [
                "cluster: {nodes: 1\n",
                "- 1\n",
                "cluster: &a [*a]\n",
                "\x00",
                "",
                "allocations: {actor_gen: {devices: '0-3'}}\n",
            ]
        )
    )
    path = files.write(data.draw(st.sampled_from([".yaml", ".yml"])), content)
    return _plan_argv(data, files, path), (path, "plan.")


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
            return _config_argv("train", files, [f"task.eval_file={path}"]), (path,)
        command = where.partition("-")[0]
        reward = f"{files.root / 'rewards.py'}:score"
        task = ["task.name=file", f"task.prompt_file={path}", f"task.reward_fn={reward}", "task.reward_timeout_s=0"]
        return _config_argv(command, files, task), (path,)

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
    return _config_argv("train", files, task), (path,)


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
    return _config_argv("train", files, task), (path,)


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
    return _config_argv("train", files, task), (spec,)


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


# ------------------------------------------------------------------------------------------------ the tests


def test_there_are_at_least_fifty_kinds():
    assert len(KINDS) >= 50, len(KINDS)
    assert len({k.name for k in KINDS}) == len(KINDS), "two kinds share a name"


@pytest.mark.parametrize("kind", KINDS, ids=[f"{k.category.replace(' ', '-')}:{k.name}" for k in KINDS])
def test_malformed_input_fails_with_one_line_and_status_2(kind, files):
    @FUZZ
    @given(data=st.data())
    def check(data):
        argv, names = kind.make(data, files)
        code, out, err = run_main(argv)
        assert_one_line_error(code, err, names, argv)
        for flag, value in zip(argv, argv[1:]):  # a rejected run writes nothing where its outputs would go
            if flag == "--out":
                assert not Path(value).is_dir(), argv
        for item in argv:
            if item.startswith(("run_dir=", "out_dir=")):
                assert not Path(item.partition("=")[2]).exists(), f"{argv!r} created its output directory"

    check()


def test_two_malformed_overrides_together_still_give_one_line(files):
    """Several faults at once: the command reports one of them, still as one line with status 2."""
    singles = [k for k in KINDS if k.category == "config override" and k.name not in ("override-without-equals",)]

    @settings(FUZZ, max_examples=max(EXAMPLES * 3, 10))
    @given(data=st.data(), first=st.sampled_from(singles), second=st.sampled_from(singles))
    def check(data, first, second):
        argv_a, names_a = first.make(data, files)
        argv_b, names_b = second.make(data, files)
        if argv_a[0] != argv_b[0]:
            argv_b = [argv_a[0], *argv_b[1:]]  # the second kind's overrides on the first's command
        argv = [*argv_a, *argv_b[2:]]
        code, _, err = run_main(argv)
        assert_one_line_error(code, err, (*names_a, *names_b, "override"), argv)

    check()


# ------------------------------------------------------------------------------------------ real processes


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
    }
    return subprocess.run(
        [sys.executable, "-m", "loomrl.cli", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )


def test_in_a_real_process_too(tmp_path):
    """What the process prints, not only what main() does: no progress bar, warning or traceback besides the line.
    One command per process for three kinds (a bad prompt file, a bad plan file, an argument error)."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_bytes(b'{"prompt": "caf\xe9"}\n')
    (tmp_path / "rewards.py").write_text("def score(prompt, response, answer):\n    return 0.0\n")
    plan = tmp_path / "plan.json"
    plan.write_text('{"cluster": {"nodes": 1, "devices_per_node": 4}, "allocations": {"actor_gen": {"devices": "0-')
    cases = [
        (
            [
                "train",
                "task.name=file",
                f"task.prompt_file={prompts}",
                f"task.reward_fn={tmp_path / 'rewards.py'}:score",
                f"run_dir={tmp_path / 'run'}",
            ],
            str(prompts),
        ),
        (["train", *RUNTIME, f"runtime.plan={plan}", f"run_dir={tmp_path / 'run'}"], str(plan)),
        (["plan", "--prompts", "many"], "--prompts"),
    ]
    for argv, name in cases:
        proc = _run_cli(*argv)
        assert_one_line_error(proc.returncode, proc.stderr, (name,), argv)
        assert proc.stdout == "", proc.stdout
    assert not (tmp_path / "run").exists()
