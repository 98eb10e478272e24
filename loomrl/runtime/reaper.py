"""A watchdog that removes what a killed driver leaves of its private Ray instance.

When a driver that started its own Ray instance dies without shutting it down (kill -9, the OOM killer), the
instance's processes follow it, but not at once: Ray 2.60's dashboard and runtime-env agents, seeing their raylet
die without a SIGTERM, first try to report this to a GCS that is already gone, with a fixed 60-second timeout
(``ray._private.utils.publish_error_to_driver``), and linger that long. A supervisor counting the processes a
run left behind sees them; a machine that restarts runs in a loop accumulates them.

:func:`watch` starts this module as a small child process, in the driver's process group (so killing the group
takes it too), holding the read end of a pipe whose write end only the driver has. It samples the driver's
descendants every ``SAMPLE_S`` seconds from ``/proc``; when the pipe reaches end-of-file (the driver exited, by
any means), it gives the last sample ``GRACE_S`` seconds to exit by themselves and then kills those still running
(the same processes: pid and start time both match). Linux only (``/proc``); elsewhere :func:`watch` does nothing.
No library does this: psutil could replace the ``/proc`` reading, but not the pipe-held lifetime.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

SAMPLE_S = 1.0
"""How often the driver's descendants are sampled while it runs."""
GRACE_S = 5.0
"""How long the last sample's processes get to exit by themselves once the driver is gone."""

_watching = False


def watch() -> None:
    """Start the watchdog for this process, once per process (no-op without ``/proc``)."""
    global _watching
    if _watching or not Path(f"/proc/{os.getpid()}/stat").exists():
        return
    read, write = os.pipe()
    os.set_inheritable(write, False)  # only this process holds the write end: children must not keep it open
    subprocess.Popen(
        [sys.executable, "-m", "loomrl.runtime.reaper", str(os.getpid())],
        stdin=read,
        close_fds=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    os.close(read)
    _watching = True  # the write end stays open, unused, until this process exits


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks) of ``pid``, or None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # the command name may hold spaces and parentheses
    return int(fields[1]), int(fields[19])


def descendants(root: int) -> dict[int, int]:
    """Every live descendant of ``root``: pid to start time."""
    children: dict[int, list[tuple[int, int]]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _stat(int(entry))
            if stat is not None:
                children.setdefault(stat[0], []).append((int(entry), stat[1]))
    found, todo = {}, [root]
    while todo:
        for pid, start in children.get(todo.pop(), []):
            if pid not in found:
                found[pid] = start
                todo.append(pid)
    return found


def _alive(procs: dict[int, int]) -> dict[int, int]:
    return {pid: start for pid, start in procs.items() if (_stat(pid) or (0, None))[1] == start}


def reap(driver: int, stdin_fd: int = 0) -> list[int]:
    """Sample ``driver``'s descendants until ``stdin_fd`` reaches end-of-file, then kill those of the last sample
    still running after :data:`GRACE_S`; returns the pids killed."""
    me = os.getpid()
    sample: dict[int, int] = {}
    while True:
        ready, _, _ = select.select([stdin_fd], [], [], SAMPLE_S)
        if ready and not os.read(stdin_fd, 4096):
            break
        sample = {pid: start for pid, start in descendants(driver).items() if pid != me}
    deadline = time.monotonic() + GRACE_S
    while (left := _alive(sample)) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return sorted(left)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C of the terminal's group is the driver's to handle
    reap(int(sys.argv[1]))
