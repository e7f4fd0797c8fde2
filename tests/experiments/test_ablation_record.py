"""`ablate.figures`: a paper figure drawn from every row's job into the ablation's parent run."""

import pytest

from mmcse import tracking
from mmcse.config import ConfigError, load_config, with_overrides
from mmcse.experiments.ablation_record import first_runs, log_ablation_figures
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
    assert first_runs(results) == {"A": jobs[("A", 1)], "B": jobs[("B", 1)]}  # lowest seed; failed rows skipped
    assert log_ablation_figures(cfg, results, parent.info.run_id) == ["figures/sts_scatter.png"]
    artifacts = {a.path for a in mlflow.MlflowClient().list_artifacts(parent.info.run_id, "figures")}
    assert artifacts == {"figures/sts_scatter.png"}
    # no figures asked for: nothing logged
    assert log_ablation_figures(with_overrides(cfg, {"ablate.figures": []}), results, parent.info.run_id) == []


def test_an_unknown_figure_is_refused_listing_the_known_ones():
    with pytest.raises(ConfigError, match=r"ablate.figures': unknown \['tsne'\]; figures: sts_scatter"):
        with_overrides(load_config(REPO / "params.yaml"), {"ablate.figures": ["tsne"]})
    assert load_config(REPO / "params.yaml", {"ablate.preset": "dalr-fig4"}).ablate.figures == ["sts_scatter"]
