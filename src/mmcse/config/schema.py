"""The root `Config`, one frozen dataclass per section of ``params.yaml``, validated as a whole
(every ablation variant and sweep key included)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from mmcse.config.checks import check, fail
from mmcse.config.coercion import apply_overrides, resolve_path, set_overrides, to_dict
from mmcse.config.declared import SECTION, build
from mmcse.config.inputs import BaseConfig, DataConfig, DetectConfig, RegionsConfig, TeachersConfig
from mmcse.config.keys import check_variable_keys
from mmcse.config.runs import AblateConfig, EvaluateConfig, SweepConfig
from mmcse.config.training import RETRIEVAL_METHODS, LossConfig, ModelConfig, TrainConfig


@dataclass(frozen=True)
class Config:
    __pydantic_config__ = SECTION
    base: BaseConfig = field(default_factory=BaseConfig)
    """Settings every stage reads: the seed, the device, where data, models, metrics and plots go, and the tracking
    store"""
    data: DataConfig = field(default_factory=DataConfig)
    """stage: download (docs/real-data.md)"""
    detect: DetectConfig = field(default_factory=DetectConfig)
    """stage: detect_objects (docs/real-data.md)"""
    teachers: TeachersConfig = field(default_factory=TeachersConfig)
    """stage: cache_teachers (frozen, cached once, memory-mapped): the text, image and joint teachers"""
    regions: RegionsConfig = field(default_factory=RegionsConfig)
    """stage: cache_regions (train.method duet: DUET §4.1.1 region features; docs/duet.md)"""
    model: ModelConfig = field(default_factory=ModelConfig)
    """used by detect_objects (tokenizer) and train"""
    train: TrainConfig = field(default_factory=TrainConfig)
    """stage: train"""
    loss: LossConfig = field(default_factory=LossConfig)
    """every term has its own switch and weight (docs/methods.md)"""
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)
    """stage: evaluate"""
    ablate: AblateConfig = field(default_factory=AblateConfig)
    """stage: ablate (Prefect flow `ablations`)"""
    sweep: SweepConfig = field(default_factory=SweepConfig)
    """`mmcse sweep` / flows/sweep.py (Optuna)"""

    def validate(self, where: str) -> None:
        validate_sections(self, where, dataclasses.fields(self))
        validate_terms(self, where)
        # Every ablation/sweep override must name a real, valid parameter.
        raw = to_dict(self)
        for name, overrides in self.ablate.variants.items():
            # A variant's values are checked now too, not when its job starts.
            here = f"{where} (ablate.variants.{name})"
            check_variable_keys(overrides, here)
            variant = build(Config, apply_overrides(raw, overrides, where=here), here, "")
            job_sections = [f for f in dataclasses.fields(variant) if f.name not in ("ablate", "sweep")]
            validate_sections(variant, here, job_sections)
            validate_terms(variant, here)
        check_variable_keys(self.sweep.space, f"{where} (sweep.space)")
        for key in self.sweep.space:
            resolve_path(raw, key, where=f"{where} (sweep.space)")


def reads_pixels(cfg: Config) -> bool:
    """True when ``cfg`` trains VSE++ with its CNN in the loop (no region set: the images' pixels)."""
    return cfg.train.method == "vsepp" and cfg.model.vsepp.image_input == "pixels"


def validate_sections(cfg: Config, where: str, sections: Iterable[dataclasses.Field]) -> None:
    """Each section's cross-field rules (its ``validate``; types and bounds were checked as it was built), its
    sub-sections' first, all the way down: a new sub-section's rules run without being wired into its parent."""
    for f in sections:
        _validate_tree(getattr(cfg, f.name), where)


def _validate_tree(section: Any, where: str) -> None:
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            _validate_tree(value, where)
    if hasattr(section, "validate"):
        section.validate(where)


def validate_terms(cfg: Config, where: str) -> None:
    if cfg.data.pairs == "none" and cfg.train.method != "simcse":
        fail(where, "data.pairs", f"none (text corpus only) trains SimCSE alone, but train.method is "
              f"{cfg.train.method!r}: set train.method: simcse, or choose image–caption pairs (demo, flickr30k, coco)")
    if cfg.train.method in RETRIEVAL_METHODS:
        m = cfg.train.method
        check(cfg.train.epochs >= 1, where, "train.epochs", f"must be >= 1 with train.method {m} (0, no training, "
              "evaluates a sentence encoder as it was loaded)")
        check(cfg.data.pairs != "none", where, "data.pairs", f"none has no images; train.method {m} retrieves images")
        check(cfg.data.pairs != "cc12m", where, "data.pairs",
              f"cc12m has no val split, and train.method {m} picks its checkpoint by the val split's R@K")
        check("val" not in cfg.data.splits or cfg.data.pairs == "demo", where, "data.splits",
               f"must not include val with train.method {m}: the val split's R@K picks its best checkpoint")
        check(cfg.evaluate.retrieval.enabled, where, "evaluate.retrieval.enabled",
               f"must be true with train.method {m}: it is scored by image–text retrieval alone")
        check(not (cfg.train.distributed and m == "vsepp" and cfg.model.vsepp.image_input == "pixels"), where,
              "train.devices", "VSE++ on pixels trains on one process: its CNN's BatchNorm takes statistics over the "
              "whole batch, which a process that encodes its share does not see (set train.devices: 1)")
    if cfg.teachers.joint.image_side == "image_encoder":
        check(cfg.train.method != "kdmcse", where, "teachers.joint.image_side",
              "image_encoder puts v̂ in another space than t̂, but KDMCSE's soft labels compare the two "
              "(α^{t,v}, Eq. 7): use joint with train.method kdmcse")
    if cfg.loss.dalr.text_batches and cfg.loss.dalr.iml is False:
        fail(where, "loss.dalr.text_batches", "adds L_IML to text batches, but loss.dalr.iml is false")


def parse_config(raw: Mapping[str, Any] | None, where: str = "params.yaml") -> Config:
    """Build and validate a :class:`Config` from a nested mapping."""
    raw = dict(raw or {})
    config = build(Config, raw, where, "")
    config.validate(where)
    return config


def with_overrides(config: Config, overrides: Mapping[str, Any], where: str = "overrides") -> Config:
    """A new validated config with dotted overrides applied (ablation variants, sweep trials)."""
    return parse_config(set_overrides(to_dict(config), overrides, where), where=where)  # to_dict: a fresh tree
