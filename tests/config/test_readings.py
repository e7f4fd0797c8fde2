"""Readings: where a paper's printed text and its authors' code differ, a table runs either way
(``ablate.reading``), every row of `mmcse plan` says which it follows, and its job runs say it too."""

from __future__ import annotations

import re

import pytest
import yaml

from mmcse.cli import main as cli_main
from mmcse.config import Config, ConfigError, to_dict, with_overrides
from mmcse.config.coercion import flatten
from mmcse.config.readings import (
    READING_POINTS,
    READING_TAG,
    points_off_printed,
    reading_summary,
    reading_tags,
    reading_values,
    row_reading,
)
from mmcse.experiments.jobs import expand, job_config, job_hash
from mmcse.experiments.params import load_config
from mmcse.experiments.plan import plan, plan_text
from mmcse.experiments.profiles import apply_profile
from mmcse.experiments.recipes import load_recipes
from tests.conftest import REPO, params_copy

DALR_PRINTED = {"simcse_on_pairs": False, "info_views": "one", "info_weight": 1.0, "consistency_scale": 1.0}
DALR_CODE = {"simcse_on_pairs": True, "info_views": "mean", "info_weight": 0.1, "consistency_scale": 0.01}


@pytest.fixture
def project(tmp_path):
    return params_copy(tmp_path)


def _dalr(row: dict) -> dict:
    return {k: row["config"]["loss"]["dalr"][k] for k in DALR_PRINTED}


def test_every_point_defaults_to_the_paper_as_printed_and_is_a_valid_setting_documented_beside_the_code():
    defaults = flatten(to_dict(Config()))
    params = flatten(yaml.safe_load((REPO / "params.yaml").read_text()))
    methods_doc = (REPO / "docs/methods.md").read_text()
    for point in READING_POINTS:
        assert defaults[point.key] == point.default_value == params[point.key], point.key
        assert point.default is None or point.default == point.code_value("bert")  # the prose, which the code follows
        for encoder in ("bert", "roberta"):
            with_overrides(Config(), {point.key: point.code_value(encoder)}, where="test")  # a valid value
        assert point.printed != point.code_value("bert") or point.printed != point.code_value("roberta")
        assert f"`{point.key}`" in methods_doc, f"{point.key} missing from docs/methods.md's side-by-side table"
    assert len({p.key for p in READING_POINTS}) == len(READING_POINTS)  # one point per key


def test_reading_values_printed_code_and_each_papers_recipe():
    recipes = {name: r.values("bert" if "bert" in r.encoders else None) for name, r in load_recipes(REPO).items()}
    printed, code = reading_values("printed", "bert", recipes), reading_values("code", "roberta", recipes)
    assert {k.split(".")[-1]: printed[f"loss.dalr.{k}"] for k in DALR_PRINTED} == DALR_PRINTED
    assert {k.split(".")[-1]: code[f"loss.dalr.{k}"] for k in DALR_CODE} == DALR_CODE
    assert code["loss.kdmcse.margin_similarity"] == "within" and printed["loss.kdmcse.margin_similarity"] == "cross"
    assert reading_values("code", "bert", recipes)["loss.simcse.mlm_head"] == "new" and code[
        "loss.simcse.mlm_head"] == "pretrained"  # SimCSE's code: a new LM head for BERT, RoBERTa's own
    recipe = reading_values("recipe", "bert", recipes)
    # each point as its own paper's recipe sets it (recipes/dalr.yaml, recipes/kdmcse.yaml); none it leaves alone
    assert recipe == {"loss.kdmcse.margin_similarity": "within", "loss.kdmcse.pair_objective": "kdmcse",
                      "loss.dalr.simcse_on_pairs": True, "loss.dalr.info_views": "mean",
                      "loss.dalr.info_weight": 0.1, "loss.dalr.consistency_scale": 0.01,
                      "loss.dalr.teacher_space": "projected", "loss.mcse.image_views": "mean",
                      "teachers.joint.model": "openai/clip-vit-base-patch32", "loss.kdmcse.margin": 0.125,
                      "loss.kdmcse.threshold": 0.9, "loss.kdmcse.threshold_drops": "above"}
    with pytest.raises(ValueError, match="unknown reading 'paper'; readings: recipe, printed, code"):
        reading_values("paper", None, recipes)


def test_a_rows_reading_lists_the_points_its_method_reads_and_which_it_follows():
    reads = {"loss.dalr.info_weight": 0.1, "loss.dalr.info_views": "one", "loss.dalr.mismatch": "shuffle",
             "model.name_or_path": "bert-base-uncased"}
    entries = row_reading(reads, "bert")
    assert [(e["key"], e["follows"]) for e in entries] == [
        ("loss.dalr.info_views", "printed"), ("loss.dalr.info_weight", "code"), ("loss.dalr.mismatch", "neither")]
    weight = entries[1]
    assert (weight["value"], weight["printed"], weight["code"]) == (0.1, 1.0, 0.1)
    assert re.fullmatch(r"printed: dalr.txt Eq. 14 \(1\); code: src/model_modified.py l.765 .*", weight["source"])
    assert reading_summary(entries) == ("loss.dalr.info_weight: 0.1 (code; printed 1.0); "
                                        "loss.dalr.mismatch: 'shuffle' (neither; printed 'derangement')")
    assert reading_summary(entries[:1]) == "as printed"
    assert reading_summary([]) == "as printed (no point where paper and code differ)"
    tags = reading_tags("code", entries)
    assert tags[READING_TAG] == "code" and tags[f"{READING_TAG}.loss.dalr.info_views"].startswith("printed: 'one'")
    assert [p.split(":")[0] for p in points_off_printed(tags)] == ["loss.dalr.info_weight", "loss.dalr.mismatch"]


def test_under_a_dalr_profile_a_table_runs_as_its_recipes_as_printed_or_as_the_code(project, capsys):
    params = project / "params.yaml"
    apply_profile(params, "dalr-flickr-bert")
    by_reading = {r: {row["variant"]: row for row in plan(params, "dalr-table4", r)["rows"]}
                  for r in ("recipe", "printed", "code")}
    assert _dalr(by_reading["recipe"]["DALR"]) == DALR_CODE  # recipes/dalr.yaml takes the authors' sum
    assert _dalr(by_reading["printed"]["DALR"]) == DALR_PRINTED  # Eq. 14 as printed, on one view
    assert _dalr(by_reading["code"]["DALR"]) == DALR_CODE
    # one reading per term within a table: KDMCSE + CML weighs L_cons as the DALR row of the same table does
    for reading, rows in by_reading.items():
        scales = {v: r["config"]["loss"]["dalr"]["consistency_scale"] for v, r in rows.items()
                  if "loss.dalr.consistency_scale" in flatten(r["reads"])}
        assert set(scales) == {"KDMCSE + CML", "DALR"} and len(set(scales.values())) == 1, (reading, scales)
    # every row carries its reading; a row of the printed table follows the text at every point it reads
    for reading, rows in by_reading.items():
        for row in rows.values():
            assert all(set(e) >= {"key", "printed", "code", "source", "follows"} for e in row["reading"])
            if reading == "printed":
                assert {e["follows"] for e in row["reading"]} <= {"printed"}
            if reading == "code":
                assert {e["follows"] for e in row["reading"]} <= {"code"}
    kd = by_reading["recipe"]["KDMCSE"]["reading"]
    assert {e["key"]: e["follows"] for e in kd}["loss.kdmcse.margin_similarity"] == "code"
    # MCSE's recipe is its authors' run: the mean of the views' image term (and no CLIP teacher to read), but for
    # the profile's bf16 where MCSE's script trains fp32 and the loop's settings (run-script points: the recipe or
    # profile names them)
    assert [(e["key"], e["follows"], e["side"]) for e in by_reading["recipe"]["MCSE"]["reading"]] == [
        ("loss.mcse.image_views", "code", "printed"), ("train.precision", "printed", "profile"),
        # the training loop's settings, where the released train_mix.py differs from the recipe's
        ("train.optimizer", "printed", "recipe"), ("train.batch_order", "printed", "recipe"),
        ("train.dev_truncation", "printed", "recipe")]
    text = plan_text(plan(params, "dalr-table4"), {})
    assert ("profile dalr-flickr-bert, preset dalr-table4, reading: each row's recipe's (ablate.reading: recipe), "
            "seeds [1, 2, 3, 4, 5]") in text
    assert ("\nMCSE: mcse, recipe mcse (bert)\n  reading: loss.mcse.image_views: 'mean' (code; printed 'sum')\n"
            in text)
    assert ("\nKDMCSE: kdmcse, recipe kdmcse (bert)\n  reading: loss.kdmcse.threshold_drops: 'above' (code; printed "
            "'below'); loss.kdmcse.margin_similarity: 'within' (code; ") in text
    assert "base.seed" not in text  # the seeds are the first line's, not a setting of the first seed
    # the job identity follows the reading: both tables can sit in one store, side by side
    hashes = {}
    for reading in ("printed", "code"):
        cfg = load_config(params, {"ablate.preset": "dalr-table4", "ablate.reading": reading})
        hashes[reading] = {j.variant: job_hash(job_config(cfg, j)) for j in expand(cfg) if j.seed == 1}
    assert hashes["printed"]["DALR"] != hashes["code"]["DALR"]
    assert hashes["printed"]["MCSE"] != hashes["code"]["MCSE"]  # the views' sum or their mean
    # the command line, and a bad reading in one line listing the valid ones
    assert cli_main(["plan", "--params", str(params), "--preset", "dalr-table4", "--reading", "printed"]) in (0, None)
    assert "reading: as printed" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="ablate.reading"):
        load_config(params, {"ablate.reading": "paper"})


def test_a_rows_own_override_of_a_point_wins_over_the_tables_reading(project):
    params = project / "params.yaml"
    apply_profile(params, "dalr-flickr-bert")
    raw = yaml.safe_load(params.read_text())
    raw["ablate"] |= {"preset": "none", "reading": "printed", "reference": "DALR", "variants": {
        "DALR": {"train.method": "dalr"}, "DALR, code's L_cons": {"train.method": "dalr",
                                                                 "loss.dalr.consistency_scale": 0.01}}}
    params.write_text(yaml.safe_dump(raw, sort_keys=False))
    rows = {row["variant"]: row for row in plan(params)["rows"]}
    assert _dalr(rows["DALR"]) == DALR_PRINTED
    assert _dalr(rows["DALR, code's L_cons"]) == {**DALR_PRINTED, "consistency_scale": 0.01}


def test_under_demo_the_recipe_reading_keeps_params_values_and_printed_sets_every_point(project):
    params = project / "params.yaml"
    demo = {row["variant"]: row for row in plan(params, "dalr-table4")["rows"]}
    assert _dalr(demo["DALR"]) == DALR_PRINTED  # params.yaml's (demo) values
    raw = yaml.safe_load(params.read_text())
    raw["loss"]["dalr"]["info_weight"] = 0.5  # an edit of params.yaml reaches the recipe reading's rows
    params.write_text(yaml.safe_dump(raw, sort_keys=False))
    assert plan(params, "dalr-table4")["rows"][-1]["config"]["loss"]["dalr"]["info_weight"] == 0.5
    coded = {row["variant"]: row for row in plan(params, "dalr-table4", "code")["rows"]}
    assert _dalr(coded["DALR"]) == DALR_CODE


def test_a_rows_own_setting_of_a_point_is_the_ablations_variable_not_a_reading():
    """KDMCSE Table 3's "w/o threshold filtering" sets the threshold off itself: that is the row, not the code's
    reading of the paper; the point reads ``row`` and the row's summary does not list it."""
    reads = {"loss.kdmcse.threshold": "off", "loss.kdmcse.margin_similarity": "within"}
    entries = row_reading(reads, "bert", own={"loss.kdmcse.threshold"})
    assert [(e["key"], e["follows"]) for e in entries] == [("loss.kdmcse.threshold", "row"),
                                                           ("loss.kdmcse.margin_similarity", "code")]
    assert reading_summary(entries) == "loss.kdmcse.margin_similarity: 'within' (code; printed 'cross')"
    tags = reading_tags("recipe", entries)
    assert [p.split(":")[0] for p in points_off_printed(tags)] == ["loss.kdmcse.margin_similarity"]
    # a point the paper prints no value for says so
    mlm = row_reading({"loss.simcse.mlm_head": "new"}, "bert")
    assert reading_summary(mlm) == "loss.simcse.mlm_head: 'new' (code; not printed, default 'pretrained')"
