"""A real Prefect server on 127.0.0.1 for the flow tests: its CLI, its REST API and workers."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.conftest import REPO


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop(*procs: subprocess.Popen, grace: float = 10.0) -> None:
    """End ``procs`` and their process groups (a worker's flow-run processes) together: TERM, then KILL what is
    still running after ``grace`` seconds. A Prefect worker that has run flows was still up 30 s after its TERM
    (measured, each of the GPU-worker test's three: stopped one after the other, 90 s of its 175)."""
    running = [proc for proc in procs if proc.poll() is None]
    for proc in running:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for proc in running:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def copy_deployments(project: Path) -> None:
    """The repo's flows/ and prefect.yaml into ``project`` (the workers' $MMCSE_ROOT)."""
    shutil.copytree(REPO / "flows", project / "flows", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "prefect.yaml", project / "prefect.yaml")


class PrefectServer:
    def __init__(self, project: Path, port: int) -> None:
        bin_dir = Path(sys.executable).parent
        self.project = project
        self.url = f"http://127.0.0.1:{port}/api"
        self.prefect = str(bin_dir / "prefect")
        self.env = {**os.environ, "PREFECT_HOME": str(project / ".prefect"), "PREFECT_API_URL": self.url,
                    "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "MMCSE_ROOT": str(project),
                    "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
        self.logs = project / "logs"
        self.logs.mkdir(exist_ok=True)
        self.started: list[subprocess.Popen] = []

    def start(self, name: str, args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        proc = subprocess.Popen([self.prefect, *args], env=env or self.env, cwd=self.project,
                                stdout=open(self.logs / f"{name}.log", "w"), stderr=subprocess.STDOUT,
                                start_new_session=True)
        self.started.append(proc)
        return proc

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text()[-3000:]

    def cli(self, *args: str) -> str:
        out = subprocess.run([self.prefect, "--no-prompt", *args], env=self.env, cwd=self.project,
                             capture_output=True, text=True, timeout=400)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        return out.stdout

    def worker(self, pool: str, name: str, env: dict[str, str | None] | None = None) -> subprocess.Popen:
        """`prefect worker start --pool <pool> --name <name> --limit 1` with ``env`` on top of
        the server's (a None value removes the variable)."""
        merged = {**self.env, **(env or {})}
        return self.start(name, ["worker", "start", "--pool", pool, "--name", name, "--limit", "1"],
                          {k: v for k, v in merged.items() if v is not None})

    def api(self, path: str, body: dict[str, Any]) -> Any:
        """POST ``body`` to the REST API (``path`` under /api)."""
        req = urllib.request.Request(f"{self.url}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read())


@contextlib.contextmanager
def prefect_server(project: Path) -> Iterator[PrefectServer]:
    """Start `prefect server` on a free loopback port with PREFECT_HOME in ``project``; wait for
    /api/health; on exit stop it and every process started through it (newest first)."""
    server = PrefectServer(project, free_port())
    try:
        proc = server.start("server", ["server", "start", "--host", "127.0.0.1", "--port",
                                       server.url.split(":")[-1].split("/")[0]])
        deadline = time.time() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{server.url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert proc.poll() is None and time.time() < deadline, server.log("server")
            time.sleep(1)
        yield server
    finally:  # the workers (and anything else started through it) first, then the server they talk to
        stop(*server.started[1:])
        stop(*server.started[:1])
    assert all(p.poll() is not None for p in server.started)
