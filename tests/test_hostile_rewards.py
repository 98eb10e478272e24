"""The hostile-reward suite: user reward code that misbehaves on purpose, and what stops or contains it.

User code reaches a run two ways, and each has its own guard:

- the reward function itself (``task.reward_fn`` with ``task.reward_timeout_s`` > 0) runs in a process of its own
  (:class:`~loomrl.data.reward_functions.RewardProcess`). It is the user's code, trusted with the run's user,
  environment, files and network; what it can do by mistake is stopped: a call past the time limit is killed,
  a crash, an exception or a value that is not a finite number is one line naming the function and the sample,
  and what it leaves running dies with its process group. :data:`REWARD_CASES`, each through
  :class:`~loomrl.data.prompts.FunctionTask` with a 1.5 s limit; after each, the next call must work again;
- code a reward function executes, such as a model's answer, is not trusted: it goes through
  :func:`loomrl.data.sandbox.run_python`, which contains it (resource limits, another user, an empty directory, a
  clean environment, no network, a PID namespace). :data:`SANDBOX_CASES`, each asserting what the code could not
  do; :func:`test_a_judge_reward_runs_hostile_answers_in_the_sandbox` runs some of them through a reward function.

Where this machine does not allow an isolation (no network namespace, not root, ...) the cases that need it are
skipped with the reason, and :func:`test_what_this_machine_cannot_isolate_is_stated` prints what the sandbox says
it lacks. docs/reliability.md has the table of outcomes.
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from loomrl.data.prompts import FunctionTask
from loomrl.data.sandbox import SandboxLimits, run_python, sandbox_gaps
from loomrl.errors import DataError

pytestmark = pytest.mark.filterwarnings("ignore:sandbox. :RuntimeWarning")  # the gaps, warned at every run

TIMEOUT_S = 1.5
"""task.reward_timeout_s of the reward-function cases."""
LIMITS = SandboxLimits(cpu_s=1, wall_s=3, memory_mb=256, file_size_mb=1, processes=8, output_bytes=4096)
"""The sandbox's limits in the sandbox cases (small, so that each case takes at most a few seconds)."""


def _processes_with(marker: str) -> list[int]:
    """Processes whose command line holds ``marker`` (nothing of a case may be left running)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            if marker.encode() in cmdline and int(entry) != os.getpid():
                state = next(
                    line for line in Path(f"/proc/{entry}/status").read_text().splitlines() if line.startswith("State:")
                )
                if "zombie" not in state:
                    found.append(int(entry))
        except (OSError, StopIteration):
            continue
    return found


def _none_left(marker: str, within_s: float = 5.0) -> list[int]:
    deadline = time.monotonic() + within_s
    while (left := _processes_with(marker)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def _alive(pids: list[int], within_s: float = 5.0) -> list[int]:
    """Which of ``pids`` still run (zombies, waiting to be reaped by init, do not) after up to ``within_s``."""

    def running(pid: int) -> bool:
        try:
            state = next(
                line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("State:")
            )
        except (OSError, StopIteration):
            return False
        return "zombie" not in state

    deadline = time.monotonic() + within_s
    while (left := [p for p in pids if running(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


# ------------------------------------------------------------------------------ the reward function itself


@dataclasses.dataclass(frozen=True)
class RewardCase:
    name: str
    body: str
    """What ``hostile(prompt, response, answer)`` does for the response 'attack' (any other gets 1.0); MARK in it
    becomes a string unique to the test, for finding what it left running."""
    error: str | None = None
    """What the one-line error of the attacking call says; None: the call returns ``value``."""
    value: float = 1.0
    later: str | None = None
    """What the error of the next call says, a moment later (the process died after answering)."""


REWARD_CASES = [
    RewardCase("infinite loop", "while True:\n    pass", error="took longer than task.reward_timeout_s=1.5 s"),
    RewardCase("sleeping past the timeout", "time.sleep(60)", error="took longer than task.reward_timeout_s=1.5 s"),
    RewardCase("reading the replies' stdin", "sys.stdin.read()", error="took longer than task.reward_timeout_s"),
    RewardCase(
        "stopping itself (SIGSTOP)",
        "os.kill(os.getpid(), signal.SIGSTOP)",
        error="took longer than task.reward_timeout_s",
    ),
    RewardCase(
        "ignoring SIGTERM and spinning",
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\nwhile True:\n    pass",
        error="took longer than task.reward_timeout_s",
    ),
    RewardCase(
        "a subprocess, then hanging",
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)', MARK])\ntime.sleep(60)",
        error="took longer than task.reward_timeout_s",
    ),
    RewardCase(
        "deep recursion",
        "def down(n):\n    return down(n + 1)\nreturn down(0)",
        error="raised RecursionError: maximum recursion depth exceeded",
    ),
    RewardCase(
        "raising a multi-line error",
        "raise ValueError('reward\\nservice\\n\\ndown')",
        error="raised ValueError: reward service down",
    ),
    RewardCase("sys.exit", "sys.exit(3)", error="raised SystemExit: 3"),
    RewardCase("raising KeyboardInterrupt", "raise KeyboardInterrupt", error="raised KeyboardInterrupt"),
    RewardCase("os._exit", "os._exit(3)", error="its process died (exit status 3)"),
    RewardCase("killing itself", "os.kill(os.getpid(), signal.SIGKILL)", error="its process died (exit status -9)"),
    RewardCase("segfault", "import ctypes\nctypes.string_at(0)", error="its process died (exit status -11)"),
    RewardCase("closing every file descriptor", "os.closerange(0, 4096)\nreturn 1.0", error="its process died"),
    RewardCase(
        "replacing json.dumps",
        "json.dumps = lambda *a, **k: 'garbage'\nreturn 1.0",
        error="its process replied 'garbage', not a reward",
    ),
    RewardCase("returning NaN", "return float('nan')", error="returned nan (must be a finite number)"),
    RewardCase("returning inf", "return float('-inf')", error="returned -inf (must be a finite number)"),
    RewardCase("returning a string", "return '1.0'", error="returned '1.0' (must be a finite number)"),
    RewardCase("returning None", "return None", error="returned None (must be a finite number)"),
    RewardCase("returning 10 MB", "return 'x' * (10 << 20)", error="(must be a finite number)"),
    RewardCase(
        "an alarm that kills it after answering",
        "signal.alarm(1)\nreturn 0.5",
        value=0.5,
        later="its process died (exit status -14)",
    ),
    RewardCase(
        "a subprocess left running",
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)', MARK])\nreturn 0.25",
        value=0.25,
    ),
    RewardCase("closing stdout, then printing", "sys.stdout.close()\nos.close(1)\nreturn 0.5", value=0.5),
    RewardCase("forging a reply on fd 1", "os.write(1, b'{\"value\": 99.0}\\n')\nreturn 0.5", value=0.5),
    RewardCase(
        "flooding its output", "sys.stderr.write('y' * (8 << 20))\nprint('z' * (1 << 20))\nreturn 0.5", value=0.5
    ),
    RewardCase("emptying sys.modules", "sys.modules.clear()\nreturn 0.5", value=0.5),
    RewardCase(
        "a memory bomb meets the OOM killer first",
        "return float(open('/proc/self/oom_score_adj').read())",
        value=1000.0,
    ),
]

REWARD_MODULE = """
import json, os, signal, subprocess, sys, time

MARK = {mark!r}


def hostile(prompt, response, answer):
    if response != "attack":
        return 1.0
{body}
"""


def _id(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


@pytest.mark.parametrize("case", REWARD_CASES, ids=[_id(c.name) for c in REWARD_CASES])
def test_a_hostile_reward_function_is_stopped_and_the_run_goes_on(case, tmp_path, capfd):
    mark = f"loomrl-hostile-{tmp_path.name}"
    path = tmp_path / "hostile.py"
    path.write_text(REWARD_MODULE.format(mark=mark, body=textwrap.indent(case.body, "    ")))
    task = FunctionTask(f"{path}:hostile", timeout_s=TIMEOUT_S)
    try:
        assert task.score("warm up", "ok", None) == 1.0  # the process is up: the attack is timed alone
        start = time.monotonic()
        if case.error is None:
            assert task.score("sort 21=", "attack", "12") == case.value
        else:
            with pytest.raises(DataError) as info:
                task.score("sort 21=", "attack", "12")
            message = str(info.value)
            assert "\n" not in message and len(message) < 600, message
            assert message.startswith(f"reward function '{path}:hostile': "), message
            assert case.error in message and "prompt 'sort 21='" in message and "response 'attack'" in message
        assert time.monotonic() - start < TIMEOUT_S + 10
        if case.later is not None:
            time.sleep(1.3)
            with pytest.raises(DataError, match=case.later.replace("(", r"\(").replace(")", r"\)")):
                task.score("next", "ok", None)
        assert task.score("after", "ok", None) == 1.0, "the next call must be served (by a new process if need be)"
    finally:
        task.close()
    assert _none_left(mark) == [], "a process of the reward function outlived it"
    capfd.readouterr()  # what it printed went to the run's stderr (8 MB for one case): not this test's output


# ------------------------------------------------------------------------------ code run in the sandbox


@dataclasses.dataclass(frozen=True)
class SandboxCase:
    name: str
    source: str
    """The hostile code (``{outside}``, ``{secret}``, ``{run_pid}``, ``{port}`` filled in)."""
    check: str
    """Which of the checks below its result must pass."""
    needs: tuple[str, ...] = ()
    """Isolation it needs: 'root' (the sandbox runs as another user), 'network', 'pid' (a PID namespace)."""
    limits: SandboxLimits = LIMITS


SANDBOX_CASES = [
    SandboxCase("cpu burner", "while True:\n    pass", "limit:cpu"),
    SandboxCase(
        "ignoring SIGXCPU",
        "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    pass",
        "limit:cpu",
    ),
    SandboxCase(
        "sleeping past the wall clock",
        "import time\nprint('started', flush=True)\ntime.sleep(60)",
        "limit:wall",
        limits=dataclasses.replace(LIMITS, wall_s=1.5),
    ),
    SandboxCase("memory bomb", "blocks = []\nwhile True:\n    blocks.append(bytearray(64 << 20))", "limit:memory"),
    SandboxCase(
        "fork bomb",
        "import os, time\nn = 0\nfor _ in range(200):\n    try:\n        pid = os.fork()\n"
        "    except OSError:\n        break\n    if pid == 0:\n"
        "        print('pid', os.readlink('/proc/self'), flush=True)\n        time.sleep(60)\n"
        "        os._exit(0)\n    n += 1\nprint(n)",
        "forks-bounded",
    ),
    SandboxCase(
        "writing a huge file",
        "with open('big', 'wb') as f:\n    while True:\n        f.write(b'x' * 65536)",
        "limit:file_size",
    ),
    SandboxCase("flooding stdout", "import sys\nfor _ in range(2000):\n    sys.stdout.write('z' * 65536)", "truncated"),
    SandboxCase(
        "deep recursion without a limit",
        "import sys\nsys.setrecursionlimit(10 ** 8)\ndef down(n):\n    return down(n + 1)\ndown(0)",
        "stopped",
    ),
    SandboxCase(
        "writing outside its directory", "open('{outside}/planted', 'w').write('x')", "refused", needs=("root",)
    ),
    SandboxCase("changing a directory outside", "import os\nos.chmod('{outside}', 0o777)", "refused", needs=("root",)),
    SandboxCase("reading a file outside", "print(open('{secret}').read())", "refused", needs=("root",)),
    SandboxCase(
        "reading the environment",
        "import os\nprint(sorted(os.environ))\nprint(os.environ.get('LOOMRL_TEST_SECRET'))",
        "clean-env",
    ),
    SandboxCase(
        "reading the run's environment",
        "print(open('/proc/{run_pid}/environ', 'rb').read())",
        "refused",
        needs=("root",),
    ),
    SandboxCase(
        "killing its parent",
        "import os, signal\ntry:\n    os.kill(os.getppid(), signal.SIGKILL)\n"
        "    print('sent')\nexcept OSError as e:\n    print('refused', e.errno)",
        "run-alive",
        needs=("root|pid",),
    ),
    SandboxCase(
        "killing the run",
        "import os, signal\ntry:\n    os.kill({run_pid}, signal.SIGKILL)\n"
        "    print('sent')\nexcept OSError as e:\n    print('refused', e.errno)",
        "refused",
        needs=("root|pid",),
    ),
    SandboxCase(
        "killing every process it may",
        "import os, signal\ntry:\n    os.kill(-1, signal.SIGKILL)\nexcept OSError as e:\n    print('refused', e.errno)",
        "run-alive",
        needs=("root|pid",),
    ),
    SandboxCase(
        "a detached process outliving it",
        "import os, time\nif os.fork() == 0:\n    os.setsid()\n"
        "    print('pid', os.readlink('/proc/self'), flush=True)\n"
        "    time.sleep(60)\nprint('left one behind')",
        "none-left",
        needs=("pid",),
    ),
    SandboxCase("becoming root", "import os\nos.setuid(0)", "refused", needs=("root",)),
    SandboxCase(
        "raising its own limits", "import resource\nresource.setrlimit(resource.RLIMIT_CPU, (10**6, 10**6))", "refused"
    ),
    SandboxCase(
        "connecting to a local port",
        "import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')",
        "refused",
        needs=("network",),
        limits=dataclasses.replace(LIMITS, user=None),
    ),  # root in its namespaces: socket must import
    SandboxCase(
        "connecting out",
        "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=2)\nprint('connected')",
        "refused",
        needs=("network",),
        limits=dataclasses.replace(LIMITS, user=None),
    ),
]


@pytest.fixture(scope="module")
def gaps() -> tuple[str, ...]:
    return sandbox_gaps()


def _missing(needs: tuple[str, ...], gaps: tuple[str, ...]) -> str | None:
    """Why a case cannot be contained here, or None."""
    why = {
        "root": None
        if os.geteuid() == 0
        else "not root: the sandbox runs as this user, whose files and processes it may then touch",
        "network": f"no network namespace here: {gaps}" if any(g.startswith("network") for g in gaps) else None,
        "pid": f"no PID namespace here: {gaps}" if any(g.startswith("processes") for g in gaps) else None,
    }
    for need in needs:  # 'a|b': either isolation contains the case
        reasons = [why[alternative] for alternative in need.split("|")]
        if all(reasons):
            return "; ".join(reasons)
    return None


@pytest.fixture
def outside():
    """A directory and a private file the sandbox must not touch (as root made them; the sandbox is nobody)."""
    where = Path(tempfile.mkdtemp(prefix="loomrl-outside-"))
    where.chmod(0o755)
    secret = where / "secret.txt"
    secret.write_text("s3cret")
    secret.chmod(0o600)
    yield where, secret
    for path in where.iterdir():
        path.unlink()
    where.rmdir()


@pytest.mark.parametrize("case", SANDBOX_CASES, ids=[_id(c.name) for c in SANDBOX_CASES])
def test_hostile_code_in_the_sandbox_is_contained(case, gaps, outside, monkeypatch):
    reason = _missing(case.needs, gaps)
    if reason is not None:
        print(f"skipped: {reason}")
        pytest.skip(reason)
    where, secret = outside
    monkeypatch.setenv("LOOMRL_TEST_SECRET", "hunter2")  # the run's environment holds a secret
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    source = (
        case.source.replace("{outside}", str(where))
        .replace("{secret}", str(secret))
        .replace("{run_pid}", str(os.getpid()))
        .replace("{port}", str(server.getsockname()[1]))
    )
    start = time.monotonic()
    result = run_python(source, limits=case.limits)
    server.close()
    assert time.monotonic() - start < case.limits.wall_s + 10
    check = case.check
    if check.startswith("limit:"):
        assert result.limit == check.partition(":")[2], result
        assert not result.ok and result.describe()
    elif check == "forks-bounded":
        (count,) = [line for line in result.stdout.splitlines() if not line.startswith("pid ")]
        assert result.ok and 0 < int(count) < case.limits.processes, result
    elif check == "truncated":
        assert result.truncated and len(result.stdout) <= case.limits.output_bytes, (
            result.truncated,
            len(result.stdout),
        )
    elif check == "stopped":
        assert not result.ok and (result.limit is not None or result.signal is not None or result.returncode), result
    elif check == "refused":
        assert "connected" not in result.stdout and "sent" not in result.stdout, result
        assert not result.ok or result.stdout.startswith("refused"), result
        last = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else result.stdout
        assert any(
            word in last
            for word in (
                "PermissionError",
                "not allowed",
                "refused",
                "OSError",
                "ConnectionRefusedError",
                "Network is unreachable",
                "TimeoutError",
            )
        ), last
    elif check == "clean-env":
        names, value = result.stdout.splitlines()
        assert value == "None" and "LOOMRL_TEST_SECRET" not in names, result.stdout
    elif check == "run-alive":
        assert result.limit is None, result  # its first process reported: the sandbox itself was not killed
    elif check == "none-left":
        assert result.ok and "left one behind" in result.stdout, result
    else:
        raise AssertionError(f"unknown check {check}")
    # nothing it did touched the run: the directory outside, and no process it started is left
    assert sorted(p.name for p in where.iterdir()) == ["secret.txt"]
    assert where.stat().st_mode & 0o777 == 0o755 and secret.read_text() == "s3cret"
    started = [int(line.split()[1]) for line in result.stdout.splitlines() if line.startswith("pid ")]
    assert _alive(started) == [], f"processes of the sandbox outlived it: {_alive(started)}"


JUDGE = '''
from loomrl.data.sandbox import SandboxLimits, run_python


def judge(prompt, response, answer):
    """Runs the answer's code, which must print the answer; 1.0 when it does."""
    result = run_python(response, limits=SandboxLimits(cpu_s=1, wall_s=2, memory_mb=256, processes=8,
                                                       output_bytes=4096))
    return float(result.ok and result.stdout.strip() == answer)
'''


def test_a_judge_reward_runs_hostile_answers_in_the_sandbox(tmp_path, outside, monkeypatch):
    """The chain of a code task: the reward function (in its process, under the time limit) runs each answer in
    the sandbox. A hostile answer scores 0 and the run goes on; a right one scores 1."""
    if os.geteuid() != 0:
        pytest.skip("not root: the sandbox runs as this user and may write the directory outside")
    where, _ = outside
    monkeypatch.setenv("LOOMRL_TEST_SECRET", "hunter2")
    (tmp_path / "judge.py").write_text(JUDGE)
    task = FunctionTask(f"{tmp_path / 'judge.py'}:judge", timeout_s=20)
    attacks = [
        f"open('{where}/planted', 'w').write('x')\nprint(42)",
        "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nprint(42)",
        "import os\nprint(os.environ.get('LOOMRL_TEST_SECRET', 42))",
        "import os, time\nfor _ in range(100):\n    if os.fork() == 0:\n        time.sleep(30)\nprint(42)",
        "while True:\n    pass",
    ]
    try:
        scores = [task.score("p", code, "42") for code in attacks]
        assert scores[0] == 0.0 and not (where / "planted").exists()  # refused: nothing written, no 42 printed
        assert scores[1] == 0.0  # refused: the reward process, and the run above it, go on
        assert scores[2] == 1.0, "the secret is not in the sandbox's environment, so the default, 42, is printed"
        assert scores[3] == 0.0 and scores[4] == 0.0  # bounded forks, then the CPU limit
        assert task.score("p", "print(6 * 7)", "42") == 1.0
    finally:
        task.close()


def test_what_this_machine_cannot_isolate_is_stated(gaps):
    """Each gap is a sentence naming what is not isolated; this machine's are printed for the record."""
    print(f"sandbox gaps on this machine (uid {os.geteuid()}): {gaps or 'none'}")
    for gap in gaps:
        assert gap.split(":")[0] in ("network", "processes", "user", "imports"), gap
        assert len(gap) > 40 and "\n" not in gap, gap
