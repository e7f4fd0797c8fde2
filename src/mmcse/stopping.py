"""Stopping a stage cleanly: SIGTERM, SIGINT (Ctrl-C) or the death of the ``dvc`` process that started it.

The first signal asks the running training to stop at its next step boundary: it writes a last
resume point and raises `StopRequested`, which unwinds like Ctrl-C (the MLflow run ends KILLED, the
stage exits 128 + the signal's number, a Prefect server it started is stopped on the way out). Outside
a training loop, where there is nothing to save, the first signal stops at once; so does a second one
anywhere. `install` (called by every entry point through `mmcse.entry.run_entry`) sets the handlers;
the training loops ask `requested()` once per step (a flag read: nothing per step costs more).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator

import psutil

_REQUESTED = threading.Event()
_SIGNAL: list[int] = []  # the signal that asked to stop
_GRACEFUL = [0]  # depth of `graceful()` blocks: inside one, the first signal only asks
_SHELLS = {"sh", "bash", "dash", "zsh", "fish"}


class StopRequested(KeyboardInterrupt):
    """The stage was asked to stop (SIGTERM, SIGINT, its ``dvc`` parent gone): unwinds like Ctrl-C, so
    MLflow records the run as KILLED; ``exit_code`` is 128 + the signal's number."""

    def __init__(self, message: str, exit_code: int = 128 + signal.SIGTERM) -> None:
        super().__init__(message)
        self.exit_code = exit_code

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "stopped"


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def requested() -> bool:
    """Whether a stop was asked for (read once per training step)."""
    return _REQUESTED.is_set()


def stop_exception(detail: str) -> StopRequested:
    """The exception a training raises once it has honoured the stop: ``detail`` says what was kept."""
    signum = _SIGNAL[0] if _SIGNAL else signal.SIGTERM
    return StopRequested(f"stopped on {signal_name(signum)}: {detail}", 128 + signum)


@contextlib.contextmanager
def graceful() -> Iterator[None]:
    """Inside this block the first signal only sets the flag (the training loop saves and stops at its
    next step); outside, a signal stops at once."""
    _GRACEFUL[0] += 1
    try:
        yield
    finally:
        _GRACEFUL[0] -= 1


def _handler(signum: int, _frame: object) -> None:
    if _REQUESTED.is_set() or _GRACEFUL[0] == 0:  # a second signal, or nothing to save: now
        _SIGNAL[:] = _SIGNAL or [signum]
        _REQUESTED.set()
        raise StopRequested(f"stopped on {signal_name(signum)}", 128 + signum)
    _SIGNAL[:] = [signum]
    _REQUESTED.set()
    print(f"{signal_name(signum)}: stopping at the next training step, after a last resume point "
          "(send it again to stop at once)", file=sys.stderr, flush=True)


def install() -> None:
    """SIGTERM and SIGINT handled as above (main thread only: elsewhere signals cannot be set)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _handler)


def reset() -> None:
    """Forget a stop request (tests; a process that goes on after handling one)."""
    _REQUESTED.clear()
    _SIGNAL.clear()


def watch_parent(poll_seconds: float = 1.0) -> threading.Thread | None:
    """When this process is a DVC stage (``DVC_STAGE`` is set), stop it once the ``dvc`` process that
    started it is gone (killed with SIGKILL, or SIGTERM to dvc alone): a daemon thread polls the
    parent and sends this process SIGTERM, so the stage ends as on SIGTERM instead of running on as an
    orphan beside the next ``dvc repro``. Returns the thread (None: not a DVC stage)."""
    if not os.environ.get("DVC_STAGE"):
        return None

    # dvc runs the stage through ``$SHELL -c``, which usually execs it; where a shell stays in between,
    # watch the process above it (the shell itself would outlive a killed dvc)
    watched = psutil.Process().parent()
    while watched is not None and watched.name() in _SHELLS and watched.parent() is not None:
        watched = watched.parent()
    if watched is None:
        return None
    pid, started = watched.pid, watched.create_time()

    def gone() -> bool:
        try:
            return abs(psutil.Process(pid).create_time() - started) > 0.01
        except psutil.NoSuchProcess:
            return True

    def watch() -> None:
        while True:
            time.sleep(poll_seconds)
            if gone():
                print(f"the dvc process that started this stage (pid {pid}) is gone: stopping",
                      file=sys.stderr, flush=True)
                os.kill(os.getpid(), signal.SIGTERM)
                return

    thread = threading.Thread(target=watch, name="mmcse-parent-watch", daemon=True)
    thread.start()
    return thread
