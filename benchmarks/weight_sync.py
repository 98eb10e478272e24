"""Weight syncs into vLLM: bytes, seconds per sync, and what verifying them costs.

    .venv/bin/python benchmarks/weight_sync.py [--model smollm2-135m-instruct] [--syncs 5] [--precision fp32 bf16]
    .venv/bin/python benchmarks/weight_sync.py --faults 20

A vLLM engine (its CPU build here; ``rollout.backend=vllm``'s, in its own process) is built for the model, then
synced ``--syncs`` times, the weights changed a little before each (as a training step changes them): each sync
sends every tensor in buckets, reloads them in place and verifies them (every tensor arrived once, every
fingerprint matches: :mod:`loomrl.rollout.weight_sync`). Reported: the bytes a sync moves, the median and range
of its transfer-and-reload seconds and of its verification seconds, and the verification's share of the sync.
What a generate call pays before its first token is the sum. The sync is the same whether the engine's worker
trains too (colocated) or holds a shadow (separate): the reallocation that fills a shadow comes before it and is
`benchmarks/realloc.py`'s figure.

With ``--faults N``: N syncs of a tiny model with each kind of fault injected between the trainer and the engine
at a random tensor (a sync skipped, one to three consecutive tensors dropped, a tensor sent twice, one entry of a
tensor corrupted, a tensor left at its previous version after a training-sized change, the engine's process
killed), and how many of them the sync caught, leaving the engine with no version a call could generate from.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from rich.console import Console  # noqa: E402

from loomrl.report import summary_table  # noqa: E402

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16}


def measure(model_name: str, precision: str, syncs: int) -> dict:
    from transformers import AutoModelForCausalLM

    from loomrl.models.pretrained import PRETRAINED, pretrained_dir
    from loomrl.rollout.vllm_engine import VLLMEngine

    path = pretrained_dir(model_name) if model_name in PRETRAINED else model_name
    model = AutoModelForCausalLM.from_pretrained(path, dtype=PRECISIONS[precision]).eval()
    engine = VLLMEngine(model, max_len=256, slots=8)
    try:
        reports = []
        for version in range(1, syncs + 1):
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(1 + 1e-3)
            reports.append(engine.sync(model, version))
    finally:
        engine.close()
    move = [r.seconds for r in reports]
    verify = [r.verify_seconds for r in reports]
    return {
        "precision": precision,
        "tensors": reports[0].tensors,
        "MB per sync": reports[0].bytes / 1e6,
        "transfer + reload s (range)": f"{statistics.median(move):.2f} ({min(move):.2f}-{max(move):.2f})",
        "verify s (range)": f"{statistics.median(verify):.3f} ({min(verify):.3f}-{max(verify):.3f})",
        "verify share": statistics.median(v / (m + v) for m, v in zip(move, verify)),
        "GB/s": reports[0].bytes / 1e9 / statistics.median(move),
    }


FAULTS = ("skipped sync", "dropped bucket", "tensor twice", "corrupted tensor", "stale tensor", "killed engine")


def _faulty(kind: str, rng, old: dict):
    """A replacement of :meth:`VLLMEngine._load` that injects ``kind`` at a tensor drawn by ``rng``."""
    from loomrl.rollout.vllm_engine import VLLMEngine

    load = VLLMEngine._load

    def faulty(self, tensors):
        tensors = list(tensors)
        at = rng.randrange(len(tensors))
        name, tensor = tensors[at]
        if kind == "skipped sync":
            tensors = []
        elif kind == "dropped bucket":
            tensors = tensors[:at] + tensors[at + rng.randint(1, 3) :]
        elif kind == "tensor twice":
            tensors.append((name, tensor))
        elif kind == "corrupted tensor":
            flat = tensor.clone().reshape(-1)
            flat[rng.randrange(flat.numel())] += rng.choice((-1, 1)) * (flat.abs().max() + 0.01)
            tensors[at] = (name, flat.view(tensor.shape))
        elif kind == "stale tensor":
            tensors[at] = (name, old[name])
        elif kind == "killed engine":
            import os
            import signal

            os.kill(self.pid, signal.SIGKILL)
        return load(self, tensors)

    return faulty


def fault_trials(trials: int, seed: int = 0) -> list[dict]:
    """``trials`` syncs of llama-1m with each fault of :data:`FAULTS` injected at a random tensor (the weights
    changed by one training-sized step, 1e-3 of each, before each), and how many the sync caught."""
    import random

    from loomrl.config.schema import TrainConfig
    from loomrl.config.tools import load_config
    from loomrl.models.tokenizer import task_tokenizer
    from loomrl.models.zoo import build_causal_lm
    from loomrl.rollout.vllm_engine import VLLMEngine
    from loomrl.rollout.weight_sync import WeightSyncError

    tok = task_tokenizer(load_config(TrainConfig, None, []).task, None)
    model = build_causal_lm("llama-1m", tok, 0).eval()
    rng = random.Random(seed)
    rows, engine = [], None
    own_load = VLLMEngine.__dict__["_load"]
    for kind in FAULTS:
        caught = 0
        for _ in range(trials):
            if engine is None:
                engine = VLLMEngine(model, max_len=64, slots=8)
            engine.sync(model, engine.syncs + 1)
            old = {n: p.detach().clone() for n, p in model.named_parameters()}
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1e-3 * p.abs().mean() * torch.sign(torch.randn_like(p)))
            VLLMEngine._load = _faulty(kind, rng, old)  # type: ignore[method-assign]
            try:
                engine.sync(model, engine.syncs + 1)
            except WeightSyncError:
                caught += engine.version is None
            finally:
                VLLMEngine._load = own_load  # type: ignore[method-assign]
            if kind == "killed engine":
                engine.close()
                engine = None
        rows.append({"fault": kind, "trials": trials, "caught": caught})
        print(rows[-1], flush=True)
    if engine is not None:
        engine.close()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="a pretrained name or a checkpoint directory")
    ap.add_argument("--syncs", type=int, default=5)
    ap.add_argument("--precision", nargs="+", default=["fp32", "bf16"], choices=sorted(PRECISIONS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--faults", type=int, default=0, help="instead: this many trials of each injected fault")
    args = ap.parse_args()
    if args.syncs < 1 or args.faults < 0:
        print("weight_sync.py: error: --syncs must be at least 1 and --faults at least 0", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    if args.faults:
        rows = fault_trials(args.faults)
        Console().print(summary_table(rows, "sync faults injected into vLLM syncs (llama-1m)"))
        return 0
    rows = [measure(args.model, p, args.syncs) for p in args.precision]
    Console(width=160).print(summary_table(rows, f"weight syncs into vLLM: {args.model}, {args.syncs} each"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
