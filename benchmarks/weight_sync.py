"""Weight syncs into vLLM: bytes, seconds per sync, and what verifying them costs.

    .venv/bin/python benchmarks/weight_sync.py [--model smollm2-135m-instruct] [--syncs 5] [--precision fp32 bf16]

A vLLM engine (its CPU build here; ``rollout.backend=vllm``'s, in its own process) is built for the model, then
synced ``--syncs`` times, the weights changed a little before each (as a training step changes them): each sync
sends every tensor in buckets, reloads them in place and verifies them (every tensor arrived once, every
fingerprint matches: :mod:`loomrl.rollout.weight_sync`). Reported: the bytes a sync moves, the median and range
of its transfer-and-reload seconds and of its verification seconds, and the verification's share of the sync.
What a generate call pays before its first token is the sum. The sync is the same whether the engine's worker
trains too (colocated) or holds a shadow (separate): the reallocation that fills a shadow comes before it and is
`benchmarks/realloc.py`'s figure.
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="a pretrained name or a checkpoint directory")
    ap.add_argument("--syncs", type=int, default=5)
    ap.add_argument("--precision", nargs="+", default=["fp32", "bf16"], choices=sorted(PRECISIONS))
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if args.syncs < 1:
        print("weight_sync.py: error: --syncs must be at least 1", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    rows = [measure(args.model, p, args.syncs) for p in args.precision]
    Console(width=160).print(summary_table(rows, f"weight syncs into vLLM: {args.model}, {args.syncs} each"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
