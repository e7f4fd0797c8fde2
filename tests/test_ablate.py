import math

import numpy as np
import pytest
from scipy import stats

from mmcse.ablate import aggregate, expand, table_markdown
from mmcse.config import parse_config


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


def test_aggregate_mean_std_ttest_and_failed_rows():
    full = [70.0, 71.0, 73.0]
    without = [65.0, 66.5, 66.0]
    results = [_ok("full", s, v, v - 1) for s, v in zip([1, 2, 3], full, strict=True)]
    results += [_ok("w/o image", s, v, v - 1) for s, v in zip([1, 2, 3], without, strict=True)]
    results += [{"variant": "broken", "seed": s, "status": "failed", "error": "boom"} for s in (1, 2, 3)]
    rows = {r["variant"]: r for r in aggregate(_cfg(), results)}
    assert list(rows) == ["full", "w/o image", "broken"]
    assert rows["full"]["avg_mean"] == pytest.approx(np.mean(full))
    assert rows["full"]["avg_std"] == pytest.approx(np.std(full, ddof=1))
    assert rows["w/o image"]["p_value"] == pytest.approx(stats.ttest_ind(without, full, equal_var=False).pvalue)
    assert math.isnan(rows["full"]["p_value"])
    assert rows["broken"]["status"] == "failed" and rows["broken"]["seeds"] == 0 and rows["broken"]["error"] == "boom"
    md = table_markdown(list(rows.values()), "avg", "full")
    assert "| broken | — | — | — | 0 | failed |" in md
    assert md.splitlines()[0] == "| variant | STS12 | avg | p vs full | seeds | status |"
