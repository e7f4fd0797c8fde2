"""`mmcse.config.declared`: a section's declaration is its validation, and pydantic's errors read as
the one line a bad params file has always got."""

import re
from dataclasses import dataclass, field
from typing import Annotated, Literal

import pytest
from pydantic import Field

from mmcse.config import ConfigError, parse_config
from mmcse.config.declared import SECTION, Bool, Int, Name, PositiveInt, build


@dataclass(frozen=True)
class Inner:
    __pydantic_config__ = SECTION
    size: Annotated[Int, Field(ge=8, le=512)] = 32
    rate: Annotated[float, Field(gt=0, description="0 would never move")] = 0.1
    names: list[Name] = field(default_factory=list)


@dataclass(frozen=True)
class Outer:
    __pydantic_config__ = SECTION
    inner: Inner = field(default_factory=Inner)
    steps: PositiveInt = 1
    switch: Bool | Literal["auto"] = "auto"


@pytest.mark.parametrize(("raw", "message"), [
    ({"steps": "5"}, "key 'x.steps': must be an integer, got '5'"),
    ({"steps": 2.0}, "key 'x.steps': must be an integer, got 2.0"),
    ({"steps": True}, "key 'x.steps': must be an integer, got True"),
    ({"steps": 0}, "key 'x.steps': must be >= 1"),
    ({"inner": {"size": 4}}, "key 'x.inner.size': must be in [8, 512]"),
    ({"inner": {"rate": 0}}, "key 'x.inner.rate': must be > 0 (0 would never move)"),
    ({"inner": {"rate": True}}, "key 'x.inner.rate': must be a number, got True"),
    ({"inner": {"rate": "fast"}}, "key 'x.inner.rate': must be a number, got 'fast'"),
    ({"inner": {"names": ["a", " "]}}, "key 'x.inner.names[1]': must not be empty"),
    ({"inner": []}, "key 'x.inner': must be a mapping, got list"),
    ({"switch": "sometimes"}, "key 'x.switch': must be true or false or one of ['auto'], got 'sometimes'"),
    ({"inner": {"sise": 1, "rat": 2}},
     "unknown key(s) x.inner.sise, x.inner.rat; valid keys under x.inner: size, rate, names"),
])
def test_a_declaration_refuses_in_one_line_naming_the_key(raw, message):
    with pytest.raises(ConfigError, match=re.escape(f"here: {message}" if message.startswith("unknown") else message)):
        build(Outer, raw, "here", "x")


def test_what_yaml_gives_is_read_as_yaml_meant_it():
    got = build(Outer, {"inner": {"rate": "1e-3", "size": 64}, "switch": False}, "here")
    assert got == Outer(inner=Inner(size=64, rate=0.001), switch=False)
    assert build(Outer, {"inner": {"rate": 2}}, "here").inner.rate == 2.0 and build(Outer, {}, "here") == Outer()
    # the real sections: a bound with its reason, kdmcse's off switch as YAML 1.1 writes it
    with pytest.raises(ConfigError, match=re.escape("key 'train.batch_size': must be >= 2 (in-batch negatives)")):
        parse_config({"train": {"batch_size": 1}})
    assert parse_config({"loss": {"kdmcse": {"threshold": False}}}).loss.kdmcse.threshold_value is None
    with pytest.raises(ConfigError, match=re.escape("key 'loss.kdmcse.threshold': must be a number or off, got True")):
        parse_config({"loss": {"kdmcse": {"threshold": True}}})


def test_an_unknown_evaluator_is_refused_by_the_parameter_check_listing_the_evaluators(tmp_path):
    """``evaluate.evaluators`` is checked against the declared evaluators before any stage runs."""
    import yaml

    from mmcse.config import ConfigError
    from mmcse.experiments.params import check_params
    from tests.conftest import REPO, params_copy

    root = params_copy(tmp_path)
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    raw["evaluate"]["evaluators"] = ["sts", "sentiment"]
    (root / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    with pytest.raises(ConfigError, match=r"evaluate.evaluators': \['sentiment'\] is no evaluator; the evaluators: "
                                          r"geometry, mteb, retrieval, sts, transfer \(or all\)"):
        check_params(root / "params.yaml")


def test_building_a_validator_reads_no_source(monkeypatch):
    """The fields' docstrings are read for the JSON Schema only: building a section's validator reads and
    parses no module source (pydantic's use_attribute_docstrings did), because CPython 3.11's AST
    constructor fails at random when two threads parse at once (gh-106905), as an ablation's Prefect tasks
    did while validating their configurations; builds are serialized too (`declared._adapter`)."""
    import inspect

    from mmcse.config import Config, declared

    def no_source(*args, **kwargs):
        raise AssertionError("module source read while building a validator")

    declared._adapter.cache_clear()
    monkeypatch.setattr(inspect, "getsourcelines", no_source)
    monkeypatch.setattr(inspect, "getsource", no_source)
    try:
        assert declared.build(Config, {"train": {"batch_size": 8}}, "params.yaml").train.batch_size == 8
    finally:
        monkeypatch.undo()
        declared._adapter.cache_clear()
    # the schema still has them
    assert declared.json_schema(Config)["$defs"]["TrainConfig"]["properties"]["dropout"]["description"].startswith(
        "the encoder's dropout")


@pytest.mark.parametrize("text,message", [
    ("  learning_rate: .inf", "key 'train.learning_rate': must be a finite number, got inf"),
    ("  learning_rate: -.inf", "key 'train.learning_rate': must be a finite number, got -inf"),
    ("  learning_rate: .nan", "key 'train.learning_rate': must be a finite number, got nan"),
    ("  max_steps: 100000000000000000000000", "key 'train.max_steps': must be at most 2,147,483,647"),
    ("  batch_size: 1000000000000", "key 'train.batch_size': must be at most 2,147,483,647"),
])
def test_the_parameter_check_refuses_what_no_run_can_use(tmp_path, text, message):
    """Issue 75.6: a non-finite number anywhere and an integer past 2³¹ − 1 are refused by `stages/check_params.py`'s
    check, with the key; a value within the bounds still passes."""
    from mmcse.experiments.params import check_params
    from tests.conftest import params_copy

    params = params_copy(tmp_path) / "params.yaml"
    key = text.split(":")[0]
    lines = params.read_text().splitlines()
    start = lines.index("train:                        # stage: train")
    at = next(i for i in range(start, len(lines)) if lines[i].startswith(key + ":"))
    params.write_text("\n".join([*lines[:at], text, *lines[at + 1:]]) + "\n")
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_params(params)
    params.write_text("\n".join([*lines[:at], f"{key}: 2147483647" if "steps" in key or "size" in key
                                 else f"{key}: 1.0e-5", *lines[at + 1:]]) + "\n")
    check_params(params)
