"""`mmcse plan` names what each row trains with (its active loss terms) and the row's own overrides it would not use,
each with why, instead of dropping them."""

from __future__ import annotations

import yaml

from mmcse.experiments.plan import plan, plan_text
from mmcse.experiments.profiles import apply_profile
from tests.conftest import params_copy


def test_each_row_lists_its_terms_and_names_an_override_it_does_not_apply(tmp_path):
    params = params_copy(tmp_path) / "params.yaml"
    raw = yaml.safe_load(params.read_text())
    raw["ablate"] |= {"preset": "none", "reference": "MCSE", "variants": {
        "MCSE": {"train.method": "mcse", "loss.dalr.mu_iml": 0.3, "loss.simcse.mlm_weight": 0.2,
                 "model.duet.heads": 2},
        "DALR": {"train.method": "dalr", "loss.dalr.mu_iml": 0.3}}}
    params.write_text(yaml.safe_dump(raw, sort_keys=False))
    rows = {row["variant"]: row for row in plan(params)["rows"]}
    assert rows["MCSE"]["terms"] == ["simcse", "image"]
    assert rows["DALR"]["terms"] == ["simcse", "info", "consistency", "cma", "rank", "ima"]  # SimCSE: text batches
    assert rows["MCSE"]["not_applied"] == {
        "loss.dalr.mu_iml": "`loss.dalr.mu_iml` does not apply to this row: terms `rank`, `ima` are off",
        "loss.simcse.mlm_weight": "`loss.simcse.mlm_weight` does not apply to this row: term `mlm` is off",
        "model.duet.heads": "`model.duet.heads` does not apply to this row: mcse does not read it"}
    assert rows["DALR"]["not_applied"] == {}  # μ weighs its L_rank and L_IMA
    text = plan_text(plan(params), {})
    assert "\nMCSE: mcse, params.yaml's values (demo)\n" in text
    assert "  terms: simcse, image\n  not applied: `loss.dalr.mu_iml` does not apply to this row: terms `rank`, " \
           "`ima` are off\n" in text
    assert "  loss.dalr.mu_iml: 0.3" in text.split("\nDALR:")[1]  # read by DALR's row: a setting it shows


def test_each_row_shows_its_share_of_image_caption_batches_under_its_batch_order(tmp_path):
    """KDMCSE on COCO with every caption: half of the steps are image–caption batches in the authors' loop (the code
    reading), 29 % where each batch comes once an epoch (the recipe's); MCSE's one caption an image: 8 %."""
    params = params_copy(tmp_path) / "params.yaml"
    apply_profile(params, "kdmcse-coco-bert")
    code = {row["variant"]: row for row in plan(params, "kdmcse-table1", "code")["rows"]}
    recipe = {row["variant"]: row for row in plan(params, "kdmcse-table1")["rows"]}
    assert code["KDMCSE"]["batches"] == {"per_epoch": 15_625 + 6_467, "pair_share": 0.5, "order": "released",
                                         "counts": "published sizes"}
    assert recipe["KDMCSE"]["batches"]["order"] == "alternate"
    assert round(recipe["KDMCSE"]["batches"]["pair_share"], 3) == 0.293
    assert round(code["MCSE"]["batches"]["pair_share"], 3) == 0.083
    assert code["SimCSE (wiki)"]["batches"]["pair_share"] == 0.0
    text = plan_text(plan(params, "kdmcse-table1", "code"), {})
    assert ("  batches: 22,092 an epoch, 50.0 % image–caption (train.batch_order: released; published sizes)"
            in text.split("\nKDMCSE:")[1])
