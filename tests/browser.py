"""A headless Chromium driven over the DevTools protocol, for tests that check a page in a real browser.

The browser is started with ``--remote-debugging-pipe``: protocol messages are JSON objects separated by NUL bytes
on file descriptors 3 (to the browser) and 4 (from it), so no port, websocket library or driver is needed, only
the ``chromium`` binary (Debian/Ubuntu: ``apt-get install -y chromium``). :func:`find_chromium` returns None
where there is none, and tests skip with that reason.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")


def find_chromium() -> str | None:
    """The first Chromium-like browser on PATH, or None."""
    return next((path for name in CANDIDATES if (path := shutil.which(name))), None)


class Browser:
    """A headless browser with one page; ``with Browser(path) as b: b.open(url); b.evaluate("1 + 1")``."""

    def __init__(self, binary: str, width: int = 1280, height: int = 900, timeout_s: float = 60.0) -> None:
        self.binary, self.width, self.height, self.timeout_s = binary, width, height, timeout_s
        self.next_id, self.session = 0, None
        self.buffer = b""

    def __enter__(self) -> Browser:
        self.profile = tempfile.mkdtemp(prefix="loomrl-chromium-")
        to_browser_r, self.to_browser = os.pipe()
        self.from_browser, from_browser_w = os.pipe()
        # the browser reads commands on fd 3 and writes replies on fd 4; the child moves the pipes there, and
        # pass_fds keeps 3 and 4 open through the close of the others (which comes after the move)
        self.proc = subprocess.Popen(
            [
                self.binary,
                "--headless=new",
                "--remote-debugging-pipe",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--no-default-browser-check",
                "--hide-scrollbars",
                f"--user-data-dir={self.profile}",
                f"--window-size={self.width},{self.height}",
                "about:blank",
            ],
            pass_fds=sorted({3, 4, to_browser_r, from_browser_w}),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=_fds_3_and_4(to_browser_r, from_browser_w),
        )
        os.close(to_browser_r)
        os.close(from_browser_w)
        try:
            target = self.call("Target.createTarget", url="about:blank")["targetId"]
            self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
            self.call("Page.enable")
            self.call(
                "Emulation.setDeviceMetricsOverride",
                width=self.width,
                height=self.height,
                deviceScaleFactor=1,
                mobile=False,
            )
        except BaseException:  # no browser left behind when the set-up fails
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self.proc.terminate()
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        finally:
            os.close(self.to_browser)
            os.close(self.from_browser)
            shutil.rmtree(self.profile, ignore_errors=True)

    # ------------------------------------------------------------------------------------------ protocol
    def _send(self, message: dict) -> None:
        os.write(self.to_browser, json.dumps(message).encode() + b"\0")

    def _receive(self, deadline: float) -> dict:
        while b"\0" not in self.buffer:
            if time.monotonic() > deadline:
                raise TimeoutError("no reply from the browser")
            chunk = os.read(self.from_browser, 1 << 16)
            if not chunk:
                raise ConnectionError("the browser closed its pipe")
            self.buffer += chunk
        raw, _, self.buffer = self.buffer.partition(b"\0")
        return json.loads(raw)

    def call(self, method: str, **params: Any) -> dict:
        """Send one command (to the page once attached) and return its result; a protocol error raises."""
        self.next_id += 1
        message: dict[str, Any] = {"id": self.next_id, "method": method, "params": params}
        if self.session is not None and not method.startswith("Target."):
            message["sessionId"] = self.session
        self._send(message)
        deadline = time.monotonic() + self.timeout_s
        while True:
            reply = self._receive(deadline)
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            if reply.get("method") == "Page.loadEventFired":
                self.loaded = True

    # ------------------------------------------------------------------------------------------ page
    def open(self, url: str) -> None:
        """Navigate and wait until the page's load event has fired."""
        self.loaded = False
        self.call("Page.navigate", url=url)
        deadline = time.monotonic() + self.timeout_s
        while not self.loaded:
            reply = self._receive(deadline)
            if reply.get("method") == "Page.loadEventFired":
                self.loaded = True

    def evaluate(self, expression: str) -> Any:
        """The JSON value of a JavaScript expression evaluated in the page."""
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"JavaScript error: {result['exceptionDetails']}")
        return result["result"].get("value")

    def screenshot(self, path: Path) -> Path:
        """A PNG of the whole page (beyond the window's height)."""
        data = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)["data"]
        path.write_bytes(base64.b64decode(data))
        return path


def _fds_3_and_4(read_fd: int, write_fd: int):
    """In the child, before exec: the command pipe on fd 3 and the reply pipe on fd 4, as Chromium expects."""

    def move() -> None:
        r, w = os.dup(read_fd), os.dup(write_fd)  # off 3 and 4 first, in case either already is one
        os.dup2(r, 3)
        os.dup2(w, 4)

    return move
