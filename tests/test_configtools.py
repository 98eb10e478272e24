"""Tests of loomrl.config.tools on a small three-level config tree defined here.

Checks the happy paths (round trip, overrides, docs, --help rows) and that every malformed input gives
a ConfigError of exactly one line naming the dotted path and the bad value.
"""

import dataclasses
import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest
import yaml

from loomrl.config.tools import (
    FieldError,
    ValidatedConfig,
    deep_merge,
    describe,
    dump_yaml,
    fail,
    field_docs,
    from_dict,
    load_config,
    parse_overrides,
    spec,
    to_dict,
)
from loomrl.errors import ConfigError


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = spec(1.0, ge=0)
    """Sampling temperature; 0 means greedy."""
    top_k: int | None = spec(None, gt=0)
    """Keep only the k most likely tokens;
    null keeps all of them."""
    stop: tuple[str, ...] = ("</s>",)
    """Strings that end a response."""


@dataclass(frozen=True)
class RolloutConfig:
    max_new_tokens: int = spec(16, gt=0)
    """Maximum number of tokens generated per response."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """How the next token is drawn."""


@dataclass(frozen=True)
class AlgoConfig(ValidatedConfig):
    name: Literal["ppo", "grpo", "rloo"] = "ppo"
    """Policy-gradient estimator."""
    clip_eps: float = spec(0.2, gt=0, le=1)
    """PPO ratio clip range."""
    kl_coef: float = spec(0.0, ge=0)
    """Weight of the KL penalty to the reference policy."""
    group_size: int = spec(1, ge=1)
    """Responses sampled per prompt."""

    def validate(self) -> None:
        if self.name == "grpo" and self.group_size < 2:
            fail("group_size", f"{self.group_size} is too small for grpo (must be >= 2)")


@dataclass(frozen=True)
class TrainConfig:
    run_name: str
    """Name of the run directory."""
    seed: int = 0
    """Seed of every random generator."""
    bf16: bool = True
    """Train in bfloat16."""
    lr: float = spec(1e-5, gt=0)
    """Learning rate."""
    optimizer: str = spec("adamw", choices=("adamw", "sgd"))
    """Optimizer name."""
    reward_weights: dict[str, float] = field(default_factory=dict)
    """Weight of each reward function."""
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    """Algorithm settings."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Generation settings."""


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return path


def test_defaults_and_conversion(tmp_path: Path) -> None:
    yaml_text = "run_name: r\nlr: 1e-4\nalgo: {kl_coef: 1}\nrollout: {sampling: {stop: [a, b], top_k: 5}}\n"
    cfg = load_config(TrainConfig, _write(tmp_path, yaml_text))
    assert cfg.lr == 1e-4 and type(cfg.lr) is float  # YAML 1.1 reads 1e-4 as a string
    assert cfg.algo.kl_coef == 1.0 and type(cfg.algo.kl_coef) is float
    assert cfg.rollout.sampling.stop == ("a", "b")
    assert cfg.rollout.sampling.top_k == 5
    assert cfg.rollout.max_new_tokens == 16 and cfg.algo == AlgoConfig(kl_coef=1.0)


def test_round_trip(tmp_path: Path) -> None:
    overrides = [
        "run_name=rt",
        "algo.name=grpo",
        "algo.group_size=4",
        "rollout.sampling.top_k=8",
        "rollout.sampling.stop=[x, y]",
        "reward_weights={len: 0.5, fmt: 2}",
        "lr=3e-6",
        "bf16=false",
    ]
    cfg = load_config(TrainConfig, None, overrides)
    text = dump_yaml(cfg)
    assert yaml.safe_load(text) == to_dict(cfg)
    again = load_config(TrainConfig, _write(tmp_path, text))
    assert again == cfg
    assert again.rollout.sampling.stop == ("x", "y") and again.reward_weights == {"len": 0.5, "fmt": 2.0}
    assert from_dict(TrainConfig, to_dict(cfg)) == cfg


def test_overrides_win_over_yaml(tmp_path: Path) -> None:
    path = _write(tmp_path, "run_name: base\nlr: 0.001\nalgo:\n  name: grpo\n  group_size: 2\n")
    cfg = load_config(TrainConfig, path, ["lr=0.0003", "algo.kl_coef=0.05", "run_name=sort"])
    assert cfg.lr == 0.0003 and cfg.run_name == "sort"
    assert cfg.algo == AlgoConfig(name="grpo", group_size=2, kl_coef=0.05)  # untouched keys survive


def test_parse_overrides_and_deep_merge() -> None:
    items = ["algo.kl_coef=0.05", "rollout.top_k=5", "task.name=sort", "x.y=[1,2]", "a.b=null", "a.c=", "f=true"]
    assert parse_overrides(items) == {
        "algo": {"kl_coef": 0.05},
        "rollout": {"top_k": 5},
        "task": {"name": "sort"},
        "x": {"y": [1, 2]},
        "a": {"b": None, "c": ""},
        "f": True,
    }
    base = {"a": {"b": 1, "c": {"d": 2}}, "e": 3}
    merged = deep_merge(base, {"a": {"c": {"d": 5}}, "e": {"f": 1}})
    assert merged == {"a": {"b": 1, "c": {"d": 5}}, "e": {"f": 1}}
    assert base == {"a": {"b": 1, "c": {"d": 2}}, "e": 3}  # inputs untouched
    merged["a"]["b"] = 9
    assert base["a"]["b"] == 1  # and not aliased


def test_field_docs() -> None:
    docs = field_docs(SamplingConfig)
    assert docs["temperature"] == "Sampling temperature; 0 means greedy."
    assert docs["top_k"] == "Keep only the k most likely tokens;\nnull keeps all of them."
    assert set(field_docs(TrainConfig)) == {f.name for f in dataclasses.fields(TrainConfig)}


def test_describe_rows() -> None:
    rows = {row[0]: row for row in describe(TrainConfig)}
    assert rows["rollout.sampling.temperature"] == (
        "rollout.sampling.temperature",
        "float (>= 0)",
        "1.0",
        "Sampling temperature; 0 means greedy.",
    )
    assert rows["rollout.sampling.top_k"][1:3] == ("int | None (> 0)", "None")
    assert rows["rollout.sampling.top_k"][3] == "Keep only the k most likely tokens; null keeps all of them."
    assert rows["algo.name"][1:3] == ("'ppo' | 'grpo' | 'rloo'", "'ppo'")
    assert rows["optimizer"][1] == "str (one of adamw, sgd)"
    assert rows["run_name"][2] == "(required)"
    assert rows["rollout"][1:3] == ("RolloutConfig", "")
    assert list(rows).index("rollout") < list(rows).index("rollout.max_new_tokens")


def test_validated_config_checks_direct_construction() -> None:
    assert AlgoConfig(kl_coef=1).kl_coef == 1.0 and type(AlgoConfig(kl_coef=1).kl_coef) is float
    with pytest.raises(ConfigError, match=r"^clip_eps: 2\.0 is out of range \(must be > 0 and <= 1\)$"):
        AlgoConfig(clip_eps=2.0)
    with pytest.raises(ConfigError, match=r"^group_size: 1 is too small for grpo"):
        dataclasses.replace(AlgoConfig(), name="grpo")


def test_errors_pickle() -> None:
    err = pickle.loads(pickle.dumps(FieldError("algo.lr", "-1 is out of range")))
    assert (err.path, err.reason, str(err)) == ("algo.lr", "-1 is out of range", "algo.lr: -1 is out of range")
    with pytest.raises(FieldError) as info:
        from_dict(TrainConfig, {"run_name": "r", "algo": {"lrr": 1}})
    assert str(pickle.loads(pickle.dumps(info.value))) == str(info.value)


def test_spec_rejects_developer_mistakes() -> None:
    with pytest.raises(TypeError):
        spec(1.0, ge=0, gt=0)
    with pytest.raises(TypeError):
        spec("a", choices="abc")
    with pytest.raises(ValueError, match="out of range"):
        spec(-1.0, gt=0)


# (yaml text or None, overrides, substrings the one-line message must contain)
MALFORMED = {
    "unknown top key": (
        "run_name: r\nlrr: 0.1\n",
        [],
        ["lrr: unknown key", "valid keys: run_name", "did you mean 'lr'?"],
    ),
    "unknown nested key": (
        "run_name: r\nrollout: {sampling: {tempreature: 0.5}}\n",
        [],
        [
            "rollout.sampling.tempreature: unknown key",
            "valid keys of rollout.sampling: temperature, top_k, stop",
            "did you mean 'temperature'?",
        ],
    ),
    "int given str": (
        "run_name: r\nrollout: {max_new_tokens: ten}\n",
        [],
        ["rollout.max_new_tokens: 'ten' is not an int"],
    ),
    "int given bool": ("run_name: r\nseed: true\n", [], ["seed: True is not an int"]),
    "int given float": ("run_name: r\nalgo: {group_size: 2.5}\n", [], ["algo.group_size: 2.5 is not an int"]),
    "float given str": ("run_name: r\nlr: fast\n", [], ["lr: 'fast' is not a float"]),
    "float given bool": ("run_name: r\nalgo: {kl_coef: false}\n", [], ["algo.kl_coef: False is not a float"]),
    "bool given int": ("run_name: r\nbf16: 1\n", [], ["bf16: 1 is not a bool (true or false)"]),
    "bool given str": ("run_name: r\nbf16: 'true'\n", [], ["bf16: 'true' is not a bool"]),
    "str given int": ("run_name: 5\n", [], ["run_name: 5 is not a str"]),
    "out of range": (
        "run_name: r\nalgo: {clip_eps: 1.5}\n",
        [],
        ["algo.clip_eps: 1.5 is out of range (must be > 0 and <= 1)"],
    ),
    "optional out of range": (
        "run_name: r\nrollout: {sampling: {top_k: 0}}\n",
        [],
        ["rollout.sampling.top_k: 0 is out of range (must be > 0)"],
    ),
    "optional wrong type": (
        "run_name: r\nrollout: {sampling: {top_k: many}}\n",
        [],
        ["rollout.sampling.top_k: 'many' is not an int or null"],
    ),
    "bad literal": (
        "run_name: r\nalgo: {name: ppoo}\n",
        [],
        ["algo.name: 'ppoo' is not one of ppo, grpo, rloo", "did you mean 'ppo'?"],
    ),
    "bad choice": ("run_name: r\noptimizer: adam\n", [], ["optimizer: 'adam' is not one of adamw, sgd"]),
    "tuple element": (
        "run_name: r\nrollout: {sampling: {stop: [a, 3]}}\n",
        [],
        ["rollout.sampling.stop[1]: 3 is not a str"],
    ),
    "tuple given str": (
        "run_name: r\nrollout: {sampling: {stop: abc}}\n",
        [],
        ["rollout.sampling.stop: 'abc' is not a list"],
    ),
    "dict value": ("run_name: r\nreward_weights: {len: heavy}\n", [], ["reward_weights.len: 'heavy' is not a float"]),
    "section not a mapping": ("run_name: r\nalgo: 3\n", [], ["algo: expected a mapping, got 3"]),
    "cross-field": ("run_name: r\nalgo: {name: grpo}\n", [], ["algo.group_size: 1 is too small for grpo"]),
    "missing required": ("seed: 1\n", [], ["run_name: missing", "required", "a str"]),
    "invalid yaml": ("run_name: r\nalgo:\n  name: [ppo\n", [], ["cfg.yaml: invalid YAML at line"]),
    "duplicate key": (
        "run_name: r\nlr: 0.1\nlr: 0.2\n",
        [],
        ["cfg.yaml: invalid YAML at line 3", "duplicate key 'lr'"],
    ),
    "top level list": ("- run_name\n- r\n", [], ["cfg.yaml: top level must be a mapping, got list"]),
    "override syntax": (None, ["run_name=r", "algo.kl_coef"], ["override 'algo.kl_coef': expected key.sub=value"]),
    "override empty key": (None, ["=3"], ["override '=3': expected key.sub=value"]),
    "override bad value": (None, ["algo.name=[ppo"], ["override 'algo.name=[ppo': invalid value"]),
    "override unknown key": (
        "run_name: r\n",
        ["rollout.sampling.tempreature=0.5"],
        [
            "override 'rollout.sampling.tempreature=0.5'",
            "rollout.sampling.tempreature: unknown key",
            "did you mean 'temperature'?",
        ],
    ),
    "override wrong type": (
        "run_name: r\n",
        ["algo.clip_eps=wide"],
        ["override 'algo.clip_eps=wide': algo.clip_eps: 'wide' is not a float"],
    ),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_input_gives_one_line_error(tmp_path: Path, case: str) -> None:
    yaml_text, overrides, expected = MALFORMED[case]
    path = None if yaml_text is None else _write(tmp_path, yaml_text)
    with pytest.raises(ConfigError) as info:
        load_config(TrainConfig, path, overrides)
    message = str(info.value)
    assert "\n" not in message and message.strip() == message
    for part in expected:
        assert part in message, f"{part!r} not in {message!r}"
    if yaml_text is not None and not overrides:  # errors from the file name the file
        assert message.startswith(f"{path}: ")


def test_missing_file_names_the_file(tmp_path: Path) -> None:
    missing = tmp_path / "examples" / "x.yaml"
    with pytest.raises(ConfigError, match=r"x\.yaml: file not found$"):
        load_config(TrainConfig, missing)


def test_from_dict_prefixes_path_and_checks_plain_sections() -> None:
    with pytest.raises(ConfigError, match=r"^train\.algo\.clip_eps: 0\.0 is out of range"):
        from_dict(TrainConfig, {"run_name": "r", "algo": {"clip_eps": 0}}, path="train")
    # A plain (non-ValidatedConfig) section given as an instance is still checked where it is used.
    bad = RolloutConfig(max_new_tokens=0)
    with pytest.raises(ConfigError, match=r"^rollout\.max_new_tokens: 0 is out of range \(must be > 0\)$"):
        from_dict(TrainConfig, {"run_name": "r", "rollout": bad})
    with pytest.raises(ConfigError, match=r"^config: expected a mapping, got \[1\]$"):
        from_dict(TrainConfig, [1])  # type: ignore[arg-type]
