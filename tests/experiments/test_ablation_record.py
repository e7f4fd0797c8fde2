"""`ablate.figures`: a paper figure drawn from every row's job into the ablation's parent run."""

import pytest

from mmcse import tracking
from mmcse.config import ConfigError, load_config, with_overrides
from mmcse.experiments.ablation_record import first_jobs, log_ablation_figures
from tests.conftest import REPO


def test_the_first_finished_seed_of_each_row_draws_the_figure(tmp_path, monkeypatch):
    import mlflow

    monkeypatch.chdir(tmp_path)
    cfg = with_overrides(load_config(REPO / "params.yaml"), {"ablate.figures": ["sts_scatter"]})
    tracking.configure(cfg)
    jobs = {}
    with tracking.run(cfg, "ablate", run_name="ablation p") as parent:
        for variant, seed, gold in (("A", 2, [0.0, 2.5, 5.0]), ("A", 1, [1.0, 2.0, 3.0]), ("B", 1, [0.0, 5.0, 2.0])):
            with tracking.run(cfg, "ablate", run_name=f"{variant}-seed{seed}", parent_run_id=parent.info.run_id) as r:
                mlflow.log_dict({"STSBenchmark": {"cos": [0.1, 0.5, 0.9], "gold": gold}},
                                "evaluation/sts_predictions.json")
                jobs[(variant, seed)] = r.info.run_id
    results = [{"variant": "A", "seed": 2, "status": "ok", "run_id": jobs[("A", 2)]},
               {"variant": "A", "seed": 1, "status": "ok", "run_id": jobs[("A", 1)]},
               {"variant": "B", "seed": 1, "status": "ok", "run_id": jobs[("B", 1)]},
               {"variant": "C", "seed": 1, "status": "failed"}]
    firsts = first_jobs(results)  # the lowest seed; failed rows skipped
    assert {v: j["run_id"] for v, j in firsts.items()} == {"A": jobs[("A", 1)], "B": jobs[("B", 1)]}
    assert log_ablation_figures(cfg, results, parent.info.run_id) == ["figures/sts_scatter.png"]
    artifacts = {a.path for a in mlflow.MlflowClient().list_artifacts(parent.info.run_id, "figures")}
    assert artifacts == {"figures/sts_scatter.png"}
    # no figures asked for: nothing logged
    assert log_ablation_figures(with_overrides(cfg, {"ablate.figures": []}), results, parent.info.run_id) == []


def test_each_rows_checkpoint_draws_its_tsne_panel_and_a_missing_one_is_named(project):
    import mlflow

    from mmcse.experiments.ablation_record import figure_sentences
    from mmcse.models.student import Student, load_backbone, load_tokenizer, save_student
    from mmcse.pipeline.paths import Paths

    cfg = with_overrides(load_config("params.yaml"), {"ablate.figures": ["tsne_clusters"]})
    sentences, images = figure_sentences(Paths.of(cfg).raw, 30, 0)
    assert len(sentences) == len(set(sentences)) == len(images) == 30  # a sample of the 40 test captions
    assert figure_sentences(Paths.of(cfg).raw, 30, 0) == (sentences, images)  # seeded
    assert len(figure_sentences(Paths.of(cfg).raw, 100, 0)[0]) == 40  # all of them when fewer
    for variant, seed in (("A", 1), ("B", 1)):
        import torch

        torch.manual_seed(seed if variant == "A" else 7)
        save_student(Student(load_backbone(cfg.model), 8, 8), load_tokenizer(cfg.model.name_or_path),
                     project / "abl" / variant / f"seed{seed}" / "best")
    tracking.configure(cfg)
    with tracking.run(cfg, "ablate", run_name="ablation fig3") as parent:
        pass
    results = [{"variant": v, "seed": 1, "status": "ok", "run_id": "r"} for v in ("A", "B")]
    assert log_ablation_figures(cfg, results, parent.info.run_id, project / "abl") == ["figures/tsne_clusters.png"]
    got = mlflow.MlflowClient().get_run(parent.info.run_id).data
    assert {"A/cluster_silhouette", "B/cluster_silhouette", "A/cluster_purity", "B/cluster_purity"} <= set(got.metrics)
    assert got.metrics["A/cluster_silhouette"] != got.metrics["B/cluster_silhouette"]  # two models, two maps
    # a row whose checkpoint is not there: the table stands, the parent says why the figure is missing
    results.append({"variant": "C", "seed": 1, "status": "ok", "run_id": "r"})
    assert log_ablation_figures(cfg, results, parent.info.run_id, project / "abl") == []
    error = mlflow.MlflowClient().get_run(parent.info.run_id).data.tags["figure.tsne_clusters.error"]
    assert "abl/C/seed1/best" in error and "row 'C'" in error


def test_an_unknown_figure_is_refused_listing_the_known_ones():
    with pytest.raises(ConfigError, match=r"ablate.figures': unknown \['tsne'\]; figures: sts_scatter, tsne_clusters"):
        with_overrides(load_config(REPO / "params.yaml"), {"ablate.figures": ["tsne"]})
    assert load_config(REPO / "params.yaml", {"ablate.preset": "dalr-fig4"}).ablate.figures == ["sts_scatter"]
