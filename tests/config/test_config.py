import re

import pytest
import yaml

from mmcse.config import Config, ConfigError, parse_config, to_dict, with_overrides
from mmcse.experiments.params import load_config
from tests.conftest import REPO


def test_repo_params_parse_and_cover_every_section():
    cfg = load_config(REPO / "params.yaml")
    assert cfg.train.method == "mcse"
    assert set(yaml.safe_load((REPO / "params.yaml").read_text())) == set(to_dict(Config()))


def test_unknown_key_lists_valid_keys(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text("loss:\n  temprature: 0.1\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    msg = str(err.value)
    assert "loss.temprature" in msg and "temperature" in msg and "lambda_img" in msg and str(path) in msg


def test_unknown_section_lists_sections():
    with pytest.raises(ConfigError, match="valid keys: base, data"):
        parse_config({"trian": {}})


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        ({"loss": {"temperature": -0.1}}, "loss.temperature"),
        ({"loss": {"lambda_img": -1}}, "loss.lambda_img"),
        ({"train": {"batch_size": 1}}, "train.batch_size"),
        ({"train": {"method": "arccse"}}, "train.method"),
        ({"loss": {"kdmcse": {"margin": 2.0}}}, "loss.kdmcse.margin"),
        ({"loss": {"dalr": {"mismatch": "shuffle"}}}, "loss.dalr.mismatch"),
        ({"loss": {"dalr": {"cml": "sometimes"}}}, "loss.dalr.cml"),
        ({"loss": {"mcseo": {"beta": -0.1}}}, "loss.mcseo.beta"),
        ({"teachers": {"text": [{"teacher": "x", "weight": 0}]}}, "teachers.text[0].weight"),
        ({"teachers": {"joint": {"dim": 1}}}, "teachers.joint.dim"),
        ({"train": {"learning_rate": "fast"}}, "train.learning_rate"),
        ({"data": {"demo": {"image_size": 8}}}, "data.demo.image_size"),
        ({"evaluate": {"pooler": "max"}}, "evaluate.pooler"),
        ({"data": {"captions": "first"}}, "data.captions"),
        ({"ablate": {"reference": "nope"}}, "ablate.reference"),
        ({"data": {"transfer_tasks": ["MR"]}}, "data.transfer_tasks"),  # needs source senteval
        ({"data": {"source": "senteval", "transfer_tasks": ["SST5"]}}, "data.transfer_tasks"),
        ({"data": {"source": "senteval", "transfer_tasks": ["MR", "MR"]}}, "data.transfer_tasks"),
        ({"evaluate": {"transfer": {"kfold": 1}}}, "evaluate.transfer.kfold"),
        ({"evaluate": {"transfer": {"optim": "sgd"}}}, "evaluate.transfer.optim"),
        ({"evaluate": {"transfer": {"epoch_size": 8, "max_epoch": 4}}}, "evaluate.transfer.max_epoch"),
        ({"ablate": {"metric": "transfer_avg"}}, "ablate.metric"),  # needs ablate.transfer
        ({"model": {"config_overrides": {"hidden_size": 8}}}, "model.config_overrides"),
        ({"sweep": {"space": {"loss.lambda_img": {"type": "float", "low": 0, "high": 1, "log": True}}}},
         "sweep.space.loss.lambda_img"),
    ],
)
def test_out_of_range_values_name_the_key(raw, key):
    with pytest.raises(ConfigError, match=re.escape(f"key '{key}'")):
        parse_config(raw)


def test_yaml_scientific_notation_is_a_float():
    cfg = parse_config({"train": {"learning_rate": "3e-5"}})
    assert cfg.train.learning_rate == pytest.approx(3e-5)


def test_overrides_apply_and_validate():
    cfg = with_overrides(Config(), {"loss.lambda_img": 0.5, "train.method": "simcse"})
    assert cfg.loss.lambda_img == 0.5 and cfg.train.method == "simcse"
    with pytest.raises(ConfigError, match="valid keys under loss"):
        with_overrides(Config(), {"loss.lamda": 1.0})
    with pytest.raises(ConfigError, match="loss.temperature"):
        with_overrides(Config(), {"loss.temperature": 0})


def test_ablation_variant_with_unknown_key_fails_at_load():
    with pytest.raises(ConfigError, match="ablate.variants.bad"):
        parse_config({"ablate": {"variants": {"mcse": {}, "bad": {"loss.nope": 1}}}})


def test_ablation_variant_with_bad_value_fails_at_load():
    with pytest.raises(ConfigError, match=r"ablate.variants.cold.*loss.temperature"):
        parse_config({"ablate": {"variants": {"mcse": {}, "cold": {"loss.temperature": -1.0}}}})


def test_sweep_space_must_name_real_params():
    with pytest.raises(ConfigError, match="loss.nope"):
        parse_config({"sweep": {"space": {"loss.nope": {"type": "float", "low": 0.1, "high": 1}}}})


def test_config_is_frozen():
    cfg = Config()
    with pytest.raises(AttributeError):
        cfg.loss.temperature = 1.0  # type: ignore[misc]


def test_sweep_space_can_name_every_method_knob():
    keys = ["loss.kdmcse.margin", "loss.kdmcse.threshold", "loss.dalr.lambda_cml", "loss.dalr.mu_iml",
            "loss.dalr.consistency_margin", "loss.mcseo.beta", "loss.lambda_img"]
    space = {k: {"type": "float", "low": 0.01, "high": 0.2} for k in keys}
    assert set(parse_config({"sweep": {"space": space}}).sweep.space) == set(keys)
    with pytest.raises(ConfigError, match="loss.kdmcse.margn"):
        parse_config({"sweep": {"space": {"loss.kdmcse.margn": {"type": "float", "low": 0, "high": 1}}}})


def test_params_yaml_survives_the_rewrite_of_dvc_exp_run_set_param(tmp_path):
    """`dvc exp run -S key=value` rewrites params.yaml with DVC's round-trip YAML dumper; the
    file must still parse, to the same values but the one that was set."""
    import shutil

    import yaml
    from dvc.utils.serialize import load_yaml, modify_yaml

    from tests.conftest import REPO

    params = tmp_path / "params.yaml"
    shutil.copy(REPO / "params.yaml", params)
    with modify_yaml(str(params)) as tree:
        tree["ablate"]["preset"] = "dalr-table9"
    expected = yaml.safe_load((REPO / "params.yaml").read_text())
    expected["ablate"]["preset"] = "dalr-table9"
    assert load_yaml(str(params)) == expected  # DVC's own reader, as the stages' params check uses
    assert yaml.safe_load(params.read_text()) == expected


def test_training_on_the_retrieval_test_split_is_refused(tmp_path):
    import pytest

    from mmcse.config import ConfigError
    from mmcse.experiments.params import load_config

    params = tmp_path / "params.yaml"
    params.write_text("data: {pairs: flickr30k, splits: [train, test]}\n")
    with pytest.raises(ConfigError, match="data.splits.*retrieval test set"):
        load_config(params)


def test_retrieval_and_ndcg_keys_are_checked(tmp_path):
    import pytest

    from mmcse.config import ConfigError
    from mmcse.experiments.params import load_config

    params = tmp_path / "params.yaml"
    for text, message in (("evaluate: {ndcg: {relevance: [bleu]}}", "unknown kind 'bleu'; valid: rouge_l, spice"),
                          ("evaluate: {retrieval: {block_size: 0}}", "evaluate.retrieval.block_size"),
                          ("data: {demo: {retrieval_images: 3}}", "data.demo.retrieval_images")):
        params.write_text(text + "\n")
        with pytest.raises(ConfigError, match=message):
            load_config(params)


def test_a_sweep_must_move_a_weight_its_trials_use():
    from mmcse.config import ConfigError
    from mmcse.methods.objectives import Objective, check_sweep_space

    def sweep_check(cfg: Config) -> None:
        check_sweep_space(Objective.of(cfg), cfg.sweep.space)

    space = {"sweep": {"space": {"loss.lambda_img": {"type": "float", "low": 0.001, "high": 1.0, "log": True}}}}
    sweep_check(parse_config({**space, "train": {"method": "mcse"}}))
    sweep_check(parse_config({**space, "train": {"method": "kdmcse"},
                                    "loss": {"kdmcse": {"pair_objective": "simcse_plus_kdmcse"}}}))
    swept = "'loss.lambda_img': is swept, but train.method"
    with pytest.raises(ConfigError, match=rf"{swept} 'kdmcse' trains .*Algorithm 1.*simcse_plus_kdmcse"):
        sweep_check(parse_config({**space, "train": {"method": "kdmcse"}}))
    with pytest.raises(ConfigError, match=f"{swept} 'dalr' has no term it weighs: drop it from sweep.space$"):
        sweep_check(parse_config({**space, "train": {"method": "dalr"}}))
    # loading such a configuration is fine: only a sweep refuses it
    assert parse_config({**space, "train": {"method": "dalr"}}).train.method == "dalr"
