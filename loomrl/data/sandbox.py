"""Run untrusted Python (model output that a reward function executes) in a limited, isolated process.

``run_python(source, stdin=...)`` runs a snippet the way ``python`` would and returns a :class:`SandboxResult`:
its exit status, stdout and stderr, and which limit, if any, ended it. A reward function judges the result:

    result = run_python(solution, stdin=test_input, limits=SandboxLimits(cpu_s=2, wall_s=5))
    return float(result.ok and result.stdout.strip() == expected)

What the snippet gets (:data:`SandboxLimits`): CPU seconds (RLIMIT_CPU: SIGXCPU, then SIGKILL), address space
(RLIMIT_AS: a MemoryError), the size of any file it writes (RLIMIT_FSIZE: SIGXFSZ), processes (RLIMIT_NPROC, added
to those its user already has: a fork bomb stops there), wall-clock time (the whole sandbox killed), an empty
temporary working directory (deleted afterwards), a clean environment, and no network: a new network namespace
whose only interface, loopback, is down. A new PID namespace makes sure no process it started outlives the call.
Started by root, it runs as ``SandboxLimits.user`` (nobody) after the namespaces are made, so it can neither
raise its limits nor write outside its directory and ``/tmp``; otherwise a new user namespace provides the other
namespaces without privileges. Where the OS refuses a namespace (no unprivileged user namespaces, a container
without ``CAP_SYS_ADMIN``), the snippet still runs, and :attr:`SandboxResult.gaps` says, in words, what was not
isolated (also warned once per process). It says too when the sandbox user cannot read this Python's library (an
interpreter under root's home): the snippet then imports only built-in and already loaded modules, rather than
run as root; ``SandboxLimits(user=None)`` chooses root instead.

Not isolated in any case: the file system beyond permissions (it reads what its user may read; no mount
namespace), disk space as a whole (many files below the size limit), and the number of processes of concurrent
sandboxes of the same user, which RLIMIT_NPROC counts together. Code inside the sandbox controls everything it
prints, so decide outside it: compare its stdout with the expected answer, never trust a score it reports.

``run_callable(fn, *args)`` runs ``fn(*args)`` in the sandbox the same way (``fn`` imported by name, arguments as
JSON); its prints are the result's stdout.
"""

from __future__ import annotations

import functools
import json
import os
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import sysconfig
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loomrl.errors import DataError

__all__ = ["SandboxError", "SandboxLimits", "SandboxResult", "run_callable", "run_python", "sandbox_gaps"]

_BOOT = Path(__file__).with_name("sandbox_boot.py")
_GRACE_S = 0.5
"""After the sandbox's first process ends, how long output still in flight is read before the rest is cut."""


class SandboxError(DataError):
    """Code run in the sandbox failed, hit a limit or timed out (:meth:`SandboxResult.check`)."""


@dataclass(frozen=True)
class SandboxLimits:
    """What one sandboxed run may use."""

    cpu_s: int = 5
    """CPU seconds (all its threads); at the limit SIGXCPU ends it."""
    wall_s: float = 10.0
    """Wall-clock seconds before the whole sandbox is killed (a snippet that sleeps or waits uses no CPU)."""
    memory_mb: int = 512
    """Address space in MiB (virtual memory: the interpreter itself takes some tens)."""
    file_size_mb: int = 16
    """Largest file it may write, in MiB."""
    processes: int = 16
    """Processes it may have at once, itself included."""
    output_bytes: int = 1 << 20
    """Bytes kept of each of stdout and stderr (the rest is read and dropped)."""
    user: int | None = 65534
    """The uid (and gid) it runs as when started by root; None keeps root (then the process limit binds nothing
    and it may read any file)."""


@dataclass(frozen=True)
class SandboxResult:
    """How a sandboxed run ended."""

    returncode: int | None
    """Exit status; None when a signal or the wall clock ended it."""
    signal: int | None
    """The signal that ended it, if any."""
    stdout: str
    stderr: str
    limit: str | None
    """The limit that ended it: 'cpu', 'memory', 'file_size' or 'wall'; None when none did."""
    cpu_s: float
    """CPU seconds it used (its reaped child processes included)."""
    limits: SandboxLimits
    gaps: tuple[str, ...] = ()
    """What this run lacked of the sandbox the module docstring describes, in words: isolation the OS refused,
    or imports its user could not read (empty when it had everything)."""
    truncated: bool = False
    """Whether stdout or stderr was longer than ``limits.output_bytes`` and was cut."""

    @property
    def timed_out(self) -> bool:
        return self.limit == "wall"

    @property
    def ok(self) -> bool:
        """Exit status 0 and no limit hit."""
        return self.returncode == 0 and self.limit is None

    def describe(self) -> str:
        """How it ended, in a few words."""
        lim = self.limits
        if self.limit == "wall":
            return f"timed out after {lim.wall_s:g} s (wall clock)"
        if self.limit == "cpu":
            return f"killed at the CPU limit ({lim.cpu_s} s)"
        if self.limit == "memory":
            return f"ran out of memory (limit {lim.memory_mb} MiB)"
        if self.limit == "file_size":
            return f"killed at the file-size limit ({lim.file_size_mb} MiB)"
        if self.signal is not None:
            return f"killed by {signal.Signals(self.signal).name}"
        return f"exit status {self.returncode}"

    def check(self, what: str = "sandboxed code") -> SandboxResult:
        """This result when :attr:`ok`, else a one-line :class:`SandboxError` naming ``what`` and how it ended."""
        if self.ok:
            return self
        last = next((line.strip() for line in reversed(self.stderr.splitlines()) if line.strip()), "")
        raise SandboxError(f"{what}: {self.describe()}" + (f" ({last[:200]})" if last else ""))


def run_python(source: str, *, stdin: str = "", limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run ``source`` as a Python program in the sandbox (module docstring), ``stdin`` as its input."""
    root = Path(tempfile.mkdtemp(prefix="loomrl-sandbox-"))
    try:
        work = root / "work"
        work.mkdir()
        (root / "source.py").write_text(source, encoding="utf-8")
        (root / "stdin").write_text(stdin, encoding="utf-8")
        uid = limits.user if os.geteuid() == 0 else None
        gaps = _unreadable_library(uid)
        if uid is not None:
            os.chown(work, uid, uid)
            root.chmod(0o711)  # the sandbox user may enter its directory, not list its parent
        report_r, report_w = os.pipe()
        cfg = {
            "report_fd": report_w,
            "source": str(root / "source.py"),
            "workdir": str(work),
            "uid": uid,
            "cpu_s": limits.cpu_s,
            "memory_mb": limits.memory_mb,
            "file_size_mb": limits.file_size_mb,
            "processes": limits.processes,
        }
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(work), "TMPDIR": str(work), "LANG": "C.UTF-8"}
        with open(root / "stdin", "rb") as stdin_file:
            proc = subprocess.Popen(
                [sys.executable, "-I", str(_BOOT), json.dumps(cfg)],
                stdin=stdin_file,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=(report_w,),
                cwd=work,
                env=env,
                start_new_session=True,
            )
        os.close(report_w)
        try:
            streams, timed_out = _collect(proc, report_r, limits)
        finally:
            _kill_group(proc)
            os.close(report_r)
            proc.stdout.close()
            proc.stderr.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return _result(streams, timed_out, limits, gaps)


def run_callable(
    fn: Callable[..., Any], *args: Any, stdin: str = "", limits: SandboxLimits = SandboxLimits()
) -> SandboxResult:
    """Run ``fn(*args)`` in the sandbox: ``fn`` must be a module-level function, importable there by its module's
    name from this process's ``sys.path`` (so readable by the sandbox user), and ``args`` JSON values."""
    if "<" in fn.__qualname__:
        raise ValueError(f"run_callable: {fn.__qualname__} is not a module-level function (it is imported by name)")
    source = (
        f"import importlib, json, sys\nsys.path[:0] = {json.dumps([p for p in sys.path if p])}\n"
        f"fn = importlib.import_module({fn.__module__!r})\n"
        f"for name in {fn.__qualname__!r}.split('.'):\n    fn = getattr(fn, name)\n"
        f"fn(*json.loads({json.dumps(json.dumps(list(args)))}))\n"
    )
    return run_python(source, stdin=stdin, limits=limits)


@functools.cache
def sandbox_gaps(limits: SandboxLimits = SandboxLimits(wall_s=60)) -> tuple[str, ...]:
    """What a sandbox lacks on this machine (:attr:`SandboxResult.gaps` of a trivial run)."""
    return run_python("pass", limits=limits).gaps


# --------------------------------------------------------------------------------------------- internals


def _collect(proc: subprocess.Popen, report_fd: int, limits: SandboxLimits) -> tuple[dict[str, Any], bool]:
    """Read stdout, stderr (each up to the output limit) and the report until the sandbox is done or the wall
    clock runs out; returns what was read and whether it timed out."""
    deadline = time.monotonic() + limits.wall_s
    got: dict[str, Any] = {"stdout": bytearray(), "stderr": bytearray(), "report": bytearray(), "truncated": False}
    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ, "stdout")
    selector.register(proc.stderr, selectors.EVENT_READ, "stderr")
    selector.register(report_fd, selectors.EVENT_READ, "report")
    timed_out, ended_at = False, None
    while selector.get_map():
        now = time.monotonic()
        if ended_at is None and proc.poll() is not None:
            ended_at = now  # its processes are gone or orphaned: read what is in flight, then stop
        if ended_at is not None and now > ended_at + _GRACE_S:
            break
        if ended_at is None and now > deadline:
            timed_out = True
            _kill_group(proc)
            ended_at = now
            continue
        for key, _ in selector.select(timeout=0.05):
            chunk = os.read(key.fd, 1 << 16)
            if not chunk:
                selector.unregister(key.fileobj)
                continue
            buffer = got[key.data]
            room = limits.output_bytes - len(buffer) if key.data != "report" else len(chunk)
            buffer += chunk[: max(room, 0)]
            got["truncated"] |= room < len(chunk)
    selector.close()
    return got, timed_out


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill the sandbox's first process and its process group (its namespace dies with it)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def _unreadable_library(uid: int | None) -> tuple[str, ...]:
    """A gap when ``uid`` (not the file owner, in no group) cannot read this interpreter's standard library."""
    if uid is None:
        return ()
    library = Path(sysconfig.get_paths()["stdlib"])
    for path in (*reversed(library.parents), library):
        mode = path.stat()
        needed = stat.S_IXOTH | (stat.S_IROTH if path == library else 0)
        if mode.st_uid != uid and mode.st_mode & needed != needed:
            return (
                f"imports: uid {uid} cannot read {path} (this Python's library is {library}): only built-in "
                "and already loaded modules import (SandboxLimits.user=None runs as root instead)",
            )
    return ()


def _result(got: dict[str, Any], timed_out: bool, limits: SandboxLimits, gaps: tuple[str, ...]) -> SandboxResult:
    lines = [json.loads(line) for line in got["report"].decode().splitlines() if line.strip()]
    notes = gaps + tuple(next((r["not_isolated"] for r in lines if "not_isolated" in r), ()))
    end = next((r for r in lines if "cpu_s" in r), {})
    stderr = got["stderr"].decode("utf-8", "replace")
    returncode, sig, cpu = end.get("returncode"), end.get("signal"), end.get("cpu_s", 0.0)
    limit = "wall" if timed_out or not end else None
    if limit is None and (sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu >= limits.cpu_s)):
        limit = "cpu"
    elif limit is None and sig == signal.SIGXFSZ:
        limit = "file_size"
    elif limit is None and returncode and stderr.rstrip().rpartition("\n")[2].startswith("MemoryError"):
        limit = "memory"
    if notes:
        warnings.warn("sandbox: " + "; ".join(notes), RuntimeWarning, stacklevel=3)
    return SandboxResult(
        None if limit == "wall" else returncode,
        sig,
        got["stdout"].decode("utf-8", "replace"),
        stderr,
        limit,
        cpu,
        limits,
        notes,
        got["truncated"],
    )
