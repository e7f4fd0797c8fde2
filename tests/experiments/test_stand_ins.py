"""Teachers by role and offline stand-ins under a paper profile: one preset serves the demo and the paper,
and a row that would train a paper profile's table with the demo's stand-in teachers is refused, or marked."""

from __future__ import annotations

import re

import pytest
import yaml

from mmcse.analysis.papers import load_paper
from mmcse.analysis.report import Reproduction, RunCell, table_sections
from mmcse.config import ConfigError
from mmcse.config.coercion import flatten
from mmcse.config.readings import encoder_of, row_reading
from mmcse.experiments.jobs import expand, job_config, job_identity
from mmcse.experiments.params import list_presets, load_config, preset_row_keys
from mmcse.experiments.plan import plan, plan_text
from mmcse.experiments.profiles import apply_profile, list_profiles
from mmcse.experiments.recipes import load_recipes, teacher_roles
from mmcse.experiments.stand_ins import check_stand_ins, row_stand_ins, stand_ins
from tests.conftest import REPO, params_copy

MINILM = "packaged:all-MiniLM-L6-v2"
BERT_TEACHERS = ["princeton-nlp/unsup-simcse-bert-base-uncased", "voidism/diffcse-bert-base-uncased-sts"]


@pytest.fixture
def project(tmp_path):
    return params_copy(tmp_path)


def _rows(project, preset: str) -> dict[str, dict]:
    return {row["variant"]: row for row in plan(project / "params.yaml", preset)["rows"]}


def _teachers(row: dict) -> list[tuple[str, str, float]]:
    return [(t["teacher"], t["pooler"], t["weight"]) for t in row["config"]["teachers"]["text"]]


def test_under_demo_the_role_preset_trains_the_offline_stand_ins_it_named_before(project):
    """dalr-table9 by role resolves to the teachers the preset spelled out before roles (MiniLM poolers for
    SimCSE / DiffCSE / RankCSE, the joint teacher's text side for CLIP); ResNet's image side is now the
    image encoder's own features (an image-only teacher, as the paper's), not a coarser CCA."""
    rows = _rows(project, "dalr-table9")
    assert _teachers(rows["CLIP + SimCSE"]) == [(MINILM, "avg_first_last", 1.0)]
    assert _teachers(rows["CLIP + DiffCSE"]) == [(MINILM, "avg", 1.0)]
    assert _teachers(rows["CLIP + CLIP"]) == [("joint", "avg", 1.0)]
    assert _teachers(rows["ResNet + SimCSE+RankCSE"]) == [(MINILM, "avg_first_last", 0.5), (MINILM, "avg_top2", 0.5)]
    assert {n: r["config"]["teachers"]["joint"]["image_side"] for n, r in rows.items()} == {
        n: "image_encoder" if n.startswith("ResNet") else "joint" for n in rows}
    assert all(r["stand_ins"] == [] for r in rows.values())  # the demo is what stand-ins are for
    # DALR Tables 4-5's KDMCSE + CML / IML rows name DALR's teachers: offline, params.yaml's own pair
    kd_cml = _rows(project, "dalr-table4")["KDMCSE + CML"]
    assert _teachers(kd_cml) == [(MINILM, "avg_first_last", 0.33), (MINILM, "avg", 0.67)]
    params_teachers = load_config(project / "params.yaml").teachers.text
    assert _teachers(kd_cml) == [(t.teacher, t.pooler, t.weight) for t in params_teachers]


@pytest.mark.slow  # end to end: the full suite runs it (fast tier under 5 min)
def test_under_a_dalr_profile_the_roles_are_the_released_checkpoints_of_its_encoder(project):
    apply_profile(project / "params.yaml", "dalr-flickr-bert")
    kd_cml = _rows(project, "dalr-table4")["KDMCSE + CML"]
    assert kd_cml["method"] == "kdmcse" and kd_cml["config"]["loss"]["dalr"]["cml"] is True
    assert [t for t, _, _ in _teachers(kd_cml)] == BERT_TEACHERS  # not the demo's MiniLM (the reported leak)
    assert kd_cml["stand_ins"] == []
    apply_profile(project / "params.yaml", "dalr-coco-roberta")
    kd_iml = _rows(project, "dalr-table5")["KDMCSE + IML"]
    assert [t for t, _, _ in _teachers(kd_iml)] == ["princeton-nlp/unsup-simcse-roberta-base",
                                                     "voidism/diffcse-roberta-base-sts"]
    # ResNet: ResNet-50 features as v̂ beside CLIP's text side, no stand-in
    params = project / "params.yaml"
    raw = yaml.safe_load(params.read_text())
    raw["ablate"] |= {"preset": "none", "reference": "ResNet + CLIP", "variants": {"ResNet + CLIP": {
        "train.method": "dalr", "teachers.image_role": "resnet", "teachers.text": [{"role": "clip"}]}}}
    params.write_text(yaml.safe_dump(raw, sort_keys=False))
    row = _rows(project, None)["ResNet + CLIP"]
    t = row["config"]["teachers"]
    assert (t["joint"]["image_side"], t["image_encoder"], t["image_weights"], t["joint"]["kind"]) == (
        "image_encoder", "resnet50", "IMAGENET1K_V1", "clip")
    assert row["stand_ins"] == []
    raw["ablate"]["variants"]["ResNet + CLIP"]["train.method"] = "kdmcse"
    params.write_text(yaml.safe_dump(raw, sort_keys=False))
    with pytest.raises(ConfigError, match="teachers.joint.image_side.*KDMCSE's soft labels compare the two"):
        load_config(params)
    # a row naming a role the profile lacks is planned as not run, with what it needs; the rest of the table runs
    # (DALR Table 9: RankCSE has no released checkpoint)
    table9 = plan(project / "params.yaml", "dalr-table9")
    assert [r["variant"] for r in table9["rows"]] == [
        "CLIP + SimCSE", "CLIP + DiffCSE", "CLIP + CLIP", "CLIP + SimCSE+DiffCSE",
        "ResNet + SimCSE", "ResNet + DiffCSE", "ResNet + CLIP", "ResNet + SimCSE+DiffCSE"]
    assert [r["variant"] for r in table9["skipped"]] == ["CLIP + SimCSE+RankCSE", "ResNet + SimCSE+RankCSE"]
    assert re.fullmatch(r"needs a rankcse checkpoint: profile dalr-coco-roberta names no text teacher role "
                        r"'rankcse' \(.*profiles/dalr.yaml: teacher_roles.text has simcse, diffcse, clip\); to train "
                        r"this row, add `rankcse: \{teacher: <HF id or local folder>, pooler: <pooler>\}` there",
                        table9["skipped"][0]["why"])
    assert table9["jobs"] == 8 * 5
    assert "\nCLIP + SimCSE+RankCSE: not run: needs a rankcse checkpoint" in plan_text(table9, {})
    # the table's reference row needing one refuses the table
    preset = project / "ablations/dalr-table9.yaml"
    preset.write_text(preset.read_text().replace("reference: CLIP + SimCSE+DiffCSE",
                                                 "reference: CLIP + SimCSE+RankCSE"))
    with pytest.raises(ConfigError, match=r"CLIP \+ SimCSE\+RankCSE\): needs a rankcse checkpoint.*\(the table's "
                                          r"reference row\)"):
        load_config(project / "params.yaml", {"ablate.preset": "dalr-table9"})


def test_the_dalr_profiles_roles_are_the_dalr_recipes_teachers():
    recipe = load_recipes(REPO)["dalr"]
    for encoder in ("bert", "roberta"):
        roles = teacher_roles(f"dalr-flickr-{encoder}", REPO)
        by_role = [{**roles.text["simcse"], "weight": 0.33}, {**roles.text["diffcse"], "weight": 0.67}]
        assert recipe.values(encoder)["teachers.text"] == by_role


def test_a_stand_in_under_a_paper_profile_is_refused_naming_the_row_unless_allowed(project):
    params = project / "params.yaml"
    apply_profile(params, "kdmcse-flickr-bert")
    raw = yaml.safe_load(params.read_text())
    # a row that turns on DALR's L_IMA under KDMCSE's recipe, its text teachers left at the demo's MiniLM
    raw["ablate"]["variants"] = {"KDMCSE": {"train.method": "kdmcse"},
                                 "KDMCSE + IML": {"train.method": "kdmcse", "loss.dalr.iml": True}}
    raw["ablate"]["reference"], raw["ablate"]["preset"] = "KDMCSE", "none"  # the profile's preset would replace them
    params.write_text(yaml.safe_dump(raw, sort_keys=False))
    cfg = load_config(params)
    assert row_stand_ins(cfg) == {"KDMCSE + IML": [f"teachers.text[0]: {MINILM} (avg_first_last)",
                                                   f"teachers.text[1]: {MINILM} (avg)"]}
    with pytest.raises(ConfigError) as err:
        check_stand_ins(cfg, "params.yaml")
    message = str(err.value)
    assert "\n" not in message and "under profile kdmcse-flickr-bert, row 'KDMCSE + IML'" in message
    assert f"teachers.text[0]: {MINILM}" in message and "teachers.stand_ins: allow" in message
    text = plan_text(plan(params), {})
    assert f"not the paper's teacher (refused): teachers.text[0]: {MINILM}" in text
    raw["teachers"]["stand_ins"] = "allow"
    params.write_text(yaml.safe_dump(raw, sort_keys=False))
    assert check_stand_ins(load_config(params)) == {"KDMCSE + IML": [f"teachers.text[0]: {MINILM} (avg_first_last)",
                                                                     f"teachers.text[1]: {MINILM} (avg)"]}
    assert "not the paper's teacher (teachers.stand_ins: allow)" in plan_text(plan(params), {})
    # a job cannot allow it for itself: the choice is params.yaml's
    raw["teachers"]["stand_ins"] = "refuse"
    raw["ablate"]["variants"]["KDMCSE + IML"]["teachers.stand_ins"] = "allow"
    params.write_text(yaml.safe_dump(raw, sort_keys=False))
    with pytest.raises(ConfigError, match="teachers.stand_ins cannot vary per job"):
        load_config(params)


def test_only_the_teachers_a_row_trains_with_count(project):
    """MCSE reads no text teacher and no joint teacher: the demo's MiniLM and CCA left in its params are
    not its teachers; the demo's colour-edge-grid image features are."""
    apply_profile(project / "params.yaml", "kdmcse-flickr-bert")
    cfg = load_config(project / "params.yaml", {"ablate.preset": "baselines"})
    assert cfg.teachers.text[0].teacher == MINILM and row_stand_ins(cfg) == {}
    demo_image = load_config(project / "params.yaml", {"teachers.image_encoder": "colour-edge-grid",
                                                        "train.method": "mcse"})
    assert stand_ins(demo_image) == ["teachers.image_encoder: colour-edge-grid"]
    cca = load_config(project / "params.yaml", {"teachers.joint.kind": "cca"})  # KDMCSE reads the joint teacher
    assert stand_ins(cca) == [f"teachers.joint: a CCA fitted on {MINILM} and colour-edge-grid features"]
    assert load_config(project / "params.yaml").teachers.joint.kind == "clip" and stand_ins(
        load_config(project / "params.yaml")) == []


def test_a_role_entry_that_also_names_its_teacher_or_an_unknown_image_role_is_refused(project):
    params = project / "params.yaml"
    raw = yaml.safe_load(params.read_text())
    raw["ablate"]["variants"] = {"a": {"teachers.text": [{"role": "simcse", "teacher": MINILM}]}}
    raw["ablate"]["reference"] = "a"
    params.write_text(yaml.safe_dump(raw, sort_keys=False))
    with pytest.raises(ConfigError, match=r"ablate.variants.a\): teachers.text\[0\] names role simcse and teacher"):
        load_config(params)
    raw["ablate"]["variants"] = {"a": {"teachers.image_role": "vit"}}
    params.write_text(yaml.safe_dump(raw, sort_keys=False))
    with pytest.raises(ConfigError, match="ablate.variants.a\\): needs a vit image teacher: profile demo names no "
                       "image teacher role 'vit'.*has clip, resnet\\); to train this row, add `vit: .*` there "
                       "\\(no row of the table can train under this profile\\)"):
        load_config(params)


def test_the_report_marks_a_row_trained_with_allowed_stand_ins():
    table = load_paper("kdmcse", REPO).tables["table1"]
    cells = {m: RunCell(75.0, 0.5, 5, 0.01) for m in table.columns.values()}
    run = Reproduction("kdmcse-flickr-bert", "r1", "FINISHED", "MCSE", "independent",
                       rows={"MCSE": cells, "KDMCSE": cells},
                       stand_ins={"KDMCSE": f"teachers.text[0]: {MINILM} (avg)"})
    sections = table_sections(load_paper("kdmcse", REPO), table, [run], preset_exists=True)
    block = next(s for s in sections if s.heading == "flickr-bert")
    assert f"Not the paper's teacher: row KDMCSE trained with offline stand-ins (teachers.stand_ins: allow): " \
           f"teachers.text[0]: {MINILM} (avg)." in block.lines
    labels = {(r[0], r[1]) for r in block.rows}
    assert ("", "mmcse (not the paper's teacher)") in labels and ("", "mmcse") in labels


# Rows the presets say are not their paper's, and why is in the preset (ablate.caveats).
CAVEATS: dict[str, set[str]] = {}  # every row of every preset is its paper's (DUET Table 1's VSE++ fine-tunes its CNN)


@pytest.mark.slow
def test_every_row_of_every_preset_under_every_paper_profile_is_its_papers_or_says_why(project):
    """Each paper profile × each preset of its paper (and `baselines`): no row trains an offline stand-in
    unless the preset names why; a row naming a role the profile lacks is skipped, with what it needs (DALR
    Table 9's RankCSE rows), the rest of its table planned; within a table every row that reads a point where
    paper and code differ has the same value; the rows that are not their paper's are exactly those the
    presets name."""
    refused, caveated = set(), {}
    # one encoder per paper context: a RoBERTa profile differs from its BERT one only in the checkpoints' ids,
    # which the roles test above resolves for both
    profiles = [p for p in list_profiles(project) if p != "demo" and not p.endswith("-roberta")]
    for profile in profiles:
        paper = profile.split("-")[0]
        apply_profile(project / "params.yaml", profile)
        for preset in list_presets(project / "ablations"):
            if not preset.startswith(f"{paper}-") and preset != "baselines":
                continue
            cfg = load_config(project / "params.yaml", {"ablate.preset": preset})
            if cfg.ablate.skipped:
                refused.add((profile, preset, *cfg.ablate.skipped))
            # one reading per term within a table: every row that reads a point has the same value, but where the
            # row sets it itself (the ablation's variable: KDMCSE Fig. 7's margins)
            values: dict[str, set] = {}
            firsts = {job.variant: job for job in reversed(expand(cfg))}  # a row's seeds differ in base.seed alone
            for variant, job in firsts.items():
                reads = flatten(job_identity(job_config(cfg, job)))
                own = preset_row_keys(cfg, variant, project)
                for entry in row_reading(reads, encoder_of(reads["model.name_or_path"]), own=own):
                    if entry["follows"] != "row":
                        values.setdefault(entry["key"], set()).add(repr(entry["value"]))
            assert {k: v for k, v in values.items() if len(v) > 1} == {}, (profile, preset)
            silent = {row: found for row, found in row_stand_ins(cfg).items() if row not in cfg.ablate.caveats}
            assert silent == {}, (profile, preset)
            if cfg.ablate.caveats:
                caveated[preset] = set(cfg.ablate.caveats)
    assert refused == {(p, "dalr-table9", "CLIP + SimCSE+RankCSE", "ResNet + SimCSE+RankCSE")
                       for p in profiles if p.startswith("dalr-")}
    assert caveated == CAVEATS


def test_plan_and_the_config_carry_a_presets_caveats(project):
    preset = project / "ablations/duet-table1.yaml"  # no shipped preset has one now: a copy gets a reason
    preset.write_text(preset.read_text().replace("variants:\n", "caveats:\n  VSE++: \"trained on a smaller crop\"\n"
                                                 "variants:\n", 1))
    rows = _rows(project, "duet-table1")
    assert rows["VSE++"]["caveat"] == "trained on a smaller crop"
    assert rows["VSRN"]["caveat"] == ""
    assert rows["DUET"]["caveat"] == ""
    text = plan_text(plan(project / "params.yaml", "duet-table1"), {})
    assert "\nVSE++: vsepp, params.yaml's values (demo)\n  not the paper's row: trained on a smaller crop\n" in text
    # the figures a table draws, and from which captions (DALR Fig. 3: COCO's test captions)
    assert "\nfigures: tsne_clusters (tsne_clusters encodes the coco captions)\n" in plan_text(
        plan(project / "params.yaml", "dalr-fig3"), {})
    with pytest.raises(ConfigError, match=r"ablate.caveats': \['nope'\] are not variants"):
        load_config(project / "params.yaml", {"ablate.caveats": {"nope": "a reason"}})
