"""The temporary Prefect server a flow run starts when no ``PREFECT_API_URL`` is set (the ablate
stage, ``python flows/ablations.py``), and the one a killed run leaves behind.

Prefect starts that server as a child process (uvicorn on 127.0.0.1) and stops it at exit; a
``kill -9`` of the stage skips the exit, and the server keeps running, orphaned, until killed by
hand. `claim_temporary_server` marks the servers this process will start (an environment variable
the child inherits: owner pid, its start time, the project folder); `stop_stale_temporary_servers`,
called before the next run, stops every marked server of the same project whose owner is gone.
A server someone started on purpose (``prefect server start``) carries no mark and is never touched.
"""

from __future__ import annotations

import os
from pathlib import Path

OWNER_VARIABLE = "MMCSE_PREFECT_SERVER_OWNER"  # "<pid>:<start time>:<project folder>"


def _owner_mark(root: Path) -> str:
    import psutil

    me = psutil.Process()
    return f"{me.pid}:{me.create_time():.3f}:{root.resolve()}"


def claim_temporary_server(root: str | Path = ".") -> None:
    """Mark the temporary Prefect server this process may start as this project's and this process's,
    and let SIGTERM end the process through its exit handlers (Prefect's stops the server; Python's
    default SIGTERM action would skip them)."""
    import signal
    import sys

    os.environ[OWNER_VARIABLE] = _owner_mark(Path(root))

    def exit_on_sigterm(_signum: int, _frame: object) -> None:
        sys.exit(128 + signal.SIGTERM)

    signal.signal(signal.SIGTERM, exit_on_sigterm)


def _owner_alive(pid: int, started: float) -> bool:
    import psutil

    try:
        return abs(psutil.Process(pid).create_time() - started) < 0.01  # the mark keeps 3 decimals
    except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
        return False


def stale_temporary_servers(root: str | Path = ".") -> list[int]:
    """The pids of this project's temporary Prefect servers whose owning process is gone."""
    import psutil

    project = str(Path(root).resolve())
    stale = []
    for process in psutil.process_iter(["pid", "cmdline"]):
        cmdline = process.info.get("cmdline") or []
        if "prefect.server.api.server:create_app" not in cmdline:
            continue
        try:
            mark = process.environ().get(OWNER_VARIABLE, "")
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        pid, _, rest = mark.partition(":")
        started, _, folder = rest.partition(":")
        if not mark or folder != project:
            continue
        try:
            owner_pid, owner_started = int(pid), float(started)
        except ValueError:
            continue
        if not _owner_alive(owner_pid, owner_started):
            stale.append(process.info["pid"])
    return stale


def stop_stale_temporary_servers(root: str | Path = ".", timeout: float = 5.0) -> list[int]:
    """Stop (SIGTERM, then SIGKILL after ``timeout`` s) the temporary Prefect servers a killed run of
    this project left behind; prints one line per server stopped and returns their pids."""
    import psutil

    stopped = []
    for pid in stale_temporary_servers(root):
        try:
            process = psutil.Process(pid)
            process.terminate()
            try:
                process.wait(timeout)
            except psutil.TimeoutExpired:
                process.kill()
                process.wait(timeout)
        except psutil.NoSuchProcess:
            pass
        print(f"stopped a temporary Prefect server (pid {pid}) that a killed run of this project left behind")
        stopped.append(pid)
    return stopped
