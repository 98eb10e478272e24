"""The processes a fault-injection trial started, found in ``/proc`` (Linux only): every process below a root,
watched while it runs so that one that loses its parent is still known, and how long they take to exit
(``benchmarks/faults.py``)."""

from __future__ import annotations

import os
import signal
import threading
import time

GRACE_S = 30.0
"""How long the processes of a trial get to exit before they count as left behind."""
LINGER_S = 120.0
"""How long processes left behind are then watched (to say when they go by themselves) before they are killed."""


def _stat(pid: int) -> tuple[int, str, int] | None:
    """(parent pid, state, start time) of a process, or None when there is none."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), fields[0], int(fields[19])


Proc = tuple[int, int]
"""A process: its pid and start time (so a pid the system gives to another process later is not taken for it)."""


def descendants(root: int) -> set[Proc]:
    """Every process below ``root`` now."""
    children: dict[int, list[Proc]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (stat := _stat(int(name))) is not None:
            children.setdefault(stat[0], []).append((int(name), stat[2]))
    found, frontier = set(), [root]
    while frontier:
        for proc in children.get(frontier.pop(), ()):
            found.add(proc)
            frontier.append(proc[0])
    return found


def identify(pids) -> set[Proc]:
    return {(pid, stat[2]) for pid in pids if (stat := _stat(pid)) is not None}


def alive(proc: Proc) -> bool:
    stat = _stat(proc[0])
    return stat is not None and stat[2] == proc[1] and stat[1] not in "ZX"


def left_behind(
    procs: set[Proc], grace_s: float = GRACE_S, linger_s: float = LINGER_S
) -> tuple[set[Proc], float | None]:
    """Those of ``procs`` still running after ``grace_s``, and the seconds until every one of ``procs`` was gone;
    None when some were still running after ``linger_s``: those are killed then, so that the next trial starts
    clean (each is checked to be the very process recorded)."""
    start, left = time.monotonic(), set()
    while running := {p for p in procs if alive(p)}:
        waited = time.monotonic() - start
        if waited >= grace_s and not left:
            left = running
        if waited >= linger_s:
            for pid, _ in running:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            return left, None
        time.sleep(0.5)
    return left, round(time.monotonic() - start, 1)


class Tree:
    """Every process seen below ``root`` while it runs (looked for every 0.25 s, and at :meth:`stop`): a process
    that loses its parent is still known."""

    def __init__(self, root: int):
        self.root, self.seen = root, set()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while True:
            self.look()
            if self._done.wait(0.25):
                return

    def look(self) -> None:
        self.seen |= descendants(self.root)

    def stop(self) -> set[Proc]:
        self._done.set()
        self._thread.join()
        self.look()
        return self.seen
