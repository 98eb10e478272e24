"""Peak memory of worker 0 while a Ray run saves and loads a checkpoint: whole roles on it, or sharded.

    .venv/bin/python benchmarks/checkpoint_memory.py [--model llama-30m] [--devices 4] [--sharding fsdp]

For each checkpoint format (``checkpoint.format=full``: every role's full weights and optimizer state gathered
onto worker 0, which writes them; ``sharded``: every worker writes the shards it owns) a PPO run of ``--model``
(actor and critic trained, each with ``--sharding`` over ``--devices`` gloo workers) takes one small iteration,
so that Adam holds its moments, then saves; a second run resumes from that checkpoint. Around the save and the
load the driver resets worker 0's resident-set high-water mark (``/proc/PID/clear_refs``) and reads it back
afterwards (``VmHWM``): "peak during save" (or load) is that mark less worker 0's resident set just before.
glibc's malloc is told to map every block of 64 KiB or more on its own (``MALLOC_MMAP_THRESHOLD_``, inherited by
the Ray workers), so freed memory leaves the resident set at once and the mark counts what the save or load
itself holds, not memory the allocator kept from before. "worker 0 writes" is the bytes of the files it writes
(sharded: its own shards, its share of the state; full: everything), "whole state" the bytes of all the
checkpoint's weights and optimizer files.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import ray

from loomrl.config.schema import TrainConfig
from loomrl.config.tools import load_config
from loomrl.train.rl import RLTrainer

MB = 1 << 20


def _status(pid: int) -> dict[str, int]:
    """The process's VmRSS and VmHWM, in bytes."""
    out = {}
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    return out


def _reset_peak(pid: int) -> None:
    with open(f"/proc/{pid}/clear_refs", "w") as fh:
        fh.write("5")  # resets VmHWM to the current resident set


def _config(fmt: str, model: str, devices: int, sharding: str, root: Path, iterations: int) -> TrainConfig:
    layouts = (
        ""
        if sharding == "none"
        else f"runtime.layouts={{actor: {{sharding: {sharding}}}, critic: {{sharding: {sharding}}}}}"
    )
    return load_config(
        TrainConfig,
        None,
        [
            o
            for o in (
                f"run_dir={root / fmt}",
                "seed=0",
                f"actor.model={model}",
                "rollout.prompts_per_iter=4",
                "rollout.max_new_tokens=4",
                "algo.minibatches=1",
                "algo.ppo_epochs=1",
                f"loop.iterations={iterations}",
                "loop.eval_every=0",
                "loop.save_every=0",
                "loop.progress=false",
                "report.html=false",
                "runtime.executor=ray",
                f"runtime.devices={devices}",
                "runtime.threads=1",
                "runtime.timeout_s=600",
                f"checkpoint.format={fmt}",
                layouts,
            )
            if o
        ],
    )


def _watched(trainer: RLTrainer, method: str, record: dict) -> None:
    """Record worker 0's peak memory (above its resident set before) and the time of the executor's ``method``."""
    executor = trainer.executor
    pid = ray.get(executor.workers[0].pid.remote(), timeout=120)
    call = getattr(executor, method)

    def watched(*args, **kwargs):
        before = _status(pid)["VmRSS"]
        _reset_peak(pid)
        start = time.perf_counter()
        out = call(*args, **kwargs)
        record[method] = {"seconds": time.perf_counter() - start, "peak": _status(pid)["VmHWM"] - before}
        return out

    setattr(executor, method, watched)


def measure(fmt: str, model: str, devices: int, sharding: str, root: Path) -> dict:
    """One iteration and its save, then a resumed run's load of that checkpoint (and one more iteration)."""
    record: dict = {}
    trainer = RLTrainer(_config(fmt, model, devices, sharding, root, 1))
    _watched(trainer, "save", record)
    trainer.run()
    resumed = RLTrainer(_config(fmt, model, devices, sharding, root, 2))
    _watched(resumed, "load", record)
    resumed.run(resume=True)
    files = [p for p in (root / fmt / "checkpoints" / "iter_000000").rglob("*") if p.is_file()]
    state = [p for p in files if p.suffix == ".safetensors" or p.name == "optimizers.pt"]
    own = [p for p in state if p.stem.endswith("-r00000")] if fmt == "sharded" else state
    return {
        "format": fmt,
        "save_mb": record["save"]["peak"] / MB,
        "load_mb": record["load"]["peak"] / MB,
        "writes_mb": sum(p.stat().st_size for p in own) / MB,
        "whole_mb": sum(p.stat().st_size for p in state) / MB,
        "save_s": record["save"]["seconds"],
        "load_s": record["load"]["seconds"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-30m", help="zoo model of the actor and the critic")
    ap.add_argument("--devices", type=int, default=4, help="Ray workers (gloo processes)")
    ap.add_argument(
        "--sharding",
        default="fsdp",
        choices=("fsdp", "zero", "none"),
        help="how the trained roles' state is divided over the workers (none: whole replicas)",
    )
    args = ap.parse_args()
    os.environ.update(MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="65536")  # before Ray starts
    with tempfile.TemporaryDirectory() as tmp:
        rows = [measure(fmt, args.model, args.devices, args.sharding, Path(tmp)) for fmt in ("full", "sharded")]
    print(f"{args.model} actor + critic, {args.devices} workers, sharding {args.sharding}: worker 0")
    print(
        "| format | peak during save (MB) | peak during load (MB) | worker 0 writes (MB) | whole state (MB) | "
        "save (s) | load (s) |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['format']} | {r['save_mb']:.0f} | {r['load_mb']:.0f} | {r['writes_mb']:.0f} | "
            f"{r['whole_mb']:.0f} | {r['save_s']:.1f} | {r['load_s']:.1f} |"
        )


if __name__ == "__main__":
    main()
