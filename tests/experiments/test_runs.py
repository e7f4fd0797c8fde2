"""`mmcse runs`: DVC's experiments as one compact table, from `dvc exp show --json`'s record."""

from mmcse.experiments.runs import experiment_rows, experiments_table


def _data(method: str, lam: float, dev: float, avg: float, rsum: float | None = None) -> dict:
    test = {"test_avg": avg, "test_alignment": 0.5, "test_demo_i2t_R1": 1.0, "test_demo_i2t_NDCG25_rouge_l": 0.4,
            "test_demo_NDCG25_rouge_l": 0.55}
    if rsum is not None:
        test["test_demo_rsum"] = rsum
    return {"timestamp": "2026-11-25T20:26:01",
            "params": {"params.yaml": {"data": {"train": {"method": method}, "loss": {"lambda_img": lam},
                                                "base": {"seed": 42}}}},
            "metrics": {"metrics/train.json": {"data": {"best_dev_sts": dev, "steps": 20}},
                        "metrics/eval.json": {"data": test},
                        "metrics/ablate.json": {"data": {"metric": "avg", "variants": {
                            "mcse": {"mean": avg}, "simcse": {"mean": avg - 1}}}},
                        "metrics/download.json": {"data": {"pairs": 1280}}}}


EXPS = [
    {"rev": "workspace", "name": None, "data": _data("mcse", 0.1, 70.857, 66.1854, 27.0)},
    {"rev": "e925f23b99", "name": "main", "data": _data("mcse", 0.1, 70.857, 66.1854, 27.0),
     "experiments": [{"revs": [{"rev": "abc1234ff", "name": "tidy-lamb",
                                "data": _data("mcse", 0.05, 71.2, 66.9, 30.5)}]},
                     {"revs": [{"rev": "def5678aa", "name": "wise-yawl",
                                "data": _data("simcse", 0.1, 69.0, 64.0)}]}]},
]


def test_one_row_per_experiment_with_its_changed_params_and_headline_scores():
    header, rows = experiment_rows(EXPS)
    # the headline scores only (never per-direction R@K, geometry or the data counts), "@" as people write it
    assert header == ["experiment", "created", "method", "changed params", "best_dev_sts", "test_avg",
                      "test_demo_NDCG@25_rouge_l", "test_demo_rsum", "mcse (avg)", "simcse (avg)"]
    assert [r[0] for r in rows] == ["workspace", "main", "tidy-lamb", "wise-yawl"]
    assert rows[2] == ["tidy-lamb", "2026-11-25 20:26", "mcse", "loss.lambda_img=0.05", "71.20", "66.90", "0.55",
                       "30.50", "66.90", "65.90"]
    assert rows[3][2:4] == ["simcse", "train.method=simcse"] and rows[3][7] == "—"  # no retrieval: no rsum
    assert rows[0][3] == "—" and rows[1][3] == "—"  # the workspace as committed


def test_the_table_fits_the_width_and_keeps_the_names_in_every_block():
    text = experiments_table(EXPS, width=80)
    assert max(len(line) for line in text.splitlines()) <= 80
    blocks = text.strip().split("\n\n")
    assert len(blocks) > 1 and all(b.startswith("experiment") for b in blocks)
    assert all("tidy-lamb" in b and "wise-yawl" in b for b in blocks)
    wide = experiments_table(EXPS, width=200)
    assert "\n\n" not in wide.strip() and "66.90" in wide and "train.method=simcse" in wide
