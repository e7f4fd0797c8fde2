"""`mmcse report`: the record of ablation runs in MLflow read back beside the papers' numbers."""

import json
import math
import re
import subprocess
import sys

import pytest
import yaml

from mmcse import tracking
from mmcse.config import ConfigError
from mmcse.experiments.params import load_config
from tests.conftest import REPO


@pytest.fixture
def store(tmp_path, monkeypatch):
    """An empty MLflow store in a scratch folder (the repo's papers/ and ablations/ are read in place)."""
    monkeypatch.chdir(tmp_path)
    # the jobs' runs as a clean checkout makes them (this checkout may have uncommitted changes)
    monkeypatch.setattr(tracking, "source_state", lambda: {"commit": "c" * 40, "dirty": False, "changed": []})
    cfg = load_config(REPO / "params.yaml")
    tracking.configure(cfg)
    return cfg


def _ablation(cfg, preset: str, profile: str, reference: str, rows: list[dict], minutes: dict | None = None,
              test: str = "independent", params: dict | None = None, tags: dict | None = None) -> str:
    """A parent run as `flows.ablations` leaves it: its params, its table, its jobs' runs (``tags``: per
    variant, its jobs' extra tags)."""
    import mlflow
    import pandas as pd

    with tracking.run(cfg, "ablate", run_name=f"ablation {preset}") as parent:
        mlflow.log_params({"ablation.preset": preset, "ablation.profile": profile, "ablation.reference": reference,
                           "ablation.test": test, **(params or {})})
        mlflow.log_table(pd.DataFrame(rows), artifact_file="ablation_table.json")
        for variant, values in (minutes or {}).items():
            for seed, value in enumerate(values, 1):
                with tracking.tagged({tracking.VARIANT_TAG: variant, "device": "cuda NVIDIA A100",
                                      **(tags or {}).get(variant, {})}), \
                        tracking.run(cfg, "ablate", run_name=f"{variant}-seed{seed}",
                                     parent_run_id=parent.info.run_id):
                    mlflow.log_metric(tracking.TRAIN_MINUTES, value)
        return parent.info.run_id


def _row(variant: str, seeds: int, **cells) -> dict:
    row = {"variant": variant, "status": "ok", "seeds": seeds, "test": "independent"}
    for metric, (mean, std, p) in cells.items():
        row |= {f"{metric}_mean": mean, f"{metric}_std": std, f"{metric}_p": p}
    return row


def test_the_report_reads_the_latest_ablation_of_each_profile(store, tmp_path):
    import mlflow

    from mmcse.experiments.report import write_report
    from mmcse.tracking.reading import log_report

    old = _ablation(store, "kdmcse-table3", "kdmcse-flickr-bert", "KDMCSE",
                    [_row("KDMCSE", 5, avg=(10.0, 1.0, math.nan))])
    new = _ablation(store, "kdmcse-table3", "kdmcse-flickr-bert", "KDMCSE", [
        _row("KDMCSE", 5, avg=(78.9, 0.41, math.nan), STSBenchmark=(81.0, 0.5, math.nan)),
        _row("w/o AdapACSE", 5, avg=(78.0, 0.3, 0.01), STSBenchmark=(80.9, 0.2, 0.6)),
    ])
    report = write_report(store, "kdmcse", "3", tmp_path / "reports", root=REPO)
    files = report.files
    text = files["md"].read_text()
    assert files["md"].name == "kdmcse-table3.md" and "## KDMCSE Table 1" not in text  # one table asked for
    assert f"MLflow run `{new}` (FINISHED)" in text and old not in text
    # beside the paper's 78.6 / 81.3: mmcse's mean ± std (runs), the table's own test's marker, Δ
    assert "| KDMCSE | paper (KDMCSE-BERT) | 74.4 | 83.1 | 76.3 | 83.7 | 78.8 | 81.3 | 73.0 | 78.6 |" in text
    assert "|  | mmcse | — | — | — | — | — | 81.0 ± 0.5 (5) | — | 78.9 ± 0.4 (5) |" in text
    # Table 3 prints no std and no number of runs: each printed number is one run with the papers' own run-to-run
    # noise σ (the tolerance, from KDMCSE's and DALR's Table 1 stds: STS-B 0.68, avg 0.72), and mmcse's 5 seeds join
    # it. KDMCSE's STS-B, 0.25 below [81.25, 81.35]: no difference, and never equivalent within 2σ = 1.36 however many
    # seeds (σ alone is the floor of the noise: (1.36 − 0.25) / 0.68 < 1.645); its avg, 0.25 above, with 36 seeds
    never = "inconclusive (the paper's own noise: no number of seeds decides)"
    assert f"|  | Δ |  |  |  |  |  | -0.3 {never} |  | +0.3 inconclusive (~36 seeds would decide) |" in text
    # w/o AdapACSE's STS-B: 80.9 ± 0.2 over 5 seeds against the printed 80.5 ([80.45, 80.55]): no difference once the
    # paper's σ joins mmcse's spread (mmcse's seeds alone: t = 3.9, p = 0.02, "higher"); its avg, 0.15 below, is
    # equivalent within ± 1.44
    assert f"|  | Δ |  |  |  |  |  | +0.4 {never} |  | -0.2 reproduced |" in text
    # the summary counts independent cells: the avg column averages the STS cells (here not run), so it is left out
    assert "**Verdict: of 2 independent cells, 0 reproduced, 0 differ, 2 inconclusive** (α = 0.05" in text
    tolerances = ("Tolerances σ (the root mean square of the papers' printed stds of the metric; the equivalence "
                  "margin's unit, and the paper's noise where it prints none): STS12 1.18 (36 cells)")
    assert tolerances in text
    assert "STSBenchmark 0.68 (36 cells)" in text
    assert "|  | mmcse | — | — | — | — | — | 80.9 ± 0.2 (5) | — | 78.0* ± 0.3 (5) |" in text  # p 0.01 on avg
    assert "(independent t-test) against KDMCSE" in text
    # the same report, as one page, in the files and (`mmcse report --log`, the report stage) on the ablation run
    assert "78.0* ± 0.3 (5)" in files["html"].read_text()
    assert report.runs == [new]
    log_report(report.files, report.runs, report.verdicts)
    logged = {a.path for a in mlflow.MlflowClient().list_artifacts(new, "report")}
    assert logged == {"report/kdmcse-table3.md", "report/kdmcse-table3.html"}
    metrics = mlflow.MlflowClient().get_run(new).data.metrics  # the table's verdict, on the ablation it read
    assert [metrics[f"verdict/table3_{k}"] for k in ("reproduced", "differs", "inconclusive", "cells")] == [0, 0, 2, 2]


def test_training_minutes_come_from_the_jobs_runs(store, tmp_path):
    from mmcse.experiments.report import build_report

    _ablation(store, "dalr-table7", "dalr-coco-bert", "DALR", [_row("KDMCSE", 2), _row("DALR", 2)],
              minutes={"KDMCSE": [400.0, 420.0], "DALR": [350.0]})
    report = build_report(store, "dalr", "table7", root=REPO)
    markdown, runs = report.markdown, report.runs
    coco = markdown.split("### coco-bert")[1].split("###")[0]
    assert "|  | mmcse | 410 ± 14 (2) |" in coco and "|  | Δ | -30 |" in coco  # paper: 440 min
    assert "|  | mmcse | 350 (1) |" in coco and "|  | Δ | -20 |" in coco  # paper: 370 min
    assert "trained on cuda NVIDIA A100" in coco
    assert "Not run yet: `mmcse profile dalr-flickr-bert && dvc exp run -S ablate.preset=dalr-table7`" in markdown
    assert len(runs) == 1


def test_a_table_as_printed_sits_beside_its_recipes_reading_with_marked_rows_and_rows_not_run(store):
    from mmcse.config.readings import reading_tags, row_reading
    from mmcse.experiments.report import build_report

    def tags(weight: float) -> dict:
        return reading_tags("recipe" if weight != 1.0 else "printed",
                            row_reading({"loss.dalr.consistency_scale": weight, "loss.dalr.info_views": "one"}, "bert"))

    skipped = {"CLIP + SimCSE+RankCSE": "needs a rankcse checkpoint: set teacher_roles.text.rankcse"}
    rows = [_row("CLIP + SimCSE", 1, avg=(77.0, math.nan, math.nan)),
            _row("CLIP + SimCSE+DiffCSE", 1, avg=(78.0, math.nan, math.nan))]
    for reading, weight in (("recipe", 0.01), ("printed", 1.0)):
        _ablation(store, "dalr-table9", "dalr-flickr-bert", "CLIP + SimCSE+DiffCSE", rows,
                  minutes={"CLIP + SimCSE": [1.0], "CLIP + SimCSE+DiffCSE": [1.0]}, test="paired",
                  params={"ablation.reading": reading, "ablation.skipped": json.dumps(skipped)},
                  tags={"CLIP + SimCSE": tags(weight), "CLIP + SimCSE+DiffCSE": tags(1.0)})
    report = build_report(store, "dalr", "table9", root=REPO)
    markdown, _, runs = report.markdown, report.html, report.runs
    assert len(runs) == 2  # the latest per profile and reading: both readings side by side
    recipe = markdown.split("### flickr-bert, reading recipe")[1].split("###")[0]
    printed = markdown.split("### flickr-bert, reading printed")[1].split("###")[0]
    assert "|  | mmcse ◊ | 77.00 (1) |" in recipe and "|  | mmcse | 78.00 (1) |" in recipe
    assert ("Reading `recipe`; ◊ CLIP + SimCSE departs from its paper as printed at: loss.dalr.consistency_scale: "
            "code: 0.01 (printed 1.0; printed: dalr.txt Eq. 9 (1); code: src/model_modified.py l.765") in recipe
    assert "◊" not in printed.split("Reading")[1].split("\n", 1)[1]
    assert "Reading `printed`: every row follows its paper as printed where paper and code differ." in printed
    for block in (recipe, printed):  # a row the profile cannot train: not run, and why
        assert "|  | mmcse | not run: needs a rankcse checkpoint: set teacher_roles.text.rankcse |" in block


def test_every_table_is_listed_and_unknown_tables_are_refused(store, tmp_path):
    from mmcse.experiments.report import build_report

    report = build_report(store, "dalr", root=REPO)

    markdown, _, runs = report.markdown, report.html, report.runs
    assert runs == []
    for n in range(1, 11):
        assert f"## DALR Table {n}:" in markdown
    assert "## DALR Figure 3:" in markdown and "## DALR Figure 4:" in markdown
    assert "No preset yet" not in markdown  # every table and figure has its preset
    with pytest.raises(ConfigError, match="no 'table11'; tables: table1, table2"):
        build_report(store, "dalr", "11", root=REPO)
    with pytest.raises(ConfigError, match="no paper file .*papers: dalr, duet, kdmcse, mcseo"):
        build_report(store, "simcse", root=REPO)


def test_a_table_without_its_preset_says_so(store, tmp_path):
    import shutil

    from mmcse.experiments.report import build_report

    for folder in ("ablations", "papers"):
        shutil.copytree(REPO / folder, tmp_path / folder)
    (tmp_path / "ablations" / "dalr-table10.yaml").unlink()
    report = build_report(store, "dalr", "10", root=tmp_path)
    markdown, _, _ = report.markdown, report.html, report.runs
    assert "No preset yet: `ablations/dalr-table10.yaml` does not exist" in markdown


@pytest.mark.slow
def test_the_report_runs_on_the_demo_outputs_end_to_end(project, capsys):
    """The real path: the ablate stage runs a paper's preset on the demo data, then `mmcse report`
    reads it back and says that the demo numbers are not the paper's."""
    import shutil

    from mmcse.cli import main

    for folder in ("ablations", "papers", "profiles", "recipes"):  # the presets and the papers' numbers
        shutil.copytree(REPO / folder, project / folder)
    raw = yaml.safe_load((project / "params.yaml").read_text())
    raw["ablate"] |= {"preset": "kdmcse-table3", "seeds": [1]}
    raw["train"] |= {"max_steps": 2, "eval_steps": 2, "checkpoint_steps": 2}
    (project / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    # its own process: the ablate stage starts a temporary Prefect server, which must not outlive it
    subprocess.run([sys.executable, str(REPO / "stages/ablate.py")], cwd=project, check=True)
    main(["report", "kdmcse", "--table", "3"])
    out = capsys.readouterr().out
    assert "### demo (demo data)" in out and "NOT comparable with the paper's" in out
    demo = out.split("### demo (demo data)")[1]
    assert load_config("params.yaml").ablate.preset == "kdmcse-table3"
    for variant in ("KDMCSE", "w/o AdapACSE", "w/o threshold filtering"):
        line = next(li for li in demo.splitlines() if li.startswith(f"| {variant} | paper"))
        mmcse = demo.splitlines()[demo.splitlines().index(line) + 1]
        # "(uncommitted code)" where this checkout's code differs from its commit; ◊ on the rows that filter: Eq. 8's
        # direction follows the paper's prose and the code (params.yaml's default), not the equation as typeset
        mark = "" if variant == "w/o threshold filtering" else " ◊"  # that row sets the threshold off itself
        assert re.match(rf"\|  \| mmcse{mark}( \(uncommitted code\))? \|", mmcse), mmcse
        assert mmcse.rstrip(" |").endswith("(1)"), mmcse
    assert (project / "reports/kdmcse-table3.html").read_text().count("<table>") == 2
    # elsewhere the demo's params follow the papers as printed where paper and code differ; the job runs say so
    assert "Reading `recipe`; ◊ KDMCSE departs from its paper as printed at: loss.kdmcse.threshold_drops: code: " \
           "'above' (printed 'below'" in demo
    import mlflow

    tracking.configure(load_config("params.yaml"))  # the report read the store without MLflow
    jobs = mlflow.search_runs(experiment_names=["mmcse-ablate"], filter_string="tags.`ablation.variant` = 'KDMCSE'",
                              output_format="list")
    assert jobs and jobs[0].data.tags["mmcse.reading"] == "recipe"
    assert jobs[0].data.tags["mmcse.reading.loss.kdmcse.margin_similarity"].startswith("printed: 'cross' (printed")


def test_a_tables_report_leaves_git_status_clean_and_the_stages_reports_tracked(store, tmp_path):
    """Issue 56.4: `mmcse report kdmcse --table 3` wrote reports/kdmcse-table3.{md,html} as untracked files; one
    table's report is git-ignored, the report stage's whole papers (reports/<paper>.*) stay tracked."""
    from mmcse.experiments.report import write_report

    files = write_report(store, "kdmcse", "3", tmp_path, REPO).files
    names = [f"reports/{files['md'].name}", f"reports/{files['html'].name}"]
    assert names == ["reports/kdmcse-table3.md", "reports/kdmcse-table3.html"]
    ignored = subprocess.run(["git", "check-ignore", *names, "reports/kdmcse.md", "reports/kdmcse.html"], cwd=REPO,
                             capture_output=True, text=True).stdout.split()
    assert ignored == names
    # and DVC's: the report stage's output folder is reports/, which the table's files must not change
    dvc_ignored = subprocess.run(["dvc", "check-ignore", *names, "reports/kdmcse.md"], cwd=REPO,
                                 capture_output=True, text=True).stdout.split()
    assert dvc_ignored == names


def test_the_store_read_directly_and_through_mlflow_give_one_report(store, tmp_path):
    """`mmcse.runstore.SqliteRuns` reads MLflow's SQLite file without MLflow: the same runs, params, tags, metrics
    and artifacts as MLflow's client (`MlflowRuns`, the reader of any other store), so the same report."""
    from mmcse.experiments.report import build_report
    from mmcse.runstore import SqliteRuns
    from mmcse.tracking.reading import MlflowRuns

    _ablation(store, "kdmcse-table3", "kdmcse-flickr-bert", "KDMCSE",
              [_row("KDMCSE", 5, avg=(78.9, 0.41, math.nan)), _row("w/o AdapACSE", 5, avg=(78.0, 0.3, 0.01))],
              minutes={"KDMCSE": [3.0, 5.0]}, tags={"KDMCSE": {tracking.STAND_IN_TAG: "teachers.image"}})
    direct, through = SqliteRuns.open(store.base.mlflow_tracking_uri), MlflowRuns()
    assert direct is not None
    experiment = direct.experiment_id("mmcse-ablate")
    assert experiment == through.experiment_id("mmcse-ablate") and direct.experiment_id("nothing") is None
    for query in ({"param": ("ablation.preset", "kdmcse-table3")}, {"tag": (tracking.VARIANT_TAG, "KDMCSE")}):
        mine, theirs = direct.runs(experiment, **query), through.runs(experiment, **query)
        assert [r.info.run_id for r in mine] == [r.info.run_id for r in theirs] and mine
        for a, b in zip(mine, theirs, strict=True):
            assert (a.data.params, a.data.tags, a.data.metrics) == (b.data.params, b.data.tags, b.data.metrics)
            assert (a.info.status, a.info.start_time) == (b.info.status, b.info.start_time)
    parent = direct.runs(experiment, param=("ablation.preset", "kdmcse-table3"))[0]
    assert direct.artifact(parent, "ablation_table.json") == through.artifact(parent, "ablation_table.json")
    assert direct.artifact(parent, "no/such.json") is None
    one, other = build_report(store, "kdmcse", "3", REPO, direct), build_report(store, "kdmcse", "3", REPO, through)
    assert one.markdown == other.markdown and "78.0* ± 0.3 (5)" in one.markdown
    assert "row KDMCSE trained with offline stand-ins (teachers.stand_ins: allow): teachers.image" in one.markdown
