"""The first process of a sandbox (:mod:`loomrl.data.sandbox`): isolate, limit, run the snippet, report.

Run as a script (``python -I sandbox_boot.py CONFIG_JSON``), standard library only, so nothing of loomrl has to be
importable where the snippet runs. Three processes:

- this one enters new network and PID namespaces where the OS allows (a new user namespace too when not root),
  reports on the report pipe what it could not isolate, then waits;
- its child, PID 1 of the new PID namespace, dies with this process (``PR_SET_PDEATHSIG``), reaps everything,
  and reports the snippet's wait status and CPU time; when it exits the kernel kills whatever is left in the
  namespace, so no process of the snippet outlives the sandbox;
- its child runs the snippet: in the empty working directory, under the resource limits, as the sandbox user
  when started by root, with SIGXFSZ at its default (killed at the file-size limit rather than an OSError).
  It holds no report pipe, so the snippet cannot forge the report.
"""

import ctypes
import json
import os
import resource
import signal
import sys
import traceback

CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
PR_SET_PDEATHSIG = 1


def main() -> None:
    cfg = json.loads(sys.argv[1])
    report = os.fdopen(cfg["report_fd"], "w", buffering=1)
    with open(cfg["source"], encoding="utf-8") as fh:  # read before any privilege is dropped
        source = fh.read()
    nproc = _processes_of(cfg["uid"] if cfg["uid"] is not None else os.getuid()) + cfg["processes"]
    report.write(json.dumps({"not_isolated": _unshare(cfg["uid"])}) + "\n")
    reaper = os.fork()
    if reaper == 0:
        _reap(cfg, source, nproc, report)
    os.waitpid(reaper, 0)
    os._exit(0)


def _unshare(uid: int | None) -> list[str]:
    """Enter new network and PID namespaces, the most this process may; what stays shared, in words."""
    libc = ctypes.CDLL(None, use_errno=True)
    root = os.geteuid() == 0
    user = 0 if root else CLONE_NEWUSER  # unprivileged namespaces need a user namespace of their own
    notes, error = [], "not tried"
    for flags in (CLONE_NEWNET | CLONE_NEWPID, CLONE_NEWNET, CLONE_NEWPID):
        if libc.unshare(flags | user) == 0:
            break
        error = os.strerror(ctypes.get_errno())
    else:
        flags = 0
    if not flags & CLONE_NEWNET:
        notes.append(f"network: not isolated (no new network namespace: unshare failed, {error})")
    if not flags & CLONE_NEWPID:
        notes.append(
            "processes: no new PID namespace; leftover processes are killed by process group only, "
            "which one that starts its own session escapes"
        )
    if root and uid is None:
        notes.append("user: runs as root (the process limit does not bind root; files are root's to read)")
    return notes


def _reap(cfg: dict, source: str, nproc: int, report) -> None:
    """PID 1 of the namespace: start the snippet, reap every process, report the snippet's end."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        snippet = os.fork()
        if snippet == 0:
            report.close()
            _run(cfg, source, nproc)
        while True:
            pid, status, usage = os.wait4(-1, 0)
            if pid == snippet:
                break
        end = {"cpu_s": usage.ru_utime + usage.ru_stime}
        if os.WIFSIGNALED(status):
            end["signal"] = os.WTERMSIG(status)
        else:
            end["returncode"] = os.WEXITSTATUS(status)
        report.write(json.dumps(end) + "\n")
    finally:
        os._exit(0)


def _run(cfg: dict, source: str, nproc: int) -> None:
    """The snippet's process: limits, identity, then the snippet as ``__main__``; never returns."""
    try:
        os.chdir(cfg["workdir"])
        mb = 1024 * 1024
        limits = {
            resource.RLIMIT_CORE: 0,
            resource.RLIMIT_CPU: cfg["cpu_s"],
            resource.RLIMIT_AS: cfg["memory_mb"] * mb,
            resource.RLIMIT_FSIZE: cfg["file_size_mb"] * mb,
            resource.RLIMIT_NPROC: nproc,
        }
        for kind, value in limits.items():
            # CPU: SIGXCPU at the soft limit; the hard one (a second later) is SIGKILL, which a handler cannot stop
            resource.setrlimit(kind, (value, value + 1 if kind == resource.RLIMIT_CPU else value))
        if cfg["uid"] is not None and os.geteuid() == 0:
            os.setgroups([])
            os.setgid(cfg["uid"])
            os.setuid(cfg["uid"])
        signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
        sys.stdout.reconfigure(line_buffering=True)  # what it printed before a limit killed it is kept
        code = compile(source, "<sandbox>", "exec")
    except BaseException:  # noqa: BLE001 - the sandbox itself failed: say so on stderr
        traceback.print_exc()
        _exit(125)
    sys.argv = ["<sandbox>"]
    try:
        exec(code, {"__name__": "__main__", "__builtins__": __builtins__})  # noqa: S102 - the point of a sandbox
    except SystemExit as stop:
        _exit(stop.code if isinstance(stop.code, int) else (0 if stop.code is None else _message(stop.code)))
    except BaseException:  # noqa: BLE001 - as python itself would: the traceback on stderr, status 1
        traceback.print_exc()
        _exit(1)
    _exit(0)


def _message(text) -> int:
    print(text, file=sys.stderr)
    return 1


def _exit(code: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001 - a closed or full stream must not change the status
            pass
    os._exit(code)


def _processes_of(uid: int) -> int:
    """Processes whose real user is ``uid`` now: RLIMIT_NPROC counts them all, so the snippet's allowance is
    added to them."""
    count = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status", encoding="utf-8") as fh:
                line = next(ln for ln in fh if ln.startswith("Uid:"))
        except (OSError, StopIteration):
            continue
        count += int(line.split()[1]) == uid
    return count


if __name__ == "__main__":
    main()
