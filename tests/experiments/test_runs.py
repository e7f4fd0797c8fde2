"""`mmcse runs`: DVC's experiments as one compact table, from `dvc exp show --json`'s record."""

from mmcse.experiments.runs import experiment_rows, experiments_table


def _data(method: str, lam: float, dev: float, avg: float, rsum: float | None = None) -> dict:
    test = {"test_avg": avg, "dev_alignment": 0.5, "test_demo_i2t_R1": 1.0, "test_demo_i2t_NDCG25_rouge_l": 0.4,
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


def _lock(student_out: str, student_used: str, ablate_lambda: float) -> dict:
    return {"schema": "2.0", "stages": {
        "train": {"deps": [{"path": "data/raw", "md5": "raw.dir"}],
                  "params": {"params.yaml": {"loss": {"lambda_img": 0.05}, "train": {"method": "mcse"}}},
                  "outs": [{"path": "models/student", "md5": student_out}, {"path": "metrics/train.json", "md5": "t"}]},
        "evaluate": {"deps": [{"path": "models/student", "md5": student_used}],
                     "outs": [{"path": "metrics/eval.json", "md5": "e"}]},
        "ablate": {"deps": [{"path": "data/raw", "md5": "raw.dir"}],
                   "params": {"params.yaml": {"loss.lambda_img": ablate_lambda}},
                   "outs": [{"path": "metrics/ablate.json", "md5": "a"}]},
        "download": {"outs": [{"path": "data/raw", "md5": "raw.dir"}]}}}


def test_scores_an_experiment_did_not_make_are_starred_and_changed_code_is_named():
    """Issue 53.12: `dvc exp run train` leaves the commit's metrics/eval.json and ablate.json in the experiment;
    its dvc.lock records evaluate on the commit's model and ablate on the commit's params, so those scores
    are starred and the note says why. Issue 53.1: a row whose code is not its commit's names the files."""
    from mmcse.experiments.runs import INHERITED_NOTE, stale_stages

    exp_params = EXPS[1]["experiments"][0]["revs"][0]["data"]["params"]["params.yaml"]["data"]
    assert stale_stages(_lock("new.dir", "old.dir", 0.1), exp_params) == {"evaluate", "ablate"}
    assert stale_stages(_lock("new.dir", "new.dir", 0.05), exp_params) == set()
    downstream = _lock("new.dir", "new.dir", 0.05)
    downstream["stages"]["train"]["deps"][0]["md5"] = "older-raw.dir"  # train did not run: what reads it neither
    assert stale_stages(downstream, exp_params) == {"train", "evaluate"}
    provenance = {"tidy-lamb": {"lock": _lock("new.dir", "old.dir", 0.1), "code": ["src/mmcse/methods/losses.py"]},
                  "workspace": {"lock": {}, "code": ["src/mmcse/training/loop.py", "stages/train.py"]}}
    header, rows = experiment_rows(EXPS, provenance)
    assert header[4] == "code" and rows[2][4] == "changed: losses.py" and rows[0][4] == "uncommitted: loop.py, train.py"
    assert rows[1][4] == "—" and rows[3][4] == "—"
    assert rows[2][5:] == ["71.20", "66.90*", "0.55*", "30.50*", "66.90*", "65.90*"]  # train ran: its score is its own
    assert not any(c.endswith("*") for row in rows if row[0] != "tidy-lamb" for c in row[5:])
    text = experiments_table(EXPS, 200, provenance)
    assert text.endswith(INHERITED_NOTE + "\n") and INHERITED_NOTE not in experiments_table(EXPS, 200)


def test_a_param_dvc_lock_holds_as_yaml_1_1_reads_it_is_the_same_value():
    """PyYAML keeps dvc.lock's ``3e-05`` a string; DVC's own record (YAML 1.2) has the float: not a change."""
    from mmcse.experiments.runs import stale_stages

    lock = {"stages": {"train": {"params": {"params.yaml": {"train.learning_rate": "3e-05",
                                                            "model": {"lr": "1e-4", "name": "bert"}}}}}}
    assert stale_stages(lock, {"train": {"learning_rate": 3e-05}, "model": {"lr": 1e-4, "name": "bert"}}) == set()
    assert stale_stages(lock, {"train": {"learning_rate": 1e-4}, "model": {"lr": 1e-4, "name": "bert"}}) == {"train"}
    assert stale_stages(lock, {"train": {"learning_rate": 3e-05}, "model": {"lr": 1e-4, "name": "x"}}) == {"train"}
