"""The harness of ``tests/test_fuzz_cli.py``: running ``loomrl.cli.main`` in this process, the junk strategies, the
configs' leaf fields and the registry of kinds of malformed input (:data:`KINDS`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import itertools
import os
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, settings
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


def pick(data, kind: type, want: Callable[[Leaf], bool] = lambda leaf: True) -> tuple[str, Leaf]:
    """A command and one of its leaf fields of ``kind`` that ``want`` accepts."""
    command = data.draw(st.sampled_from(sorted(COMMANDS)), label="command")
    leaves = [leaf for leaf in LEAVES[command] if leaf.kind is kind and want(leaf)]
    if not leaves:
        command, leaves = "train", [leaf for leaf in LEAVES["train"] if leaf.kind is kind and want(leaf)]
    return command, data.draw(st.sampled_from(leaves), label="field")


def config_argv(command: str, files: Files, overrides: list[str]) -> list[str]:
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
