import math

import numpy as np
import pytest
from scipy import stats

from mmcse.analysis.tables import aggregate, table_markdown
from mmcse.config import parse_config, with_overrides
from mmcse.experiments.jobs import expand, job_config, job_hash
from tests.conftest import REPO


def _cfg():
    return parse_config({"ablate": {"variants": {"full": {}, "w/o image": {"loss.lambda_img": 0.0},
                                                 "broken": {"train.method": "simcse"}},
                                    "reference": "full", "seeds": [1, 2, 3]}})


def _ok(variant, seed, avg, sts):
    return {"variant": variant, "seed": seed, "status": "ok", "scores": {"avg": avg, "STS12": sts}}


def test_expand_variants_times_seeds_in_order():
    jobs = expand(_cfg())
    assert [(j.variant, j.seed) for j in jobs][:4] == [("full", 1), ("full", 2), ("full", 3), ("w/o image", 1)]
    assert jobs[3].overrides == {"loss.lambda_img": 0.0, "base.seed": 1}


def test_job_hash_ignores_bookkeeping_but_not_what_the_result_holds():
    cfg = _cfg()
    job = job_config(cfg, expand(cfg)[0])
    same = [with_overrides(job, {"ablate.retries": 3}), with_overrides(job, {"sweep.n_trials": 2}),
            with_overrides(job, {"ablate.transfer": False})]
    assert {job_hash(c) for c in same} == {job_hash(job)}
    different = [with_overrides(job, {"ablate.transfer": True}), with_overrides(job, {"loss.lambda_img": 0.5}),
                 with_overrides(job, {"base.seed": 9})]
    assert len({job_hash(c) for c in different} | {job_hash(job)}) == 4


def test_a_jobs_identity_is_what_its_method_reads():
    """issue 39: a SimCSE job is not retrained when a parameter SimCSE never reads changes (the image
    term's λ, the teachers, the regions, DUET's model), and is when one it reads does; an MCSE job
    reads λ and its teachers; a retrieval job its own loss and model sections only."""
    simcse = with_overrides(_cfg(), {"train.method": "simcse"})
    ignored = [{"loss.lambda_img": 0.5}, {"loss.temperature_img": 0.2}, {"loss.kdmcse.margin": 0.3},
               {"teachers.image_encoder": "resnet50"}, {"regions.max_regions": 20}, {"model.duet.joint_dim": 512},
               {"detect.min_objects": 3}, {"loss.duet.margin": 0.3}]
    assert {job_hash(with_overrides(simcse, o)) for o in ignored} == {job_hash(simcse)}
    read = [{"loss.temperature": 0.1}, {"loss.simcse.mlm": True}, {"train.learning_rate": 1e-4},
            {"data.captions": "longest"}]
    assert len({job_hash(with_overrides(simcse, o)) for o in read} | {job_hash(simcse)}) == 5
    mcse = with_overrides(_cfg(), {"train.method": "mcse"})
    assert job_hash(with_overrides(mcse, {"loss.lambda_img": 0.5})) != job_hash(mcse)
    assert job_hash(with_overrides(mcse, {"teachers.image_encoder": "resnet50"})) != job_hash(mcse)
    assert job_hash(with_overrides(mcse, {"loss.kdmcse.margin": 0.3})) == job_hash(mcse)
    vsepp = with_overrides(_cfg(), {"train.method": "vsepp"})
    assert job_hash(with_overrides(vsepp, {"loss.vsepp.margin": 0.3})) != job_hash(vsepp)
    assert job_hash(with_overrides(vsepp, {"regions.max_regions": 20})) != job_hash(vsepp)
    for other in ({"loss.lambda_img": 0.5}, {"model.duet.joint_dim": 512}, {"loss.vsrn.caption_weight": 0.5}):
        assert job_hash(with_overrides(vsepp, other)) == job_hash(vsepp)
    # regions from the objects are encoded with the image encoder: then the teachers count
    assert job_hash(with_overrides(vsepp, {"teachers.image_encoder": "resnet50"})) != job_hash(vsepp)
    grid = with_overrides(vsepp, {"regions.source": "grid", "regions.max_regions": 49})
    assert job_hash(with_overrides(grid, {"teachers.image_encoder": "resnet50"})) == job_hash(grid)
    # KDMCSE with DALR's CML term (DALR Table 4's rows) reads DALR's parameters; plain KDMCSE does not
    kdmcse = with_overrides(_cfg(), {"train.method": "kdmcse"})
    assert job_hash(with_overrides(kdmcse, {"loss.dalr.lambda_cml": 0.3})) == job_hash(kdmcse)
    cml = with_overrides(kdmcse, {"loss.dalr.cml": True})
    assert job_hash(with_overrides(cml, {"loss.dalr.lambda_cml": 0.3})) != job_hash(cml)


def test_plan_lists_only_what_a_rows_method_reads(tmp_path):
    from mmcse.experiments.plan import plan, plan_text

    params = tmp_path / "params.yaml"
    params.write_text((REPO / "params.yaml").read_text())
    for folder in ("recipes", "profiles", "ablations"):
        (tmp_path / folder).symlink_to(REPO / folder)
    result = plan(params, "baselines")
    # issue 56.6: every seed a row runs (its config is the first seed's)
    assert all(row["seeds"] == result["seeds"] and len(result["seeds"]) > 1 for row in result["rows"])
    assert all(row["config"]["base"]["seed"] == result["seeds"][0] for row in result["rows"])
    text = plan_text(result, {"loss": {"lambda_img": 0.0}})  # defaults that differ: each row would print it
    rows = {row["variant"]: row for row in result["rows"]}
    assert "lambda_img" not in rows["SimCSE"]["reads"]["loss"] and "teachers" not in rows["SimCSE"]["reads"]
    assert "lambda_img" in rows["MCSE"]["reads"]["loss"]
    simcse_block = text.split("\nSimCSE: ")[1].split("\n\n")[0]
    mcse_block = text.split("\nMCSE: ")[1].split("\n\n")[0]
    assert "loss.lambda_img" not in simcse_block and "loss.lambda_img" in mcse_block
    # issue 67.7: the header says what `recipe` means beside the rows' "reading: as printed"
    assert f"reading: each row's recipe's (ablate.reading: {result['reading']})" in text.splitlines()[0]


def test_aggregate_mean_std_paired_ttest_and_failed_rows():
    full = [70.0, 71.0, 73.0]
    without = [65.0, 66.5, 66.0]
    results = [_ok("full", s, v, v - 1) for s, v in zip([1, 2, 3], full, strict=True)]
    results += [_ok("w/o image", s, v, v - 1) for s, v in zip([1, 2, 3], without, strict=True)]
    results += [{"variant": "broken", "seed": s, "status": "failed", "error": "boom"} for s in (1, 2, 3)]
    rows = {r["variant"]: r for r in aggregate(_cfg(), results)}
    assert list(rows) == ["full", "w/o image", "broken"]
    assert rows["full"]["avg_mean"] == pytest.approx(np.mean(full))
    assert rows["full"]["avg_std"] == pytest.approx(np.std(full, ddof=1))
    assert rows["w/o image"]["p_value"] == pytest.approx(stats.ttest_rel(without, full).pvalue)
    assert rows["w/o image"]["STS12_p"] == rows["w/o image"]["avg_p"] == rows["w/o image"]["p_value"]
    assert rows["w/o image"]["paired_seeds"] == 3 and rows["w/o image"]["note"] == ""
    assert math.isnan(rows["full"]["p_value"]) and rows["full"]["note"] == "reference"
    assert rows["broken"]["status"] == "failed" and rows["broken"]["seeds"] == 0 and rows["broken"]["error"] == "boom"
    assert rows["broken"]["note"].startswith("n<2") and math.isnan(rows["broken"]["avg_p"])
    md = table_markdown(list(rows.values()), "avg", "full")
    assert "| broken | — | — | n<2 | 0 | failed |" in md
    assert md.splitlines()[0] == "| variant | STS12 | STS avg | p vs full (STS avg) | seeds | status |"
    assert f"| full | {np.mean(full) - 1:.2f} ± {np.std(full, ddof=1):.2f} |" in md
    # one seed: its value, no "± 0.00" that reads as a measured spread
    one = {r["variant"]: r for r in aggregate(_cfg(), [r for r in results if r["seed"] == 1])}
    md = table_markdown(list(one.values()), "avg", "full")
    assert "| full | 69.00 | 70.00 | reference | 1 | ok |" in md and "a row of one seed: its value" in md


PRESET_ROWS = {
    "baselines": ["SimCSE", "MCSE", "KDMCSE", "DALR", "MCSEO"],
    "dalr-table3": ["DALR", "w/o L_info", "w/o L_CML", "w/o L_cons", "w/o L_CMA", "w/o L_IML", "w/o L_rank",
                    "w/o L_IMA", "w/o L_IML & L_CML"],
    "kdmcse-table3": ["KDMCSE", "w/o AdapACSE", "w/o threshold filtering"],
    "mcseo-table1": ["untrained", "SimCSE", "MCSE", "MCSEO"],
    "kdmcse-table1": ["SimCSE (wiki)", "SimCSE", "MCSE", "KDMCSE"],
    "kdmcse-table2": ["MCSE", "KDMCSE"],
    "dalr-table1": ["SimCSE (wiki)", "SimCSE", "MCSE", "KDMCSE", "DALR"],
    "dalr-table2": ["SimCSE (wiki)", "MCSE", "KDMCSE", "DALR"],
    "dalr-table4": ["MCSE", "KDMCSE", "KDMCSE + CML", "DALR"],
    "dalr-table5": ["SimCSE (wiki)", "MCSE", "KDMCSE", "KDMCSE + IML", "DALR"],
    "dalr-table6": ["MCSE", "KDMCSE", "DALR"],
    "dalr-table7": ["KDMCSE", "DALR"],
    "dalr-fig4": ["SimCSE", "MCSE", "KDMCSE", "DALR"],
    "dalr-fig3": ["DALR", "w/o L_info", "w/o L_CML", "w/o L_IML"],
    "dalr-table8": ["DALR", "w/o L_info", "w/o L_CML", "w/o L_cons", "w/o L_CMA", "w/o L_IML", "w/o L_rank",
                    "w/o L_IMA", "w/o L_IML & L_CML"],
    "kdmcse-fig7": [f"m={round(0.025 * i, 3)}" for i in range(1, 10)],
    "dalr-table9": [f"{image} + {text}" for image in ("CLIP", "ResNet")
                    for text in ("SimCSE", "DiffCSE", "CLIP", "SimCSE+DiffCSE", "SimCSE+RankCSE")],
    "dalr-table10": ["KDMCSE", "DALR"],
    "kdmcse-table4": ["MCSE", "KDMCSE"],
    "kdmcse-table5": ["MCSE + CLIP text", "KDMCSE"],
    "kdmcse-fig5": ["CLIP teacher (KDMCSE recipe, untrained encoder)"],
    "kdmcse-fig6": ["CLIP teacher (KDMCSE recipe, untrained encoder)"],
    **{f"kdmcse-fig{n}": ["KDMCSE", "MCSE"] for n in range(8, 13)},
}
DALR_TERMS = {"info", "consistency", "cma", "rank", "ima"}
DALR_REMOVED = {"DALR": set(), "w/o L_info": {"info"}, "w/o L_CML": {"consistency", "cma"},
                "w/o L_cons": {"consistency"}, "w/o L_CMA": {"cma"}, "w/o L_IML": {"rank", "ima"},
                "w/o L_rank": {"rank"}, "w/o L_IMA": {"ima"},
                "w/o L_IML & L_CML": {"consistency", "cma", "rank", "ima"}}


@pytest.mark.parametrize("preset", sorted(PRESET_ROWS))
def test_every_preset_loads_in_the_papers_row_order(preset):
    from mmcse.experiments.params import load_config
    from mmcse.methods.objectives import Objective, active_terms

    cfg = load_config(REPO / "params.yaml", {"ablate.preset": preset})
    assert list(cfg.ablate.variants) == PRESET_ROWS[preset]
    reference = {"kdmcse-fig7": "m=0.125", "dalr-table9": "CLIP + SimCSE+DiffCSE", "baselines": "MCSE",
                 "mcseo-table1": "MCSE", "kdmcse-table1": "MCSE", "kdmcse-table2": "MCSE"}
    assert cfg.ablate.title and cfg.ablate.reference == reference.get(
        preset, "DALR" if preset.startswith("dalr") else PRESET_ROWS[preset][0])
    jobs = expand(cfg)
    once = {"untrained"} if preset == "mcseo-table1" else set()  # no seed changes the untrained encoder: one run
    assert len(jobs) == (len(PRESET_ROWS[preset]) - len(once)) * len(cfg.ablate.seeds) + len(once)
    assert all([j.seed for j in jobs if j.variant == row] == cfg.ablate.seeds[:1] for row in once)
    terms = {j.variant: active_terms(Objective.of(job_config(cfg, j))) for j in jobs}
    if preset == "baselines":  # one method per row, five seeds, compared against MCSE
        assert cfg.ablate.seeds == [1, 2, 3, 4, 5] and cfg.ablate.reference == "MCSE"
        methods = {j.variant: job_config(cfg, j).train.method for j in jobs}
        assert methods == {"SimCSE": "simcse", "MCSE": "mcse", "KDMCSE": "kdmcse", "DALR": "dalr", "MCSEO": "mcseo"}
    # DALR's TR (Avg.) and Table 2: the jobs probe transfer tasks
    assert cfg.ablate.transfer == (preset in ("dalr-table2", "dalr-table3", "dalr-table8"))
    if preset in ("dalr-table1", "dalr-table2", "dalr-table5", "kdmcse-table1"):  # the wiki row: no pairs
        wiki = next(job_config(cfg, j) for j in jobs if j.variant == "SimCSE (wiki)")
        assert (wiki.data.pairs, wiki.train.method) == ("none", "simcse")
        assert all(job_config(cfg, j).data.pairs == cfg.data.pairs for j in jobs if j.variant != "SimCSE (wiki)")
    if preset in ("kdmcse-table1", "kdmcse-table2", "baselines"):
        assert cfg.ablate.test == "independent"
    if preset == "dalr-table8":  # Table 3's rows (rows_of), its own title
        table3 = load_config(REPO / "params.yaml", {"ablate.preset": "dalr-table3"}).ablate
        assert cfg.ablate.variants == table3.variants and cfg.ablate.title != table3.title
    if preset == "dalr-table5":
        assert {tuple(job_config(cfg, j).evaluate.mteb) for j in jobs} == {("Reranking", "Classification",
                                                                            "Retrieval", "STS")}
    if preset == "dalr-table3":
        assert all(job_config(cfg, j).ablate.transfer for j in jobs)
        for name, removed in DALR_REMOVED.items():
            assert {t for t in DALR_TERMS if terms[name][t]} == DALR_TERMS - removed, name
    if preset == "kdmcse-table3":
        kd = {j.variant: job_config(cfg, j).loss.kdmcse for j in jobs}
        assert kd["w/o AdapACSE"].margin == 0 and kd["w/o AdapACSE"].threshold_value == 0.9
        assert kd["w/o threshold filtering"].threshold_value is None and kd["w/o threshold filtering"].margin == 0.125
    if preset == "mcseo-table1":
        assert terms["MCSEO"]["object"] and not terms["MCSE"]["object"]
        assert {job_config(cfg, j).loss.lambda_img for j in jobs} == {0.01}
    if preset in ("dalr-table9", "kdmcse-table5"):  # teacher comparisons: only the teachers' key moves
        from mmcse.integrity.keys import artifact_keys

        keys = [artifact_keys(job_config(cfg, j), cfg.base.seed) for j in jobs[::len(cfg.ablate.seeds)]]
        assert {(k["data"], k["objects"]) for k in keys} == {tuple(artifact_keys(cfg).values())[:2]}
        assert len({k["teachers"] for k in keys}) == (10 if preset == "dalr-table9" else 1)
    if preset == "dalr-table9":  # the "CLIP" text teacher is the joint teacher's text side
        texts = {j.variant: [t.teacher for t in job_config(cfg, j).teachers.text] for j in jobs}
        assert texts["CLIP + CLIP"] == texts["ResNet + CLIP"] == ["joint"]
    if preset == "kdmcse-table5":  # MCSE with a CLIP-text term beside its image term, against KDMCSE
        assert terms["MCSE + CLIP text"]["image"] and terms["MCSE + CLIP text"]["clip_text"]
        assert not terms["MCSE + CLIP text"]["kdmcse"] and terms["KDMCSE"]["kdmcse"]
        assert not terms["KDMCSE"]["clip_text"]
    if preset.startswith("kdmcse-fig") and preset != "kdmcse-fig7":  # pictures of one model per row
        assert cfg.ablate.seeds == [1] and cfg.ablate.figures
        if cfg.ablate.figures == ["dropout_tsne"]:
            assert len(cfg.ablate.sentences) == 3
        else:  # the teacher's statistics: nothing trains
            assert [job_config(cfg, j).train.epochs for j in jobs] == [0]
    if preset == "kdmcse-fig7":
        assert cfg.ablate.plot_x == "loss.kdmcse.margin"
        assert [job_config(cfg, j).loss.kdmcse.margin for j in jobs[::len(cfg.ablate.seeds)]] == pytest.approx(
            [0.025 * i for i in range(1, 10)])


def test_unknown_preset_lists_the_available_ones():
    from mmcse.config import ConfigError
    from mmcse.experiments.params import load_config

    presets = ("baselines, dalr-fig3, dalr-fig4, dalr-table1, dalr-table10, dalr-table2, dalr-table3, dalr-table4, "
               "dalr-table5, dalr-table6, dalr-table7, dalr-table8, dalr-table9, duet-table1, duet-table2, "
               "kdmcse-fig10, kdmcse-fig11, kdmcse-fig12, kdmcse-fig5, kdmcse-fig6, kdmcse-fig7, kdmcse-fig8, "
               "kdmcse-fig9, kdmcse-table1, kdmcse-table2, kdmcse-table3, kdmcse-table4, kdmcse-table5, mcseo-table1")
    with pytest.raises(ConfigError, match=f"ablate.preset.*{presets}"):
        load_config(REPO / "params.yaml", {"ablate.preset": "dalr-table99"})


def test_rows_of_takes_the_other_presets_keys_and_refuses_a_cycle(tmp_path):
    from mmcse.config import ConfigError
    from mmcse.experiments.params import load_config

    (tmp_path / "ablations").mkdir()
    (tmp_path / "ablations/a.yaml").write_text("reference: y\nmetric: alignment\nvariants:\n  x: {}\n  y: {}\n")
    (tmp_path / "ablations/b.yaml").write_text("description: b on other data\nrows_of: a\n")
    (tmp_path / "ablations/c.yaml").write_text("rows_of: d\n")
    (tmp_path / "ablations/d.yaml").write_text("rows_of: c\n")
    (tmp_path / "params.yaml").write_text((REPO / "params.yaml").read_text())
    cfg = load_config(tmp_path / "params.yaml", {"ablate.preset": "b"}).ablate
    assert (list(cfg.variants), cfg.reference, cfg.metric) == (["x", "y"], "y", "alignment")
    assert cfg.title == "b on other data"
    with pytest.raises(ConfigError, match=r"rows_of 'c' makes a cycle \(c -> d -> c\)"):
        load_config(tmp_path / "params.yaml", {"ablate.preset": "c"})
    (tmp_path / "ablations/b.yaml").write_text("rows_of: e\n")
    with pytest.raises(ConfigError, match="b.yaml: rows_of.*no preset file .*e.yaml"):
        load_config(tmp_path / "params.yaml", {"ablate.preset": "b"})


def test_preset_variant_with_a_bad_key_fails_at_load(tmp_path):
    from mmcse.config import ConfigError
    from mmcse.experiments.params import load_config

    (tmp_path / "ablations").mkdir()
    (tmp_path / "ablations/p.yaml").write_text("variants:\n  a: {}\n  b: {loss.dalr.lamda: 1}\n")
    (tmp_path / "params.yaml").write_text("ablate:\n  preset: p\n")
    with pytest.raises(ConfigError, match="lamda"):
        load_config(tmp_path / "params.yaml")


def test_run_job_refuses_a_worker_whose_params_differ(tmp_path):
    from mmcse.experiments.ablate import run_job

    cfg = _cfg()
    job = expand(cfg)[0]
    with pytest.raises(ValueError, match=r"'full' seed 1 .* worker's checkout differs"):
        run_job(cfg, job, tmp_path, expected_hash="0" * 64)
    assert not (tmp_path / "full").exists()  # refused before training


def test_record_result_keeps_a_finished_result_from_another_worker(tmp_path):
    from mmcse.experiments.ablate import finished_result, record_result

    cfg = _cfg()
    job = expand(cfg)[1]
    h = job_hash(job_config(cfg, job))
    record_result(tmp_path, job, {"variant": "full", "seed": 2, "status": "failed", "error": "x"})
    assert not job.folder(tmp_path).exists()  # failed results are not kept: a rerun tries again
    ok = _ok("full", 2, 70.0, 69.0) | {"config_hash": h, "device": "cuda:0 X", "skipped": True}
    record_result(tmp_path, job, ok)
    assert finished_result(job.folder(tmp_path), h) == {k: v for k, v in ok.items() if k != "skipped"}


def test_tagged_runs_record_the_device_and_cuda_visible_devices(tmp_path, monkeypatch):
    import mlflow

    from mmcse import tracking
    from mmcse.models.device import describe_device, device_tags, resolve_device

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    cfg = parse_config({"base": {"device": "auto"}})
    where = device_tags("auto")
    assert where["device"] == describe_device(resolve_device("auto"))
    assert where["device"] == "cpu" or where["device"].startswith("cuda:")
    assert where["cuda_visible_devices"] == "3"
    with tracking.tagged(where), tracking.tagged({"prefect.worker": "gpu-3"}):
        with tracking.run(cfg, "ablate", run_name="parent") as parent:
            with tracking.run(cfg, "ablate", run_name="job", parent_run_id=parent.info.run_id,
                              tags={"device": "overridden"}) as job:
                pass
    with tracking.run(cfg, "ablate", run_name="untagged") as plain:
        pass
    with tracking.tagged({"cuda_visible_devices": "5"}), tracking.run(cfg, "ablate", run_id=plain.info.run_id):
        pass  # a resumed run keeps the tags it was started with
    client = mlflow.MlflowClient()
    tags = {r.info.run_id: client.get_run(r.info.run_id).data.tags for r in (parent, job, plain)}
    assert tags[parent.info.run_id]["cuda_visible_devices"] == "3"
    assert tags[parent.info.run_id]["prefect.worker"] == "gpu-3"
    assert tags[job.info.run_id]["device"] == "overridden" and tags[job.info.run_id]["cuda_visible_devices"] == "3"
    assert "cuda_visible_devices" not in tags[plain.info.run_id]


@pytest.mark.slow  # end to end: the full suite runs it (fast tier under 5 min)
def test_a_job_recorded_under_older_score_names_is_evaluated_again_not_retrained(project, monkeypatch):
    """result.json from before one-name-per-number (``DemoSTS`` beside ``avg``, ``demo_i2t_R@1``):
    the rerun evaluates the job's best checkpoint again and rewrites the result under today's names,
    with the same numbers, and trains nothing; a current result is reused as it is."""
    import json

    import mmcse.pipeline.train
    from mmcse.experiments.ablate import SCORE_NAMES, run_job
    from mmcse.experiments.jobs import Job
    from mmcse.experiments.params import load_config

    cfg = with_overrides(load_config("params.yaml"), {"train.max_steps": 2, "train.eval_steps": 2})
    job = Job("mcse", 1, {"base.seed": 1})
    first = run_job(cfg, job, project / "ablation")
    assert first["score_names"] == SCORE_NAMES and "DemoSTS" not in first["scores"]
    path = project / "ablation/mcse/seed1/result.json"
    old = json.loads(path.read_text())
    old.pop("score_names")
    old["scores"] = {**{k.replace("_R", "_R@"): v for k, v in old["scores"].items()}, "DemoSTS": old["scores"]["avg"]}
    path.write_text(json.dumps(old))

    def no_training(*args, **kwargs):
        raise AssertionError("a finished job was trained again")

    monkeypatch.setattr(mmcse.pipeline.train, "run_train", no_training)
    monkeypatch.setattr("mmcse.experiments.ablate.run_train", no_training)  # where a job calls it
    again = run_job(cfg, job, project / "ablation")
    assert again["skipped"] and again["score_names"] == SCORE_NAMES
    assert again["scores"] == pytest.approx(first["scores"], abs=1e-6)  # today's names, the same numbers
    assert json.loads(path.read_text())["scores"] == pytest.approx(first["scores"], abs=1e-6)
    calls = []
    monkeypatch.setattr("mmcse.experiments.ablate._evaluate", lambda *a, **k: calls.append(a) or {})
    assert run_job(cfg, job, project / "ablation")["scores"] == again["scores"] and not calls  # reused as is


@pytest.mark.slow  # end to end: the full suite runs it (fast tier under 5 min)
def test_a_finished_job_is_rescored_after_an_evaluation_edit_and_retrained_after_a_training_edit(project,
                                                                                                   monkeypatch):
    """Code edited since a job finished: evaluation code (a metric) → its checkpoint is scored again, not
    trained; training code (a loss) → the job is trained again from step 0 under a new hash."""
    import json

    import mmcse.experiments.ablate as ablate
    import mmcse.experiments.jobs as jobs
    import mmcse.training.checkpoints as checkpoints
    from mmcse.experiments.params import load_config
    from mmcse.integrity.code import EVALUATION_CODE, TRAINING_CODE, code_files

    def edited(roots_edited, name):
        return lambda roots: {**code_files(roots), **({name: "0" * 64} if roots == roots_edited else {})}

    cfg = with_overrides(load_config("params.yaml"), {"train.max_steps": 2, "train.eval_steps": 2})
    job = jobs.Job("mcse", 1, {"base.seed": 1})
    first = ablate.run_job(cfg, job, project / "ablation")
    trained = []
    real_train = ablate.run_train
    monkeypatch.setattr(ablate, "run_train", lambda *a, **k: trained.append(1) or real_train(*a, **k))

    monkeypatch.setattr(ablate, "code_files", edited(EVALUATION_CODE, "mmcse/evaluation/sts.py"))
    again = ablate.run_job(cfg, job, project / "ablation")
    assert again["skipped"] and not trained and again["evaluation_code"] != first["evaluation_code"]
    assert again["scores"] == pytest.approx(first["scores"], abs=1e-6)
    assert ablate.run_job(cfg, job, project / "ablation")["skipped"] and not trained  # rescored once

    for module in (jobs, checkpoints):  # the job's hash and its checkpoint's seal
        monkeypatch.setattr(module, "code_files", edited(TRAINING_CODE, "mmcse/methods/terms/mcse.py"))
    retrained = ablate.run_job(cfg, job, project / "ablation")
    assert not retrained.get("skipped") and trained == [1]
    assert retrained["config_hash"] == job_hash(job_config(cfg, job), cfg.base.seed) != first["config_hash"]
    sealed = json.loads((project / "ablation/mcse/seed1/best/checkpoint.json").read_text())
    assert sealed["code_files"]["mmcse/methods/terms/mcse.py"] == "0" * 64  # trained by the edited code


def test_the_ablation_folder_holds_this_tables_jobs_alone(tmp_path):
    """Issue 67: job folders of earlier tables left in the output made a workspace's dvc.lock depend on its
    history. A finished one goes (kept by hash in the store first), an unfinished one stays for its resume point."""
    from mmcse.experiments.ablate import finished_result, prune_other_tables
    from mmcse.io import write_json

    root, store = tmp_path / "ablation", tmp_path / "jobs"
    jobs = expand(_cfg())

    def finished(folder, config_hash):
        write_json(folder / "result.json", {"status": "ok", "config_hash": config_hash, "scores": {"avg": 1.0}})
        (folder / "best").mkdir()
        (folder / "best/model.safetensors").write_bytes(b"w" + config_hash.encode())

    for folder, config_hash in ((jobs[0].folder(root), "a"), (root / "full/seed4", "b"), (root / "old/seed1", "c")):
        folder.mkdir(parents=True)
        finished(folder, config_hash)
    (store / "c").mkdir(parents=True)
    finished(store / "c", "c")  # kept before: not rewritten
    (root / "old-unfinished/seed2/last").mkdir(parents=True)
    (root / "ablation.csv").write_text("variant\n")

    lines = prune_other_tables(root, jobs, store)

    assert sorted(p.relative_to(root).as_posix() for p in root.glob("*/*")) == [
        "full/seed1", "old-unfinished/seed2"]
    assert (root / "ablation.csv").is_file()
    assert len(lines) == 1 and lines[0].startswith(f"{root / 'old-unfinished/seed2'}: a job of another table")
    assert finished_result(store / "b", "b")["scores"] == {"avg": 1.0}  # its table, run again, restores it
    assert (store / "b/best/model.safetensors").read_bytes() == b"wb"
    assert finished_result(jobs[0].folder(root), "a") is not None
    assert prune_other_tables(root, jobs, store) == lines  # nothing else to do


def test_a_finished_job_survives_its_folder_being_restored_to_an_older_output(project, monkeypatch):
    """Issue 33.8: `dvc exp run` restores the ablation/ output of its commit, which drops the jobs an
    interrupted run finished; they are kept by configuration hash under data/jobs and put back, not
    trained again."""
    import shutil

    import mmcse.pipeline.train
    from mmcse.experiments.ablate import run_job
    from mmcse.experiments.jobs import Job, job_hash
    from mmcse.experiments.params import load_config

    cfg = with_overrides(load_config("params.yaml"), {"train.max_steps": 2, "train.eval_steps": 2})
    job = Job("mcse", 1, {"base.seed": 1})
    first = run_job(cfg, job, project / "ablation")
    kept = project / "data/jobs" / job_hash(job_config(cfg, job), cfg.base.seed)
    assert (kept / "result.json").is_file() and (kept / "best/model.safetensors").is_file()
    # hard links: the kept best checkpoint takes no second copy of the weights
    assert (kept / "best/model.safetensors").stat().st_ino == \
        (project / "ablation/mcse/seed1/best/model.safetensors").stat().st_ino
    shutil.rmtree(project / "ablation")  # what checking out the committed ablation/ does to a new job

    def no_training(*args, **kwargs):
        raise AssertionError("a finished job was trained again")

    monkeypatch.setattr(mmcse.pipeline.train, "run_train", no_training)
    monkeypatch.setattr("mmcse.experiments.ablate.run_train", no_training)  # where a job calls it
    again = run_job(cfg, job, project / "ablation")
    assert again["skipped"] and again["scores"] == first["scores"]
    assert (project / "ablation/mcse/seed1/best/checkpoint.json").is_file()


def test_the_first_line_counts_only_the_jobs_it_will_train(monkeypatch, tmp_path):
    """Issue 53: jobs finished before with the same configuration and code are reused, and the line says so."""
    from mmcse.experiments import ablate

    monkeypatch.chdir(tmp_path)
    cfg = with_overrides(_cfg(), {"ablate.seeds": [1, 2]})
    jobs = expand(cfg)
    by_folder = {job.folder(tmp_path).parts[-2:]: job for job in jobs}  # (row, seed) -> job
    finished = {jobs[0].folder(tmp_path).parts[-2:], jobs[1].folder(tmp_path).parts[-2:]}
    looked_up = []

    def finished_result(folder, config_hash, store=None):
        job = by_folder[folder.parts[-2:]]
        looked_up.append(config_hash == job_hash(job_config(cfg, job), cfg.base.seed))
        return {"status": "ok"} if folder.parts[-2:] in finished else None

    class Estimated:
        def __init__(self, n):
            self.n = n

        def line(self):
            return f"{self.n} job(s) to train"

    monkeypatch.setattr(ablate, "finished_result", finished_result)
    monkeypatch.setattr(ablate, "estimate", lambda params, todo: Estimated(len(todo)))
    n = len(jobs)
    assert ablate.start_line(cfg) == f"{n} job(s): 2 finished before, reused; the rest: {n - 2} job(s) to train"
    assert looked_up and all(looked_up)  # each job looked up by its own configuration's hash
    finished |= set(by_folder)
    assert ablate.start_line(cfg) == f"{n} job(s): all {n} finished before, reused; nothing to train"
    finished.clear()
    assert ablate.start_line(cfg) == f"{n} job(s) to train"


def test_a_row_no_seed_changes_runs_once():
    """The untrained pretrained encoder pooled without a fresh head is the same under every seed (MCSEO Table 1's
    first row): one job; with a fresh head (pooler cls), random weights or a training step it is not."""
    from mmcse.config import Config, with_overrides
    from mmcse.experiments.jobs import seed_free

    untrained = with_overrides(Config(), {"train.method": "simcse", "train.epochs": 0,
                                          "evaluate.pooler": "avg_embeddings_last"}, where="test")
    assert seed_free(untrained)
    for change in ({"evaluate.pooler": "cls"}, {"model.init": "random"}, {"train.epochs": 1},
                   {"train.method": "mcse"}):
        assert not seed_free(with_overrides(untrained, change, where="test")), change


def test_a_parent_runs_params_are_the_tables_not_one_rows():
    """Issue 67.5: a key the rows set differently (or leave at params.yaml's value) and the seed read "table:
    <preset>" in the ablation's parent run; a key every row sets alike has that value."""
    from mmcse.experiments.jobs import Job, table_params

    cfg = _cfg()
    jobs = [Job("a", 1, {"train.method": "kdmcse", "loss.lambda_img": 0.5}),
            Job("b", 2, {"train.method": "kdmcse", "loss.lambda_img": 0.25}),
            Job("c", 1, {"train.method": "kdmcse"})]  # leaves lambda_img at params.yaml's value
    assert cfg.loss.lambda_img not in (0.5, 0.25) and cfg.train.method != "kdmcse"
    assert table_params(cfg, jobs) == {"base.seed": "table: variants", "loss.lambda_img": "table: variants",
                                       "train.method": "kdmcse"}
    assert table_params(cfg, jobs[:1])["loss.lambda_img"] == "0.5"
