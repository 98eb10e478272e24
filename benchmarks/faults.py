"""Fault injection (kill -9): lost workers, saves cut short, damaged checkpoints; each trial against an
uninterrupted run of the same seed.

    .venv/bin/python benchmarks/faults.py [--trials 10] [--quick] [--kinds worker,save-worker,save-driver,flip]

Every run is PPO or GRPO on llama-1m, 4 iterations of 8 prompts (GRPO: 4 prompts × a group of 4), 6 new tokens,
a checkpoint after every iteration (``checkpoint.keep_last=2``), ``runtime.max_failures=3``,
``runtime.timeout_s=180`` (a worker that starts slowly on a loaded machine is not a fault), one thread per
process. The fault kinds (``--trials`` each; ``--quick``: 2 each, a smoke check):

- ``worker``: a random worker of a Ray run is killed with SIGKILL after a random delay, uniform over the
  uninterrupted run's length (its iterations, saves and final evaluation), so at a random point of a random
  iteration. The trials take PPO and GRPO on 2 and 4 devices in turn. The run must finish by itself: it
  recovers (``RLTrainer._recover``: new workers, resumed from the latest checkpoint).
- ``save-worker``: worker 0 of a Ray run, which writes its own shards and completes every save (index, RNG,
  manifest, the rename into place), is killed while the save of a random iteration after the first is under
  way (its ``checkpoints/iter_N.tmp-<pid>`` directory exists, after a random delay of up to 80 ms: a save lasts
  75 to 170 ms here). Same configurations in turn, same recovery.
- ``save-driver``: the driver, ``loomrl train`` in a process of its own, is killed while a save is under way,
  alternately on the Ray executor and on the reference executor, PPO and GRPO on 2 devices. On the reference
  executor the driver writes the checkpoint itself, so its save is cut short; on Ray the workers write it and
  live on for a few seconds after the driver (until the dead driver's Ray instance takes it along), time
  enough to finish the save most often. The latest checkpoint must then be the one before that save (or that
  save's, when it was finished) and pass its manifest, and ``--resume`` (``RLTrainer.run(resume=True)``, in
  this process, once the killed run's processes are gone) must finish the run.
- ``flip``: one byte of a random file listed in a saved checkpoint's manifest, at a random offset, XORed with a
  random non-zero mask: ``verify_checkpoint`` must name the file and ``load_checkpoint`` refuse it (and both pass
  again once the byte is restored). The manifest itself is not listed in it: a change there names a file the
  data no longer matches, or none, and changes no data that is loaded.

Outcomes, per trial, counted per kind:

- **finished**: the run (for ``save-driver``, the resumed one) returned its last iteration's metrics;
- **same metrics**: the per-iteration metrics equal the uninterrupted run's of the same configuration (same
  executor, devices and seed) with the tolerances of ``tests/test_runtime.py::_assert_equivalent``: sample
  metrics within 1e-6 relative, losses and gradient norms within 1e-4 relative (1e-6 absolute), the same keys
  (timings and evaluations aside, and the ``recovery/`` keys a recovery adds) and the same final evaluation;
- **checkpoints ok**: no checkpoint lost: at the fault, the latest checkpoint is the last one completed before it
  (or the one being written, when it was already in place) and passes its manifest; the run resumes from it; at
  the end the last iteration's checkpoint passes its manifest and no partial save is left;
- **detected** (``flip``): the damaged file is named and nothing loads;
- **saves cut short** (``save-*``): trials that left the save they hit unfinished (its ``.tmp-`` directory);
- **processes left**: processes the trial started (every worker of every executor, the Ray instance, the
  killed driver's children, found in ``/proc``: Linux only) still running 30 s after the run ended or the driver
  was killed; **all gone by s**: the longest any trial's processes took to exit (those left are watched for up
  to 120 s, then killed);
- **landed**: the kills that hit what they were aimed at (a save that ended before its kill is re-aimed at the
  next save; a kill after the run's last call, or of a worker the run had already closed, does not land);
  **trials** counts the trials whose fault landed: trials are drawn until ``--trials`` of them have, at most
  twice that many in all (each drawn trial's run must still finish with the same metrics);
  **recoveries**: those the runs logged (``failures.jsonl``; a worker killed after its last call needs none).

The command exits with status 1 when a trial misses an outcome or a kind has fewer landed trials than asked;
``--out FILE`` writes every trial as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from rich.console import Console  # noqa: E402

from loomrl.checkpoint.store import (  # noqa: E402
    MANIFEST_FILE,
    CheckpointError,
    checkpoint_name,
    latest_checkpoint,
    load_checkpoint,
    verify_checkpoint,
)
from loomrl.config.schema import TrainConfig  # noqa: E402
from loomrl.config.tools import load_config  # noqa: E402
from loomrl.report import summary_table  # noqa: E402
from loomrl.run_dir import RunDir  # noqa: E402
from loomrl.runtime.launch import quiet_libraries  # noqa: E402
from loomrl.train.rl import RLTrainer  # noqa: E402
from process_tree import GRACE_S, LINGER_S, Tree, descendants, identify, left_behind  # noqa: E402

KINDS = ("worker", "save-worker", "save-driver", "flip")
TITLES = {
    "worker": "kill -9 of a worker mid-iteration",
    "save-worker": "kill -9 of worker 0 mid-save",
    "save-driver": "kill -9 of the driver mid-save",
    "flip": "a flipped byte in a checkpoint",
}
RAY_CONFIGS = (("ppo", 2), ("grpo", 2), ("ppo", 4), ("grpo", 4))
"""(algorithm, devices) of the Ray runs the ``worker`` and ``save-worker`` trials take in turn."""
DRIVER_CONFIGS = (("ray", "ppo"), ("reference", "ppo"), ("ray", "grpo"), ("reference", "grpo"))
"""(executor, algorithm) of the ``save-driver`` trials in turn, on 2 devices."""
ITERATIONS = 4
SEED = 3
SAVE_DELAY_S = 0.08
"""Longest random delay between a save's ``.tmp-`` directory appearing and the kill."""
POLL_S = 0.002
MAX_ATTEMPTS = 2
"""Trials drawn per kind, at most, as a multiple of the landed trials asked for."""
SAMPLE_KEYS = ("reward/mean", "reward/exact_match", "response/length", "response/length_max")
LOSS_KEYS = (
    "kl/mean",
    "actor/pg_loss",
    "critic/value_loss",
    "actor/clipfrac",
    "actor/approx_kl",
    "actor/grad_norm",
    "critic/grad_norm",
    "actor/entropy",
    "actor/kl_loss",
)
IGNORED = ("time", "perf", "eval/", "fusion/", "recovery/")
"""Keys not compared: timings, evaluations (the final one is, below) and what a recovery reports."""


def overrides(run_dir: Path, algo: str, executor: str, devices: int) -> list[str]:
    """The config of every run here (see the module docstring)."""
    return [
        f"run_dir={run_dir}",
        f"seed={SEED}",
        f"algo.name={algo}",
        f"rollout.prompts_per_iter={8 if algo == 'ppo' else 4}",
        "rollout.max_new_tokens=6",
        f"loop.iterations={ITERATIONS}",
        "loop.save_every=1",
        "loop.eval_every=0",
        "loop.eval_prompts=8",
        "loop.progress=false",
        "report.html=false",
        "actor.optim.lr=0.001",
        "checkpoint.keep_last=2",
        f"runtime.executor={executor}",
        f"runtime.devices={devices}",
        "runtime.threads=1",
        "runtime.timeout_s=180",
        "runtime.max_failures=3",
    ]


def last_call_end(run_dir: Path) -> float:
    """When the run's last call ended on any device (``time.time()``; its traces), 0 when it traced none."""
    path = RunDir(run_dir).traces
    if not path.exists():
        return 0.0
    return max((max(t["end"]) for t in map(json.loads, path.read_text().splitlines()) if t["end"]), default=0.0)


def kill_worker(trainer: RLTrainer, rank: int) -> int | None:
    """SIGKILL worker ``rank`` of the trainer's current executor; its pid, or None when it is not running (only a
    process below this one is ever signalled)."""
    pids = list(getattr(trainer.executor, "pids", ()))
    if rank >= len(pids) or not any(pid == pids[rank] for pid, _ in descendants(os.getpid())):
        return None
    os.kill(pids[rank], signal.SIGKILL)
    return pids[rank]


# ------------------------------------------------------------------------------------------------ outcomes
def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _near(a: float, b: float, rel: float, abs_: float) -> bool:
    return math.isfinite(a) and abs(a - b) <= max(rel * abs(b), abs_)


def metric_differences(got: list[dict], expected: list[dict]) -> list[str]:
    """Where ``got`` is not ``expected`` within the executors' tolerances (empty when it is)."""
    if [m["iteration"] for m in got] != [m["iteration"] for m in expected]:
        return [f"iterations {[m['iteration'] for m in got]} != {[m['iteration'] for m in expected]}"]
    diffs = []
    for a, b in zip(got, expected):
        it = b["iteration"]
        keys = {k for k in a if not k.startswith(IGNORED)} ^ {k for k in b if not k.startswith(IGNORED)}
        if keys:
            diffs.append(f"iteration {it}: keys {sorted(keys)} in one run only")
        for key in SAMPLE_KEYS:
            if key in b and not _near(a.get(key, math.nan), b[key], 1e-6, 1e-9):
                diffs.append(f"iteration {it}: {key} {a.get(key)} != {b[key]}")
        for key in LOSS_KEYS:
            if key in b and not _near(a.get(key, math.nan), b[key], 1e-4, 1e-6):
                diffs.append(f"iteration {it}: {key} {a.get(key)} != {b[key]}")
    if got and got[-1].get("eval/exact_match") != expected[-1].get("eval/exact_match"):
        diffs.append(
            f"final eval/exact_match {got[-1].get('eval/exact_match')} != {expected[-1].get('eval/exact_match')}"
        )
    return diffs


def iteration_of(checkpoint: Path) -> int:
    return int(json.loads((checkpoint / "state.json").read_text())["iteration"])


def checkpoint_problem(run_dir: Path, at_least: int) -> str | None:
    """Why the run's latest checkpoint is not one of iteration ``at_least`` or later that passes its manifest;
    None when it is (and when none was expected: ``at_least`` < 0)."""
    latest = latest_checkpoint(run_dir)
    if latest is None:
        return None if at_least < 0 else f"no checkpoint; iteration {at_least}'s was complete"
    if iteration_of(latest) < at_least:
        return f"latest checkpoint {latest.name}, but iteration {at_least}'s was complete"
    try:
        verify_checkpoint(latest)
    except CheckpointError as err:
        return str(err)
    return None


def final_checkpoint_problem(run_dir: Path) -> str | None:
    """Why a finished run's checkpoints are not as they should be: the last iteration's, passing its manifest,
    and nothing left of a save cut short."""
    problem = checkpoint_problem(run_dir, ITERATIONS - 1)
    if problem is not None:
        return problem
    leftovers = sorted(
        p.name
        for p in RunDir(run_dir).checkpoints.iterdir()
        if ".tmp-" in p.name or ".stale-" in p.name or ".old-" in p.name
    )
    return f"left in checkpoints/: {leftovers}" if leftovers else None


def failures(run_dir: Path) -> list[dict]:
    path = RunDir(run_dir).failures
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


class Watch:
    """What a trainer does about a fault: the pids of every executor it makes, the last save it completed, and at
    each recovery, whether the checkpoint the run resumes from is the last completed one and passes its
    manifest."""

    def __init__(self, trainer: RLTrainer):
        self.trainer = trainer
        self.procs = identify(getattr(trainer.executor, "pids", ()))
        self.saved = -1
        self.problems: list[str] = []
        self.resumed_from: list[int] = []
        self.cut_short: list[str] = []
        """At each recovery, the unfinished saves left in checkpoints/."""
        save, recover = trainer.save, trainer._recover

        def watched_save(iteration: int):
            path = save(iteration)
            self.saved = iteration
            return path

        def watched_recover(err, count: int) -> None:
            problem = checkpoint_problem(trainer.run_dir, self.saved)
            if problem is not None:
                self.problems.append(problem)
            latest = latest_checkpoint(trainer.run_dir)
            self.cut_short += unfinished_saves(trainer.run_dir)
            self.resumed_from.append(iteration_of(latest) if latest is not None else -1)
            recover(err, count)
            self.procs |= identify(getattr(trainer.executor, "pids", ()))

        trainer.save, trainer._recover = watched_save, watched_recover


def unfinished_saves(run_dir: Path) -> list[str]:
    """The ``.tmp-`` directories of checkpoints in ``run_dir`` (``latest``'s own temporary file aside)."""
    try:
        return sorted(n for n in os.listdir(RunDir(run_dir).checkpoints) if n.startswith("iter_") and ".tmp-" in n)
    except OSError:
        return []


def save_under_way(run_dir: Path, iteration: int) -> Path | None:
    """The ``.tmp-`` directory of the save of ``iteration``, while there is one."""
    prefix = checkpoint_name(iteration) + ".tmp-"
    try:
        names = os.listdir(RunDir(run_dir).checkpoints)
    except OSError:
        return None
    return next((RunDir(run_dir).checkpoints / n for n in names if n.startswith(prefix)), None)


def aim_at_a_save(run_dir: Path, first: int, rng: random.Random, done: threading.Event, kill) -> dict:
    """Wait for the save of iteration ``first`` (or of a later one, when a save ends before its kill) to be under
    way, then call ``kill()`` after a random delay while it still is. Returns where the kill landed."""
    for iteration in range(first, ITERATIONS):
        while (tmp := save_under_way(run_dir, iteration)) is None:
            if done.is_set():
                return {"landed": False}
            time.sleep(POLL_S)
        delay = rng.uniform(0, SAVE_DELAY_S)
        time.sleep(delay)
        if tmp.exists() and kill():
            return {"landed": True, "save_of": iteration, "delay_s": round(delay, 4)}
        while tmp.exists() and not done.is_set():  # ended before the kill: aim at the next save
            time.sleep(POLL_S)
    return {"landed": False}


# ------------------------------------------------------------------------------------------------ the trials
class Bench:
    """Trials of every kind under ``root``, with each configuration's uninterrupted run made once."""

    def __init__(self, root: Path, console: Console | None = None):
        self.root = root
        self.console = console or Console()
        self.references: dict[tuple, tuple[list[dict], float]] = {}

    def config(self, run_dir: Path, algo: str, executor: str, devices: int) -> TrainConfig:
        return load_config(TrainConfig, None, overrides(run_dir, algo, executor, devices))

    def reference(self, algo: str, executor: str, devices: int) -> tuple[list[dict], float]:
        """The uninterrupted run's metrics and the seconds of its loop (from its workers' start to its end, less
        their shutdown)."""
        key = (algo, executor, devices)
        if key not in self.references:
            run_dir = self.root / f"reference-{algo}-{executor}{devices}"
            trainer = RLTrainer(self.config(run_dir, algo, executor, devices))
            close, closing = trainer.close, [0.0]

            def timed_close() -> None:
                t0 = time.perf_counter()
                close()
                closing[0] += time.perf_counter() - t0

            trainer.close = timed_close
            t0 = time.perf_counter()
            trainer.run()
            self.references[key] = (read_metrics(run_dir), time.perf_counter() - t0 - closing[0])
            self.console.print(
                f"  uninterrupted {algo} on {executor} ({devices} devices): {self.references[key][1]:.1f} s"
            )
        return self.references[key]

    def trial(self, kind: str, k: int, rng: random.Random) -> dict:
        """Trial ``k`` of ``kind``; its seconds leave out the uninterrupted run it is compared with."""
        if kind in ("worker", "save-worker"):
            algo, devices = RAY_CONFIGS[k % len(RAY_CONFIGS)]
            self.reference(algo, "ray", devices)
        elif kind == "save-driver":
            executor, algo = DRIVER_CONFIGS[k % len(DRIVER_CONFIGS)]
            self.reference(algo, executor, 2)
        else:
            self.flip_source()
        t0 = time.perf_counter()
        result = {
            "worker": self.worker_trial,
            "save-worker": self.save_worker_trial,
            "save-driver": self.save_driver_trial,
            "flip": self.flip_trial,
        }[kind](k, rng)
        result.update(kind=kind, trial=k, seconds=round(time.perf_counter() - t0, 2))
        return result

    def _ray_trial(self, name: str, algo: str, devices: int, arm) -> dict:
        """A Ray run with a fault ``arm(trainer, done)`` injects from a thread; its outcomes."""
        expected, _ = self.reference(algo, "ray", devices)
        run_dir = self.root / name
        before, tree = descendants(os.getpid()), Tree(os.getpid())
        trainer = RLTrainer(self.config(run_dir, algo, "ray", devices))
        watch = Watch(trainer)
        done, shot = threading.Event(), {}
        thread = threading.Thread(target=lambda: shot.update(arm(trainer, done)), daemon=True)
        thread.start()
        error = None
        try:
            trainer.run()
        except Exception as err:  # a run that does not recover: reported as such
            error = f"{type(err).__name__}: {err}"
        done.set()
        thread.join()
        if "at" in shot:  # a kill lands only while calls are left: some call ends after it, or the run fails
            at = shot.pop("at")
            shot["landed"] = shot["landed"] and (error is not None or last_call_end(run_dir) > at)
        metrics = read_metrics(run_dir)
        problems = list(watch.problems)
        if error is None:
            problems += [p for p in [final_checkpoint_problem(run_dir)] if p]
        log = failures(run_dir)
        if [f["resumes_after"] for f in log] != watch.resumed_from:
            problems.append(f"resumed after {[f['resumes_after'] for f in log]}, latest was {watch.resumed_from}")
        left, gone_by = left_behind(watch.procs | (tree.stop() - before))
        return {
            "config": f"{algo} ray {devices}dev",
            "algo": algo,
            "executor": "ray",
            "devices": devices,
            **shot,
            "cut_short": watch.cut_short,
            "gone_by_s": gone_by,
            "finished": error is None,
            "error": error,
            "same_metrics": error is None and not metric_differences(metrics, expected),
            "differences": metric_differences(metrics, expected)[:3] if error is None else [],
            "checkpoints_ok": not problems,
            "problems": problems,
            "recoveries": len(log),
            "left": sorted(pid for pid, _ in left),
        }

    def worker_trial(self, k: int, rng: random.Random) -> dict:
        algo, devices = RAY_CONFIGS[k % len(RAY_CONFIGS)]
        _, loop_s = self.reference(algo, "ray", devices)
        delay, rank = rng.uniform(0, loop_s), rng.randrange(devices)

        def arm(trainer: RLTrainer, done: threading.Event) -> dict:
            if done.wait(delay):
                return {"landed": False}
            at = time.time()
            pid = kill_worker(trainer, rank)
            return {"landed": pid is not None, "at": at, "rank": rank, "delay_s": round(delay, 3)}

        return self._ray_trial(f"worker-{k}", algo, devices, arm)

    def save_worker_trial(self, k: int, rng: random.Random) -> dict:
        algo, devices = RAY_CONFIGS[k % len(RAY_CONFIGS)]
        first = rng.randint(1, ITERATIONS - 1)

        def arm(trainer: RLTrainer, done: threading.Event) -> dict:
            return aim_at_a_save(trainer.run_dir, first, rng, done, lambda: kill_worker(trainer, 0) is not None)

        return self._ray_trial(f"save-worker-{k}", algo, devices, arm)

    def save_driver_trial(self, k: int, rng: random.Random) -> dict:
        executor, algo = DRIVER_CONFIGS[k % len(DRIVER_CONFIGS)]
        devices = 2
        expected, _ = self.reference(algo, executor, devices)
        run_dir = self.root / f"save-driver-{k}"
        items = overrides(run_dir, algo, executor, devices)
        first = rng.randint(1, ITERATIONS - 1)
        run_dir.mkdir(parents=True)
        with open(run_dir.parent / f"save-driver-{k}.log", "w") as log:
            driver = subprocess.Popen(
                [sys.executable, "-m", "loomrl.cli", "train", *items],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        tree, done = Tree(driver.pid), threading.Event()  # the driver's processes, known after it dies
        ended = threading.Thread(target=lambda: (driver.wait(), done.set()), daemon=True)
        ended.start()

        def kill() -> bool:
            if driver.poll() is not None:
                return False
            tree.look()
            driver.kill()
            return True

        shot: dict = {"landed": False}
        try:
            shot = aim_at_a_save(run_dir, first, rng, done, kill)
            if not shot["landed"]:
                done.wait(600)
        finally:
            driver.kill()
            ended.join()
        left, gone_by = left_behind(tree.stop())
        shot["cut_short"] = unfinished_saves(run_dir)
        problems = []
        if shot.get("landed"):  # the save of shot["save_of"] was hit: the checkpoint before it, at least, is there
            problem = checkpoint_problem(run_dir, shot["save_of"] - 1)
            if problem is not None:
                problems.append(problem)
        latest = latest_checkpoint(run_dir)
        resumed_after = iteration_of(latest) if latest is not None else -1
        before, tree = descendants(os.getpid()), Tree(os.getpid())
        trainer = RLTrainer(self.config(run_dir, algo, executor, devices))
        watch = Watch(trainer)
        error = None
        try:
            trainer.run(resume=True)
        except Exception as err:
            error = f"{type(err).__name__}: {err}"
        metrics = read_metrics(run_dir)
        if error is None:
            problems += [p for p in [final_checkpoint_problem(run_dir)] if p]
        if any("recovery/failures" in m for m in metrics):
            problems.append("the resumed run recovered from a failure")
        left_after, gone_after = left_behind(watch.procs | (tree.stop() - before))
        left |= left_after
        gone_by = None if None in (gone_by, gone_after) else max(gone_by, gone_after)
        return {
            "config": f"{algo} {executor} {devices}dev",
            "algo": algo,
            "executor": executor,
            "devices": devices,
            **shot,
            "resumed_after": resumed_after,
            "gone_by_s": gone_by,
            "finished": error is None,
            "error": error,
            "same_metrics": error is None and not metric_differences(metrics, expected),
            "differences": metric_differences(metrics, expected)[:3] if error is None else [],
            "checkpoints_ok": not problems,
            "problems": problems,
            "recoveries": len(failures(run_dir)),
            "left": sorted(pid for pid, _ in left),
        }

    def flip_source(self) -> Path:
        """A saved checkpoint of a PPO run (actor and critic, optimizers, RNG, state), copied aside."""
        copy = self.root / "flip" / checkpoint_name(ITERATIONS - 1)
        if not copy.exists():
            self.reference("ppo", "reference", 2)
            source = latest_checkpoint(self.root / "reference-ppo-reference2")
            shutil.copytree(source, copy)
        return copy

    def flip_trial(self, k: int, rng: random.Random) -> dict:
        return flip_one_byte(self.flip_source(), rng)


def flip_one_byte(checkpoint: Path, rng: random.Random) -> dict:
    """Flip one byte of a random file the checkpoint's manifest lists: detected when verification names the
    file, loading refuses the checkpoint, and both pass again once the byte is restored."""
    listed = sorted(json.loads((checkpoint / MANIFEST_FILE).read_text())["files"])
    name = rng.choice(listed)
    file = checkpoint / name
    data = bytearray(file.read_bytes())
    offset, mask = rng.randrange(len(data)), rng.randrange(1, 256)
    original = data[offset]
    data[offset] ^= mask
    file.write_bytes(bytes(data))
    named = refused = False
    try:
        try:
            verify_checkpoint(checkpoint)
        except CheckpointError as err:
            named = str(file) in str(err)
        try:
            load_checkpoint(checkpoint, {}, {}, restore_rng=False)
        except CheckpointError:
            refused = True
    finally:
        data[offset] = original
        file.write_bytes(bytes(data))
    try:
        verify_checkpoint(checkpoint)
        clean = True
    except CheckpointError:
        clean = False
    return {
        "file": name,
        "offset": offset,
        "mask": mask,
        "detected": named and refused and clean,
        "named": named,
        "refused": refused,
        "restored_passes": clean,
    }


# ------------------------------------------------------------------------------------------------ the table
def failed(trial: dict) -> list[str]:
    """The outcomes a trial missed."""
    if trial["kind"] == "flip":
        return [] if trial["detected"] else ["detected"]
    missed = [name for name in ("finished", "same_metrics", "checkpoints_ok") if not trial.get(name)]
    return missed + (["left"] if trial["left"] else [])


def gone_by(trials: list[dict]) -> float | str:
    """The longest any trial's processes took to exit after its run ended (or its driver was killed)."""
    if any(t["gone_by_s"] is None for t in trials):
        return f"> {LINGER_S:.0f} (killed)"
    return max((t["gone_by_s"] for t in trials), default=0.0)


def row(kind: str, trials: list[dict]) -> dict:
    n = len(trials)

    def count(key: str) -> str:
        return f"{sum(bool(t.get(key)) for t in trials)}/{n}"

    def values(key: str) -> str:
        return "/".join(str(v) for v in sorted({t[key] for t in trials}, key=str))

    seconds = [t["seconds"] for t in trials]
    if kind == "flip":
        out = {
            "fault": kind,
            "runs": f"{len({t['file'] for t in trials})} files",
            "trials": n,
            "landed": f"{n}/{n}",
            "saves cut short": "-",
            "finished": "-",
            "same metrics": "-",
            "checkpoints ok": "-",
            "detected": count("detected"),
            "processes left": "-",
            "all gone by s": "-",
            "recoveries": "-",
        }
    else:
        runs = f"{values('algo')}, {values('executor')}, {values('devices')} dev" if trials else ""
        out = {
            "fault": kind,
            "runs": runs,
            "trials": sum(bool(t.get("landed")) for t in trials),
            "landed": count("landed"),
            "saves cut short": count("cut_short") if kind.startswith("save") else "-",
            "finished": count("finished"),
            "same metrics": count("same_metrics"),
            "checkpoints ok": count("checkpoints_ok"),
            "detected": "-",
            "processes left": sum(len(t["left"]) for t in trials),
            "all gone by s": gone_by(trials),
            "recoveries": sum(t["recoveries"] for t in trials),
        }
    return {**out, "mean s": sum(seconds) / max(n, 1), "total s": sum(seconds)}


def describe(trial: dict) -> str:
    if trial["kind"] == "flip":
        what = f"{trial['file']} byte {trial['offset']} ^ {trial['mask']:#04x}"
    elif trial.get("landed"):
        where = f"save of iteration {trial['save_of']}" if "save_of" in trial else f"{trial['delay_s']} s"
        victim = "driver" if trial["kind"] == "save-driver" else f"worker {trial.get('rank', 0)}"
        cut = f", {' '.join(trial['cut_short'])} left unfinished" if trial.get("cut_short") else ""
        what = f"{trial['config']}: {victim} killed at {where}{cut}; {trial['recoveries']} recoveries"
    else:
        what = f"{trial['config']}: the kill did not land"
    missed = failed(trial)
    status = "ok" if not missed else "MISSED " + ", ".join(missed)
    details = [trial.get("error"), *trial.get("problems", []), *trial.get("differences", [])]
    if trial.get("left"):
        went = trial["gone_by_s"]
        details.append(
            f"processes left {GRACE_S:.0f} s after: {trial['left']}; "
            + (f"all gone {went:.0f} s after" if went is not None else f"killed after {LINGER_S:.0f} s")
        )
    return f"{trial['kind']} #{trial['trial']}: {what} ({trial['seconds']:.1f} s): {status}" + "".join(
        f"\n    {d}" for d in details if d
    )


def run(kinds: list[str], trials: int, seed: int, root: Path, console: Console) -> list[dict]:
    """``trials`` trials of each kind whose fault landed: a kill aimed past the run's last call (the uniform
    delay of a ``worker`` trial) or at a save that ended first (in the last iterations) did not test anything,
    so another trial is drawn, up to ``MAX_ATTEMPTS`` times ``trials`` in all."""
    bench, rng = Bench(root, console), random.Random(seed)
    results = []
    for kind in kinds:
        console.print(f"[bold]{TITLES[kind]}[/]: {trials} trials")
        landed = 0
        for k in range(MAX_ATTEMPTS * trials):
            if landed == trials:
                break
            results.append(bench.trial(kind, k, rng))
            landed += bool(results[-1].get("landed", True))  # a flipped byte always lands
            console.print("  " + describe(results[-1]), markup=False, highlight=False, soft_wrap=True)
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=10, help="trials per fault kind")
    ap.add_argument("--quick", action="store_true", help="2 trials per kind: a smoke check")
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS)}")
    ap.add_argument("--seed", type=int, default=0, help="of the random points, victims and bytes")
    ap.add_argument("--out", type=Path, help="write every trial as JSON to this file")
    ap.add_argument("--keep", type=Path, help="run in this directory and keep it (runs, logs, checkpoints)")
    args = ap.parse_args(argv)
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        ap.error(f"--kinds: unknown {unknown}; valid: {', '.join(KINDS)}")
    trials = 2 if args.quick else args.trials
    quiet_libraries()
    console = Console(width=None if sys.stdout.isatty() else 200)  # the table whole in a log file too
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="loomrl-faults-") as d:
        root = args.keep or Path(d)
        root.mkdir(parents=True, exist_ok=True)
        results = run(kinds, trials, args.seed, root, console)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    rows = [row(kind, [t for t in results if t["kind"] == kind]) for kind in kinds]
    console.print(
        summary_table(
            rows,
            f"fault injection: {trials} trials per kind, {ITERATIONS} iterations per run, "
            f"{time.perf_counter() - start:.0f} s in all",
        )
    )
    missed = [t for t in results if failed(t)]
    for t in missed:
        console.print(
            f"missed: {t['kind']} #{t['trial']}: {', '.join(failed(t))}", markup=False, highlight=False, soft_wrap=True
        )
    short = [row for row in rows if row["trials"] < trials]
    for r in short:
        console.print(
            f"missed: {r['fault']}: {r['trials']} of {trials} faults landed in {r['landed'].split('/')[1]} trials",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
    return 1 if missed or short else 0


if __name__ == "__main__":
    sys.exit(main())
