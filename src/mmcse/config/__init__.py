"""Typed, frozen configuration parsed once from ``params.yaml``.

Every section of ``params.yaml`` maps to one frozen dataclass (`inputs`: base, data, detect,
teachers, regions; `training`: model, train, loss; `runs`: evaluate, ablate, sweep; `schema`: the
root `Config`, `parse_config`, `with_overrides`). Each section is declared once (`declared`: types,
bounds and descriptions on the field, pydantic checks them), so an unknown key fails with the list
of valid keys and a value of the wrong type or out of range fails with the dotted key named
(`checks`), all before any compute starts; cross-field rules are each section's ``validate``.
`coercion` applies dotted overrides and `keys` says which keys a job may vary. Reading a params
file with its preset and recipes is `mmcse.experiments.params`. This module is the package's public face.
"""

from mmcse.config.checks import ConfigError
from mmcse.config.coercion import apply_overrides, to_dict
from mmcse.config.inputs import (
    KARPATHY_SPLITS,
    TRANSFER_TASKS,
    BaseConfig,
    DataConfig,
    DemoDataConfig,
    DetectConfig,
    JointTeacherConfig,
    RegionsConfig,
    SourceConfig,
    SourcesConfig,
    TeachersConfig,
    TextTeacherConfig,
)
from mmcse.config.keys import FIXED_KEYS, UPSTREAM_KEYS, check_variable_keys, is_fixed
from mmcse.config.runs import (
    POOLERS,
    AblateConfig,
    EvaluateConfig,
    NdcgConfig,
    RetrievalConfig,
    SweepConfig,
    TransferConfig,
)
from mmcse.config.schema import Config, parse_config, reads_pixels, with_overrides
from mmcse.config.sections import DALRLossConfig, KDMCSELossConfig, MCSELossConfig, MCSEOLossConfig, SimCSELossConfig
from mmcse.config.training import (
    LAUNCH_KEYS,
    RETRIEVAL_METHODS,
    DuetLossConfig,
    DuetModelConfig,
    LossConfig,
    ModelConfig,
    TrainConfig,
    VseppModelConfig,
    VsrnModelConfig,
)

__all__ = [
    "FIXED_KEYS", "KARPATHY_SPLITS", "LAUNCH_KEYS", "POOLERS", "RETRIEVAL_METHODS", "TRANSFER_TASKS", "UPSTREAM_KEYS",
    "AblateConfig", "BaseConfig",
    "Config", "ConfigError", "DALRLossConfig", "DataConfig", "DemoDataConfig", "DetectConfig", "DuetLossConfig",
    "DuetModelConfig", "EvaluateConfig", "JointTeacherConfig", "KDMCSELossConfig", "LossConfig", "MCSELossConfig",
    "MCSEOLossConfig", "SimCSELossConfig",
    "ModelConfig", "NdcgConfig", "RegionsConfig", "RetrievalConfig", "SourceConfig", "SourcesConfig", "SweepConfig",
    "TeachersConfig", "TextTeacherConfig", "TrainConfig", "TransferConfig", "VseppModelConfig", "VsrnModelConfig",
    "apply_overrides",
    "check_variable_keys", "is_fixed", "parse_config", "reads_pixels", "to_dict", "with_overrides",
]
