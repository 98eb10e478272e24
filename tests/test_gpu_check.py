"""`benchmarks/gpu_check.py`: its CPU dry run runs every part with Ray unimportable, and its pure pieces.

The dry run is the GPU check's own code on tiny shapes; a GPU machine has no Ray, so the run here makes
``import ray`` fail in it and in the pytest it starts (a ``sitecustomize`` on ``PYTHONPATH``).
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmark_modules import load_benchmark
from loomrl.plan.hardware import load_profile

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    return load_benchmark("gpu_check")


def _without_ray(tmp_path: Path) -> dict[str, str]:
    """An environment whose Python processes cannot import ray."""
    guard = tmp_path / "no_ray"
    guard.mkdir()
    (guard / "sitecustomize.py").write_text("import sys\n\nsys.modules['ray'] = None  # `import ray` fails\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(guard), str(ROOT)]), "HF_HUB_OFFLINE": "1"}


def test_the_dry_run_runs_every_part_without_ray(tmp_path):
    env = _without_ray(tmp_path)
    blocked = subprocess.run([sys.executable, "-c", "import ray"], env=env, capture_output=True, text=True)
    assert blocked.returncode != 0 and "import of ray halted" in blocked.stderr  # the guard holds
    out = tmp_path / "check" / "x.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--cpu", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,  # a guard against a hang, not a budget
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert list(report["parts"]) == ["tests", "decode", "train", "grpo", "profile"]
    assert all("error" not in part for part in report["parts"].values())
    assert report["parts"]["tests"]["rows"][0]["skipped"] >= 1  # the CUDA tests, collected and skipped on CPU
    planned = re.search(r"planned total: ([\d.]+) min", proc.stdout)
    assert planned is not None and float(planned.group(1)) < 8
    profile = load_profile(out.parent / "profile_local.json")  # the form `loomrl plan --profile` reads
    assert profile.name == "local" and profile.matmul_flops > 0
    assert not (ROOT / "benchmarks" / "profiles" / "local.json").exists()  # the dry run leaves the tree alone


def test_a_part_not_known_is_a_one_line_error(gpu_check, capsys):
    with pytest.raises(SystemExit) as stopped:
        gpu_check.main(["--cpu", "--parts", "tests,speed"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert "--parts: 'speed' is not a part; valid: tests, decode, train, grpo, profile" in err
    assert "Traceback" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a CUDA device the check would run")
def test_without_a_gpu_the_check_asks_for_the_dry_run(gpu_check, capsys):
    assert gpu_check.main([]) == 2
    assert capsys.readouterr().err == "gpu_check: no CUDA device here; --cpu runs the dry run with tiny shapes\n"


def test_pytest_counts_read_the_closing_line(gpu_check):
    counts = gpu_check.pytest_counts("....\n==== 1 failed, 3 passed, 2 skipped, 1 error in 4.20s ====\n")
    assert counts == {"passed": 3, "failed": 1, "skipped": 2, "errors": 1}
    assert gpu_check.pytest_counts("no tests ran in 0.01s") == {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}


def test_the_decode_roofline_reads_weights_and_each_sample_s_own_keys_and_values(gpu_check):
    """Two samples of 2-token prompts, 3 tokens each: step 1 prefills both (weights 10 params × 2 bytes, their
    4 keys/values written at 1 byte per token), steps 2 and 3 decode both at contexts 3 and 4; bandwidth 1 B/s."""
    rates = gpu_check.Rates(matmul_flops=1e30, bandwidth=1.0)
    step_log = [(0, 2, 4), (2, 0, 0), (2, 0, 0)]
    seconds = gpu_check.decode_roofline_seconds(step_log, 2, 3, 10, 2, 1, rates)
    assert seconds == (20 + 4) + (20 + 2 * 3) + (20 + 2 * 4)


def test_the_decode_roofline_prices_the_output_head_at_sampled_positions_only(gpu_check):
    """Compute-bound (bandwidth unlimited), 10 params of which 4 are the head: the 2-row prefill of 4 tokens runs
    the other 6 at 4 positions and the head at 2; each decode step both at 2 rows; 1 FLOP/s."""
    rates = gpu_check.Rates(matmul_flops=1.0, bandwidth=1e30)
    step_log = [(0, 2, 4), (2, 0, 0)]
    seconds = gpu_check.decode_roofline_seconds(step_log, 2, 3, 10, 2, 1, rates, head_params=4)
    assert seconds == pytest.approx(2 * (6 * 4 + 4 * 2) + 2 * (6 * 2 + 4 * 2))
