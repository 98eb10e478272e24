"""User reward functions: imported by name (:func:`load_reward_fn`), called in a process of their own, each call
under a time limit (``task.reward_timeout_s``, :class:`RewardProcess`). Which arguments a function takes, and what
it must return, is :mod:`loomrl.data.reward_forms`' business.

A reward function is user code: it may raise, loop forever, or block inside C code that holds the GIL (a regular
expression that backtracks), which no thread-based timeout can interrupt. So :class:`RewardProcess` runs it in a
child Python process, started at the first call and kept for the next ones. A call that outlasts the limit kills
the child (the next call starts a new one) and raises a one-line :class:`~loomrl.errors.DataError` naming the
function and the sample; so does a call that raises, or a child that dies.

The child speaks JSON lines on its stdin and stdout (the arguments in; the value, made :func:`plain`, or an error
out); the function's own prints go to stderr. One call may be one sample or a whole batch (a batched function):
the limit is per call. It ignores Ctrl-C (its parent decides) and exits at the end of its input, or
once its parent is gone even in the middle of a call: at once on Linux when the parent's main thread started it
(``PR_SET_PDEATHSIG`` follows the starting thread, which may be a short-lived one), else within a second (a
watchdog thread, which a call holding the GIL in C code delays).

The child leads a process group of its own: whatever it leaves running (a subprocess it started) is killed with
it, when it is stopped, killed past the limit or found dead; a process that starts a session of its own escapes
that. It is the kernel's first choice when memory runs out (``oom_score_adj`` 1000), so a function that
allocates without bound loses its process rather than the run's. A reply that is not the child's own (the
function replaced ``json.dumps``, say) fails like a crash. The function otherwise runs as the run does: same user,
environment, files and network (it may need them, e.g. a remote reward service). Code that is not to be trusted
with those, such as a model's output, belongs in :mod:`loomrl.data.sandbox`.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import numbers
import os
import select
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from loomrl.errors import DataError

__all__ = ["RewardFn", "RewardProcess", "describe_batch", "describe_sample", "load_reward_fn", "one_line", "plain"]

RewardFn = Callable[..., Any]
"""A user reward function, of one of the forms of :mod:`loomrl.data.reward_forms`."""

LOAD_TIMEOUT_S = 60.0
"""Least time the child is given to start and import the function (imports may be slow; calls are limited)."""

_CHILD = (
    "import json, sys; sys.path[:0] = json.loads(sys.argv[1]); from loomrl.data.reward_functions import main; "
    "main(sys.argv[2] == 'main', int(sys.argv[3]))"
)


def load_reward_fn(spec: str) -> RewardFn:
    """Import a reward function named 'package.module:function' or 'path/to/file.py:function'.

    Module names resolve against the current directory first, as ``python -m`` would.
    """
    fn = import_attribute(spec, "reward function", "function")
    if not callable(fn):
        module_name, _, attr = spec.rpartition(":")
        raise DataError(f"reward function '{spec}': module '{module_name}' has no callable '{attr}'")
    return fn


def import_attribute(spec: str, what: str, kind: str) -> Any:
    """What ``spec``, 'package.module:name' or 'path/to/file.py:name', names (a reward function, an environment
    class), None when its module has no such name; ``what`` and ``kind`` word the one-line errors ("reward
    function", "function")."""
    module_name, colon, attr = spec.rpartition(":")
    if not (colon and module_name and attr):
        raise DataError(f"{what} '{spec}': expected the form 'module:{kind}' or 'file.py:{kind}'")
    try:
        if module_name.endswith(".py"):
            module = _module_from_file(module_name)
        else:
            if os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(module_name)
    except (ImportError, FileNotFoundError) as exc:
        raise DataError(f"{what} '{spec}': cannot import module '{module_name}' ({exc})") from exc
    return getattr(module, attr, None)


def _module_from_file(path: str):
    location = importlib.util.spec_from_file_location(Path(path).stem, path)
    if location is None or not Path(path).is_file():
        raise FileNotFoundError(f"no such file: {path}")
    module = importlib.util.module_from_spec(location)
    location.loader.exec_module(module)
    return module


class RewardProcess:
    """Calls ``spec`` ('module:function' or 'file.py:function') in a child process, ``timeout_s`` per call."""

    def __init__(self, spec: str, timeout_s: float) -> None:
        if timeout_s <= 0:
            raise ValueError(f"RewardProcess: timeout_s must be > 0, got {timeout_s}")
        self.spec, self.timeout_s = spec, timeout_s
        self._proc: subprocess.Popen | None = None
        self._buffer = b""
        self._finalizer: weakref.finalize | None = None

    def call(self, args: Sequence[Any], kwargs: Mapping[str, Any], sample: str) -> Any:
        """The function's value for ``fn(*args, **kwargs)``, made :func:`plain`; ``sample`` names the sample (or
        batch) in errors. A value a JSON line cannot carry (a date in a row) is sent as its ``str``."""
        if self._proc is None:
            self._start(sample)
        reply = self._exchange(
            {"args": list(args), "kwargs": dict(kwargs)},
            self.timeout_s,
            sample,
            f"took longer than task.reward_timeout_s={self.timeout_s:g} s",
        )
        if "raised" in reply:
            raise DataError(f"reward function '{self.spec}': raised {reply['raised']} {sample}")
        return _reprs(reply["value"])

    def close(self) -> None:
        """End the child (it exits at the end of its input; one that does not is killed)."""
        if self._finalizer is not None:
            self._finalizer()
        self._proc, self._buffer, self._finalizer = None, b"", None

    def __getstate__(self) -> dict:  # a copy starts its own child when first called
        return {"spec": self.spec, "timeout_s": self.timeout_s}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["spec"], state["timeout_s"])

    # ------------------------------------------------------------------------------------------ internals
    def _start(self, sample: str) -> None:
        starter = "main" if threading.current_thread() is threading.main_thread() else "thread"
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD, json.dumps(sys.path), starter, str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=os.getcwd(),
            start_new_session=True,
        )  # its group: what it leaves running dies with it
        self._finalizer = weakref.finalize(self, _stop, self._proc)
        reply = self._exchange(
            {"spec": self.spec}, max(LOAD_TIMEOUT_S, self.timeout_s), sample, "did not load in its process"
        )
        if "error" in reply:
            self.close()
            raise DataError(reply["error"])

    def _exchange(self, message: dict, timeout_s: float, sample: str, late: str) -> dict:
        proc = self._proc
        try:
            proc.stdin.write((json.dumps(message, default=str) + "\n").encode())
            proc.stdin.flush()
            line = self._read_line(time.monotonic() + timeout_s)
        except (BrokenPipeError, EOFError):
            try:
                code = proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                code = None
            self.close()
            raise DataError(f"reward function '{self.spec}': its process died (exit status {code}) {sample}") from None
        except TimeoutError:
            _kill_group(proc)  # stuck in the call: it would not read the end of its input
            self.close()
            raise DataError(f"reward function '{self.spec}': {late} {sample}") from None
        try:
            reply = json.loads(line)
        except ValueError:
            reply = None
        if not (isinstance(reply, dict) and reply.keys() & {"ready", "error", "value", "raised"}):
            _kill_group(proc)
            self.close()
            raise DataError(
                f"reward function '{self.spec}': its process replied {_short(line.decode('utf-8', 'replace'))}"
                f", not a reward (did the function replace something the replies are written with?) "
                f"{sample}"
            )
        return reply

    def _read_line(self, deadline: float) -> bytes:
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise EOFError
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line


class _Repr(str):
    """A returned value that is not a number, shown as its repr."""

    def __repr__(self) -> str:
        return str(self)


def plain(value: Any) -> Any:
    """A returned value as numbers (floats), lists and str-keyed dicts of them (sequences with ``tolist``, such as
    numpy arrays, become lists), anything else as an object whose repr is its own, for the caller's check to name.
    The same in the run's process and through the child's JSON line."""
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    tolist = getattr(value, "tolist", None)  # numpy arrays and scalars, tensors
    if callable(tolist) and not isinstance(value, str):
        converted = tolist()
        if converted is not value:
            return plain(converted)
    return _Repr(repr(value)[:200])


def _reprs(value: Any) -> Any:
    """A plain value read back from JSON: its strings were reprs."""
    if isinstance(value, str):
        return _Repr(value)
    if isinstance(value, dict):
        return {k: _reprs(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_reprs(v) for v in value]
    return value


def _stop(proc: subprocess.Popen) -> None:
    try:
        proc.stdin.close()
        proc.wait(timeout=2)
    except (OSError, subprocess.TimeoutExpired):
        proc.kill()
        proc.wait()
    _kill_group(proc)  # what the function left running in the child's group


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL to the child's process group (it leads one: ``start_new_session``)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # none of the group is left


def describe_sample(prompt: str, response: str) -> str:
    """The sample a reward call was about, for error messages: its prompt and response, shortened."""
    return f"(sample: prompt {_short(prompt)}, response {_short(response)})"


def describe_batch(prompts: Sequence[str], responses: Sequence[str]) -> str:
    """The batch a batched reward call was about, for error messages: its size and first sample."""
    if not prompts:
        return "(an empty batch)"
    size = f"{len(prompts)} samples" if len(prompts) != 1 else "1 sample"
    return f"(batch of {size}, the first: prompt {_short(prompts[0])}, response {_short(responses[0])})"


def _short(text: Any, limit: int = 60) -> str:
    shown = repr(text)
    return shown if len(shown) <= limit else shown[: limit - 4] + "...'"


def one_line(exc: BaseException) -> str:
    """``Type: message`` of an exception on one line."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}" if text else type(exc).__name__


# ----------------------------------------------------------------------------------------------- the child


def main(started_by_main_thread: bool, parent: int) -> None:
    """The child's loop: load the function named by the first message, then answer one call per line."""
    _die_with_parent(started_by_main_thread, parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:  # when memory runs out, the kernel kills this process (and what it starts) before the run's
        with open("/proc/self/oom_score_adj", "w") as adj:
            adj.write("1000")
    except OSError:
        pass  # not Linux, or /proc is not there
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # the function's prints go to stderr, never into the replies
    sys.stdout = sys.stderr
    try:
        fn = load_reward_fn(json.loads(sys.stdin.readline())["spec"])
    except DataError as err:
        replies.write(json.dumps({"error": str(err)}) + "\n")
        return
    replies.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        call = json.loads(line)
        try:
            value = plain(fn(*call["args"], **call["kwargs"]))
        except (Exception, SystemExit, KeyboardInterrupt) as exc:  # noqa: BLE001 - the parent stops the run naming it
            replies.write(json.dumps({"raised": one_line(exc)}) + "\n")
            continue
        replies.write(json.dumps({"value": value}) + "\n")


def _die_with_parent(started_by_main_thread: bool, parent: int) -> None:
    """A child stuck in a call must not outlive the run (module docstring)."""
    if started_by_main_thread and sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:  # the parent died before the child could watch it
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()
