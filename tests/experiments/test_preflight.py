"""`mmcse preflight`: rows built at their real architectures offline (random weights where the model is not
here), run through the train stage's own step, their widths from the teachers' architectures, out of memory
answered with the micro-batch that fits, and the command on the demo and on one paper-shaped row."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys

import pytest

from mmcse.errors import ModelUnavailableError
from mmcse.experiments import preflight as pf
from mmcse.experiments.params import load_config
from mmcse.experiments.profiles import apply_profile
from mmcse.models import architectures
from mmcse.models.architectures import model_config
from tests.conftest import params_copy


@pytest.fixture
def project(tmp_path):
    return params_copy(tmp_path)


@pytest.fixture
def nothing_downloaded(monkeypatch):
    """No model of the hub's is on this machine (the CI machine's state, whatever a developer's cache holds)."""
    real = architectures.local_model
    monkeypatch.setattr(architectures, "local_model", lambda name: real(name) if name.startswith("packaged:") else None)


def test_an_id_not_here_is_built_from_the_architecture_table_and_an_unknown_one_is_named_with_the_fix(
        nothing_downloaded):
    bert, here = model_config("princeton-nlp/unsup-simcse-bert-base-uncased")
    assert not here and (bert.hidden_size, bert.num_hidden_layers, bert.num_attention_heads, bert.vocab_size) == (
        768, 12, 12, 30522)
    roberta, _ = model_config("voidism/diffcse-roberta-base-sts")
    assert (roberta.model_type, roberta.vocab_size, roberta.max_position_embeddings) == ("roberta", 50265, 514)
    clip, _ = model_config("openai/clip-vit-large-patch14")
    assert (clip.projection_dim, clip.vision_config.patch_size, clip.vision_config.num_hidden_layers) == (768, 14, 24)
    packaged, here = model_config("packaged:all-MiniLM-L6-v2")
    assert here and packaged.hidden_size == 384  # on the machine: its own config.json
    with pytest.raises(ModelUnavailableError, match=r"'someone/new-model' is not on this machine and not in mmcse's "
                                                    r"architecture table .*hf download someone/new-model"):
        model_config("someone/new-model")


def test_a_paper_rows_input_widths_come_from_its_teachers_architectures(project, nothing_downloaded):
    apply_profile(project / "params.yaml", "dalr-flickr-bert")
    widths = pf.input_widths(load_config(project / "params.yaml"))
    # CLIP ViT-B/32's joint space for t̂ and v̂; SimCSE and DiffCSE (BERT-base) as the text teachers
    assert (widths["joint_text"], widths["joint_image"], widths["text_teachers"]) == (512, 512, [768, 768])
    demo = pf.input_widths(load_config(project / "params.yaml", {"teachers.image_grid": 2, "teachers.colour_bins": 3,
                                                                 "teachers.joint.kind": "cca", "teachers.joint.dim": 16,
                                                                 "teachers.text": [{"teacher": "joint"}]}))
    assert (demo["image"], demo["joint_text"], demo["text_teachers"]) == (2 * 2 * (27 + 8), 16, [16])


SLOW = pytest.mark.slow


@pytest.mark.parametrize("method", [pytest.param("mcse", marks=SLOW), pytest.param("dalr", marks=SLOW),
                                    pytest.param("mcseo", marks=SLOW), "vsepp"])
def test_a_row_runs_the_train_stages_step_at_its_shapes(project, method):
    """In process (the command runs each row in its own): the demo's models, the method's own step."""
    overrides = {"train.method": method, "train.batch_size": 4, "model.max_seq_len": 12}
    if method == "vsepp":  # its CNN on pixels, frozen then fine-tuned: both phases are timed
        overrides |= {"model.vsepp.image_input": "pixels", "model.vsepp.crop_size": 32, "model.vsepp.joint_dim": 16,
                      "model.vsepp.word_dim": 8, "model.vsepp.finetune_epochs": 1, "regions.grid_model": "resnet50"}
    job = load_config(project / "params.yaml", overrides)
    out = pf.run_row(job, steps=2)
    assert out["step_seconds"] > 0 and math.isfinite(out["step_seconds"])
    assert out["weights"] == ("real" if method != "vsepp" else pf.RANDOM)  # the packaged MiniLM is here
    assert ("finetune_step_seconds" in out) == (method == "vsepp")
    # the resume point round trip: fp32 weights and AdamW's two moments of the ~23M parameters that trained
    # (MiniLM-L6's encoder; VSE++: ResNet-50, fine-tuned in the second phase), so over 3 × 4 × 21M bytes
    assert out["checkpoint_bytes"] > 2.5e8 and out["checkpoint_seconds"] > 0
    assert out["dev_batch_seconds"] > 0


def test_a_rows_dev_evaluations_are_counted_as_the_loop_scores(project):
    job = load_config(project / "params.yaml", {"train.eval_steps": 10, "evaluate.batch_size": 64})
    counts = {"sts_dev_pairs": 1500, "retrieval_val_images": 5000, "retrieval_val_captions": 25000}
    # at steps 0, 10, ..., 100: 11 dev scores over 3,000 sentences in batches of 64
    assert pf.dev_evaluations(job, 100, counts) == 11 * 47
    assert pf.dev_evaluations(job, 105, counts) == 12 * 47  # and one at the end
    duet = load_config(project / "params.yaml", {"train.method": "duet", "train.eval_steps": 10,
                                                 "evaluate.batch_size": 64})
    assert pf.dev_evaluations(duet, 100, counts) == 11 * math.ceil(25000 / 64)  # a batch of each, as timed


@pytest.mark.slow  # a process that imports this test module
def test_a_row_whose_process_is_killed_is_a_failed_row_not_a_hang(project, monkeypatch):
    """What the kernel does to a process that runs a CPU out of memory: SIGKILL, no result."""
    monkeypatch.setattr(pf, "_child", _killed_child)
    out = pf.check_in_process(load_config(project / "params.yaml"), steps=1, timeout=120)
    assert out["status"] == "failed" and out["out_of_memory"] and "killed, e.g. out of memory" in out["error"]


def test_out_of_memory_is_tried_again_with_halved_micro_batches_until_one_fits(project, monkeypatch):
    tried = []

    def fake(job, steps, timeout=None):
        tried.append(job.train.micro_batch)
        if job.train.micro_batch and job.train.micro_batch <= 8:
            assert job.train.dropout_rng == "per_row"  # the setting micro-batches need
            return {"status": "ran", "step_seconds": 1.0}
        return {"status": "failed", "out_of_memory": True, "error": "OutOfMemoryError: CUDA out of memory"}

    monkeypatch.setattr(pf, "check_in_process", fake)
    job = load_config(project / "params.yaml", {"train.batch_size": 64})
    result = pf.preflight_row(job, steps=2)
    assert tried == [0, 32, 16, 8] and result["fits_with"] == "train.micro_batch: 8" and result["status"] == "ran"
    other = pf.preflight_row(load_config(project / "params.yaml", {"train.method": "duet"}), steps=2)
    assert other["status"] == "failed" and tried[-1] == 0  # retrieval models have no micro-batches: reported


def test_the_command_on_the_demo_prints_its_table(project, capsys, monkeypatch):
    """The command's table, each row run in this process (the slow test below runs them as the command does,
    each in its own): the demo's row ran with its real weights, at its shapes, and the table says why no
    time is projected."""
    from mmcse.cli import main

    def here(job, steps, timeout=None, check=None):
        return (check or pf.run_row)(job, steps) | {"status": "ran", "peak_bytes": 2**30, "peak_kind": "test"}

    monkeypatch.setattr(pf, "check_in_process", here)
    (project / "ablations/one-row.yaml").write_text(
        "description: the demo's MCSE\nreference: MCSE\nvariants:\n  MCSE: {train.method: mcse}\n")
    with pytest.raises(SystemExit) as stopped:
        main(["preflight", "--params", str(project / "params.yaml"), "--preset", "one-row", "--steps", "2",
              "--cache-items", "2"])
    text = capsys.readouterr().out
    assert stopped.value.code == 0
    assert re.search(r"\nMCSE +mcse +32x32 ran +1\.0 GiB +\d+\.\d\d +20 +\d+\.\d min\n", text), text
    assert re.search(r"total: about \d+\.\d min of training on this device", text)  # the demo's own sizes
    assert "projected from the sources' published sizes, not downloaded here: MCSE" in text
    assert re.search(r"MCSE: a resume point of 0\.\d GiB written and read back in \d+\.\d s", text)
    # the row's teacher caches: the demo's encoders on 2 synthetic items
    assert "teacher caches: the cache_teachers stage's encoders on 2 synthetic items" in text
    assert re.search(r"rows MCSE: ran, peak 1\.0 GiB, about \d+\.\d min to cache the data at its published size", text)
    # MCSE's terms read the image set alone: no text-teacher or joint set is built for it
    assert re.search(r"\n +image +colour-edge-grid +none +\d+\.\d{4} +\d+\.\d\d  images, retrieval_images\n", text)
    assert "packaged:all-MiniLM-L6-v2" not in text and "joint" not in text


@pytest.mark.slow  # two row processes
def test_the_command_on_the_demo_reports_each_row_and_a_crashing_one_fails_alone(project, capsys):
    """Each row in its own process: the demo's MCSE row runs with its real (packaged) weights, a row whose
    model is nowhere fails with the fix, and the command exits 1."""
    from mmcse.cli import main

    (project / "ablations/two-rows.yaml").write_text(
        "description: the demo's MCSE and a model nobody has\nreference: MCSE\nvariants:\n"
        "  MCSE: {train.method: mcse}\n  new: {train.method: mcse, model.name_or_path: someone/new-model}\n")
    with pytest.raises(SystemExit) as stopped:
        # no teacher-cache check (its own process per teacher set; the in-process test above and
        # test_preflight_cache.py check it): the rows' processes are what this test is about
        main(["preflight", "--params", str(project / "params.yaml"), "--preset", "two-rows", "--steps", "2", "--json",
              "--cache-items", "0"])
    assert stopped.value.code == 1
    rows = {r["row"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    ran, failed = rows["MCSE"], rows["new"]
    assert ran["status"] == "ran" and ran["weights"] == "real" and ran["peak_bytes"] > 2**20 and ran["step_seconds"] > 0
    assert (ran["batch_size"], ran["max_seq_len"]) == (32, 32)  # the demo row's own shapes
    # no data downloaded in this copy: projected from the demo world's own sizes (its parameters)
    assert ran["counts_from"] == "published sizes" and ran["training_steps"] > 0 and ran["projected_minutes"] > 0
    assert failed["status"] == "failed" and "not in mmcse's architecture table" in failed["error"]


@pytest.mark.slow
def test_a_paper_shaped_row_runs_end_to_end(project, capsys, nothing_downloaded):
    """DALR Table 1's SimCSE (wiki) row under dalr-flickr-bert: BERT-base at batch 64 × 32 tokens, random weights."""
    from mmcse.cli import main

    apply_profile(project / "params.yaml", "dalr-flickr-bert")
    (project / "ablations/one-row.yaml").write_text(  # DALR Table 1's first row, as ablations/dalr-table1.yaml
        "description: DALR Table 1's first row alone\nreference: SimCSE (wiki)\nvariants:\n"
        "  SimCSE (wiki): {train.method: simcse, data.pairs: none}\n")
    with pytest.raises(SystemExit) as stopped:
        # 2 synthetic items for its teachers' cache check (its real-architecture paths: test_preflight_cache.py)
        main(["preflight", "--params", str(project / "params.yaml"), "--preset", "one-row", "--steps", "2",
              "--cache-items", "2"])
    text = capsys.readouterr().out
    assert stopped.value.code == 0
    assert "SimCSE (wiki)" in text and " ran " in text
    assert "random weights: wiring, memory and time only (bert-base-uncased)" in text
    # BERT-base's resume point: 110M fp32 weights and two AdamW moments, about 1.2 GiB
    assert re.search(r"SimCSE \(wiki\): a resume point of 1\.[23] GiB written and read back", text)
    # nothing downloaded: its steps come from Wiki1M's published 1,000,000 sentences, 3 epochs at batch 64
    assert re.search(r"\nSimCSE \(wiki\) +simcse +64x32 +ran .* 46875 ", text), text
    assert "projected from the sources' published sizes, not downloaded here: SimCSE (wiki)" in text
    assert "teacher caches" not in text  # SimCSE's terms read no teacher feature: no set is built for it


def _killed_child(config, steps, conn, **_) -> None:
    import os
    import signal

    os.kill(os.getpid(), signal.SIGKILL)


def _hanging_child(config, steps, conn, scratch=None, **_) -> None:
    import pathlib
    import time

    (pathlib.Path(scratch) / "half-built-cache").mkdir()  # what a row leaves when it is stopped mid-way
    time.sleep(600)


def test_a_row_past_its_timeout_is_named_timed_out_and_leaves_no_temporary_folder(project, monkeypatch, tmp_path):
    import tempfile

    monkeypatch.setattr(pf, "_child", _hanging_child)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # where the row's scratch folder is made
    out = pf.check_in_process(load_config(project / "params.yaml"), steps=2, timeout=3)
    assert out["status"] == "failed" and out["timed_out"] and not out["out_of_memory"]
    assert out["error"] == "timed out: no result after --timeout 3 s (the row was stopped)"
    assert list(scratch.iterdir()) == []  # the killed row's temporary files are gone with it


@pytest.mark.parametrize(("args", "message"), [
    ({"steps": 0}, "--steps 0: at least 2"), ({"steps": 1}, "--steps 1: at least 2"),
    ({"timeout": 1}, "--timeout 1: at least 30 s"), ({"timeout": 0}, "--timeout 0: at least 30 s"),
])
def test_bad_arguments_are_refused_before_any_row_runs(project, monkeypatch, args, message):
    monkeypatch.setattr(pf, "preflight_row", lambda *a, **k: pytest.fail("a row ran"))
    with pytest.raises(ValueError, match=message):
        pf.preflight(project / "params.yaml", **args)


def test_when_no_row_ran_the_total_says_so():
    rows = [{"row": "A", "method": "mcse", "batch_size": 8, "max_seq_len": 32, "status": "failed", "error": "boom",
             "projected_minutes": None, "training_steps": 100, "counts_from": "downloaded"}]
    text = pf.preflight_text({"profile": "demo", "preset": "p", "device": "CPU", "steps": 2, "rows": rows,
                              "total_minutes": None})
    assert "total: no projection: no row ran (their errors are below)" in text and "A: boom" in text


def test_an_unknown_or_outside_preset_is_refused_before_torch_is_imported(project):
    (project.parent / "evil.yaml").write_text("variants: {a: {}}\n")
    probe = ("import sys\nfrom mmcse.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n"
             "    print('exit', e.code, 'torch' in sys.modules)\n")
    for name in ("no-such", "../evil"):
        run = subprocess.run([sys.executable, "-c", probe, "preflight", "--params", str(project / "params.yaml"),
                              "--preset", name], capture_output=True, text=True, cwd=project)
        assert "exit 2 False" in run.stdout, run.stdout + run.stderr
        assert f"--preset {name!r}: no preset file" in run.stderr and "presets: baselines" in run.stderr
