"""User reward code: each reward call under a time limit in its own process, and the sandbox for code a reward
function executes (resource limits, an empty directory, no network, nothing left running)."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import time
import warnings
from pathlib import Path

import pytest

from loomrl.config.schema import TaskConfig
from loomrl.data.prompts import FunctionTask
from loomrl.data.sandbox import SandboxError, SandboxLimits, run_callable, run_python, sandbox_gaps
from loomrl.data.sources import build_task
from loomrl.errors import DataError

# What this machine cannot isolate is warned at every run; test_gaps_are_returned_and_warned looks at it.
pytestmark = pytest.mark.filterwarnings("ignore:sandbox. :RuntimeWarning")

REWARDS = """
import re, time

def exact(prompt, response, answer):
    print("a reward function may print")  # must not disturb the replies
    return float(response == answer)

def boom(prompt, response, answer):
    raise ValueError("reward service\\nunavailable")

def sleepy(prompt, response, answer):
    if response == "hang":
        time.sleep(60)
    return 0.5

def backtracking(prompt, response, answer):
    re.match(r"(a+)+$", "a" * 40 + "b")  # exponential, inside C code that holds the GIL
    return 1.0
"""


def _one_line(info: pytest.ExceptionInfo) -> str:
    message = str(info.value)
    assert message and "\n" not in message, message
    return message


@pytest.fixture
def rewards(tmp_path) -> str:
    path = tmp_path / "rewards.py"
    path.write_text(REWARDS)
    return str(path)


# --- reward functions under a time limit ----------------------------------------------------------------


def test_a_reward_function_runs_in_its_own_process_and_may_print(rewards):
    task = FunctionTask(f"{rewards}:exact", timeout_s=5)
    assert [task.score("p", r, "42") for r in ("42", "41", "42")] == [1.0, 0.0, 1.0]
    assert task.process is not None and task.process._proc.pid != os.getpid()
    task.close()


@pytest.mark.parametrize("name", ["sleepy", "backtracking"])
def test_a_call_past_the_limit_is_killed_with_one_line_naming_function_and_sample(rewards, name):
    task = FunctionTask(f"{rewards}:{name}", timeout_s=1)
    if name == "sleepy":
        assert task.score("warm up", "ok", None) == 0.5  # the process is started: the next call is timed alone
    child = None if task.process._proc is None else task.process._proc
    start = time.monotonic()
    with pytest.raises(DataError) as info:
        task.score("sort 321=", "hang", "123")
    elapsed = time.monotonic() - start
    message = _one_line(info)
    assert f"reward function '{rewards}:{name}': took longer than task.reward_timeout_s=1 s" in message
    assert "prompt 'sort 321='" in message and "response 'hang'" in message
    assert elapsed < 30, elapsed
    if child is not None:
        assert child.poll() is not None, "the stuck process was left running"
    if name == "sleepy":
        assert task.score("again", "ok", None) == 0.5, "a new process serves the next call"
    task.close()


@pytest.mark.parametrize("timeout_s", [0.0, 5.0])
def test_a_reward_function_that_raises_gives_one_line_naming_function_and_sample(rewards, timeout_s):
    task = FunctionTask(f"{rewards}:boom", timeout_s=timeout_s)
    with pytest.raises(DataError) as info:
        task.score("add 1+1=", "2", "2")
    message = _one_line(info)
    assert f"reward function '{rewards}:boom': raised ValueError: reward service unavailable" in message
    assert "prompt 'add 1+1='" in message and "response '2'" in message
    task.close()


def test_task_reward_timeout_s_decides_where_the_function_runs(rewards, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "x"}\n')
    limited = build_task(TaskConfig(name="file", prompt_file=str(prompts), reward_fn=f"{rewards}:exact"))
    assert limited.process is not None and limited.process.timeout_s == 30.0
    here = build_task(
        TaskConfig(name="file", prompt_file=str(prompts), reward_fn=f"{rewards}:exact", reward_timeout_s=0)
    )
    assert here.process is None and here.score("p", "a", "a") == 1.0
    with pytest.raises(DataError, match="module-level function"):
        FunctionTask(lambda p, r, a: 1.0, timeout_s=1)


# --- the sandbox ------------------------------------------------------------------------------------------


def test_a_snippet_gets_its_stdin_an_empty_directory_and_its_exit_status():
    result = run_python(
        "import os, sys\nprint(sys.stdin.read().upper(), os.listdir('.'), os.getcwd())\n"
        "open('scratch', 'w').write('x')\nsys.exit(3)",
        stdin="abc",
    )
    words = result.stdout.split()
    assert words[:2] == ["ABC", "[]"] and result.returncode == 3 and result.limit is None
    assert not result.ok and result.describe() == "exit status 3"
    assert not Path(words[2]).exists(), "the working directory outlived the run"


def test_a_cpu_burner_is_killed_at_the_cpu_limit():
    # A generous wall clock: on a loaded machine one CPU second can take many seconds of wall time.
    result = run_python("while True:\n    pass", limits=SandboxLimits(cpu_s=1, wall_s=120))
    assert result.limit == "cpu" and result.cpu_s >= 0.9, result
    assert "CPU limit" in result.describe()


def test_a_memory_hog_is_stopped_by_the_memory_limit():
    result = run_python("x = bytearray(1 << 30)\nprint('allocated')", limits=SandboxLimits(memory_mb=256, wall_s=60))
    assert result.limit == "memory" and "allocated" not in result.stdout, result
    assert (
        run_python("x = bytearray(64 << 20)\nprint('allocated')", limits=SandboxLimits(memory_mb=512, wall_s=60)).stdout
        == "allocated\n"
    )


def test_a_file_writer_is_killed_at_the_file_size_limit():
    writer = "with open('big', 'wb') as f:\n    for _ in range({n}):\n        f.write(b'x' * 65536)\nprint('wrote')"
    result = run_python(writer.format(n=64), limits=SandboxLimits(file_size_mb=1, wall_s=60))  # 4 MiB
    assert result.limit == "file_size" and "wrote" not in result.stdout, result
    assert run_python(writer.format(n=8), limits=SandboxLimits(file_size_mb=1, wall_s=60)).ok  # 512 KiB


FORK_BOMB = """
import os, time
forked = 0
for _ in range(200):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    forked += 1
print(forked)
"""


def _sandbox_processes() -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and b"sandbox_boot.py" in Path(f"/proc/{entry}/cmdline").read_bytes():
                found.append(int(entry))
        except OSError:
            continue
    return found


def test_a_fork_bomb_is_bounded_and_leaves_nothing_running():
    limits = SandboxLimits(processes=8, wall_s=60)
    result = run_python(FORK_BOMB, limits=limits)
    assert result.ok, result
    assert 0 < int(result.stdout) < limits.processes, result.stdout  # itself and the ones it forked
    assert _sandbox_processes() == [], "processes of the sandbox outlived it"


def test_the_network_is_unreachable_where_a_network_namespace_is_available():
    gaps = sandbox_gaps()
    if any(gap.startswith("network") for gap in gaps):
        print(f"skipped: {gaps}")
        pytest.skip(f"no network namespace here: {gaps}")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    socket.create_connection(("127.0.0.1", port), timeout=5).close()  # reachable from here
    snippet = (
        f"import os, socket\nprint(os.readlink('/proc/self/ns/net'))\n"
        f"try:\n    socket.create_connection(('127.0.0.1', {port}), timeout=5)\n    print('connected')\n"
        f"except OSError as exc:\n    print('refused', exc.errno)"
    )
    # socket must be importable: as root (still in its own namespace) where nobody cannot read the library
    result = run_python(snippet, limits=SandboxLimits(user=None, wall_s=60))
    namespace, outcome = result.stdout.split("\n")[:2]
    assert namespace != os.readlink("/proc/self/ns/net")
    assert outcome.startswith("refused"), result
    server.close()


def test_a_snippet_past_the_wall_clock_is_killed_and_check_gives_one_line():
    start = time.monotonic()
    result = run_python("import time\nprint('started')\ntime.sleep(60)", limits=SandboxLimits(wall_s=2))
    assert time.monotonic() - start < 20
    assert result.timed_out and result.returncode is None and result.stdout == "started\n"
    with pytest.raises(SandboxError) as info:
        result.check("solution of sample 7")
    assert _one_line(info) == "solution of sample 7: timed out after 2 s (wall clock)"
    assert _sandbox_processes() == []


def test_run_callable_runs_a_function_by_name_and_returns_its_output():
    where = Path(tempfile.mkdtemp())
    try:
        where.chmod(0o755)  # readable by the sandbox user
        (where / "judge_helpers.py").write_text("def shout(word, times):\n    print(word.upper() * times)\n")
        (where / "judge_helpers.py").chmod(0o644)
        import importlib
        import sys

        sys.path.insert(0, str(where))
        try:
            judge_helpers = importlib.import_module("judge_helpers")  # written just above, not a dependency
            result = run_callable(judge_helpers.shout, "ab", 3, limits=SandboxLimits(wall_s=60))
        finally:
            sys.path.remove(str(where))
            sys.modules.pop("judge_helpers", None)
    finally:
        shutil.rmtree(where)
    assert result.check().stdout == "ABABAB\n"


def test_gaps_are_returned_and_warned():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        result = run_python("pass", limits=SandboxLimits(wall_s=60))
    assert result.ok and result.gaps == sandbox_gaps()
    print(f"sandbox gaps on this machine: {result.gaps}")
    warned = [str(w.message) for w in seen if str(w.message).startswith("sandbox: ")]
    assert warned == ([f"sandbox: {'; '.join(result.gaps)}"] if result.gaps else [])
