"""Measure the current machine as a :class:`HardwareProfile` (the ``local`` profile, measured).

What is measured, and how (best of ``repeats`` after a warm-up, each):

- **matmul rate**: an n×n by n×n matmul (2n³ FLOPs) in the runtime's dtype (fp32 on CPU, bf16 on CUDA), on
  CPU with as many torch threads as a runtime worker gets: ``cores // devices`` (``runtime/worker.py``);
- **memory bandwidth**: a large tensor copy, one read and one write per byte;
- **loopback collective bandwidth and latency**: a TCP connection on 127.0.0.1 between two endpoints, the
  transport gloo uses between worker processes of one machine (measured with sockets, so the planner never
  imports torch.distributed); the latency is half a small message's round trip. On CUDA with two or more
  GPUs, a device-to-device copy measures the NVLink/PCIe path instead;
- **operator overhead**: the time of one tiny elementwise operator (8 floats), what the dispatcher and a kernel
  launch cost however little work an operator does;
- **cores shared**: how many devices share each core (``ceil(devices / cores)``), from the process's CPU
  affinity;
- **host to device** (CUDA only): a copy from pinned host memory, what reloading an offloaded role costs. CPU
  devices are their own host: the runtime does not offload there, and the profile says so (``host_offload``).

One machine has no inter-node link; the profile reuses the loopback figure for it.
"""

from __future__ import annotations

import math
import os
import socket
import threading
import time
from collections.abc import Callable

from loomrl.plan.hardware import HardwareProfile

__all__ = ["calibrate_local", "usable_cores"]


def usable_cores() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _best_of(fn: Callable[[], object], repeats: int, sync: Callable[[], None] = lambda: None) -> float:
    fn()
    sync()
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return max(best, 1e-9)


def _matmul_rate(torch, n: int, dtype, device: str, repeats: int, sync) -> float:
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    return 2 * n**3 / _best_of(lambda: torch.mm(a, b), repeats, sync)


def _op_overhead(torch, device: str, repeats: int, sync) -> float:
    """Seconds per call of a tiny ``add`` (best of ``repeats`` batches of 200 calls)."""
    a = torch.ones(8, device=device)
    b = torch.ones(8, device=device)

    def batch() -> None:
        for _ in range(200):
            torch.add(a, b)

    return _best_of(batch, repeats, sync) / 200


def _copy_bandwidth(torch, megabytes: int, device: str, repeats: int, sync) -> float:
    src = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / _best_of(lambda: dst.copy_(src), repeats, sync)


def _host_bandwidth(torch, megabytes: int, device: str, repeats: int, sync) -> float:
    host = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32).pin_memory()
    dst = torch.empty(host.shape, dtype=host.dtype, device=device)
    return host.numel() * 4 / _best_of(lambda: dst.copy_(host, non_blocking=True), repeats, sync)


def _serve_messages(server: socket.socket) -> None:
    """Accept one connection; for each message (8-byte length, then the bytes) reply one byte once it is all in."""
    conn, _ = server.accept()
    buffer = bytearray(2**20)
    with conn:
        while header := conn.recv(8, socket.MSG_WAITALL):
            remaining = int.from_bytes(header, "little")
            while remaining:
                got = conn.recv_into(buffer, min(remaining, len(buffer)))
                if not got:
                    return
                remaining -= got
            conn.sendall(b"k")


def loopback_bandwidth(megabytes: int = 32, repeats: int = 3) -> tuple[float, float]:
    """(bytes/s, one-way latency in s) of a TCP connection over 127.0.0.1, timed until the receiver has
    every byte (it acknowledges each message)."""
    server = socket.create_server(("127.0.0.1", 0))
    receiver = threading.Thread(target=_serve_messages, args=(server,), daemon=True)
    receiver.start()
    try:
        with socket.create_connection(server.getsockname()) as client:
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

            def message(payload: bytes) -> None:
                client.sendall(len(payload).to_bytes(8, "little") + payload)
                client.recv(1)

            payload = bytes(megabytes * 2**20)
            seconds = _best_of(lambda: message(payload), repeats)
            latency = _best_of(lambda: message(b"x"), repeats * 10) / 2
    finally:
        server.close()
        receiver.join(timeout=5)
    return len(payload) / seconds, latency


def _peer_bandwidth(torch, megabytes: int, repeats: int) -> float:
    src = torch.ones(megabytes * 2**20 // 4, device="cuda:0")

    def sync() -> None:
        torch.cuda.synchronize("cuda:0")
        torch.cuda.synchronize("cuda:1")

    return src.numel() * 4 / _best_of(lambda: src.to("cuda:1"), repeats, sync)


def _memory_bytes(torch, device: str, devices: int) -> float:
    if device.startswith("cuda"):
        return float(torch.cuda.get_device_properties(0).total_memory)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / devices


def calibrate_local(
    devices: int | None = None,
    *,
    device: str = "cpu",
    matmul_n: int = 1024,
    copy_mb: int = 256,
    transfer_mb: int = 32,
    repeats: int = 3,
) -> HardwareProfile:
    """Measure this machine as ``devices`` devices (default: one per core on CPU, one per GPU on CUDA).

    Sizes are arguments so a test can run a quick, small calibration; the defaults take a few seconds.
    """
    import torch  # measurements only: the rest of the planner must not need torch

    cuda = device.startswith("cuda")
    cores = usable_cores()
    devices = devices or (torch.cuda.device_count() if cuda else cores)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    threads = torch.get_num_threads()
    if not cuda:
        torch.set_num_threads(max(1, cores // devices))  # what runtime/worker.py gives each worker
    try:
        dtype = torch.bfloat16 if cuda else torch.float32
        flops = _matmul_rate(torch, matmul_n, dtype, device, repeats, sync)
        memory_bw = _copy_bandwidth(torch, copy_mb, device, repeats, sync)
        op_overhead = _op_overhead(torch, device, repeats, sync)
        host_bw = _host_bandwidth(torch, copy_mb, device, repeats, sync) if cuda else memory_bw
    finally:
        torch.set_num_threads(threads)
    link_bw, latency = loopback_bandwidth(transfer_mb, repeats)
    if cuda and torch.cuda.device_count() >= 2:
        link_bw = _peer_bandwidth(torch, transfer_mb, repeats)
    return HardwareProfile(
        name="local",
        matmul_flops=flops,
        mem_bandwidth=memory_bw,
        memory_bytes=_memory_bytes(torch, device, devices),
        intra_node_bw=link_bw,
        inter_node_bw=link_bw,
        devices_share_cores=1 if cuda else max(1, math.ceil(devices / cores)),
        link_latency=latency,
        op_overhead=op_overhead,
        async_launch=cuda,
        host_bw=host_bw,
        host_offload=cuda,
    )
