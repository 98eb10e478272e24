"""Measured machine rates for roofline fractions: dense matmul FLOP/s and memory bandwidth.

Shared by the benchmarks so that every fraction they print is against numbers measured in the same run.
"""

from __future__ import annotations

import time

import torch


def best_of(fn, repeats: int = 5, device: str = "cpu") -> float:
    """Best seconds of ``fn`` over ``repeats`` runs after a warm-up; on CUDA each run is timed to its kernels'
    end (kernels are launched asynchronously)."""

    def sync() -> None:
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)

    fn()  # warm-up
    sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def matmul_flops(n: int = 1024, dtype=torch.float32, device: str = "cpu") -> float:
    """FLOP/s of an n×n by n×n matmul (2n³ FLOPs), best of several."""
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    seconds = best_of(lambda: torch.mm(a, b), device=device)
    return 2 * n**3 / seconds


def memory_bandwidth(megabytes: int = 256, device: str = "cpu") -> float:
    """Bytes/s of a large tensor copy (one read plus one write per byte copied)."""
    src = torch.empty(megabytes * 2**20 // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    seconds = best_of(lambda: dst.copy_(src), device=device)
    return 2 * src.numel() * 4 / seconds
