"""The temporary Prefect server a killed ablate run leaves behind is found and stopped by the next
run, and only that: a server of another project, or of a live run, is left alone."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest

from mmcse.experiments.prefect_server import (
    OWNER_VARIABLE,
    claim_temporary_server,
    stale_temporary_servers,
    stop_stale_temporary_servers,
    worker_gpus,
)
from tests.conftest import REPO

# what Prefect's SubprocessASGIServer runs, without the server: the argument the scan looks for
FAKE_SERVER = [sys.executable, "-c", "import time, sys; time.sleep(120)", "prefect.server.api.server:create_app"]


def _fake_server(mark: str | None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != OWNER_VARIABLE}
    if mark is not None:
        env[OWNER_VARIABLE] = mark
    return subprocess.Popen(FAKE_SERVER, env=env)


def test_only_this_projects_servers_of_a_dead_owner_are_stale(tmp_path, capsys):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    dead_started = psutil.Process().create_time()  # any start time: the pid is gone
    project, other = tmp_path / "project", tmp_path / "other"
    project.mkdir(), other.mkdir()
    live_mark = f"{os.getpid()}:{psutil.Process().create_time():.3f}:{project.resolve()}"
    servers = {
        "stale": _fake_server(f"{dead.pid}:{dead_started:.3f}:{project.resolve()}"),
        "live owner": _fake_server(live_mark),
        "other project": _fake_server(f"{dead.pid}:{dead_started:.3f}:{other.resolve()}"),
        "unmarked": _fake_server(None),  # e.g. `prefect server start`
    }
    try:
        deadline = time.time() + 10
        while time.time() < deadline and not stale_temporary_servers(project):
            time.sleep(0.1)
        assert stale_temporary_servers(project) == [servers["stale"].pid]
        assert stop_stale_temporary_servers(project) == [servers["stale"].pid]
        assert servers["stale"].wait(5) is not None
        assert f"pid {servers['stale'].pid}" in capsys.readouterr().out
        assert all(p.poll() is None for name, p in servers.items() if name != "stale")
        assert stop_stale_temporary_servers(project) == []
    finally:
        for p in servers.values():
            p.kill()
            p.wait()


@pytest.mark.slow  # end to end: the full suite runs it (fast tier under 5 min)
def test_claiming_marks_the_children_of_this_process(tmp_path, monkeypatch):
    monkeypatch.delenv(OWNER_VARIABLE, raising=False)
    monkeypatch.delenv("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", raising=False)
    claim_temporary_server(tmp_path)
    pid, started, folder = os.environ[OWNER_VARIABLE].split(":", 2)
    assert int(pid) == os.getpid() and folder == str(tmp_path.resolve())
    assert abs(float(started) - psutil.Process().create_time()) < 0.01
    # a loaded machine gives the server more than Prefect's 20 s (issue 33.6)
    assert os.environ["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] == "90"


def test_a_server_that_does_not_start_in_time_is_tried_once_more_then_named_in_one_line():
    from mmcse.errors import StageError
    from mmcse.experiments.prefect_server import start_retry

    timeout = RuntimeError("Timed out while attempting to connect to ephemeral Prefect API server. stdout: ...")
    calls, said = [], []

    def flaky():
        calls.append(1)
        if len(calls) == 1:
            raise timeout
        return "rows"

    assert start_retry(flaky, said.append) == "rows" and len(calls) == 2
    assert said == ["the temporary Prefect server did not answer in time (Timed out while attempting to connect "
                    "to ephemeral Prefect API server); starting it once more"]

    def never():
        raise timeout

    with pytest.raises(StageError, match="^the temporary Prefect server did not start twice") as err:
        start_retry(never, said.append)
    assert "\n" not in str(err.value)
    with pytest.raises(RuntimeError, match="something else"):  # other errors are not retried
        start_retry(lambda: (_ for _ in ()).throw(RuntimeError("something else")), said.append)


def _command_line(process: psutil.Process) -> list[str]:
    """``process``'s command line; empty for one that ended (a zombie not yet reaped has none to read: the server
    a timed-out start killed, a process a stage started and lost)."""
    try:
        return process.cmdline()
    except (psutil.ZombieProcess, psutil.NoSuchProcess, psutil.AccessDenied):
        return []


@pytest.mark.slow  # the ablate stage in a subprocess, killed once its temporary server is up
def test_a_killed_ablate_stage_leaves_no_server_behind_on_the_next_run(project):
    proc = subprocess.Popen([sys.executable, str(REPO / "stages/ablate.py")], cwd=project,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    server = None
    try:
        deadline = time.time() + 120
        while time.time() < deadline and server is None and proc.poll() is None:
            for child in psutil.Process(proc.pid).children(recursive=True):
                if "prefect.server.api.server:create_app" in _command_line(child):
                    server = child
            time.sleep(0.2)
        assert server is not None, "the ablate stage started no temporary Prefect server"
        proc.kill()  # kill -9: Prefect's exit handler never runs
        proc.wait()
        time.sleep(1.0)
        assert server.is_running()  # left behind
        assert stale_temporary_servers(project) == [server.pid]
        assert stop_stale_temporary_servers(project) == [server.pid]
        assert not server.is_running() or server.status() == psutil.STATUS_ZOMBIE
    finally:
        if proc.poll() is None:
            proc.kill()
        if server is not None and server.is_running():
            server.kill()


def test_the_temporary_servers_notices_are_dropped_and_the_runs_lines_kept(tmp_path, monkeypatch):
    import logging
    import signal

    from mmcse.experiments.prefect_server import VERBOSE_VARIABLE

    seen: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    logger, handler, before = logging.getLogger("prefect"), Collect(), signal.getsignal(signal.SIGTERM)
    filters = list(logger.filters)
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        for verbose in ("1", None):
            if verbose:
                monkeypatch.setenv(VERBOSE_VARIABLE, verbose)
            else:
                monkeypatch.delenv(VERBOSE_VARIABLE)
            seen.clear()
            claim_temporary_server(tmp_path)
            logger.info("Starting temporary server on http://127.0.0.1:8123\nSee https://www.prefect.io/docs/...")
            logging.getLogger("prefect.flow_runs").info("[1/2] mcse seed=1: starting")
            logger.info("Stopping temporary server on http://127.0.0.1:8123")
            if verbose:
                assert len(seen) == 3  # asked for: every notice kept
        assert seen == ["[1/2] mcse seed=1: starting"]
    finally:
        logger.removeHandler(handler)
        logger.filters[:] = filters
        logger.setLevel(level)
        signal.signal(signal.SIGTERM, before)


def test_prefect_down_never_signals_a_pid_another_process_reuses(tmp_path):
    """Issue 33.12: pids.json names processes by pid, start time and command line; a recorded pid now
    held by another process (its start time differs) is left alone, a recorded process is stopped."""
    import json

    from mmcse.experiments.prefect_server import UP_DIR, _identity, prefect_down

    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "prefect-worker"],
                              start_new_session=True)
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    try:
        reused = _identity(bystander.pid) | {"started": _identity(bystander.pid)["started"] - 3600.0}
        (tmp_path / UP_DIR).mkdir()
        (tmp_path / UP_DIR / "pids.json").write_text(json.dumps({"server": reused, "w": _identity(worker.pid)}))
        said = []
        assert prefect_down(tmp_path, say=said.append) == ["w"]
        assert worker.wait(10) is not None and bystander.poll() is None  # the bystander was never signalled
        assert f"server (pid {bystander.pid}): that pid now belongs to another process; not signalled" in said
    finally:
        for p in (worker, bystander):
            p.kill()
            p.wait()


def test_an_exported_api_url_nothing_answers_is_one_line_and_down_says_to_unset_it(tmp_path, monkeypatch):
    """Issue 39.7: after `mmcse prefect down` the exported PREFECT_API_URL points at nothing; the ablate
    stage says so in one line (not Prefect's traceback), and `down` tells the user to unset it."""
    import http.server
    import json
    import socket
    import threading

    from mmcse.errors import StageError
    from mmcse.experiments.prefect_server import UP_DIR, _identity, check_api_url, prefect_down

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/api"
    with pytest.raises(StageError) as err:
        check_api_url({"PREFECT_API_URL": dead})
    assert "\n" not in str(err.value) and f"PREFECT_API_URL={dead} does not answer" in str(err.value)
    assert "unset PREFECT_API_URL" in str(err.value)
    check_api_url({})  # unset: Prefect's own temporary server, nothing to check

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            self.send_response(200 if self.path == "/api/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    try:
        check_api_url({"PREFECT_API_URL": f"http://127.0.0.1:{server.server_port}/api/"})  # answers: no error
    finally:
        server.shutdown()

    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "prefect-server"],
                               start_new_session=True)
    try:
        (tmp_path / UP_DIR).mkdir()
        (tmp_path / UP_DIR / "pids.json").write_text(json.dumps({"server": _identity(sleeper.pid)}))
        monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:4200/api")
        said = []
        assert prefect_down(tmp_path, say=said.append) == ["server"]
        assert said[-1].startswith("PREFECT_API_URL=http://127.0.0.1:4200/api points at the server just stopped: "
                                   "`unset PREFECT_API_URL`")
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_worker_may_hold_several_gpus_and_its_jobs_train_on_all_of_them():
    assert worker_gpus(4, 1) == ["0", "1", "2", "3"]  # one worker per GPU (the default)
    assert worker_gpus(8, 4) == ["0,1,2,3", "4,5,6,7"]  # train.devices: auto is 4 inside each worker's jobs
    assert worker_gpus(0, 4) == []  # no GPU: --workers decides
    for gpus, each in ((6, 4), (4, 0)):
        with pytest.raises(ValueError, match=f"--gpus-per-worker {each}: must be >= 1 and divide this machine's"):
            worker_gpus(gpus, each)


@pytest.mark.slow  # two real server starts (~10 s)
def test_a_retry_after_a_timed_out_start_runs_one_server_not_two(tmp_path, monkeypatch):
    """Issue 67.3: Prefect leaves a timed-out server starting; the retry spawned a second one on the same port
    that died with "address already in use" and its shutdown tracebacks. The retry stops the first."""
    from prefect.server.api.server import SubprocessASGIServer

    from mmcse.experiments.prefect_server import start_retry

    monkeypatch.setenv("PREFECT_HOME", str(tmp_path))
    timeouts = [0.2, 90]  # the first start times out while its process is still starting
    said = []
    servers = []

    def start():
        server = SubprocessASGIServer()
        servers.append(server)
        server.start(timeout=timeouts.pop(0))
        return server.server_process.pid

    try:
        pid = start_retry(start, said.append)
        assert len(said) == 1 and "starting it once more" in said[0]
        uvicorns = [p for p in psutil.Process().children(recursive=True)
                    if "prefect.server.api.server:create_app" in _command_line(p)]
        assert [p.pid for p in uvicorns] == [pid]  # the timed-out one is gone, not still binding the port
        assert servers[0] is not servers[1]  # a fresh server object, on a port of its own
    finally:
        for server in servers:
            server.stop()
