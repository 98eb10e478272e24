"""The `loomrl` command: a subprocess smoke test of every subcommand, and malformed input of every kind.

Smoke tests run ``python -m loomrl.cli`` in a fresh process with tiny settings (SFT -> RM -> PPO share one
SFT checkpoint). Config errors must end with exit status 2 and exactly one stderr line,
``loomrl: error: ...``, naming the field or file and the bad value. Errors raised at run time (a model
path, a prompt file, a reward function, an occupied run_dir) go through a real process; the errors
raised while loading the config go through ``loomrl.cli.main`` in this process, because a fresh Python
that imports torch and transformers costs about three seconds per case.
"""

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import transformers
from transformers.utils import logging as hf_logging

from loomrl.cli import main
from loomrl.config.schema import EvalConfig, RMConfig, SFTConfig, TrainConfig
from loomrl.config.tools import field_docs

REPO = Path(__file__).resolve().parents[1]
TINY_TRAIN = (
    "runtime.executor=reference",
    "loop.iterations=2",
    "rollout.prompts_per_iter=8",
    "loop.eval_prompts=8",
    "loop.progress=false",
)


def run_cli(*args: str, timeout: float = 60, pythonpath: Path | None = None) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        # One thread: a 1M-parameter model is slower on two threads that contend with other processes.
        "OMP_NUM_THREADS": "1",
        "COLUMNS": "200",  # rich would wrap the demo's summary at 80 columns
    }
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return subprocess.run(
        [sys.executable, "-m", "loomrl.cli", *map(str, args)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def assert_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"


def assert_one_line_error(returncode: int, stderr: str, *expected: str) -> str:
    assert returncode == 2, f"exit {returncode}, stderr:\n{stderr}"
    assert "Traceback" not in stderr, stderr
    lines = stderr.splitlines()
    assert len(lines) == 1 and lines[0].strip(), f"expected exactly one stderr line, got:\n{stderr}"
    assert lines[0].startswith("loomrl: error: "), lines[0]
    for text in expected:
        assert text in lines[0], f"{text!r} not in {lines[0]!r}"
    return lines[0]


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# ----------------------------------------------------------------------------------- sft -> rm -> train


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("sft") / "policy"
    proc = run_cli(
        "sft", "examples/sft_sort.yaml", "steps=5", "batch_size=8", "eval_prompts=8", f"out_dir={out}", timeout=180
    )
    return proc, out


@pytest.fixture(scope="module")
def ppo_run(tmp_path_factory, sft_run):
    _, sft_dir = sft_run
    run_dir = tmp_path_factory.mktemp("ppo") / "run"
    args = ("train", "examples/ppo_sort.yaml", f"actor.model={sft_dir}", *TINY_TRAIN, f"run_dir={run_dir}")
    return run_cli(*args, timeout=180), run_dir, args


def test_sft_writes_a_checkpoint_that_plain_transformers_loads(sft_run):
    proc, out = sft_run
    assert_ok(proc)
    assert "eval/exact_match=" in proc.stdout and str(out) in proc.stdout
    summary = json.loads((out / "sft_summary.json").read_text())
    assert 0.0 <= summary["eval/exact_match"] <= 1.0
    assert len((out / "sft_metrics.jsonl").read_text().splitlines()) == 5
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    ids = tokenizer("sort 312=", return_tensors="pt").input_ids
    assert model(input_ids=ids).logits.shape[-1] == len(tokenizer)


def test_sft_prints_no_warnings(sft_run):
    proc, _ = sft_run
    assert_ok(proc)
    assert "Warning" not in proc.stderr, proc.stderr


def test_rm_trains_from_the_sft_checkpoint(sft_run, tmp_path):
    _, sft_dir = sft_run
    out = tmp_path / "rm"
    proc = run_cli(
        "rm",
        "examples/rm_sort.yaml",
        f"model={sft_dir}",
        "train_pairs=32",
        "eval_pairs=16",
        "epochs=1",
        f"out_dir={out}",
        "--quiet",
        timeout=180,
    )
    assert_ok(proc)
    summary = json.loads((out / "rm_summary.json").read_text())
    assert 0.0 <= summary["eval/pair_accuracy"] <= 1.0
    assert "eval/pair_accuracy=" in proc.stdout
    model = transformers.AutoModelForSequenceClassification.from_pretrained(out)
    assert model.config.num_labels == 1


def test_train_ppo_logs_plots_and_checkpoints(ppo_run):
    proc, run_dir, _ = ppo_run
    assert_ok(proc)
    assert "reward/mean=" in proc.stdout and str(run_dir) in proc.stdout
    assert "mismatch/mean_abs_logp_diff=" in proc.stdout  # the training-inference mismatch, in the summary
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [0, 1]
    assert "eval/exact_match" in records[-1]
    assert (run_dir / "reward_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (run_dir / "config.yaml").is_file()
    latest = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    assert latest.name == "iter_000001"
    exported = run_cli("export", run_dir, "--role", "actor", timeout=120)  # the shards as from_pretrained reads
    assert_ok(exported)
    assert exported.stdout.strip() == f"wrote {latest / 'hf' / 'actor'}"
    actor = transformers.AutoModelForCausalLM.from_pretrained(latest / "hf" / "actor")
    assert actor.config.model_type == "llama"


def _leaf_fields(cls, prefix=""):
    """(dotted path, class, field name) of every non-section field, found by walking the dataclasses."""
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            yield from _leaf_fields(type(default), f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", cls, f.name


@pytest.mark.parametrize(
    "command, cls", [("train", TrainConfig), ("sft", SFTConfig), ("rm", RMConfig), ("eval", EvalConfig)]
)
def test_config_lists_every_field_with_its_doc(command, cls):
    proc = run_cli("config", command)
    assert_ok(proc)
    lines = proc.stdout.splitlines()
    leaves = list(_leaf_fields(cls))
    assert len(leaves) > 10
    for path, owner, name in leaves:
        doc = " ".join(field_docs(owner)[name].split())
        assert doc, f"{path} has no docstring"
        matching = [line for line in lines if line.split()[0] == path]
        assert len(matching) == 1, f"{path}: {matching}"
        assert matching[0].endswith(doc), f"{path}: {matching[0]!r} does not end with its doc {doc!r}"
    if command == "train":
        clip = next(line for line in lines if line.split()[0] == "algo.clip_eps")
        assert "0.2" in clip and "> 0 and <= 1" in clip and "PPO ratio clip range" in clip


def _one_iteration_of(example: str, tmp_path) -> dict:
    """The metrics of one iteration of an example config, trained by the CLI."""
    run_dir = tmp_path / "run"
    proc = run_cli(
        "train",
        example,
        "loop.iterations=1",
        "rollout.prompts_per_iter=4",
        "loop.eval_prompts=4",
        "loop.progress=false",
        "report.html=false",
        f"run_dir={run_dir}",
        timeout=180,
    )
    assert_ok(proc)
    (record,) = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return record


def test_train_on_a_user_prompt_file_with_a_reward_file(tmp_path):
    record = _one_iteration_of("examples/grpo_user_task.yaml", tmp_path)
    assert 0.0 <= record["reward/mean"] <= 1.0 and "eval/score" in record


# ------------------------------------------------------------------------------------------ config errors


@pytest.fixture
def inputs(tmp_path) -> Path:
    (tmp_path / "broken.yaml").write_text("algo: {name: ppo\nloop: {iterations: 2}\n")
    (tmp_path / "list.yaml").write_text("- algo\n- loop\n")
    (tmp_path / "good.yaml").write_text("seed: 1\nloop: {progress: false}\n")
    (tmp_path / "myreward.py").write_text("def score(prompt, response, answer):\n    return 0.0\n")
    return tmp_path


@pytest.fixture
def restore_hf_logging():
    """main() quiets transformers' logging for the process; leave it as the other tests found it."""
    verbosity, bar = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    yield
    hf_logging.set_verbosity(verbosity)
    (hf_logging.enable_progress_bar if bar else hf_logging.disable_progress_bar)()


# (id, argv after `train` given the inputs dir, strings the error line must contain)
LOAD_ERRORS = [
    ("unknown-top-level-key", lambda d: ["bogus=1"], ["'bogus=1'", "bogus: unknown key", "run_dir"]),
    (
        "unknown-nested-key-suggests",
        lambda d: ["algo.clip_epz=0.1"],
        ["algo.clip_epz", "0.1", "did you mean 'clip_eps'?"],
    ),
    ("int-gets-word", lambda d: ["loop.iterations=abc"], ["loop.iterations", "'abc' is not an int"]),
    ("int-gets-float", lambda d: ["rollout.prompts_per_iter=2.5"], ["rollout.prompts_per_iter", "2.5 is not an int"]),
    ("float-gets-word", lambda d: ["algo.clip_eps=wide"], ["algo.clip_eps", "'wide' is not a float"]),
    ("bool-gets-word", lambda d: ["loop.progress=maybe"], ["loop.progress", "'maybe' is not a bool"]),
    ("bool-gets-int", lambda d: ["report.html=1"], ["report.html", "1 is not a bool"]),
    ("out-of-range", lambda d: ["algo.clip_eps=1.5"], ["algo.clip_eps", "1.5 is out of range", "<= 1"]),
    ("bad-choice", lambda d: ["algo.name=ppoo"], ["algo.name", "'ppoo' is not one of", "did you mean 'ppo'?"]),
    ("missing-yaml", lambda d: [d / "nothere.yaml"], ["nothere.yaml", "file not found"]),
    ("invalid-yaml", lambda d: [d / "broken.yaml"], ["broken.yaml", "invalid YAML at line"]),
    ("yaml-top-level-list", lambda d: [d / "list.yaml"], ["list.yaml", "top level must be a mapping, got list"]),
    ("override-without-equals", lambda d: [d / "good.yaml", "algo.name"], ["override 'algo.name'", "key.sub=value"]),
    ("override-without-key", lambda d: ["=5"], ["override '=5'", "key.sub=value"]),
    (
        "min-len-above-max-len",
        lambda d: ["task.min_len=6", "task.max_len=4"],
        ["task.min_len", "6 is greater than max_len 4"],
    ),
    ("model-reward-without-model", lambda d: ["reward.source=model"], ["reward.model", "'model'"]),
    ("grpo-group-of-one", lambda d: ["algo.name=grpo", "algo.group_size=1"], ["algo.group_size", "1 is too small"]),
    ("yaml-value-overridden-badly", lambda d: [d / "good.yaml", "seed=zero"], ["seed", "'zero' is not an int"]),
    (
        "sharding-a-frozen-role",
        lambda d: ["runtime.layouts={ref: {sharding: fsdp}}"],
        ["runtime.layouts.ref.sharding", "ref is frozen", "valid: none"],
    ),
    (
        "fsdp-with-pp",
        lambda d: ["runtime.layouts={actor: {pp: 2, sharding: fsdp}}"],
        ["sharding", "valid with fsdp: pp=1, any dp and tp"],
    ),
    ("bad-sharding", lambda d: ["runtime.layouts={actor: {sharding: zero3}}"], ["sharding", "'zero3' is not one of"]),
]


@pytest.mark.parametrize("make_argv, expected", [c[1:] for c in LOAD_ERRORS], ids=[c[0] for c in LOAD_ERRORS])
def test_config_errors_are_one_line_with_path_and_value(make_argv, expected, inputs, capfd, restore_hf_logging):
    run_dir = inputs / "run"
    returncode = main(["train", *map(str, make_argv(inputs)), f"run_dir={run_dir}"])
    out, err = capfd.readouterr()
    assert_one_line_error(returncode, err, *expected)
    assert out == "" and not run_dir.exists(), "a rejected config must not start the run"


def test_config_error_through_a_real_process(tmp_path):
    proc = run_cli("train", "algo.name=ppoo", f"run_dir={tmp_path / 'run'}")
    assert_one_line_error(proc.returncode, proc.stderr, "algo.name", "'ppoo'", "did you mean 'ppo'?")
    assert proc.stdout == "" and not (tmp_path / "run").exists()


RUNTIME_ERRORS = [
    ("model-neither-zoo-nor-dir", lambda d: ["actor.model=nope-7m"], ["'nope-7m'", "not a zoo name", "llama-1m"]),
    (
        "prompt-file-missing",
        lambda d: ["task.name=file", f"task.prompt_file={d / 'missing.jsonl'}", "task.reward_fn=myreward:score"],
        ["missing.jsonl", "does not exist"],
    ),
    (
        "reward-fn-not-importable",
        lambda d: ["task.name=file", f"task.prompt_file={d / 'missing.jsonl'}", "task.reward_fn=nomodule:fn"],
        ["'nomodule:fn'", "cannot import"],
    ),
]


@pytest.mark.parametrize("make_argv, expected", [c[1:] for c in RUNTIME_ERRORS], ids=[c[0] for c in RUNTIME_ERRORS])
def test_runtime_errors_are_one_line_too(make_argv, expected, inputs):
    run_dir = inputs / "run"
    proc = run_cli("train", *make_argv(inputs), *TINY_TRAIN, f"run_dir={run_dir}", pythonpath=inputs)
    assert_one_line_error(proc.returncode, proc.stderr, *expected)
    assert not run_dir.exists(), "a run that cannot start must not leave a run_dir behind"


def test_bad_model_error_names_the_config_field(inputs, capfd, restore_hf_logging):
    returncode = main(["train", "actor.model=nope-7m", f"run_dir={inputs / 'run'}", *TINY_TRAIN])
    assert_one_line_error(returncode, capfd.readouterr().err, "actor.model", "nope-7m")


def test_train_refuses_a_run_dir_with_checkpoints_unless_resumed(ppo_run, tmp_path):
    proc, original, args = ppo_run
    assert_ok(proc)
    run_dir = tmp_path / "run"
    shutil.copytree(original, run_dir)
    before = tree_bytes(run_dir)
    assert any(name.startswith("checkpoints/iter_") for name in before) and "metrics.jsonl" in before

    again = run_cli(*args[:-1], f"run_dir={run_dir}", "loop.iterations=3", timeout=120)
    assert_one_line_error(again.returncode, again.stderr, str(run_dir), "already holds checkpoints", "--resume")
    assert tree_bytes(run_dir) == before, "a refused run must leave every file of the earlier run as it was"

    resumed = run_cli(*args[:-1], f"run_dir={run_dir}", "loop.iterations=3", "--resume", timeout=120)
    assert_ok(resumed)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["iteration"] for line in lines] == [0, 1, 2]
    assert "\n".join(lines[:2]) + "\n" == before["metrics.jsonl"].decode(), "resuming rewrote earlier iterations"
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "iter_000002"


def test_train_multi_turn_on_the_guessing_game_example(tmp_path):
    record = _one_iteration_of("examples/grpo_guess.yaml", tmp_path)
    assert 0.0 <= record["reward/mean"] <= 1.0 and 1 <= record["episode/turns"] <= 4 and "eval/turns" in record


def test_overrides_may_follow_the_options(capfd):
    """``loomrl train CONFIG --plan P key=value``: the override after the option is read (its bad value is
    named), and an argument that is neither an option nor an override is refused in one line."""
    config = str(Path(__file__).resolve().parent.parent / "examples" / "grpo_sort.yaml")
    assert main(["train", config, "--plan", "colocate", "loop.iterations=xyz"]) == 2
    assert "loop.iterations: 'xyz' is not an int" in capfd.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["train", config, "--plan", "colocate", "stray"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: stray" in capfd.readouterr().err
