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

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from mmcse.errors import InputError, StageError

OWNER_VARIABLE = "MMCSE_PREFECT_SERVER_OWNER"  # "<pid>:<start time>:<project folder>"


def _owner_mark(root: Path) -> str:
    me = psutil.Process()
    return f"{me.pid}:{me.create_time():.3f}:{root.resolve()}"


NOTICES = ("Starting temporary server", "Stopping temporary server")  # Prefect's, at INFO on logger "prefect"
VERBOSE_VARIABLE = "MMCSE_PREFECT_NOTICES"  # 1: keep them


class _QuietNotices:
    """A filter on logger ``prefect`` that drops the temporary server's start and stop notices (and
    the how-to link after them); the flow and task runs' own lines (child loggers, whose records the
    parent's filters never see) are kept."""

    def filter(self, record: object) -> bool:
        message = str(getattr(record, "msg", ""))
        return not message.startswith(NOTICES)


# Seconds the temporary server gets to answer its health check (Prefect's default, 20, counts only its
# own sleeps: on a loaded machine a start failed with "Timed out while attempting to connect to
# ephemeral Prefect API server"); a start that still times out is tried once more (`start_retry`).
STARTUP_SECONDS = "90"


def _server_in_its_own_session() -> None:
    """Start Prefect's temporary server in a session of its own. Prefect starts it in the stage's process
    group, and a terminal's Ctrl-C goes to every process of that group: the server died at once, and the
    stage, still stopping its job, spent minutes retrying a dead API. In its own session it only gets
    the stop Prefect's exit handler sends it (or `stop_stale_temporary_servers`, after a kill -9)."""

    from prefect.server.api import server

    cls = server.SubprocessASGIServer
    if getattr(cls._run_uvicorn_command, "_mmcse_own_session", False):
        return
    start, lock = cls._run_uvicorn_command, threading.Lock()

    def in_own_session(self: object) -> subprocess.Popen:
        popen = subprocess.Popen
        with lock:  # the module's Popen, swapped only while this one call builds the server's process
            subprocess.Popen = lambda *args, **kwargs: popen(*args, **{"start_new_session": True, **kwargs})
            try:
                return start(self)
            finally:
                subprocess.Popen = popen

    in_own_session._mmcse_own_session = True  # type: ignore[attr-defined]
    cls._run_uvicorn_command = in_own_session


def claim_temporary_server(root: str | Path = ".") -> None:
    """Mark the temporary Prefect server this process may start as this project's and this process's,
    give it `STARTUP_SECONDS` to start (unless ``PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS`` is
    set) in a session of its own (a terminal's Ctrl-C reaches the stage only), and keep the server's
    start/stop notices out of the stage's output unless ``MMCSE_PREFECT_NOTICES=1``. SIGTERM and
    Ctrl-C end the process through its exit handlers
    (`mmcse.stopping`, installed by the entry point; Prefect's handler stops the server)."""

    os.environ[OWNER_VARIABLE] = _owner_mark(Path(root))
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", STARTUP_SECONDS)
    _server_in_its_own_session()
    logger = logging.getLogger("prefect")
    for old in [f for f in logger.filters if isinstance(f, _QuietNotices)]:
        logger.removeFilter(old)
    if os.environ.get(VERBOSE_VARIABLE) != "1":
        logger.addFilter(_QuietNotices())


def server_start_failed(err: BaseException) -> bool:
    """Whether ``err`` is Prefect's "the temporary server did not answer in time"."""
    return isinstance(err, RuntimeError) and "attempting to connect to ephemeral Prefect API server" in str(err)


def start_retry(run: Callable[[], object], say: Callable[[str], None] = print) -> object:
    """``run()`` (a flow call that starts the temporary server), once more when the server did not start
    in time; a second failure is one line (`mmcse.errors.StageError`), not Prefect's traceback."""

    for attempt in (1, 2):
        try:
            return run()
        except RuntimeError as err:
            if not server_start_failed(err):
                raise
            first = str(err).split(".")[0]
            if attempt == 2:
                raise StageError(f"the temporary Prefect server did not start twice ({first}); the machine may be "
                                 "overloaded: rerun later, raise PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS, or "
                                 "start a server (mmcse prefect up) and set PREFECT_API_URL") from None
            say(f"the temporary Prefect server did not answer in time ({first}); starting it once more")
            stop_timed_out_servers()
    raise AssertionError("unreachable")


def stop_timed_out_servers() -> None:
    """Stop the temporary servers whose start timed out. Prefect leaves such a server's
    process running, still starting, and its next start spawns a second server on the same port: the
    health check then reached the first one while the second failed ("address already in use") and
    printed its shutdown's tracebacks. Stopped, the next start is a fresh server on a free port."""

    from prefect.server.api import server

    # Prefect keeps one server object per requested port (`SubprocessASGIServer._instances`)
    for instance in list(server.SubprocessASGIServer._instances.values()):
        if not instance.running and instance.server_process is not None:
            instance.stop()  # terminates it, waits, and forgets the object: the next start makes a new one


def _owner_alive(pid: int, started: float) -> bool:
    try:
        return abs(psutil.Process(pid).create_time() - started) < 0.01  # the mark keeps 3 decimals
    except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
        return False


def stale_temporary_servers(root: str | Path = ".") -> list[int]:
    """The pids of this project's temporary Prefect servers whose owning process is gone."""

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


# --------------------------------------------------------------------------- a standing Prefect side

POOLS = ("gpu", "head")  # prefect.yaml: the job and sweep deployments on gpu, ablations/fan-out on head
UP_DIR = ".prefect-up"  # in the project: the processes `prefect_up` started (pids.json) and their logs


def _healthy(api_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{api_url}/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def check_api_url(environ: dict[str, str] | os._Environ[str] = os.environ) -> None:
    """Before a flow run: a ``PREFECT_API_URL`` that no server answers (left exported after `mmcse prefect
    down`, a server that died) fails in one line saying what to do, instead of Prefect's traceback. Unset,
    Prefect starts its own temporary server, which needs no check."""
    api_url = environ.get("PREFECT_API_URL", "").strip().rstrip("/")
    if api_url and not _healthy(api_url):
        raise StageError(f"PREFECT_API_URL={api_url} does not answer (no Prefect server there: stopped by `mmcse "
                         "prefect down`, or it died): start it again (`mmcse prefect up`), or `unset PREFECT_API_URL` "
                         "and the ablation runs on a temporary server of its own")


def _start(command: list[str], log: Path, env: dict[str, str], cwd: Path) -> int:
    """A detached process (its own session: it outlives this one and `prefect_down` stops its
    group), output to ``log``; returns its pid."""

    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as handle:
        return subprocess.Popen(command, cwd=cwd, env=env, stdout=handle, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True).pid


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def worker_gpus(gpus: int, per_worker: int) -> list[str]:
    """The ``CUDA_VISIBLE_DEVICES`` of each ``gpu`` worker on a machine with ``gpus`` GPUs, ``per_worker`` each
    (``0,1,2,3`` then ``4,5,6,7``): a job asking for ``train.devices: auto`` trains on all of its worker's."""
    if per_worker < 1 or (gpus and gpus % per_worker):
        raise InputError(f"--gpus-per-worker {per_worker}: must be >= 1 and divide this machine's {gpus} GPUs")
    return [",".join(str(g) for g in range(first, first + per_worker)) for first in range(0, gpus, per_worker)]


def prefect_up(root: str | Path = ".", port: int = 4200, gpu_workers: int | None = None,
               timeout: float = 120.0, say: Callable[[str], None] = print,
               gpus_per_worker: int = 1) -> dict[str, object]:
    """Bring up the Prefect side of this project in order, each step waiting for the one before:
    the server on 127.0.0.1:``port`` (reused when one answers there), its ``/api/health`` polled
    until it answers, the work pools ``gpu`` and ``head`` (created when missing), every deployment
    of ``prefect.yaml`` (``MMCSE_ROOT`` = ``root``), then the workers: one on ``gpu`` per GPU
    (``CUDA_VISIBLE_DEVICES`` = its index), or per ``gpus_per_worker`` GPUs (`worker_gpus`; ``gpu_workers``
    workers without GPUs, default 1) and one on ``head``. The processes started are recorded in
    ``<root>/.prefect-up/pids.json`` (their logs beside it) for `prefect_down`. Returns the API URL, what
    was started, and the pools."""

    root = Path(root).resolve()
    if not (root / "prefect.yaml").is_file():
        raise FileNotFoundError(f"{root / 'prefect.yaml'}: no Prefect deployments here (run from the project root)")
    prefect = shutil.which("prefect", path=str(Path(sys.executable).parent)) or shutil.which("prefect")
    if prefect is None:
        raise FileNotFoundError("the prefect command is not installed in this environment")
    api_url = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, "PREFECT_API_URL": api_url, "MMCSE_ROOT": str(root),
           "PREFECT_SERVER_ANALYTICS_ENABLED": os.environ.get("PREFECT_SERVER_ANALYTICS_ENABLED", "false")}
    state_dir = root / UP_DIR
    pids_file = state_dir / "pids.json"
    started: dict[str, dict[str, Any]] = _read_started(pids_file)

    def record(name: str, pid: int) -> None:
        started[name] = _identity(pid)
        state_dir.mkdir(parents=True, exist_ok=True)
        pids_file.write_text(json.dumps(started, indent=2) + "\n")

    if _healthy(api_url):
        say(f"Prefect server: already answering at {api_url}")
    else:
        say(f"Prefect server: starting on 127.0.0.1:{port} (log {state_dir / 'server.log'})")
        pid = _start([prefect, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                     state_dir / "server.log", env, root)
        record("server", pid)
        deadline = time.monotonic() + timeout
        while not _healthy(api_url):
            if not _alive(pid):
                tail = (state_dir / "server.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"the Prefect server exited before it answered "
                                   f"({state_dir / 'server.log'}):\n{tail}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Prefect server did not answer {api_url}/health in {timeout:.0f} s "
                                   f"(log {state_dir / 'server.log'})")
            time.sleep(0.5)
        say(f"Prefect server: healthy at {api_url}")
    os.environ["PREFECT_API_URL"] = api_url  # the client below talks to this server
    created = _ensure_pools(api_url)
    say(f"work pools: {', '.join(POOLS)}" + (f" (created {', '.join(created)})" if created else " (present)"))
    deploy = subprocess.run([prefect, "--no-prompt", "deploy", "--all"], cwd=root, env=env, capture_output=True,
                            text=True)
    if deploy.returncode != 0:
        raise RuntimeError(f"prefect deploy --all failed:\n{(deploy.stdout + deploy.stderr)[-3000:]}")
    say("deployments: every one of prefect.yaml")
    gpus = _gpu_count()
    visible = worker_gpus(gpus, gpus_per_worker)
    count = len(visible) or (1 if gpu_workers is None else gpu_workers)
    host = os.uname().nodename
    for i in range(count):
        name = (f"{host}-gpu{visible[i].replace(',', '-')}") if gpus else f"{host}-cpu{i}"
        if name in started and _same_process(started[name]):
            continue
        worker_env = {**env, **({"CUDA_VISIBLE_DEVICES": visible[i]} if gpus else {})}
        record(name, _start([prefect, "worker", "start", "--pool", "gpu", "--name", name, "--limit", "1"],
                            state_dir / f"{name}.log", worker_env, root))
    head = f"{host}-head"
    if not (head in started and _same_process(started[head])):
        record(head, _start([prefect, "worker", "start", "--pool", "head", "--name", head, "--limit", "1"],
                            state_dir / f"{head}.log", env, root))
    each = "one per GPU" if gpus_per_worker == 1 else f"{gpus_per_worker} GPUs each"
    say(f"workers: {count} on gpu ({each if gpus else 'no GPU here'}), 1 on head; logs in {state_dir}")
    say(f"next: export PREFECT_API_URL={api_url}; prefect deployment run 'ablations/ablations' --watch")
    pids = {name: entry["pid"] for name, entry in started.items()}
    return {"api_url": api_url, "started": pids, "pools": list(POOLS)}


def _identity(pid: int) -> dict[str, Any]:
    """What tells process ``pid`` from a later one that reuses its number: its start time and command."""

    try:
        process = psutil.Process(pid)
        return {"pid": pid, "started": round(process.create_time(), 3), "cmdline": process.cmdline()}
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return {"pid": pid, "started": None, "cmdline": []}


def _read_started(pids_file: Path) -> dict[str, dict[str, Any]]:
    """The processes `prefect_up` recorded (an older pids.json holds bare pids: no start time)."""

    if not pids_file.is_file():
        return {}
    raw = json.loads(pids_file.read_text())
    return {name: entry if isinstance(entry, dict) else {"pid": int(entry), "started": None, "cmdline": []}
            for name, entry in raw.items()}


def _same_process(entry: dict[str, Any]) -> bool:
    """Whether the process `prefect_up` recorded in ``entry`` still runs: its pid alive with the same
    start time and command line. A pid the system gave to another process since is not it (and is never
    signalled); an entry without a start time (older mmcse) is checked by its command naming prefect."""

    try:
        process = psutil.Process(int(entry["pid"]))
        if process.status() == psutil.STATUS_ZOMBIE:
            return False
        cmdline = process.cmdline()
        if entry.get("started") is None:
            return any("prefect" in part for part in cmdline)
        return abs(process.create_time() - float(entry["started"])) < 0.01 and cmdline == entry.get("cmdline")
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, KeyError, TypeError, ValueError):
        return False


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _ensure_pools(api_url: str) -> list[str]:
    """Create the work pools of `POOLS` (process type) that the server at ``api_url`` lacks."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound

    created = []
    with get_client(sync_client=True) as client:
        for pool in POOLS:
            try:
                client.read_work_pool(pool)
            except ObjectNotFound:
                client.create_work_pool(WorkPoolCreate(name=pool, type="process"))
                created.append(pool)
    return created


def prefect_down(root: str | Path = ".", say: Callable[[str], None] = print) -> list[str]:
    """Stop what `prefect_up` started in ``root`` (workers first, the server last; each process
    group TERM, then KILL after 30 s) and forget it; returns the names stopped."""

    pids_file = Path(root).resolve() / UP_DIR / "pids.json"
    if not pids_file.is_file():
        say("nothing to stop: no Prefect processes recorded by `mmcse prefect up` here")
        return []
    started = _read_started(pids_file)
    stopped = []
    for name in sorted(started, key=lambda n: n == "server"):  # the server last
        pid = int(started[name]["pid"])
        if not _same_process(started[name]):
            if _alive(pid):
                say(f"{name} (pid {pid}): that pid now belongs to another process; not signalled")
            continue
        try:
            os.killpg(pid, signal.SIGTERM)
            try:
                psutil.Process(pid).wait(30)
            except psutil.TimeoutExpired:
                os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, psutil.NoSuchProcess):
            pass
        stopped.append(name)
        say(f"stopped {name} (pid {pid})")
    pids_file.unlink()
    exported = os.environ.get("PREFECT_API_URL", "").strip().rstrip("/")
    if "server" in stopped and exported:
        say(f"PREFECT_API_URL={exported} points at the server just stopped: `unset PREFECT_API_URL` before the "
            "next dvc repro (or the ablate stage says so and stops)")
    return stopped
