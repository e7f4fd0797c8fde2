"""The JSON Schema of params.yaml (`mmcse schema`): committed, current, and as strict as the parser."""

import json
import subprocess
import sys

import jsonschema
import pytest
import yaml

from mmcse.config import Config
from mmcse.config.declared import json_schema
from tests.conftest import REPO


def test_the_committed_schema_is_the_declared_one_and_params_yaml_names_it():
    committed = json.loads((REPO / "params.schema.json").read_text())
    assert committed == json_schema(Config), "regenerate it: mmcse schema --out params.schema.json"
    assert (REPO / "params.yaml").read_text().splitlines()[0] == "# yaml-language-server: $schema=params.schema.json"


def test_the_schema_accepts_params_yaml_and_refuses_what_the_parser_refuses():
    schema = json_schema(Config)
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    jsonschema.validate(raw, schema)
    for section, key, value in (("loss", "temprature", 0.1), ("train", "batch_size", 1), ("train", "method", "arccse"),
                                ("train", "epochs", "3"), ("loss", "image_term", "yes")):
        bad = json.loads(json.dumps(raw))
        bad[section][key] = value
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    batch = schema["$defs"]["TrainConfig"]["properties"]["batch_size"]
    assert batch["minimum"] == 2 and batch["description"] == "in-batch negatives"


def test_mmcse_schema_prints_it():
    out = subprocess.run([sys.executable, "-m", "mmcse.cli", "schema"], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == json_schema(Config)


def test_the_typed_defaults_are_params_yaml():
    """issue 54: one source of defaults. `Config()` (what `tiny_config` builds on) is the committed params.yaml,
    which is the demo profile (`mmcse profile demo` gives it back byte for byte); each paper's values live in its
    recipe and profile."""
    from mmcse.config import parse_config, to_dict

    assert to_dict(Config()) == to_dict(parse_config(yaml.safe_load((REPO / "params.yaml").read_text())))


def test_every_field_of_params_yaml_has_its_description():
    """The JSON Schema's hover text: every key of every section, sub-sections and list items included, says
    what it is (a field's docstring, or its Field description)."""
    schema = json_schema(Config)
    undescribed = [f"{where}.{name}" for where, body in [("Config", schema), *schema["$defs"].items()]
                   for name, prop in body.get("properties", {}).items() if not prop.get("description")]
    assert undescribed == []
    assert len(schema["$defs"]) > 25  # every section reached (the walk sees them all)
