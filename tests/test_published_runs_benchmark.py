"""benchmarks/published_runs.py's out-of-sample factors: hand-computed on made-up rows, and the profiles' stated
factors are what the benchmark fits in sample on the published rows."""

import math

import pytest

from benchmark_modules import load_benchmark
from loomrl.plan import ClusterSpec
from loomrl.plan.cluster import profile_for


@pytest.fixture(scope="module")
def published():
    return load_benchmark("published_runs")


def test_a_factor_is_fitted_without_the_row_or_the_system_it_prices(published):
    def row(name, system, assumed=""):
        return published.PublishedRun(name, system, "made up", {}, 1.0, assumed=assumed)

    # predicted / published without a factor: 0.5 and 0.8 on one system, 0.625 on another, 0.25 assumed (no fit)
    rows = [
        (row("a", "S"), "h100-80g", 0.5),
        (row("b", "S"), "h100-80g", 0.8),
        (row("c", "T"), "h100-80g", 0.625),
        (row("d", "T", assumed="lengths"), "h100-80g", 0.25),
        (row("e", "S"), "gb200", 0.5),
    ]
    got = published.out_of_sample_factors(rows)
    all_h100 = (2 * 1.25 * 1.6) ** (1 / 3)
    assert got["fitted"] == pytest.approx([all_h100] * 4 + [2.0])
    assert got["leave one row out"] == pytest.approx(
        [math.sqrt(1.25 * 1.6), math.sqrt(2 * 1.6), math.sqrt(2 * 1.25), all_h100, 1.0]
    )
    assert got["leave one system out"] == pytest.approx([1.6, 1.6, math.sqrt(2 * 1.25), math.sqrt(2 * 1.25), 1.0])


def test_the_stated_factors_are_the_benchmarks_in_sample_fit(published):
    bare = []
    for row in published.ROWS:
        profile = profile_for(ClusterSpec.parse(row.run["cluster"]))
        predicted = published.predict(row).result.iteration_time
        bare.append((row, profile, predicted / profile.system_factor / row.step_s))
    fitted = published.out_of_sample_factors([(row, profile.name, ratio) for row, profile, ratio in bare])["fitted"]
    for (row, profile, _), factor in zip(bare, fitted):
        assert factor == pytest.approx(profile.system_factor, abs=0.005), row.name


def test_the_verl_rows_lengths_reproduce_the_stages_they_are_fitted_on(published):
    """The stated mean and spread of the verl rows' response lengths give back the published update_actor and
    generation seconds of the row they were fitted on (within the constants' rounding)."""
    name, stages = published.VERL_FIT
    row = next(r for r in published.ROWS if r.name == name)
    got = published.predict(row).stages
    for stage, seconds in stages.items():
        assert got[stage] == pytest.approx(seconds, rel=0.02), stage
