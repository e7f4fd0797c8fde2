"""Smoke: the real repo in a temp git repo, real params shrunk, `dvc repro` end to end."""

import contextlib
import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, repo_params, shrink

pytestmark = pytest.mark.slow


def _run(cmd, cwd, env):
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, f"{cmd}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout + out.stderr


@pytest.fixture(scope="module")
def repo_copy(tmp_path_factory):
    root = tmp_path_factory.mktemp("repo")
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout.split()
    for name in files:
        if name == "dvc.lock" or not (REPO / name).is_file():
            continue
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, root / name)
    raw = shrink(repo_params())
    raw["ablate"]["seeds"] = repo_params()["ablate"]["seeds"]  # the demo's table as README runs it: one seed a row
    (root / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "DVC_NO_ANALYTICS": "1"}
    _run(["git", "init", "-q"], root, env)
    _run(["git", "add", "-A"], root, env)
    _run(["git", "commit", "-qm", "init"], root, env)
    (root / "repro.log").write_text(_run(["dvc", "repro"], root, env))  # what the user sees (stdout + stderr)
    return root, env


def test_dvc_repro_produces_every_artifact(repo_copy):
    root, _ = repo_copy
    for path in ("data/raw/manifest.json", "data/objects/objects.jsonl", "data/teachers/manifest.json",
                 "models/student/best/model.safetensors", "ablation/ablation.md", "plots/train_loss.csv",
                 "plots/sts_scatter.png", "plots/ablation.png",
                 "plots/tsne.png", "plots/dev_geometry.csv", "plots/geometry_trajectory.png", "dvc.lock"):
        assert (root / path).is_file(), path
    record = json.loads((root / "metrics/eval.json").read_text())
    # keyed as in MLflow (one name per number), by the split each is computed on
    assert all(k.startswith("test_") or k in ("dev_alignment", "dev_uniformity") for k in record)
    scores = {k.removeprefix("test_"): v for k, v in record.items()}
    retrieval = {f"demo_{d}_R{k}" for d in ("i2t", "t2i") for k in (1, 5, 10)} | {"demo_rsum"}
    ndcg = {f"demo_{d}NDCG25_rouge_l" for d in ("i2t_", "t2i_", "")}
    geometry = {"dev_alignment", "dev_uniformity", "cluster_silhouette"}
    assert set(scores) == {"avg"} | retrieval | ndcg | geometry and -100 <= scores["avg"] <= 100
    assert 0 <= scores["dev_alignment"] <= 4 and scores["dev_uniformity"] < 0
    assert -1 <= scores["cluster_silhouette"] <= 1
    assert all(0 < scores[k] <= 1 for k in ndcg)
    assert len(list((root / "data/relevance").glob("rouge_l-*.npy"))) == 1
    assert 0 <= scores["demo_rsum"] <= 600
    assert scores["demo_rsum"] == pytest.approx(sum(scores[k] for k in retrieval - {"demo_rsum"}), abs=1e-3)
    table = (root / "plots/sentence_retrieval.md").read_text()
    assert table.count("| 1 |") == 5 and table.count("| 3 |") == 5  # 5 queries × 3 neighbours
    # issue 56: the card's first screen says what data the model saw; its score table is eval.json's, retrieval
    # beside the untrained encoder's and chance's
    card = (root / "models/student/best/README.md").read_text().split("\n---\n", 1)[1].lstrip()
    assert card.splitlines()[2].startswith("**Data: generated, not a benchmark.**")
    rows = {cells[0]: cells[1:] for line in card.splitlines() if line.startswith("| ")
            and len(cells := [c.strip() for c in line.strip("|").split("|")]) == 5}
    assert rows.pop("score") == ["value", "scale", "untrained", "chance"]
    assert {name: float(cells[0]) for name, cells in rows.items()} == scores
    for name in retrieval:
        assert rows[name][2] and rows[name][3], name  # an untrained and a chance number beside each R@K


def test_every_long_stage_says_what_it_is_doing_and_the_table_fits_120_columns(repo_copy):
    root, _ = repo_copy
    log = (root / "repro.log").read_text()
    assert "evaluate: 100%" in log and "STS test (1 task)" in log and "dev geometry" in log  # evaluate's bar
    # issue 56.5: a bar in a log is whole lines (a tenth or 30 s apart), not a kilobyte of carriage returns
    assert "\r" not in log and max(len(line) for line in log.split("\n")) <= 500
    jobs = re.findall(r"\[(\d)/2\] (\w+) seed=(\d): (starting|trained on cpu in [\d.]+ min, avg -?[\d.]+)", log)
    assert [(n, v, s) for n, v, s, what in jobs if what == "starting"] == [("1", "mcse", "1"), ("2", "simcse", "1")]
    assert len([j for j in jobs if j[3] != "starting"]) == 2
    assert "Starting temporary server" not in log and "Stopping temporary server" not in log
    table = log[log.index("variant  "):]  # the final table as printed: aligned blocks
    block = table[: table.index("\n\n")].splitlines()
    assert block[0].split()[0] == "variant" and block[2].startswith("mcse") and block[3].startswith("simcse")
    assert max(len(line) for line in table.splitlines()[:20]) <= 120


def test_mlflow_has_runs_params_curves_table_and_figures(repo_copy):
    root, _ = repo_copy
    with sqlite3.connect(root / "mlruns/mlflow.db") as db:
        experiments = {r[0] for r in db.execute("select name from experiments")}
        assert {"mmcse-mcse", "mmcse-ablate"} <= experiments
        (run_id,) = db.execute(
            "select r.run_uuid from runs r join experiments e on e.experiment_id = r.experiment_id "
            "where e.name = 'mmcse-mcse'").fetchone()
        steps = [r[0] for r in db.execute(
            "select step from metrics where run_uuid=? and key='dev_sts' order by step", (run_id,))]
        assert steps == [0, 4, 8]
        assert db.execute("select value from params where run_uuid=? and key='loss.lambda_img'",
                          (run_id,)).fetchone()[0] == "0.1"
        test_metrics = {r[0] for r in db.execute("select key from metrics where run_uuid=?", (run_id,))}
        assert {"test_avg", "loss/simcse", "loss/image", "test_demo_i2t_R1", "test_demo_rsum"} <= test_metrics
        # one name per number, named by its split: eval.json's keys are the test scores and the evaluated model's
        # dev geometry, which training logged under the same names
        record = json.loads((root / "metrics/eval.json").read_text())
        assert {k for k in test_metrics if k.startswith("test_")} == {k for k in record if k.startswith("test_")}
        assert {k for k in record if not k.startswith("test_")} == {"dev_alignment", "dev_uniformity"}
        assert {k for k in test_metrics if k.startswith("dev_")} == {"dev_sts", "dev_alignment", "dev_uniformity"}
        # the evaluated student as an MLflow model of the run (its "Logged models")
        (uri,) = db.execute("select value from tags where run_uuid=? and key='mmcse.model_uri'", (run_id,)).fetchone()
        assert uri.startswith("models:/")
        # issue 67.5: the model card is the run's description and its logged model's ("No description" before)
        (note,) = db.execute("select value from tags where run_uuid=? and key='mlflow.note.content'",
                             (run_id,)).fetchone()
        assert note.startswith("# ") and "## Scores" in note and "**Data: generated" in note
        (model_note,) = db.execute("select tag_value from logged_model_tags where model_id=? and tag_key="
                                   "'mlflow.note.content'", (uri.removeprefix("models:/"),)).fetchone()
        assert model_note == note
    artifacts = {p.name for p in (root / "mlruns/artifacts").rglob("*") if p.is_file()}
    assert {"ablation_table.json", "ablation.png", "sts_scatter.png", "training_curves.png", "MLmodel"} <= artifacts


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _page(url: str, tmp_path: Path, name: str) -> str:
    """The page at ``url`` as headless Chromium draws it in a 2400×1600 window: its DOM (scripts
    left out) and a screenshot ``<name>.png`` beside it (what a user sees, kept for a failure)."""
    from tests.test_dvc_plots import chromium

    common = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-extensions",
              f"--user-data-dir={tmp_path / 'chrome-profile'}", "--window-size=2400,1600",
              "--virtual-time-budget=20000"]
    shot = subprocess.run([*common, f"--screenshot={tmp_path / name}.png", url], capture_output=True, timeout=180)
    assert shot.returncode == 0 and (tmp_path / f"{name}.png").stat().st_size > 10_000, shot.stderr[-2000:]
    dom = subprocess.run([*common, "--dump-dom", url], capture_output=True, text=True, timeout=180)
    assert dom.returncode == 0, dom.stderr[-2000:]
    return re.sub(r"<script\b.*?</script>", "", dom.stdout, flags=re.DOTALL)


def _text(html: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html))


@pytest.mark.skipif(shutil.which("chromium-headless-shell") is None and shutil.which("chromium") is None,
                    reason="no Chromium (Debian: apt-get install chromium-headless-shell)")
def test_mlflow_views_show_the_scores_without_configuring(repo_copy, tmp_path):
    """`mmcse ui` as a user starts it after the quick start: the runs table it links shows the method,
    seed, best dev score and test scores of the train stage's run, and the ablation parent's page
    shows the variants' headline table (mean ± std; one seed: its value), drawn by the real MLflow UI in headless
    Chromium."""
    import urllib.request

    root, env = repo_copy
    port = _free_port()
    ui = subprocess.Popen([sys.executable, "-m", "mmcse.cli", "ui", "--no-dashboard", "--port", str(port)], cwd=root,
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        while not lines or "Ctrl-C stops them." not in lines[-1]:
            line = ui.stdout.readline()
            assert line, "".join(lines)
            lines.append(line)
        urls = dict(re.findall(r"^\s+(mmcse-\w+): (\S+)$", "".join(lines), flags=re.MULTILINE))
        for _ in range(120):  # the server answers /health once it has started
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200:
                    break
            except OSError:
                time.sleep(1)
        record = json.loads((root / "metrics/eval.json").read_text())
        best = json.loads((root / "metrics/train.json").read_text())["best_dev_sts"]
        table = _text(_page(urls["mmcse-mcse"], tmp_path, "runs"))
        for column in ("train.method", "base.seed", "best_dev_sts", "test_avg", "test_demo_rsum",
                       "test_demo_NDCG25_rouge_l"):
            assert column in table, column
        assert "mcse-seed42" in table and "mcse" in table
        # the cells: MLflow prints the logged values (cut to the column's width), eval.json rounds to 4 places
        assert f"{best:.2f}" in table and f"{record['test_avg']:.2f}" in table, table[:3000]

        (ablation,) = re.findall(r"latest ablation table: (\S+)", "".join(lines))  # the parent run's page
        page = _text(_page(ablation, tmp_path, "ablation"))
        summary = json.loads((root / "metrics/ablate.json").read_text())["variants"]
        assert "STS avg" in page and "p vs mcse (STS avg)" in page
        for variant, cell in summary.items():  # one seed a row (the demo's default): its value, no "± 0.00"
            assert f"{variant} {cell['mean']:.2f} " in page and "± 0.00" not in page, (variant, page[:3000])
    finally:
        ui.terminate()
        ui.wait(timeout=30)


@pytest.mark.parametrize("bad", ["loss.kdmcse.threshold=1.5", "train.method=foo"])
def test_an_invalid_value_through_dvc_fails_first_and_loses_nothing(repo_copy, bad):
    """`dvc exp run -S` with a bad value: the check_params stage fails before DVC removes any
    stage's outputs, so every committed output stays and at most params.yaml differs."""
    root, env = repo_copy
    _run(["git", "add", "-A"], root, env)
    _run(["git", "commit", "-qm", "the pipeline's outputs", "--allow-empty"], root, env)
    kept = {p: (root / p).read_bytes() for p in ("metrics/teachers.json", "metrics/threshold.json",
                                                 "plots/kdmcse_threshold.png", "metrics/train.json",
                                                 "plots/train_loss.csv")}
    out = subprocess.run(["dvc", "exp", "run", "-S", bad], cwd=root, env=env, capture_output=True, text=True,
                         timeout=300)
    try:
        log = out.stdout + out.stderr
        assert out.returncode != 0 and "Running stage 'check_params'" in log
        assert bad.split("=")[0] in log
        for stage in ("download", "cache_teachers", "train"):
            assert f"Running stage '{stage}'" not in log
        status = subprocess.run(["git", "status", "--porcelain"], cwd=root, env=env, capture_output=True, text=True,
                                check=True).stdout
        assert set(status.splitlines()) <= {" M params.yaml"}, status  # (DVC 3.67 puts params.yaml back, too)
        assert {p: (root / p).read_bytes() for p in kept} == kept
    finally:
        _run(["git", "checkout", "--", "params.yaml"], root, env)


def test_a_failed_download_through_dvc_keeps_the_data_that_was_there(repo_copy):
    """Issue 33.9: offline, a profile's download fails; data/raw is as it was (DVC does not delete a
    persisted output first, the stage swaps its new folder in only on success) and `dvc status` says
    nothing was deleted."""
    root, env = repo_copy
    manifest = (root / "data/raw/manifest.json").read_bytes()
    raw = yaml.safe_load((root / "params.yaml").read_text())
    raw["data"].update(source="senteval", senteval_dir="download")
    (root / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    offline = {**env, "MMCSE_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(root / "empty-hub")}
    try:
        out = subprocess.run(["dvc", "repro", "download"], cwd=root, env=offline, capture_output=True, text=True,
                             timeout=300)
        log = out.stdout + out.stderr
        assert out.returncode != 0 and "senteval.tar is not in the local Hugging Face cache" in log, log[-2000:]
        assert "hf download --repo-type dataset princeton-nlp/datasets-for-simcse senteval.tar" in log
        assert (root / "data/raw/manifest.json").read_bytes() == manifest
        status = subprocess.run(["dvc", "status", "download"], cwd=root, env=env, capture_output=True, text=True)
        assert "deleted" not in status.stdout, status.stdout
    finally:
        _run(["git", "checkout", "--", "params.yaml"], root, env)


def test_dvc_exp_run_reruns_only_what_changed_and_after_ctrl_c_reuses_the_finished_jobs(repo_copy):
    """`dvc exp run -S loss.temperature=0.07` (as README's `-S loss.lambda_img=0.05`, with a key both of the table's
    rows read): the stages upstream of train are skipped, train, evaluate and the ablation run. Issue 33.8: Ctrl-C
    after the ablation's first new job finished; the same `dvc exp run` again restores ablation/ from its commit,
    and the finished job comes back from data/jobs instead of being trained again. The finished experiment is then
    in `dvc exp show`, `mmcse runs` and `dvc plots show`."""
    import signal

    root, env = repo_copy
    _run(["git", "add", "-A"], root, env)
    _run(["git", "commit", "-qm", "the pipeline's outputs", "--allow-empty"], root, env)
    cmd = ["dvc", "exp", "run", "-S", "loss.temperature=0.07"]  # two new jobs: every method reads it
    exp = subprocess.Popen(cmd, cwd=root, env={**env, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines, sent = [], False
    for line in exp.stdout:
        lines.append(line)
        if "[2/2] simcse seed=1: starting" in line and not sent:
            os.killpg(exp.pid, signal.SIGINT)  # a terminal's Ctrl-C reaches dvc and the stage
            sent = True
    exp.wait(120)
    log = "".join(lines)
    for unchanged in ("download", "detect_objects", "cache_teachers"):
        assert f"Stage '{unchanged}' didn't change, skipping" in log
    assert "Running stage 'train'" in log and "Running stage 'evaluate'" in log
    assert sent and exp.returncode != 0 and "[1/2] mcse seed=1: trained on cpu" in log, log[-3000:]
    assert "Error logging to API" not in log and "ConnectError" not in log  # the server outlived the Ctrl-C
    assert "[2/2] simcse seed=1: trained" not in log
    again = _run(cmd, root, env)
    assert "[1/2] mcse seed=1: reused (finished before)" in again, again[-3000:]
    assert "[2/2] simcse seed=1: trained on cpu" in again

    shown = subprocess.run(["dvc", "exp", "show", "--json"], cwd=root, env=env, capture_output=True,
                           text=True, check=True).stdout
    assert '"test_avg"' in shown and "0.07" in shown
    # `mmcse runs`: the experiments at a glance in 200 columns (dvc exp show lists ~400 there)
    table = _run([sys.executable, "-m", "mmcse.cli", "runs", "--width", "200"], root, env)
    lines = table.splitlines()
    assert max(len(line) for line in lines) <= 200 and lines[0].split()[:4] == ["experiment", "created", "method",
                                                                               "changed"]
    exp_record = json.loads(shown)[1]["experiments"][0]["revs"][0]
    # the experiment and the workspace it left behind, each with the param it changed against the commit
    (exp_line,) = [line for line in lines if line.startswith(exp_record["name"] + " ")]
    assert "loss.temperature=0.07" in exp_line and "loss.temperature=0.07" in next(
        line for line in lines if line.startswith("workspace "))
    test_avg = exp_record["data"]["metrics"]["metrics/eval.json"]["data"]["test_avg"]
    assert "best_dev_sts" in lines[0] and "test_avg" in lines[0] and f"{test_avg:.2f}" in exp_line
    _run(["dvc", "plots", "show", "-o", "dvc_plots"], root, env)
    assert (root / "dvc_plots/index.html").stat().st_size > 1000


def _commit_workspace(root, env):
    _run(["git", "checkout", "--", "params.yaml"], root, env)
    _run(["git", "add", "-A"], root, env)
    _run(["git", "commit", "-qm", "the workspace as it stands", "--allow-empty"], root, env)


def _runs_with(root: Path, key: str, value: str) -> list[tuple[str, str, dict]]:
    """(run id, status, tags) of the project store's runs whose param ``key`` is ``value``."""
    with sqlite3.connect(root / "mlruns/mlflow.db") as db:
        found = db.execute("select r.run_uuid, r.status from runs r join params p on p.run_uuid = r.run_uuid "
                           "where p.key = ? and p.value = ?", (key, value)).fetchall()
        return [(run_id, status, dict(db.execute("select key, value from tags where run_uuid=?", (run_id,))))
                for run_id, status in found]


def test_two_failed_dvc_exp_runs_in_a_row_name_the_values_the_first_left_behind(repo_copy):
    """Issue 53.6: DVC leaves a failed experiment's -S values in params.yaml, so the second -S is checked with the
    first one's; its error says so, naming both keys with their committed values and how to drop them."""
    root, env = repo_copy
    _commit_workspace(root, env)
    try:
        for bad in ("train.devices=0", "train.dropout_rng=bogus"):
            out = subprocess.run(["dvc", "exp", "run", "-S", bad, "check_params"], cwd=root, env=env,
                                 capture_output=True, text=True, timeout=300)
            assert out.returncode != 0
        log = out.stdout + out.stderr
        (note,) = [line for line in log.splitlines() if line.startswith("note: params.yaml differs")]
        assert "train.devices=0 (committed: 1)" in note and "train.dropout_rng=bogus (committed: " in note
        assert note.endswith("`git checkout params.yaml` drops them")
    finally:
        _run(["git", "checkout", "--", "params.yaml"], root, env)


def _stop_queue_workers(root: Path, env: dict) -> None:
    """`dvc queue stop`, then SIGTERM to any worker still alive (its pid file under .dvc/tmp/exps/celery)."""
    import signal

    subprocess.run(["dvc", "queue", "stop"], cwd=root, env=env, capture_output=True, timeout=120)
    deadline = time.monotonic() + 20
    pids = [int(p.read_text().split()[0]) for p in (root / ".dvc/tmp/exps/celery").glob("*.pid")
            if p.read_text().strip().split()[0].isdigit()]
    while pids and time.monotonic() < deadline:
        pids = [pid for pid in pids if Path(f"/proc/{pid}").exists()]
        time.sleep(0.5)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)


def test_queued_experiments_land_in_the_projects_store_and_runs_stars_what_they_did_not_make(repo_copy):
    """Issue 53.11: two experiments queued and run by `dvc queue start -j 2` (each in a copy under .dvc/tmp/exps
    that DVC deletes) log their MLflow runs into the project's store. Issue 53.12: they ran only train, so
    `mmcse runs` stars the evaluate scores they hold (the commit's), and not their own dev scores."""
    root, env = repo_copy
    _commit_workspace(root, env)
    for rate in ("0.002", "0.003"):
        _run(["dvc", "exp", "run", "--queue", "-S", f"train.learning_rate={rate}", "train"], root, env)
    # `dvc queue start` leaves its workers running as daemons that inherit its output: into a file, not a pipe this
    # test would wait on until every worker exits (a celery worker that missed its own shutdown never does)
    with open(root.parent / "queue-start.log", "w") as log:
        subprocess.run(["dvc", "queue", "start", "-j", "2"], cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT,
                       timeout=300, check=True)
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            status = _run(["dvc", "queue", "status"], root, env)
            if "Queued" not in status and "Running" not in status:
                break
            time.sleep(1)
    finally:
        _stop_queue_workers(root, env)
    assert status.count("Success") >= 2, status
    for rate in ("0.002", "0.003"):
        ((_, state, _),) = _runs_with(root, "train.learning_rate", rate)
        assert state == "FINISHED"
    assert not list((root / ".dvc/tmp").rglob("mlflow.db"))
    table = _run([sys.executable, "-m", "mmcse.cli", "runs", "--width", "400"], root, env)
    header, *rows = table.splitlines()
    queued = [row.split() for row in rows if "train.learning_rate=0.00" in row]
    assert len(queued) == 2 and 0 < header.index("best_dev_sts") < header.index("test_avg"), table
    for cells in queued:  # ... changed params, best_dev_sts (train ran: its own), test_avg (evaluate did not)
        at = next(i for i, c in enumerate(cells) if c.startswith("train.learning_rate="))
        assert not cells[at + 1].endswith("*") and cells[at + 2].endswith("*"), table
    assert "* not this experiment's score" in table


def test_dvc_exp_run_resumes_the_training_it_interrupted_in_the_same_mlflow_run(repo_copy):
    """Issue 53.2: `dvc exp run` checks models/student out of the commit before it reproduces, which replaced the
    resume point SIGTERM had written; the kept copy (data/resume) is put back, the rerun continues from that step
    in the run the interrupted one began (KILLED, then FINISHED), and nothing is left kept once it finished."""
    import signal

    root, env = repo_copy
    _commit_workspace(root, env)
    cmd = ["dvc", "exp", "run", "-S", "train.max_steps=160", "-S", "train.eval_steps=80", "train"]
    exp = subprocess.Popen(cmd, cwd=root, env={**env, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + 300
    while not any((root / "data/resume").glob("*/last/state.json")) and time.monotonic() < deadline:
        assert exp.poll() is None, exp.communicate()[0][-3000:]
        time.sleep(0.2)
    os.killpg(exp.pid, signal.SIGTERM)
    log = exp.communicate(timeout=120)[0]
    assert exp.returncode != 0 and "rerun to continue from it" in log, log[-3000:]
    stopped = int(re.search(r"resume point written at step (\d+)", log).group(1))
    assert 0 < stopped < 160
    ((run_id, state, _),) = _runs_with(root, "train.max_steps", "160")
    assert state == "KILLED"

    again = _run(cmd, root, env)
    assert "retrained from step 0" not in again, again[-3000:]
    ((resumed_id, state, tags),) = _runs_with(root, "train.max_steps", "160")
    assert (resumed_id, state, tags.get("mmcse.resumed_from_step")) == (run_id, "FINISHED", str(stopped)), again[-3000:]
    assert json.loads((root / "metrics/train.json").read_text())["steps"] > stopped  # (the data's epochs end first)
    assert not any((root / "data/resume").iterdir())
