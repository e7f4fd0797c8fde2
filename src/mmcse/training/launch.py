"""Starting one training job on several processes (``train.devices``, ``train.nodes``): torch's own launcher,
torchrun (``python -m torch.distributed.run``), runs the job's entry point once per process; inside, each
process joins the group (`mmcse.training.distributed.joined`) and encodes its share of every batch.

On one machine torchrun runs ``--standalone`` (a free local port: two jobs on one machine do not collide). On
several, every machine runs the same entry point with the same params.yaml; each sets its place with
``MMCSE_NODE_RANK`` (0: the machine that runs the stage and writes its outputs; 1 … nodes − 1 the others), and
torchrun's static rendezvous meets at ``train.master_addr:train.master_port`` (node 0's address). The launching
process holds the stage's outputs, forwards a stop (SIGTERM, Ctrl-C) to the job's processes once, so they
agree on a step, rank 0 writes a resume point and all stop, and fails with the job's exit status.

What the user sees is what one process would print, and one line when the job stops: torchrun's own output (its
OMP_NUM_THREADS banner, its ChildFailedError traceback) and every rank's copy of the stop's reason go to a log
file (``mlruns/launch/``) that the last line names; the ranks' other lines are passed through as they come.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from mmcse import stopping
from mmcse.config import ConfigError, TrainConfig
from mmcse.errors import StageError
from mmcse.io import at_home
from mmcse.processes import NODE_RANK, launched


def processes_per_node(train: TrainConfig, device_name: str) -> int:
    """``train.devices`` on this machine: ``auto`` is every GPU this process sees (`CUDA_VISIBLE_DEVICES`),
    or 1 where it sees none or ``base.device`` is cpu."""
    if train.devices != "auto":
        return int(train.devices)
    if device_name == "cpu":
        return 1
    # here, not at the top: the train stage's launcher process (it starts torchrun and waits) imports no torch
    import torch

    return max(torch.cuda.device_count(), 1) if torch.cuda.is_available() else 1


def node_rank(train: TrainConfig) -> int:
    """This machine's ``MMCSE_NODE_RANK`` (default 0), checked against ``train.nodes``."""
    raw = os.environ.get(NODE_RANK, "0")
    if not raw.strip().isdigit() or int(raw) >= train.nodes:
        raise ConfigError(f"{NODE_RANK}={raw!r}: must be a whole number in [0, {train.nodes - 1}] "
                          f"(train.nodes is {train.nodes}; 0 is the machine that writes the outputs)")
    return int(raw)


def processes(train: TrainConfig, device_name: str) -> int:
    """The job's processes over all its machines."""
    return processes_per_node(train, device_name) * train.nodes


def check_split(train: TrainConfig, device_name: str) -> None:
    """``train.batch_size`` splits evenly over the processes ``auto`` resolved to (integers are checked when
    params.yaml is read)."""
    n = processes(train, device_name)
    if train.batch_size % n:
        raise ConfigError(f"train.batch_size={train.batch_size} does not split evenly over the job's {n} processes "
                          f"(train.devices: {train.devices} is {processes_per_node(train, device_name)} here, "
                          f"× train.nodes {train.nodes})")


def needs_launch(train: TrainConfig, device_name: str) -> bool:
    """Whether this process must start the job's processes (several, and torchrun did not start this one)."""
    return not launched() and processes(train, device_name) > 1


def torchrun_command(train: TrainConfig, device_name: str, entry: Sequence[str]) -> list[str]:
    """The torchrun command that runs ``entry`` (a script and its arguments) once per process of this
    machine."""
    per_node = processes_per_node(train, device_name)
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={per_node}"]
    if train.nodes == 1:
        command.append("--standalone")
    else:
        command += [f"--nnodes={train.nodes}", f"--node-rank={node_rank(train)}",
                    f"--master-addr={train.master_addr}", f"--master-port={train.master_port}"]
    return command + list(entry)


RANK_LINE = re.compile(r"^\[[A-Za-z_]*(\d+)\]:(.*)$")  # torchrun --tee: "[default1]:<the line>"
RANK_TRACEBACK = re.compile(r"^\[rank\d+\]:")  # torch's prefix on what an uncaught exception prints in a rank
TEE_PREFIX = re.compile(r"\[default\d+\]:")  # inside a line: a progress bar's redraws joined by torchrun
# the first line of a traceback Python prints itself (an uncaught exception, an exception in an atexit callback),
# and the lines inside one that are not indented
TRACEBACK_START = ("Traceback (most recent call last):", "Exception ignored in")
TRACEBACK_INSIDE = ("During handling of the above exception", "The above exception was the direct cause", "Traceback")
ROOT_CAUSE = re.compile(r"Root Cause.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", re.S)
LAUNCH_LOGS = Path("mlruns") / "launch"


@dataclass
class LaunchOutput:
    """torchrun's output, line by line: every line to ``log``; a rank's lines without their ``[defaultN]:``
    prefix to the console, but its ``error:`` lines and an uncaught exception's traceback, which are kept per
    rank for the launcher's one line."""

    log: Path
    errors: dict[int, str] = field(default_factory=dict)  # local rank -> its last "error: ..." line
    uncaught: dict[int, str] = field(default_factory=dict)  # local rank -> the last line of its traceback
    in_traceback: set[int] = field(default_factory=set)  # ranks whose lines are inside a traceback now

    def take(self, line: str, handle) -> None:
        handle.write(line)
        ranked = RANK_LINE.match(line.rstrip("\n"))
        if ranked is None:
            return  # torchrun's own: the banner, its warnings, its traceback (the log keeps them)
        rank, text = int(ranked.group(1)), TEE_PREFIX.sub("", ranked.group(2))
        if not text.strip():
            return
        if text.startswith("error: "):
            self.errors[rank] = text.removeprefix("error: ")
        elif RANK_TRACEBACK.match(text):  # an uncaught exception's traceback: its last line says what it was
            if said := RANK_TRACEBACK.sub("", text).strip():
                self.uncaught[rank] = said
        elif text.startswith(TRACEBACK_START) or (rank in self.in_traceback and (
                text[0].isspace() or text.startswith(TRACEBACK_INSIDE))):
            self.in_traceback.add(rank)
        elif rank in self.in_traceback:  # the exception's own line ends the traceback
            self.in_traceback.discard(rank)
            self.uncaught[rank] = text.strip()
        else:
            print(text, flush=True)

    def failure(self, code: int) -> str:
        """The one line for a job that failed with torchrun status ``code``: which rank failed first
        (torchrun's root cause) and how: its own error, or the signal that killed it."""
        report = self.log.read_text(errors="replace") if self.log.is_file() else ""
        found = ROOT_CAUSE.search(report)
        where = f"torchrun's report: {self.log}"
        if found is None:
            return f"the job's processes failed (torchrun exit status {code}; {where})"
        rank, exit_code = int(found.group(1)), int(found.group(2))
        if rank in self.errors or rank in self.uncaught:
            return f"rank {rank} failed: {self.errors.get(rank) or self.uncaught[rank]} ({where})"
        if exit_code < 0:
            try:
                how = signal.Signals(-exit_code).name
            except ValueError:
                how = f"signal {-exit_code}"
            return (f"rank {rank} was killed by {how} and printed no error; the job's other processes were stopped "
                    f"({where})")
        return f"rank {rank} exited with status {exit_code} and printed no error ({where})"


def run_launched(command: Sequence[str]) -> None:
    """Run a torchrun ``command`` to its end. The first SIGTERM / Ctrl-C is passed once to the job's
    processes (not to torchrun, which would kill them 30 s later, maybe inside a save), which stop together
    after a resume point; a second stops everything at once. Raises `StageError` when the job failed (naming
    the rank that failed first and how) and `stopping.StopRequested` when it was stopped (rank 0's reason):
    one line either way, torchrun's report in the log file it names (`LaunchOutput`)."""
    log_dir = at_home(LAUNCH_LOGS)
    log_dir.mkdir(parents=True, exist_ok=True)
    output = LaunchOutput(log_dir / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log")
    # the ranks' own files: torchrun tees them to its output with a rank prefix (without a folder of ours it
    # would leave one under /tmp per run)
    ranks_dir = Path(tempfile.mkdtemp(prefix="mmcse-ranks-"))
    at = list(command).index("torch.distributed.run") + 1
    command = [*command[:at], f"--log-dir={ranks_dir}", "--redirects=3", "--tee=3", *command[at:]]
    # its own session: Ctrl-C at a terminal reaches this process alone, which passes it on once
    proc = subprocess.Popen(command, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, errors="replace", bufsize=1)

    def read() -> None:
        with open(output.log, "w") as handle:
            for line in proc.stdout:
                output.take(line, handle)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    forwarded = False
    try:
        with stopping.graceful():
            while True:
                try:
                    code = proc.wait(timeout=0.5)
                    break
                except subprocess.TimeoutExpired:
                    if stopping.requested() and not forwarded:
                        forwarded = True
                        for worker in psutil.Process(proc.pid).children():
                            worker.send_signal(signal.SIGTERM)
    finally:
        if proc.poll() is None:  # stopped at once: the job's whole session
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        reader.join(timeout=10)
        shutil.rmtree(ranks_dir, ignore_errors=True)
    if stopping.requested():
        reason = re.sub(r"^stopped on [A-Z]+: ", "", output.errors.get(0, "")) or (
            "the job's processes stopped together after rank 0's last resume point; rerun to continue from it")
        raise stopping.stop_exception(f"{reason} (every process stopped; their output: {output.log})")
    if code != 0:
        raise StageError(output.failure(code))
