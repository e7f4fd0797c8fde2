"""`ablate.figures`: a paper figure drawn from every row's job into the ablation's parent run."""

import matplotlib.pyplot as plt
import pytest

from mmcse import tracking
from mmcse.config import ConfigError, with_overrides
from mmcse.experiments.ablation_record import first_jobs, log_ablation_figures
from mmcse.experiments.params import load_config
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
    assert plt.get_fignums() == []  # logged and closed (pyplot keeps a figure until then)
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
    sentences, images, what = figure_sentences(Paths.of(cfg).raw, 30, 0)
    assert len(sentences) == len(set(sentences)) == len(images) == 30  # a sample of the 40 test captions
    assert what == "30 demo test captions"
    assert figure_sentences(Paths.of(cfg).raw, 30, 0) == (sentences, images, what)  # seeded
    assert len(figure_sentences(Paths.of(cfg).raw, 100, 0)[0]) == 40  # all of them when fewer
    # COCO's test captions (DALR Fig. 3): the demo world has none, and the title says which it encoded
    coco = figure_sentences(Paths.of(cfg).raw, 30, 0, "coco")
    assert coco == (sentences, images, "30 demo test captions (the demo world has no COCO test captions)")
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
    with pytest.raises(ConfigError, match=r"ablate.figures': unknown \['tsne'\]; figures: sts_scatter, tsne_clusters, "
                                          r"dropout_tsne, neighbours, teacher_ranks, teacher_similarities"):
        with_overrides(load_config(REPO / "params.yaml"), {"ablate.figures": ["tsne"]})
    assert load_config(REPO / "params.yaml", {"ablate.preset": "dalr-fig4"}).ablate.figures == ["sts_scatter"]


def _checkpoints(cfg, root, variants):
    import torch

    from mmcse.models.student import Student, load_backbone, load_tokenizer, save_student

    for i, variant in enumerate(variants):
        torch.manual_seed(11 + i)
        save_student(Student(load_backbone(cfg.model), 8, 8), load_tokenizer(cfg.model.name_or_path),
                     root / variant / "seed1" / "best")
    return [{"variant": v, "seed": 1, "status": "ok", "run_id": "r"} for v in variants]


@pytest.mark.slow  # end to end: the full suite runs it (fast tier under 5 min)
def test_dropout_views_and_neighbours_of_every_row_in_one_picture_each(project):
    """KDMCSE Figs. 8-12 and DALR Table 10 from the rows' checkpoints: the neighbours are those a
    direct encoding of the pool gives, the dropout metrics differ between the two models."""
    import mlflow
    import numpy as np

    from mmcse.evaluation.sts import TextEncoder
    from mmcse.experiments.ablation_record import neighbour_pool
    from mmcse.pipeline.paths import Paths

    queries = ["a dog runs on the beach", "two people ride bikes"]
    cfg = with_overrides(load_config("params.yaml"), {"ablate.figures": ["dropout_tsne", "neighbours"],
                                                      "ablate.sentences": queries + ["a red wall"]})
    results = _checkpoints(cfg, project / "abl", ["KDMCSE", "MCSE"])
    tracking.configure(cfg)
    with tracking.run(cfg, "ablate", run_name="ablation figs") as parent:
        pass
    assert log_ablation_figures(cfg, results, parent.info.run_id, project / "abl") == [
        "figures/dropout_tsne.png", "figures/neighbours.png"]
    client = mlflow.MlflowClient()
    metrics = client.get_run(parent.info.run_id).data.metrics
    assert metrics["KDMCSE/dropout_spread"] != metrics["MCSE/dropout_spread"]
    assert {"KDMCSE/dropout_separation_1_3", "MCSE/dropout_silhouette", "KDMCSE/neighbour_cosine"} <= set(metrics)
    table = mlflow.artifacts.load_dict(f"runs:/{parent.info.run_id}/figures/neighbours.json")
    pool = neighbour_pool(Paths.of(cfg).raw)
    assert table["pool"] == len(pool) == len(set(pool)) > 3
    assert [q["query"] for q in table["queries"]] == queries + ["a red wall"]
    enc = TextEncoder(str(project / "abl/MCSE/seed1/best"), cfg.evaluate.pooler)
    p, q = enc(pool), enc([queries[0]])
    cos = (p / np.linalg.norm(p, axis=1, keepdims=True)) @ (q[0] / np.linalg.norm(q[0]))
    got = table["queries"][0]["MCSE"]
    assert [h["cosine"] for h in got] == pytest.approx(np.sort(cos)[::-1][:3], abs=1e-5)  # the top 3 cosines
    for hit in got:  # and the sentences that have them (batching moves a cosine by < 1e-5; near-ties may swap)
        assert cos[pool.index(hit["sentence"])] == pytest.approx(hit["cosine"], abs=1e-5)


def test_a_dropout_figure_needs_its_sentences_and_sentences_need_a_figure():
    cfg = load_config(REPO / "params.yaml")
    with pytest.raises(ConfigError, match="dropout_tsne needs at least 2 sentences"):
        with_overrides(cfg, {"ablate.figures": ["dropout_tsne"]})
    with pytest.raises(ConfigError, match="no figure reads them; figures that do: dropout_tsne, neighbours"):
        with_overrides(cfg, {"ablate.sentences": ["a dog"]})
    fig8 = load_config(REPO / "params.yaml", {"ablate.preset": "kdmcse-fig8"}).ablate
    assert fig8.figures == ["dropout_tsne"] and len(fig8.sentences) == 3 and list(fig8.variants) == ["KDMCSE", "MCSE"]


def test_the_teacher_figures_read_the_first_rows_teacher_cache(project):
    """KDMCSE Figs. 5 and 6 from the joint teacher the row's configuration caches: the numbers on
    the parent are `threshold_metrics` of that cache."""
    import mlflow

    from mmcse.evaluation.teacher_statistics import (
        DEFAULT_THRESHOLDS,
        cached_joint_teacher,
        threshold_metrics,
        threshold_summary,
    )
    from mmcse.pipeline.paths import Paths

    row = {"train.method": "kdmcse", "train.epochs": 0}  # kdmcse-fig5's row
    cfg = load_config("params.yaml", {"ablate.variants": {"CLIP teacher": row}, "ablate.reference": "CLIP teacher",
                                      "ablate.figures": ["teacher_ranks", "teacher_similarities"]})
    variant = next(iter(cfg.ablate.variants))
    tracking.configure(cfg)
    with tracking.run(cfg, "ablate", run_name="ablation fig5") as parent:
        pass
    results = [{"variant": variant, "seed": 1, "status": "ok", "run_id": "r"}]
    assert log_ablation_figures(cfg, results, parent.info.run_id, project / "abl") == [
        "figures/teacher_ranks.png", "figures/teacher_similarities.png"]
    got = mlflow.MlflowClient().get_run(parent.info.run_id).data.metrics
    paths = Paths.of(cfg)
    threshold = cfg.loss.kdmcse.threshold_value
    candidates = (*DEFAULT_THRESHOLDS, *(() if threshold in DEFAULT_THRESHOLDS else (threshold,)))
    s = threshold_summary(*cached_joint_teacher(paths.teachers, paths.raw), candidates, seed=cfg.base.seed)
    want = threshold_metrics(s)
    assert got["teacher/rank_mean"] == pytest.approx(want["rank_mean"])
    assert got["teacher/teacher_i2t_R1"] == pytest.approx(want["teacher_i2t_R1"])
    assert got["teacher/tv_neg_above_0.9"] == pytest.approx(want["tv_neg_above_0.9"])


def test_figure_captions_read_karpathys_test_split_of_the_named_set(tmp_path):
    """DALR Fig. 3 encodes COCO test captions whatever trains (ablate.figure_captions: coco); a data
    folder without them is named with the stage that writes them."""
    from mmcse.experiments.ablation_record import figure_sentences
    from mmcse.io import write_json, write_jsonl

    raw = tmp_path / "raw"
    write_json(raw / "manifest.json", {"pairs": "flickr30k", "retrieval_set": "flickr30k_1k"})
    write_jsonl(raw / "retrieval" / "captions.jsonl", [{"image_id": "f-1", "caption": "A flickr caption ."}])
    coco = [{"image_id": f"coco-{i // 5}", "caption": f"coco caption {i} ."} for i in range(25)]
    write_jsonl(raw / "test_captions" / "coco.jsonl", coco)
    sentences, images, what = figure_sentences(raw, 10, 0, "coco")
    assert len(sentences) == 10 and set(sentences) <= {r["caption"] for r in coco}
    assert images == [next(r["image_id"] for r in coco if r["caption"] == s) for s in sentences]
    assert what == "10 COCO test captions"
    assert figure_sentences(raw, 10, 0) == (["A flickr caption ."], ["f-1"], "1 flickr30k_1k test captions")
    with pytest.raises(FileNotFoundError, match=r"test_captions/flickr30k.jsonl: ablate.figure_captions flickr30k"):
        figure_sentences(raw, 10, 0, "flickr30k")
