"""Method recipes and profiles that compose: each table row trains with its own paper's recipe,
profiles leave no residue, `mmcse plan` shows a table's rows before any compute."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest
import yaml

from mmcse.cli import main as cli_main
from mmcse.config import ConfigError
from mmcse.experiments.params import load_config
from mmcse.experiments.plan import plan
from mmcse.experiments.profiles import apply_profile, list_profiles
from mmcse.experiments.recipes import load_recipes, owned_keys, profile_values
from tests.conftest import REPO


def _applied(project, *names: str) -> bytes:
    shutil.copy(REPO / "params.yaml", project / "params.yaml")
    for name in names:
        apply_profile(project / "params.yaml", name)
    return (project / "params.yaml").read_bytes()


def test_the_committed_params_are_the_demo_profile(project):
    assert apply_profile(project / "params.yaml", "demo") == {}
    assert (project / "params.yaml").read_bytes() == (REPO / "params.yaml").read_bytes()


def test_a_profile_gives_the_same_params_whatever_was_applied_before(project):
    assert _applied(project, "mcseo-flickr-bert", "dalr-flickr-bert") == _applied(project, "dalr-flickr-bert")
    text = _applied(project, "mcseo-flickr-bert", "dalr-flickr-bert").decode()
    assert "sam2" not in yaml.safe_load(text)["detect"]["backend"]  # mcseo's detect backend is gone
    assert yaml.safe_load(text)["teachers"]["image_encoder"] == "colour-edge-grid"  # and its ResNet-50


@pytest.mark.slow  # every profile, applied twice each
def test_every_profile_composes_with_demo_and_duet(project):
    original = (REPO / "params.yaml").read_bytes()
    for name in list_profiles(REPO):
        assert _applied(project, name, "demo") == original, f"{name} then demo is not the offline params.yaml"
        assert _applied(project, "duet-coco", name) == _applied(project, name), name


def test_profile_show_prints_the_changes_and_writes_nothing(project):
    before = (project / "params.yaml").read_bytes()
    got = subprocess.run([sys.executable, "-m", "mmcse.cli", "profile", "--show", "mcseo-flickr-bert"], cwd=project,
                         capture_output=True, text=True)
    assert got.returncode == 0, got.stderr
    assert "detect.backend: 'annotations' -> 'sam2'" in got.stdout and "would change" in got.stdout
    assert (project / "params.yaml").read_bytes() == before


def test_every_recipe_value_names_its_source():
    """A recipe value is the paper's: each line of settings/encoders says where it comes from."""
    for file in sorted((REPO / "recipes").glob("*.yaml")):
        block = False
        for line in file.read_text().splitlines():
            if re.match(r"^(settings|encoders):", line):
                block = True
                continue
            if block and re.match(r"^\s+[\w.]+:\s*\S", line) and "train.method" not in line and "{}" not in line:
                assert "#" in line, f"{file.name}: no source for `{line.strip()}`"


def _plan_rows(project, preset: str) -> dict[str, dict]:
    return {row["variant"]: row for row in plan(project / "params.yaml", preset)["rows"]}


def test_under_a_kdmcse_profile_each_baseline_row_trains_its_own_recipe(project):
    apply_profile(project / "params.yaml", "kdmcse-flickr-bert")
    rows = _plan_rows(project, "baselines")
    mcse, dalr, kdmcse, simcse = (rows[n]["config"] for n in ("MCSE", "DALR", "KDMCSE", "SimCSE"))
    assert (mcse["teachers"]["image_encoder"], mcse["teachers"]["image_weights"]) == ("resnet50", "IMAGENET1K_V1")
    assert (mcse["loss"]["lambda_img"], mcse["train"]["epochs"], mcse["data"]["captions"]) == (0.01, 3, "random")
    # MCSE trains on its ResNet-50 alone; the recipe's CLIP is read only by loss.mcse.clip_text (KDMCSE Table 5)
    assert (mcse["teachers"]["joint"]["kind"], mcse["loss"]["mcse"]["clip_text"]) == ("clip", False)
    assert [t["teacher"] for t in dalr["teachers"]["text"]] == [
        "princeton-nlp/unsup-simcse-bert-base-uncased", "voidism/diffcse-bert-base-uncased-sts"]
    assert (dalr["loss"]["dalr"]["lambda_cml"], dalr["train"]["learning_rate"], dalr["train"]["batch_size"]) == \
        (0.1, 2e-5, 128)
    assert (kdmcse["teachers"]["joint"]["kind"], kdmcse["loss"]["kdmcse"]["threshold"]) == ("clip", 0.9)
    assert (simcse["train"]["method"], simcse["train"]["epochs"]) == ("simcse", 3)
    for row in (mcse, dalr, kdmcse, simcse):  # the table's context is every row's
        assert (row["data"]["pairs"], row["model"]["name_or_path"], row["base"]["profile"]) == \
            ("flickr30k", "bert-base-uncased", "kdmcse-flickr-bert")
    assert rows["MCSE"]["recipe"] == "mcse" and rows["MCSE"]["encoder"] == "bert"
    # the ablate stage and the flow read the same rows: load_config carries each row's recipe
    cfg = load_config(project / "params.yaml", overrides={"ablate.preset": "baselines"})
    assert cfg.ablate.variants["MCSE"]["teachers.image_encoder"] == "resnet50"


def test_paper_recipes_clip_as_their_authors_code_and_mcseos_mcse_row_takes_the_longest_caption(project):
    """The authors' src/train_mix.py clip the gradient norm at 1.0 (MCSE, KDMCSE, DALR; SimCSE rows run MCSE's
    script; MCSEO follows MCSE); DUET names no clipping; MCSEO reproduces MCSE on its own longest captions."""
    apply_profile(project / "params.yaml", "mcseo-flickr-bert")
    rows = _plan_rows(project, "mcseo-table1")
    assert {name: row["config"]["train"]["max_grad_norm"] for name, row in rows.items()} == {
        "untrained": 1.0, "SimCSE": 1.0, "MCSE": 1.0, "MCSEO": 1.0}
    assert rows["MCSE"]["config"]["data"]["captions"] == "longest"
    assert rows["MCSE"]["overrode_recipe"] == {"data.captions": ["random", "longest"]}
    recipes = load_recipes(REPO)
    assert {m: r.values("bert" if r.encoders else None).get("train.max_grad_norm") for m, r in recipes.items()} == {
        "simcse": 1.0, "simcse-wiki": 1.0, "mcse": 1.0, "kdmcse": 1.0, "dalr": 1.0, "mcseo": 1.0, "duet": 0.0,
        "vsepp": 2.0, "vsrn": 2.0}


@pytest.mark.parametrize(("preset", "quoted"), [
    # Table 5 (the row set right in issue 35) in the fast tier; Tables 1 and 2 in the slow one
    ("dalr-table5", ("simcse-wiki", 1, 64, "none", False)),
    pytest.param("dalr-table1", ("simcse", 3, 64, "none", False), marks=pytest.mark.slow),
    pytest.param("dalr-table2", ("simcse-wiki", 1, 64, "none", True), marks=pytest.mark.slow)])
def test_dalrs_simcse_rows_train_the_recipe_of_the_model_each_table_quotes(project, preset, quoted):
    """DALR's SimCSE rows: Table 1's wiki cells are MCSE's runs (MCSE's run_wiki.sh: 3 epochs), Table 2's
    SimCSE's own "w/ MLM" model, Table 5's the MTEB paper's SimCSE-BERT-unsup (SimCSE's released model: its
    own recipe, one epoch on Wiki1M, no MLM)."""
    apply_profile(project / "params.yaml", "dalr-flickr-bert")
    row = _plan_rows(project, preset)["SimCSE (wiki)"]
    c = row["config"]
    assert (row["recipe"], c["train"]["epochs"], c["train"]["batch_size"], c["data"]["pairs"],
            c["loss"]["simcse"]["mlm"]) == quoted


@pytest.mark.slow  # end to end: the full suite runs it (fast tier under 5 min)
def test_a_row_may_name_another_recipe_of_its_method_simcses_own(project):
    """MCSEO Table 1 quotes SimCSE's own models: its SimCSE row trains SimCSE's recipe (run_unsup_example.sh:
    one epoch; README: RoBERTa batch 512, lr 1e-5) on Wiki1M alone, not the multimodal papers' baseline."""
    apply_profile(project / "params.yaml", "mcseo-flickr-roberta")
    rows = _plan_rows(project, "mcseo-table1")
    simcse = rows["SimCSE"]
    assert simcse["recipe"] == "simcse-wiki" and simcse["overrode_recipe"] == {}
    c = simcse["config"]
    assert (c["train"]["epochs"], c["train"]["batch_size"], c["train"]["learning_rate"], c["data"]["pairs"]) == \
        (1, 512, 1e-5, "none")
    assert rows["untrained"]["recipe"] == "simcse" and rows["MCSE"]["config"]["train"]["batch_size"] == 64
    raw = yaml.safe_load((project / "params.yaml").read_text())
    raw["ablate"]["preset"] = "none"
    for recipe, message in (("kdmcse", "names recipe kdmcse, which trains kdmcse, but the row trains simcse"),
                            ("simcse-web", r"recipe 'simcse-web' has no file in .*recipes: .*simcse-wiki")):
        raw["ablate"]["variants"] = {"a": {"train.method": "simcse", "recipe": recipe}}
        raw["ablate"]["reference"] = "a"
        (project / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
        with pytest.raises(ConfigError, match=message):
            load_config(project / "params.yaml")


def test_a_row_of_the_profiles_own_method_keeps_params_edits_and_reports_recipe_overrides(project):
    apply_profile(project / "params.yaml", "kdmcse-flickr-bert")
    raw = yaml.safe_load((project / "params.yaml").read_text())
    # a researcher's edit of KDMCSE's own setting (one where paper and code agree: a reading point takes the
    # table's reading, each point as its recipe sets it)
    raw["loss"]["kdmcse"]["soft_labels"] = "projections"
    (project / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    rows = _plan_rows(project, "kdmcse-table3")
    assert all(row["config"]["loss"]["kdmcse"]["soft_labels"] == "projections" for row in rows.values())
    no_filter = next(row for name, row in rows.items() if "threshold" in name.lower())
    assert no_filter["overrode_recipe"] == {"loss.kdmcse.threshold": [0.9, "off"]}


@pytest.mark.slow  # end to end: the full suite runs it (fast tier under 5 min)
def test_plan_prints_json_and_a_diff_and_refuses_an_unknown_preset_in_one_line(project, monkeypatch, capsys):
    """`mmcse plan` as its console script runs it (in this process: the CLI's own entry point)."""
    apply_profile(project / "params.yaml", "kdmcse-flickr-bert")
    monkeypatch.chdir(project)
    run = ["plan", "--preset", "baselines"]
    cli_main([*run, "--json"])
    rows = {r["variant"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert rows["MCSE"]["config"]["teachers"]["image_encoder"] == "resnet50"
    cli_main(run)
    out = capsys.readouterr().out
    assert "MCSE: mcse, recipe mcse (bert)" in out and '  teachers.image_encoder: "resnet50"' in out
    with pytest.raises(SystemExit) as exit_:
        cli_main(["plan", "--preset", "no-such-table"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and "no preset file" in err
    assert "baselines" in err  # the presets there are listed
    assert not (project / "data").exists() and not (project / "mlruns").exists()  # nothing computed


def test_bad_recipes_and_profiles_fail_in_one_line_naming_the_file(project):
    recipe = project / "recipes" / "mcse.yaml"
    good = recipe.read_text()
    recipe.write_text(good.replace("loss.lambda_img: 0.01", "loss.lambda_imgg: 0.01"))
    with pytest.raises(ConfigError, match=r"mcse\.yaml \(settings\).*loss\.lambda_imgg.*valid keys under loss"):
        load_recipes(project)
    recipe.write_text(good.replace("train.method: mcse", "train.method: mcse\n  data.source: senteval  # x"))
    with pytest.raises(ConfigError, match=r"mcse\.yaml: settings sets data\.source.*put them in a profile"):
        load_recipes(project)
    recipe.write_text(good)
    profile = project / "profiles" / "kdmcse.yaml"
    text = profile.read_text()
    profile.write_text(text.replace("  base.device: auto", "  base.device: auto\n  loss.lambda_img: 0.05"))
    with pytest.raises(ConfigError, match=r"kdmcse\.yaml: profile kdmcse-flickr-bert sets loss\.lambda_img, which "
                                          r"recipe kdmcse owns .*recipe_overrides"):
        profile_values("kdmcse-flickr-bert", project)
    # a file's shape is declared (issue 54): keys and types checked as params.yaml's are, the file and key named
    profile.write_text(text + "teacher_roles:\n  audio: {}\n")
    with pytest.raises(ConfigError, match=r"kdmcse\.yaml: unknown key\(s\) teacher_roles\.audio; valid keys under "
                                          r"teacher_roles: text, image"):
        profile_values("kdmcse-flickr-bert", project)
    profile.write_text(text.replace("recipe: kdmcse", "recipe: kdmcse\nrecipe_overrides: [train.epochs]"))
    with pytest.raises(ConfigError, match=r"kdmcse\.yaml: key 'recipe_overrides': must be a mapping, got list"):
        profile_values("kdmcse-flickr-bert", project)
    profile.write_text(text)
    recipe.write_text(good.replace("settings:", "setting:"))
    with pytest.raises(ConfigError, match=r"mcse\.yaml: unknown key\(s\) setting; valid keys: description, method, "
                                          r"settings, encoders"):
        load_recipes(project)
    recipe.write_text(good)
    raw = yaml.safe_load((project / "params.yaml").read_text())
    raw["base"]["profile"] = "kdmcse-wiki-bert"
    (project / "params.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match="unknown profile 'kdmcse-wiki-bert'"):
        load_config(project / "params.yaml")


def test_a_declared_recipe_override_reaches_every_row(project):
    profile = project / "profiles" / "kdmcse.yaml"
    profile.write_text(profile.read_text() + "recipe_overrides:\n  train.batch_size: 128   # one batch for every row\n")
    apply_profile(project / "params.yaml", "kdmcse-flickr-bert")
    rows = _plan_rows(project, "baselines")
    assert {row["config"]["train"]["batch_size"] for row in rows.values()} == {128}


def test_the_demo_profile_names_every_owned_key():
    demo = yaml.safe_load((REPO / "profiles" / "demo.yaml").read_text())["common"]
    assert set(owned_keys(REPO)) - {"base.profile"} == set(demo)


def test_sentence_encoder_profiles_train_on_flickr30k_entities_split_and_kdmcse_rows_its_scripts_epochs(project):
    """The papers' 29,783 Flickr30k training images (Flickr30k Entities' train.txt); DUET keeps Karpathy's;
    KDMCSE's rows train its authors' scripts' 3 epochs, DALR Table 7's at DALR's 4 (its App. C)."""
    params = project / "params.yaml"
    for name in list_profiles(project):  # what applying each profile writes (one is applied and loaded below)
        split = profile_values(name, project)["data.flickr_split"]
        paper = name.split("-")[0]
        assert split == ("entities" if paper in ("dalr", "kdmcse", "mcseo") else "karpathy"), name
    apply_profile(params, "kdmcse-flickr-bert")
    assert load_config(params).data.flickr_split == "entities"
    rows = {r["variant"]: r["config"]["train"] for r in plan(params, "kdmcse-table1")["rows"]}
    assert (rows["KDMCSE"]["epochs"], rows["KDMCSE"]["batch_size"]) == (3, 64)
    apply_profile(params, "dalr-flickr-bert")
    rows = {r["variant"]: r["config"]["train"] for r in plan(params, "dalr-table7")["rows"]}
    assert {v: (t["epochs"], t["batch_size"]) for v, t in rows.items()} == {"KDMCSE": (4, 128), "DALR": (4, 128)}


def test_a_preset_name_is_a_name_not_a_path(project):
    """Presets are confined to their folder as profiles are: `mmcse plan --preset ../../evil` reads nothing outside."""
    (project.parent / "evil.yaml").write_text("description: outside\nvariants: {a: {train.method: simcse}}\n")
    with pytest.raises(ConfigError, match=r"ablate.preset.*no preset file .*presets: baselines"):
        plan(project / "params.yaml", "../evil")
