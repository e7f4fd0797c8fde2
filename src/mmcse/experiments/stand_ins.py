"""Offline stand-in teachers under a paper profile: named per row, refused unless asked for.

The demo trains with teachers this machine has without a download (``packaged:*`` text teachers, the
CCA joint teacher, colour-edge-grid image features). Under a paper profile such a teacher is not the
paper's, so a row that trains with one would report a number beside the paper's that means something
else. `check_stand_ins` refuses such a configuration before anything runs (the check_params stage, the
ablate stage, `mmcse plan`), one line naming the row and the teacher; ``teachers.stand_ins: allow``
trains it anyway and `mmcse plan` marks the row. Only the teachers a row trains with count: the feature
groups its loss terms read (`mmcse.methods.objectives.needed_features`) and, for the retrieval methods,
the image encoder behind their region sets.
"""

from __future__ import annotations

from mmcse.config import RETRIEVAL_METHODS, Config, ConfigError
from mmcse.config.inputs import JOINT_TEXT_TEACHER
from mmcse.experiments.jobs import expand, job_config
from mmcse.experiments.recipes import DEMO
from mmcse.methods.objectives import Objective, needed_features

PACKAGED = "packaged:"  # a model shipped in a pip package: the demo's stand-in text teacher and student


def used_teacher_groups(cfg: Config) -> set[str]:
    """The cached feature groups ``cfg`` trains with: image, joint, text_teachers, objects."""
    o = Objective.of(cfg)
    groups = needed_features(o, pair_batch=True) | needed_features(o, pair_batch=False)
    if cfg.train.method in RETRIEVAL_METHODS and cfg.regions.source == "objects":
        groups.add("image")  # DUET / VSE++ region sets: the objects encoded with teachers.image_encoder
    return groups


def used_sets(cfg: Config) -> dict[str, bool]:
    """Which of the cache_teachers stage's sets ``cfg``'s terms read (`used_teacher_groups`): ``image`` (the
    image encoder's, also behind a CCA joint teacher or an image-only v̂), ``text`` (the text teachers'),
    ``cca_text`` (the text teacher a CCA joint teacher is fitted on) and ``joint`` (the joint teacher's)."""
    t, groups = cfg.teachers, used_teacher_groups(cfg)
    text = "text_teachers" in groups
    joint = "joint" in groups or (text and any(x.teacher == JOINT_TEXT_TEACHER for x in t.text))
    cca = joint and t.joint.kind == "cca"
    image = bool(groups & {"image", "objects"}) or cca or (joint and t.joint.image_side == "image_encoder")
    return {"image": image, "text": text, "cca_text": cca, "joint": joint}


def stand_ins(cfg: Config) -> list[str]:
    """The offline stand-ins among the teachers ``cfg`` trains with, each as ``key: what stands in``."""
    t, groups, used = cfg.teachers, used_teacher_groups(cfg), used_sets(cfg)
    found = []
    if used["text"]:
        for i, teacher in enumerate(t.text):
            if teacher.teacher.startswith(PACKAGED):
                found.append(f"teachers.text[{i}]: {teacher.teacher} ({teacher.pooler})")
    if used["cca_text"]:
        found.append(f"teachers.joint: a CCA fitted on {t.joint.text_teacher} and {t.image_encoder} features")
    image_side = used["joint"] and t.joint.image_side == "image_encoder"  # v̂: the image encoder's (image-only teacher)
    if (groups & {"image", "objects"} or image_side) and t.image_encoder == "colour-edge-grid":
        found.append("teachers.image_encoder: colour-edge-grid")
    if cfg.train.method in RETRIEVAL_METHODS and cfg.regions.source == "grid" and cfg.regions.grid_weights == "random":
        found.append(f"regions.grid_weights: random ({cfg.regions.grid_model})")
    return found


def paper_stand_ins(cfg: Config) -> list[str]:
    """`stand_ins` under a paper profile; none under demo, whose teachers are meant to stand in."""
    return [] if cfg.base.profile == DEMO else stand_ins(cfg)


def row_stand_ins(cfg: Config) -> dict[str, list[str]]:
    """Per ablation row (and ``params.yaml``: the train stage's own run), its stand-in teachers."""
    rows = {"params.yaml": stand_ins(cfg)}
    for job in expand(cfg):
        if job.variant not in rows:  # a row's seeds differ in base.seed only
            rows[job.variant] = stand_ins(job_config(cfg, job))
    return {name: found for name, found in rows.items() if found}


def check_stand_ins(cfg: Config, where: str = "params.yaml") -> dict[str, list[str]]:
    """Under a paper profile, refuse a row trained with stand-in teachers (one line naming the row and
    the teachers) unless ``teachers.stand_ins: allow``; returns the allowed ones (none under demo)."""
    if cfg.base.profile == DEMO:
        return {}
    rows = row_stand_ins(cfg)
    if rows and cfg.teachers.stand_ins != "allow":
        name, found = next(iter(rows.items()))
        table = cfg.ablate.title or "the ablation"
        row = "params.yaml's own run" if name == "params.yaml" else f"row {name!r} of {table}"
        more = f" ({len(rows) - 1} more row(s) too)" if len(rows) > 1 else ""
        raise ConfigError(
            f"{where}: under profile {cfg.base.profile}, {row} trains with offline stand-in teachers, not the "
            f"paper's: {'; '.join(found)}{more}. Name the paper's teacher (a preset by role: teachers.text: "
            "[{role: simcse}], from the profile's teacher_roles), or set teachers.stand_ins: allow to train it "
            "anyway (mmcse plan marks such rows)")
    return rows
