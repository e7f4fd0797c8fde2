"""Scale-out: a real PostgreSQL (Debian's package) on 127.0.0.1 holds the Optuna study and
the MLflow runs of a sweep run by two worker processes; every trial is recorded once."""

import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import optuna
import pytest

from tests.experiments.test_sweep import run_sweep_workers

pytestmark = pytest.mark.slow


def _postgres_bin() -> Path | None:
    found = shutil.which("pg_ctl")
    if found:
        return Path(found).resolve().parent
    versions = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"))
    return versions[-1].parent if versions else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _as_server_user(cmd: list[str]) -> list[str]:
    """PostgreSQL refuses to run as root: run its tools as the package's `postgres` user."""
    return ["runuser", "-u", "postgres", "--", *cmd] if os.geteuid() == 0 else cmd


@pytest.fixture(scope="module")
def postgres():
    """A throw-away cluster on 127.0.0.1 with databases `optuna` and `mlflow`; yields its URL base."""
    bindir = _postgres_bin()
    if bindir is None:
        if os.environ.get("MMCSE_REQUIRE_POSTGRES"):
            pytest.fail("PostgreSQL server binaries not found (apt-get install postgresql)")
        pytest.skip("PostgreSQL server binaries not found (apt-get install postgresql)")
    # not under pytest's tmp dir: the server user must be able to reach its data folder
    root = Path(tempfile.mkdtemp(prefix="mmcse-pg-"))
    data, sockets = root / "data", root / "sock"
    sockets.mkdir()
    if os.geteuid() == 0:
        shutil.chown(root, "postgres")
        shutil.chown(sockets, "postgres")
    subprocess.run(_as_server_user([str(bindir / "initdb"), "-D", str(data), "-U", "mmcse", "--auth=trust",
                                    "-E", "UTF8"]), check=True, capture_output=True)
    port = _free_port()
    options = f"-h 127.0.0.1 -p {port} -k {sockets}"
    subprocess.run(_as_server_user([str(bindir / "pg_ctl"), "-D", str(data), "-o", options, "-l",
                                    str(root / "server.log"), "-w", "start"]), check=True, capture_output=True)
    try:
        for name in ("optuna", "mlflow"):
            subprocess.run([str(bindir / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "mmcse", name],
                           check=True, capture_output=True)
        yield f"postgresql+psycopg://mmcse@127.0.0.1:{port}"
    finally:
        subprocess.run(_as_server_user([str(bindir / "pg_ctl"), "-D", str(data), "-m", "fast", "stop"]),
                       capture_output=True)
        shutil.rmtree(root, ignore_errors=True)


def test_two_workers_share_a_postgres_study_and_tracking_store(project, postgres):
    import sqlalchemy

    finished = run_sweep_workers(project, "pg", storage=f"{postgres}/optuna", tracking=f"{postgres}/mlflow")

    engine = sqlalchemy.create_engine(f"{postgres}/mlflow")
    with engine.connect() as db:
        names = [r[0] for r in db.execute(sqlalchemy.text(
            "select r.name from runs r join tags t on t.run_uuid = r.run_uuid where t.key='mlflow.parentRunId'"))]
        parents = db.execute(sqlalchemy.text("select count(*) from runs where name = 'sweep pg'")).scalar()
    engine.dispose()
    assert sorted(names) == sorted(f"trial {t.number}" for t in finished)  # each trial once in MLflow
    assert parents == 2
    complete = [t for t in finished if t.state == optuna.trial.TrialState.COMPLETE]
    assert all(t.user_attrs["mlflow_run_id"] for t in complete)
