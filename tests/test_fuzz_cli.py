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

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

# the kinds' modules register their kinds in KINDS when imported
import fuzz_kinds_configs  # noqa: F401
import fuzz_kinds_inputs  # noqa: F401
import fuzz_kinds_plans  # noqa: F401
from fuzz_harness import EXAMPLES, FUZZ, KINDS, REPO, RUNTIME, Accepted, Files, assert_one_line_error, run_main


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
