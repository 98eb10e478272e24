"""The pieces of benchmarks/dynamic_placement.py that need no run: the oracle that bounds every switching rule,
and the reversing workload's prompt file."""

import itertools
import json
import math
import random

import pytest

from benchmark_modules import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("dynamic_placement")


def _brute_force(times: dict[str, list[float]], switch_s: float) -> float:
    plans, n = list(times), len(next(iter(times.values())))
    return min(
        sum(times[p][i] for i, p in enumerate(path)) + switch_s * sum(a != b for a, b in itertools.pairwise(path))
        for path in itertools.product(plans, repeat=n)
    )


@pytest.mark.parametrize("switch_s", [0.0, 0.7, 100.0])
def test_the_oracle_is_the_best_schedule_over_every_path(bench, switch_s):
    rng = random.Random(5)
    for _ in range(20):
        times = {p: [rng.uniform(0.5, 3.0) for _ in range(6)] for p in "abc"}
        seconds, switches = bench.oracle_seconds(times, switch_s)
        assert math.isclose(seconds, _brute_force(times, switch_s), rel_tol=1e-12)
        assert seconds <= min(sum(t) for t in times.values()) + 1e-12  # never worse than the best static plan
        if switch_s == 100.0:
            assert switches == 0


def test_the_oracle_switches_where_the_phases_best_plans_differ(bench):
    times = {"short": [1, 1, 5, 5, 1], "long": [3, 3, 1, 1, 3]}
    assert bench.oracle_seconds(times, 0.0) == (5, 2)
    assert bench.oracle_seconds(times, 1.0) == (7, 2)
    assert bench.oracle_seconds(times, 100.0) == (11, 0)


def test_the_reversing_workload_drifts_out_and_back(bench, tmp_path):
    path = tmp_path / "reversing.jsonl"
    bench.write_prompts(path, 9, 64, 4.0, 24.0, 0.0, 0.5, seed=7, reverse=True)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    digits = [len(r["answer"]) for r in rows]
    medians = [sorted(digits[i * 64 : (i + 1) * 64])[32] for i in range(9)]
    assert medians[0] == medians[-1] == 4 and medians[4] == 24  # σ 0: the median exactly
    assert medians[:5] == sorted(medians[:5]) and medians[4:] == sorted(medians[4:], reverse=True)


def test_the_phases_workload_moves_its_cost_from_the_prompts_to_the_responses(bench, tmp_path):
    path = tmp_path / "phases.jsonl"
    bench.write_phases(path, 6, 32, 24.0, 1.0, seed=7)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    first, second = rows[: 3 * 32], rows[3 * 32 :]
    assert all(r["prompt"].startswith("min ") and len(r["answer"]) == 1 for r in first)
    assert all(r["prompt"].startswith("sort ") and r["answer"] == "".join(sorted(r["prompt"][5:-1])) for r in second)
    assert min(len(r["prompt"]) for r in first) > sorted(len(r["prompt"]) for r in second)[len(second) // 2]
    assert all(r["answer"] == min(r["prompt"][4:-1]) for r in first)
