"""Peak memory of worker 0 while a Ray run saves a checkpoint: whole roles gathered onto it, or sharded.

    .venv/bin/python benchmarks/checkpoint_memory.py [--model llama-30m] [--devices 4] [--sharding fsdp]

For each checkpoint format (``checkpoint.format=full``: every role's full weights and optimizer state gathered
onto worker 0, which writes them; ``sharded``: every worker writes the shards it owns) a PPO run of ``--model``
(actor and critic trained, each with ``--sharding`` over ``--devices`` gloo workers) takes one small iteration,
so that Adam holds its moments, then saves. Around that save the driver resets worker 0's resident-set
high-water mark (``/proc/PID/clear_refs``) and reads it back afterwards (``VmHWM``): "peak during save" is that
mark less worker 0's resident set just before. glibc's malloc is told to map every block of 64 KiB or more on
its own (``MALLOC_MMAP_THRESHOLD_``, inherited by the Ray workers), so freed memory leaves the resident set at
once and the mark counts what the save itself holds, not memory the allocator kept from the iteration. "worker 0 writes" is the bytes of the files it writes (sharded:
its own shards, its share of the state; full: everything), "whole state" the bytes of all the checkpoint's
weights and optimizer files.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import ray

from loomrl.config import TrainConfig
from loomrl.configtools import load_config
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


def measure(fmt: str, model: str, devices: int, sharding: str, root: Path) -> dict:
    layouts = "" if sharding == "none" else \
        f"runtime.layouts={{actor: {{sharding: {sharding}}}, critic: {{sharding: {sharding}}}}}"
    cfg = load_config(TrainConfig, None, [o for o in (
        f"run_dir={root / fmt}", "seed=0", f"actor.model={model}", "rollout.prompts_per_iter=4",
        "rollout.max_new_tokens=4", "algo.minibatches=1", "algo.ppo_epochs=1", "loop.iterations=1",
        "loop.eval_every=0", "loop.save_every=0", "loop.progress=false", "report.html=false", "runtime.executor=ray",
        f"runtime.devices={devices}", "runtime.threads=1", "runtime.timeout_s=600", f"checkpoint.format={fmt}",
        layouts) if o])
    trainer = RLTrainer(cfg)
    executor = trainer.executor
    pid = ray.get(executor.workers[0].pid.remote(), timeout=120)
    save, record = executor.save, {}

    def measured_save(*args, **kwargs):
        before = _status(pid)["VmRSS"]
        _reset_peak(pid)
        start = time.perf_counter()
        path = save(*args, **kwargs)
        record.update(seconds=time.perf_counter() - start, peak=_status(pid)["VmHWM"] - before, path=Path(path))
        return path

    executor.save = measured_save
    trainer.run()
    files = [p for p in record["path"].rglob("*") if p.is_file()]
    state = [p for p in files if p.suffix == ".safetensors" or p.name == "optimizers.pt"]
    own = [p for p in state if p.stem.endswith("-r00000")] if fmt == "sharded" else state
    return {"format": fmt, "peak_mb": record["peak"] / MB, "writes_mb": sum(p.stat().st_size for p in own) / MB,
            "whole_mb": sum(p.stat().st_size for p in state) / MB, "seconds": record["seconds"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-30m", help="zoo model of the actor and the critic")
    ap.add_argument("--devices", type=int, default=4, help="Ray workers (gloo processes)")
    ap.add_argument("--sharding", default="fsdp", choices=("fsdp", "zero", "none"),
                    help="how the trained roles' state is divided over the workers (none: whole replicas)")
    args = ap.parse_args()
    os.environ.update(MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="65536")  # before Ray starts
    with tempfile.TemporaryDirectory() as tmp:
        rows = [measure(fmt, args.model, args.devices, args.sharding, Path(tmp)) for fmt in ("full", "sharded")]
    print(f"{args.model} actor + critic, {args.devices} workers, sharding {args.sharding}: worker 0 during the save")
    print("| format | peak during save (MB) | worker 0 writes (MB) | whole state (MB) | save (s) |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['format']} | {r['peak_mb']:.0f} | {r['writes_mb']:.0f} | {r['whole_mb']:.0f} | {r['seconds']:.1f} |")


if __name__ == "__main__":
    main()
