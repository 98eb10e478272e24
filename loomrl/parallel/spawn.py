"""Run a function on a small local gloo world of spawned processes (tests and benchmarks).

The runtime proper uses Ray workers; this is the light harness for checking collectives against a single
process: each rank joins a gloo group on 127.0.0.1, runs ``body(rank)``, and sends back its result or its
traceback, so a failure on any rank surfaces in the parent instead of a hang.
"""

from __future__ import annotations

import datetime
import os
import queue as queues
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(rank: int, world: int, port: int, body: Callable[[int], Any], queue: Any, group_timeout_s: float) -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"
    torch.set_num_threads(1)
    # A short timeout: if one rank fails, its peers' next collective errors out instead of hanging for 30 min.
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=group_timeout_s),
    )
    try:
        queue.put((rank, body(rank)))
    except BaseException:  # noqa: BLE001 - the parent must learn of any failure, not wait for a timeout
        queue.put((rank, RankFailure(traceback.format_exc())))
    finally:
        dist.destroy_process_group()


class RankFailure(str):
    """The traceback of a rank whose body raised."""


def run_world(
    body: Callable[[int], Any], world: int, timeout_s: float = 300.0, group_timeout_s: float = 60.0
) -> list[Any]:
    """``body(rank)`` on ``world`` spawned gloo ranks; results in rank order. ``body`` must be picklable (a
    module-level function); a rank that raises makes this raise RuntimeError with its traceback."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(rank, world, port, body, queue, group_timeout_s)) for rank in range(world)
    ]
    for proc in procs:
        proc.start()
    try:
        results = _collect(queue, procs, timeout_s)
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    for rank, result in sorted(results.items()):
        if isinstance(result, RankFailure):
            raise RuntimeError(f"rank {rank} failed:\n{result}")
    return [results[rank] for rank in range(world)]


def _collect(queue: Any, procs: list, timeout_s: float) -> dict[int, Any]:
    """Every rank's result; raises as soon as a rank dies without sending one (killed, e.g. out of memory:
    its peers would otherwise wait for it until the timeout) or when ``timeout_s`` passes."""
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    while len(results) < len(procs):
        try:
            rank, result = queue.get(timeout=1.0)
            results[rank] = result
            continue
        except queues.Empty:
            pass
        for rank, proc in enumerate(procs):
            if rank not in results and proc.exitcode is not None:
                try:  # its result may have been sent just before it exited
                    late_rank, result = queue.get(timeout=1.0)
                    results[late_rank] = result
                    break
                except queues.Empty:
                    raise RuntimeError(
                        f"rank {rank} died without a result (exit code {proc.exitcode}"
                        f"{': killed, e.g. out of memory' if proc.exitcode < 0 else ''})"
                    ) from None
        if time.monotonic() > deadline:
            missing = sorted(set(range(len(procs))) - set(results))
            raise RuntimeError(f"ranks {missing} sent no result within {timeout_s:.0f} s")
    return results
