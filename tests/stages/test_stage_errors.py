"""Stage scripts turn bad input into one clear line (exit 2) before any compute."""

import os
import subprocess
import sys

import pytest
import yaml

from tests.conftest import REPO, stage_here


def _stage(name, cwd):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, str(REPO / "stages" / f"{name}.py")], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_unknown_key_names_file_key_and_valid_keys(tmp_path):
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    raw["train"]["lerning_rate"] = 1e-3
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    out = _stage("download", tmp_path)
    assert out.returncode == 2
    assert "params.yaml" in out.stderr and "train.lerning_rate" in out.stderr and "learning_rate" in out.stderr
    assert not (tmp_path / "data").exists()


def test_out_of_range_value_fails_before_compute(tmp_path):
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    raw["loss"]["temperature"] = -0.05
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    out = _stage("download", tmp_path)
    assert out.returncode == 2 and "loss.temperature" in out.stderr and "must be > 0" in out.stderr
    assert not (tmp_path / "data").exists()


@pytest.mark.slow  # a stage process (~6 s); the fast tier checks the rows and sweep ends in-process (tests/config)
def test_check_params_names_a_bad_variant_or_sweep_range_in_one_line_and_writes_nothing(tmp_path):
    """The first stage DVC runs: the ablation rows and the sweep space's ends are checked too."""
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    raw["ablate"] |= {"variants": {"ok": {}, "too high": {"loss.kdmcse.threshold": 1.5}}, "reference": "ok"}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    out = _stage("check_params", tmp_path)
    assert out.returncode == 2 and out.stderr.count("\n") == 1
    assert "ablate.variants.too high" in out.stderr and "loss.kdmcse.threshold" in out.stderr
    raw["ablate"]["variants"] = {"ok": {}}
    raw["sweep"]["space"] = {"loss.temperature": {"type": "float", "low": 0.0, "high": 0.1}}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    out = _stage("check_params", tmp_path)
    assert out.returncode == 2 and "sweep.space.loss.temperature: 0.0" in out.stderr and "must be > 0" in out.stderr
    assert not (tmp_path / "data").exists()
    raw["sweep"]["space"] = {"loss.temperature": {"type": "float", "low": 0.01, "high": 0.1}}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    assert _stage("check_params", tmp_path).returncode == 0
    assert (tmp_path / "data/params_checked.json").read_text() == '{\n  "params.yaml": "valid"\n}\n'


def test_the_ablate_stage_names_a_bad_variant_before_any_prefect_server(tmp_path):
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    raw["ablate"] |= {"variants": {"ok": {}, "bad": {"train.method": "foo"}}, "reference": "ok"}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    out = _stage("ablate", tmp_path)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "train.method" in out.stderr
    assert "prefect" not in (out.stdout + out.stderr).lower()


@pytest.mark.slow  # a stage process start (~6 s); offline ids are checked in-process in tests/teachers, tests/data
def test_offline_model_id_fails_fast_in_detect(project):
    raw = yaml.safe_load((project / "params.yaml").read_text())
    raw["model"] = {**raw["model"], "name_or_path": "no-such-org/no-such-model"}
    (project / "params.yaml").write_text(yaml.safe_dump(raw))
    before = (project / "data/objects/objects.jsonl").read_bytes()
    out = _stage("detect_objects", project)
    assert out.returncode == 2 and "no-such-org/no-such-model" in out.stderr and "HF_HUB_OFFLINE" in out.stderr
    assert (project / "data/objects/objects.jsonl").read_bytes() == before  # nothing lost


@pytest.mark.slow  # end to end: real stages, models or subprocesses (the full suite runs it)
def test_train_stage_without_upstream_outputs_says_what_to_run(tmp_path, capsys):
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    out = stage_here("train", tmp_path, capsys)
    assert out.returncode == 2 and "data/raw (data: missing)" in out.stderr and "dvc repro" in out.stderr


def _truncated_teacher_set(project, role="image"):
    import json

    sets = json.loads((project / "data/teachers/manifest.json").read_text())["sets"]
    file = project / "data/teachers" / sets[role] / "features.npy"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])
    return file.relative_to(project), data


@pytest.mark.slow  # end to end: real stages, models or subprocesses (the full suite runs it)
def test_train_stage_names_a_truncated_teacher_set_in_one_line(project, capsys):
    file, _ = _truncated_teacher_set(project)
    out = stage_here("train", project, capsys)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: {file}: truncated: ")
    assert last.endswith("; rerun the cache_teachers stage to rebuild it (dvc repro cache_teachers)")
    assert not (project / "mlruns").exists()  # caught before a (failed) MLflow run was started


@pytest.mark.slow  # end to end: real stages, models or subprocesses (the full suite runs it)
def test_cache_teachers_stage_rebuilds_a_truncated_set(project, capsys, caplog):
    file, whole = _truncated_teacher_set(project)
    out = stage_here("cache_teachers", project, capsys)
    assert out.returncode == 0, out.stderr
    # a warning: on stderr in the stage's own process (logging's last resort), in caplog in this one
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any(f"{file}: truncated: " in m and "computing it again" in m for m in warned), warned
    assert (project / file).read_bytes() == whole  # the same features, recomputed
    assert "cache_teachers: image: computed" in out.stderr  # the damaged set was no cache hit
    assert "cache_teachers: object: cached" in out.stderr
    assert "cache_hit" not in (project / "metrics/teachers.json").read_text()  # tracked: nothing history-dependent
