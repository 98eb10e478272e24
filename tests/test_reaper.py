"""The watchdog that removes what a killed driver leaves behind (loomrl.runtime.reaper)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loomrl.runtime import reaper

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="the reaper reads /proc (Linux)")

DRIVER = """
import subprocess, sys, time
from loomrl.runtime import reaper
reaper.watch()
# A process that outlives its parent unless removed: its own session, as Ray's agents are reparented to init.
lingering = subprocess.Popen(["sleep", "600"], start_new_session=True)
print(lingering.pid, flush=True)
time.sleep(600)
"""


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if reaper._stat(pid) is None or Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] == "Z":
            return True
        time.sleep(0.1)
    return False


def test_a_killed_drivers_lingering_descendant_is_killed():
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )
    lingering = int(driver.stdout.readline())
    watchdogs = [pid for pid in reaper.descendants(driver.pid) if pid != lingering]
    time.sleep(reaper.SAMPLE_S * 2)  # the watchdog samples the driver's descendants once at least
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    try:
        assert _gone_within(lingering, reaper.GRACE_S + 5), "the lingering process outlived the watchdog's grace"
        assert all(_gone_within(pid, 5) for pid in watchdogs), "the watchdog did not exit after reaping"
    finally:
        try:
            os.kill(lingering, signal.SIGKILL)
        except OSError:
            pass


def test_descendants_follow_the_tree():
    child = subprocess.Popen(["sh", "-c", "sleep 30 & wait"])
    try:
        deadline = time.monotonic() + 5
        while len(found := reaper.descendants(os.getpid())) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert child.pid in found and len(found) >= 2  # the shell and its sleep, a grandchild
    finally:
        for pid in reaper.descendants(child.pid):
            os.kill(pid, signal.SIGKILL)
        child.kill()
        child.wait()
