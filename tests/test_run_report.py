"""The run report (RUN_DIR/report.html) and the Chrome trace of a run's timeline: their content from hand-made run
files, a real run writing the report as it goes, the commands, and the page in a real headless browser."""

from __future__ import annotations

import json
import re

import pytest
import torch

from browser import Browser, find_chromium
from loomrl.config.schema import TrainConfig
from loomrl.config.tools import load_config
from loomrl.planner.simulation.simulator import Interval, SimResult
from loomrl.report.chrome_trace import chrome_trace
from loomrl.report.html import curve_svg, render_report
from loomrl.train import rl
from test_cli import assert_ok, run_cli

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _points(svg: str) -> list[tuple[float, float]]:
    text = re.search(r' points="([^"]*)"', svg).group(1)
    return [tuple(map(float, p.split(","))) for p in text.split()]


def test_curve_svg_places_points_on_its_axes():
    # width 400, height 190, margins: left 52, right 10, top 24, bottom 28 -> plot area x 52..390, y 24..162
    svg = curve_svg("kl/mean", "KL", [0, 2, 4], [1.0, 3.0, 2.0])
    assert _points(svg) == [(52.0, 162.0), (221.0, 24.0), (390.0, 93.0)]
    assert 'data-metric="kl/mean"' in svg and 'data-points="3"' in svg and "last 2" in svg
    fraction = curve_svg("eval/exact_match", "eval", [0, 1], [0.0, 0.5])  # fractions keep a 0-1 axis
    assert _points(fraction) == [(52.0, 162.0), (390.0, 93.0)]
    flat = curve_svg("response/length", "len", [3], [5.0])  # one point: centred, the flat value mid-height
    assert _points(flat) == [(221.0, 93.0)]


def _write_run(run_dir, iterations: int = 3) -> None:
    """The files a run leaves, written by hand: metrics, step traces, the plan and the config."""
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "metrics.jsonl", "w") as f:
        for it in range(iterations):
            record = {
                "iteration": it,
                "time": 0.0,
                "reward/mean": 0.1 * it,
                "kl/mean": 0.01 * it,
                "response/length": 5.0 + it,
                "mismatch/mean_abs_logp_diff": 0.001 * it,
                "time/iteration_s": 1.0,
            }
            if it == iterations - 1:
                record["eval/exact_match"] = 0.5
            f.write(json.dumps(record) + "\n")
    with open(run_dir / "traces.jsonl", "w") as f:
        for it in range(iterations):
            t = 100.0 + it
            for step, kind, mfc_kind, start, end in (
                ("actor_gen", "call", "generate", 0.0, 0.4),
                ("actor_train", "call", "train", 0.5, 0.9),
            ):
                f.write(
                    json.dumps(
                        {
                            "iteration": it,
                            "phase": "iteration",
                            "step": step,
                            "kind": kind,
                            "role": "actor",
                            "mfc_kind": mfc_kind,
                            "devices": [0, 1],
                            "start": [t + start, t + start],
                            "end": [t + end, t + end],
                        }
                    )
                    + "\n"
                )
    plan = {
        "cluster": {"nodes": 1, "devices_per_node": 2, "device_kind": "cuda", "profile": "local", "memory_gb": 24.0},
        "allocations": {
            "actor_gen": {"devices": "0-1", "dp": 1, "tp": 2, "pp": 1, "micro_batches": 1},
            "actor_train": {"devices": "0-1", "dp": 2, "tp": 1, "pp": 1, "micro_batches": 2, "zero": True},
        },
        "shadow": None,
        "offload": None,
    }
    (run_dir / "plan.json").write_text(json.dumps(plan))
    (run_dir / "config.yaml").write_text("algo:\n  name: grpo  # <b>not markup</b>\n")


def test_the_report_holds_curves_timeline_plan_and_config(tmp_path):
    run = tmp_path / "myrun"
    _write_run(run)
    page = render_report(run, running=True, total_iterations=10)
    assert '<meta http-equiv="refresh"' in page and "running: 3 of 10 iterations" in page
    metrics = re.findall(r'class="curve" data-metric="([^"]+)" data-points="(\d+)"', page)
    assert metrics == [
        ("reward/mean", "3"),
        ("kl/mean", "3"),
        ("mismatch/mean_abs_logp_diff", "3"),
        ("response/length", "3"),
        ("eval/exact_match", "1"),
        ("time/iteration_s", "3"),
    ]
    assert page.count('<rect class="interval"') == 3 * 2 * 2  # the last 3 iterations, 2 steps, 2 devices
    assert "no prediction" in page  # a cuda run: the nominal local profile does not price it
    assert "<td>actor_train</td><td>0-1</td><td>2</td><td>1</td><td>1</td><td>2</td><td>zero</td>" in page
    assert "&lt;b&gt;not markup&lt;/b&gt;" in page and "<b>not markup</b>" not in page
    finished = render_report(run)
    assert "refresh" not in finished and "finished after 3 iterations" in finished


def test_a_fresh_run_directory_gets_a_report_that_says_what_is_missing(tmp_path):
    page = render_report(tmp_path)
    assert "no iteration logged yet" in page and "no measured timeline yet" in page and "no plan.json" in page


def test_chrome_trace_events_by_hand():
    traces = [
        {
            "iteration": 0,
            "phase": "prologue",
            "step": "sync_actor",
            "kind": "sync",
            "role": "actor",
            "mfc_kind": None,
            "devices": [0, 1],
            "start": [10.0, 10.0],
            "end": [10.5, 10.25],
        },
        {
            "iteration": 0,
            "phase": "iteration",
            "step": "actor_gen",
            "kind": "call",
            "role": "actor",
            "mfc_kind": "generate",
            "devices": [1],
            "start": [11.0],
            "end": [12.5],
        },
    ]
    predicted = SimResult(1.0, {0: 1.0}, {}, [Interval(0, 0.0, 0.75, "actor_gen", "generate", 0)], True, "", [1.0])
    trace = chrome_trace(traces, predicted, title="r")
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [(e["pid"], e["tid"], e["name"], e["ts"], e["dur"]) for e in complete] == [
        (0, 0, "sync_actor", 0.0, 500000.0),
        (0, 1, "sync_actor", 0.0, 250000.0),
        (0, 1, "actor_gen", 1000000.0, 1500000.0),
        (1, 0, "actor_gen", 0.0, 750000.0),
    ]
    assert complete[0]["cat"] == "sync" and complete[2]["cat"] == "generate"
    assert complete[0]["args"]["phase"] == "prologue"
    names = {(e["pid"], e["tid"], e["name"]): e["args"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert names[(0, 0, "process_name")] == {"name": "measured run: r"}
    assert names[(0, 1, "thread_name")] == {"name": "device 1"}
    assert names[(1, 0, "process_name")] == {"name": "simulator's prediction"}
    json.dumps(trace)  # plain JSON, as Perfetto and chrome://tracing read it
    assert chrome_trace([]) == {"traceEvents": [], "displayTimeUnit": "ms"}


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    """A two-iteration run on the reference executor, its report spied on as the trainer rewrites it."""
    run_dir = tmp_path_factory.mktemp("report") / "run"
    cfg = load_config(
        TrainConfig,
        None,
        [
            "runtime.executor=reference",
            "loop.iterations=3",
            "loop.save_every=1",
            "loop.eval_every=1",
            "rollout.prompts_per_iter=2",
            "rollout.max_new_tokens=4",
            "loop.eval_prompts=2",
            "loop.progress=false",
            "algo.minibatches=1",
            "runtime.threads=1",
            f"run_dir={run_dir}",
        ],
    )
    written = []
    original = rl.write_run_report
    threads = torch.get_num_threads()

    def spy(path, running, total):
        out = original(path, running, total)
        written.append(out.read_text())
        return out

    rl.write_run_report = spy
    try:
        rl.RLTrainer(cfg).run()
    finally:
        rl.write_run_report = original
        torch.set_num_threads(threads)
    return run_dir, written


def test_a_run_rewrites_its_report_as_it_goes(small_run):
    run_dir, written = small_run
    assert len(written) == 3  # save_every=1: after every iteration
    assert "running: 1 of 3 iterations" in written[0] and 'http-equiv="refresh"' in written[0]
    assert "finished after 3 iterations" in written[-1] and "refresh" not in written[-1]
    assert written[0].count('data-points="1"') >= 3 and 'data-metric="reward/mean" data-points="3"' in written[-1]
    assert "predicted by the simulator" in written[-1]  # a CPU run: its prediction is drawn above it
    assert (run_dir / "report.html").read_text() == written[-1]
    assert json.loads((run_dir / "plan.json").read_text())["cluster"]["device_kind"] == "cpu"


def test_timeline_chrome_and_report_commands(small_run):
    run_dir, _ = small_run
    (run_dir / "report.html").unlink()
    proc = run_cli("timeline", run_dir, "--chrome", timeout=120)
    assert_ok(proc)
    trace = json.loads((run_dir / "timeline.trace.json").read_text())
    steps = [json.loads(line) for line in (run_dir / "traces.jsonl").read_text().splitlines()]
    measured = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == 0]
    assert len(measured) == sum(len(s["devices"]) for s in steps)  # every step of every phase, per device
    assert any(e["pid"] == 1 for e in trace["traceEvents"]) and "ui.perfetto.dev" in proc.stdout
    proc = run_cli("report", run_dir, timeout=120)
    assert_ok(proc)
    assert "finished after 3 iterations" in (run_dir / "report.html").read_text()


def test_the_report_in_a_real_browser(small_run, tmp_path):
    """Chromium loads the report, lays out its curves and timeline (non-empty boxes), and takes a screenshot."""
    binary = find_chromium()
    if binary is None:
        pytest.skip("no Chromium on PATH (Debian/Ubuntu: apt-get install -y chromium)")
    run_dir, _ = small_run
    with Browser(binary) as browser:
        browser.open((run_dir / "report.html").as_uri())
        found = browser.evaluate("""(() => {
            const box = e => { const r = e.getBoundingClientRect(); return [r.width, r.height]; };
            return {
              title: document.title,
              curves: [...document.querySelectorAll('svg.curve')].map(s => ({
                metric: s.dataset.metric, box: box(s),
                points: s.querySelector('polyline.series').points.numberOfItems})),
              timelines: [...document.querySelectorAll('#timeline svg.timeline')].map(box),
              bars: [...document.querySelectorAll('#timeline rect.interval')].filter(r => box(r)[0] > 0).length,
              planRows: document.querySelectorAll('#plan table.plan tr').length,
              config: document.getElementById('config').textContent.includes('run_dir:'),
            }; })()""")
        shot = browser.screenshot(tmp_path / "report.png")
    assert found["title"] == "run: loomrl run report"
    assert {c["metric"] for c in found["curves"]} >= {
        "reward/mean",
        "kl/mean",
        "response/length",
        "eval/exact_match",
        "eval/score",
    }
    assert all(c["box"][0] > 300 and c["box"][1] > 150 and c["points"] >= 1 for c in found["curves"])
    assert len(found["timelines"]) == 2 and all(
        w > 500 and h > 30 for w, h in found["timelines"]
    )  # predicted, measured
    calls = len(json.loads((run_dir / "plan.json").read_text())["allocations"])
    assert found["bars"] > 0 and found["planRows"] == 1 + calls and found["config"]
    from PIL import Image

    image = Image.open(shot)
    assert shot.read_bytes().startswith(PNG_MAGIC) and image.width == 1280 and image.height > 900
    assert len(image.convert("RGB").getcolors(maxcolors=1 << 16) or range(1 << 16)) > 20  # drawn, not blank
    print(f"screenshot of the report: {shot} ({image.width}x{image.height})")
