"""`loomrl plan` and `loomrl timeline`: plans at scale and drawings of real runs."""

import dataclasses
import json

import pytest

from loomrl.cli import main
from loomrl.config.schema import TrainConfig
from loomrl.config.tools import load_config
from loomrl.plan import ExecutionPlan
from loomrl.plan.hardware import PROFILES
from loomrl.train.rl import RLTrainer


def test_plan_prints_every_strategy_and_writes_a_plan_file_and_timeline(tmp_path, capsys):
    out = tmp_path / "plan"
    assert (
        main(
            [
                "plan",
                "--cluster",
                "h100:1x8",
                "--model",
                "llama2-7b",
                "--response-len",
                "128",
                "--search-steps",
                "20",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    for name in ("colocate", "interleave", "separate", "searched"):
        assert name in printed
    assert "lower bound" in printed and "segment by segment" in printed and "ref_inf, reward_inf" in printed
    assert "training placement" in printed and "actor=" in printed
    plan = ExecutionPlan.load(out / "best_plan.json")
    assert plan.cluster.n_devices == 8
    assert (out / "timeline.png").stat().st_size > 1000
    assert "<svg" in (out / "timeline.html").read_text()


def test_plan_names_every_figure_it_applies_and_prices_without_the_factor_on_request(tmp_path, capsys):
    """The header lists each figure that is not a datasheet number with its source; --no-factor divides every
    time by the profile's system_factor."""
    factor = PROFILES["h100-80g"].system_factor
    times = {}
    for flags in ((), ("--no-factor",)):
        args = ["plan", "--cluster", "h100:1x8", "--model", "llama2-7b", "--plan", "colocate", *flags]
        assert main([*args, "--out", str(tmp_path / "plan")]) == 0
        printed = capsys.readouterr().out
        assert "matmul_efficiency" in printed and "Megatron-LM README" in printed and "vLLM CI" in printed
        assert ("multiplied by system_factor" in printed) == (not flags)
        assert ("system_factor" in printed and "published_runs.py" in printed) == (not flags)
        line = next(line for line in printed.splitlines() if line.startswith("given plan:"))
        times[flags] = float(line.split()[2])
    assert factor > 1 and times[()] / times[("--no-factor",)] == pytest.approx(factor, rel=0.01)


def test_plan_rejects_an_unknown_model_in_one_line(tmp_path, capsys):
    assert main(["plan", "--model", "llama2-8b", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "llama2-8b" in err and "llama2-7b" in err


def test_a_run_writes_traces_that_timeline_draws(tmp_path, capsys):
    cfg = load_config(
        TrainConfig,
        None,
        [
            f"run_dir={tmp_path / 'run'}",
            "runtime.executor=reference",
            "loop.iterations=2",
            "rollout.prompts_per_iter=4",
            "loop.eval_prompts=4",
            "loop.progress=false",
            "report.html=false",
            "rollout.max_new_tokens=4",
        ],
    )
    RLTrainer(cfg).run()
    traces = [json.loads(line) for line in (tmp_path / "run" / "traces.jsonl").read_text().splitlines()]
    assert {t["step"] for t in traces} >= {"actor_gen", "actor_train", "critic_train"}
    assert {t["iteration"] for t in traces} == {0, 1} and {t["kind"] for t in traces} == {"call"}
    assert all(e >= s for t in traces for s, e in zip(t["start"], t["end"]))
    assert main(["timeline", str(tmp_path / "run")]) == 0
    assert (tmp_path / "run" / "timeline.png").stat().st_size > 1000
    printed = capsys.readouterr().out
    assert "predicted (profile local, uncorrected)" in printed and "measured (2 iterations)" in printed
    page = (tmp_path / "run" / "timeline.html").read_text()
    assert page.count("<svg") == 2 and page.index("<h3>predicted") < page.index("<h3>measured")
    for step in ("actor_gen", "critic_train"):  # the same step ids in both panels: 2 iterations each, 1 device
        assert page.count(f"<title>{step} (") == 2 + 2
    assert main(["timeline", str(tmp_path / "run"), "--measured-only"]) == 0
    assert (tmp_path / "run" / "timeline.html").read_text().count("<svg") == 1


def test_calibrate_fits_corrections_from_a_run(tmp_path, capsys):
    cfg = load_config(
        TrainConfig,
        None,
        [
            f"run_dir={tmp_path / 'run'}",
            "runtime.executor=reference",
            "loop.iterations=3",
            "rollout.prompts_per_iter=4",
            "loop.eval_prompts=4",
            "loop.progress=false",
            "report.html=false",
            "rollout.max_new_tokens=4",
        ],
    )
    RLTrainer(cfg).run()
    assert main(["calibrate", "--from", str(tmp_path / "run"), "--out", str(tmp_path / "cal")]) == 0
    fitted = json.loads((tmp_path / "cal" / "corrections.json").read_text())
    assert set(fitted["scale"]) >= {"generate", "inference", "train"}
    assert all(v >= 0 for v in fitted["scale"].values())
    for kind in ("generate", "inference", "train"):  # some term group explains each kind's time
        assert fitted["scale"][kind] + fitted["scale"].get(f"{kind}.launch", 0.0) + fitted["overhead_s"][kind] > 0
    assert fitted["observations"]["train"] == 2 * 2  # two train MFCs, iterations 1 and 2 (the first is skipped)
    assert fitted["observations"]["iteration"] == 1  # the whole-iteration remainder, fitted on the run itself
    assert main(["calibrate", "--from", str(tmp_path / "missing"), "--out", str(tmp_path / "cal")]) == 2
    assert "not a run directory" in capsys.readouterr().err

    # the fitted corrections and a saved profile plan the same workload on this machine's devices
    profile = tmp_path / "cal" / "local_profile.json"
    profile.write_text(json.dumps(dataclasses.asdict(PROFILES["local"])))
    out = tmp_path / "plan"
    args = [
        "plan",
        "--cluster",
        "cpu:2",
        "--model",
        "llama-1m",
        "--response-len",
        "4",
        "--prompts",
        "4",
        "--search-steps",
        "10",
        "--out",
        str(out),
        "--profile",
        str(profile),
    ]
    assert main([*args, "--corrections", str(tmp_path / "cal" / "corrections.json")]) == 0
    assert "searched" in capsys.readouterr().out and ExecutionPlan.load(out / "best_plan.json").cluster.n_devices == 2
    for bad, field in ((tmp_path / "nope.json", "nope.json"), (tmp_path / "cal" / "corrections.json", "profile")):
        assert main([*args[:-1], str(bad)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and field in err
    (tmp_path / "neg.json").write_text('{"scale": {"train": -1}}')
    assert main([*args, "--corrections", str(tmp_path / "neg.json")]) == 2
    assert "scale.train" in capsys.readouterr().err
