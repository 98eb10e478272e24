"""The pieces of benchmarks/faults.py that need no Ray run: a flipped byte in a saved checkpoint is always named
and refused, and the driver of a run on the reference executor killed with SIGKILL during a save leaves a
checkpoint that verifies, from which the resumed run finishes as the uninterrupted one did."""

import json
import random

import pytest

from benchmark_modules import load_benchmark
from loomrl.checkpoint.store import MANIFEST_FILE, verify_checkpoint


@pytest.fixture(scope="module")
def faults():
    return load_benchmark("faults")


@pytest.fixture(scope="module")
def bench(faults, tmp_path_factory):
    """Trials sharing one uninterrupted PPO run on the reference executor (its checkpoint is the flips' too)."""
    return faults.Bench(tmp_path_factory.mktemp("faults"))


def test_a_flipped_byte_is_always_detected(faults, bench):
    checkpoint = bench.flip_source()
    listed = json.loads((checkpoint / MANIFEST_FILE).read_text())["files"]
    assert {
        "actor/weights-r00000.safetensors",
        "critic/optim-r00000.safetensors",
        "index.json",
        "rng.pt",
        "state.json",
    } <= set(listed)
    rng = random.Random(0)
    trials = [bench.trial("flip", k, rng) for k in range(12)]
    assert all(t["detected"] and t["named"] and t["refused"] and t["restored_passes"] for t in trials), trials
    assert len({t["file"] for t in trials}) > 3
    verify_checkpoint(checkpoint)  # every byte restored
    row = faults.row("flip", trials)
    assert (row["trials"], row["detected"]) == (12, "12/12")


def test_a_driver_killed_during_a_save_resumes_from_the_checkpoint_before(faults, bench):
    trial = bench.trial("save-driver", 1, random.Random(1))  # the reference executor: the driver writes itself
    assert trial["config"] == "ppo reference 2dev"
    assert trial["landed"] and 1 <= trial["save_of"] < faults.ITERATIONS, trial
    assert trial["resumed_after"] in (trial["save_of"] - 1, trial["save_of"]), trial
    assert not faults.failed(trial), faults.describe(trial)
    assert "ok" in faults.describe(trial)


def test_a_kill_lands_only_before_the_runs_last_call_ends(faults, tmp_path):
    """A worker kill counts as landed only while calls are left: the latest call end of the run's traces."""
    assert faults.last_call_end(tmp_path) == 0.0  # no traces: nothing was left to hit
    traces = [{"step": "actor_gen", "start": [1.0, 2.0], "end": [5.0, 7.5]}, {"step": "x", "start": [], "end": []}]
    (tmp_path / "traces.jsonl").write_text("".join(json.dumps(t) + "\n" for t in traces))
    assert faults.last_call_end(tmp_path) == 7.5
