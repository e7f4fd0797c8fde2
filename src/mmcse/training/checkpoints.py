"""Resume points and best weights: what a killed training continues from, written atomically and
checked before it is loaded (a damaged one is named and skipped, never loaded).
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from mmcse.config import Config
from mmcse.errors import CorruptArtifact
from mmcse.integrity.files import check_model_folder, check_safetensors, load_torch, read_json_artifact
from mmcse.models.student import HEADS_FILE, HEADS_META, Student

log = logging.getLogger(__name__)


@dataclass
class TrainState:
    step: int = 0
    best_score: float = -math.inf
    best_step: int = -1
    history: list[dict[str, float]] = field(default_factory=list)


def write_weights_folder(model: torch.nn.Module, weights: dict[str, torch.Tensor], folder: Path,
                         save: Callable[[Path], None]) -> None:
    """Write ``model`` with ``weights`` (the best checkpoint's, held in memory) to ``folder`` through
    ``save(tmp)``, atomically (`_swap_in`); the model's current weights are restored afterwards."""
    current = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model.load_state_dict(weights)
    tmp = folder.with_name(folder.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        save(tmp)
        _swap_in(tmp, folder)
    finally:
        model.load_state_dict(current)


def _swap_in(tmp: Path, final: Path) -> None:
    """Replace folder ``final`` by ``tmp`` so that one complete version always exists."""
    old = final.with_name(final.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    if old.exists():
        shutil.rmtree(old)


def save_resume_point(
    folder: Path, student: torch.nn.Module, optimizer, scheduler, scaler, state: TrainState, config_hash: str,
) -> None:
    tmp = folder.with_name(folder.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    save_file({k: v.detach().contiguous() for k, v in student.state_dict().items()}, str(tmp / "student.safetensors"))
    rng = {"rng": torch.get_rng_state()}
    if torch.cuda.is_initialized():  # dropout on the GPU draws from the CUDA generators
        rng["cuda_rng"] = torch.cuda.get_rng_state_all()
    torch.save(
        {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
         **rng},
        tmp / "trainer.pt",
    )
    (tmp / "state.json").write_text(
        json.dumps({"step": state.step, "best_score": state.best_score, "best_step": state.best_step,
                    "history": state.history, "config_hash": config_hash})
    )
    _swap_in(tmp, folder)


RESUME_WEIGHTS = ("student.safetensors", "trainer.pt")


def release_resume_point(out_dir: Path) -> int:
    """Delete a finished run's resume weights (student + AdamW moments, ~3x the model),
    keeping ``last/state.json`` for its history; returns the bytes freed.

    An ablation keeps dozens of finished runs whose result is already recorded; their
    resume points would only fill the disk and the DVC cache. A later ``train`` with the
    same folder starts afresh (see ``load_resume_point``)."""
    freed = 0
    for name in RESUME_WEIGHTS:
        path = out_dir / "last" / name
        if path.is_file():
            freed += path.stat().st_size
            path.unlink()
    return freed


def run_definition_hash(cfg: Config) -> str:
    """What defines a training run: everything but bookkeeping that cannot change the numbers
    (a resume point of another definition is not resumed)."""
    from mmcse.config import to_dict
    from mmcse.io import sha256_json

    run_def = to_dict(cfg)
    for section in ("ablate", "sweep", "evaluate"):
        run_def.pop(section)
    run_def["dev_pooler"] = cfg.evaluate.pooler  # it picks the best checkpoint
    return sha256_json(run_def)


@dataclass(frozen=True)
class ResumeDecision:
    """What `train` will do in a folder, known before it runs (`resume_point_run`): continue
    ``run_id`` from ``step``, or start afresh (``run_id`` None); ``stale_run`` is the folder's
    remembered run of the same configuration that a fresh start leaves behind, and ``reason`` why."""

    run_id: str | None = None
    step: int = 0
    stale_run: str | None = None
    reason: str = ""


def _resume_point_problem(folder: Path) -> str | None:
    """Why `load_resume_point` would not restore the resume point in ``folder`` (header-level checks:
    state fields, both weight files, the safetensors header, trainer.pt's zip directory); None: whole."""
    import zipfile

    try:
        meta = json.loads((folder / "state.json").read_text())
    except (OSError, ValueError) as err:
        return f"{folder / 'state.json'} is unreadable ({err})"
    if not isinstance(meta, dict) or not {"step", "best_score", "best_step", "history", "config_hash"} <= meta.keys():
        return f"{folder / 'state.json'} lacks fields"
    missing = [name for name in RESUME_WEIGHTS if not (folder / name).is_file()]
    if missing:
        return f"{folder}: {', '.join(missing)} released or missing"
    try:
        check_safetensors(folder / "student.safetensors", _IGNORED)
    except CorruptArtifact as err:
        return str(err)
    if not zipfile.is_zipfile(folder / "trainer.pt"):
        return f"{folder / 'trainer.pt'} is damaged (not a whole torch archive)"
    return None


def resume_point_run(out_dir: Path, cfg: Config, best_required: Sequence[str] = ()) -> ResumeDecision:
    """Whether ``train`` will continue the resume point in ``out_dir`` (same checks as
    `load_resume_point`: the configuration, the best checkpoint beside it, the files of ``last`` or
    its ``.old`` copy), so the caller continues that MLflow run only for a true resume, and starts a
    new one when training restarts from step 0. The run id is the folder's remembered run
    (`mmcse.tracking.remembered_run`), not part of the resume point: a tracked output holds nothing
    random (a resume point written by an older version that still names its run is read too).
    ``best_required``: the files a best checkpoint must hold (default: a student's, `BEST_REQUIRED`)."""
    from mmcse.tracking import remembered_run

    candidates = [f for f in (out_dir / "last", out_dir / "last.old") if (f / "state.json").is_file()]
    if not candidates or _recorded_definition(out_dir / "last") not in (None, run_definition_hash(cfg)):
        return ResumeDecision()  # nothing to resume, or another configuration's point: its run is not ours
    record = remembered_run(out_dir)
    remembered = record["run_id"] if record else None
    best = out_dir / "best"
    if best.is_dir():
        try:
            check_model_folder(best, _IGNORED, required=best_required or BEST_REQUIRED)
        except CorruptArtifact as err:
            return ResumeDecision(stale_run=remembered, reason=f"retrained from step 0: {err}")
    problems = []
    for folder in candidates:
        problem = _resume_point_problem(folder)
        if problem is None:
            meta = json.loads((folder / "state.json").read_text())
            return ResumeDecision(remembered or meta.get("run_id"), int(meta.get("step", 0)))
        problems.append(problem)
    return ResumeDecision(stale_run=remembered, reason="retrained from step 0: " + "; ".join(problems))


def _recorded_definition(folder: Path) -> str | None:
    """The run-definition hash a resume point in ``folder`` (or its ``.old`` copy) records; None
    when there is none or it cannot be read (the full checks of `load_resume_point` then apply)."""
    for candidate in (folder, folder.with_name(folder.name + ".old")):
        try:
            meta = json.loads((candidate / "state.json").read_text())
        except (OSError, ValueError):
            continue
        if isinstance(meta, dict) and isinstance(meta.get("config_hash"), str):
            return meta["config_hash"]
    return None


def load_resume_point(
    folder: Path, student: torch.nn.Module, optimizer, scheduler, scaler, config_hash: str,
    best_required: Sequence[str] | None = None,
) -> TrainState | None:
    """Restore the resume point in ``folder`` (or the ``.old`` copy a kill between the renames
    of ``_swap_in`` left). Every file is checked before anything is restored: a damaged one is
    named in a warning and the next copy tried, else training starts afresh. A damaged best
    checkpoint beside it is deleted and training starts afresh too: the best weights can only
    be had again by replaying the run (the resume point holds the latest weights, not the best).
    ``best_required``: the files a best checkpoint must hold (default: a student's, `BEST_REQUIRED`)."""
    if _recorded_definition(folder) not in (None, config_hash):
        return None  # another configuration's run (e.g. another method): its best folder is not checked
    if best_is_damaged(folder.parent / "best", BEST_REQUIRED if best_required is None else best_required):
        return None
    damaged = False
    for candidate in (folder, folder.with_name(folder.name + ".old")):
        if not (candidate / "state.json").is_file():
            continue
        try:
            loaded = _read_resume_point(candidate, student, config_hash)
        except CorruptArtifact as err:
            log.warning("%s", err)
            damaged = True
            continue
        if loaded is None:
            return None
        meta, weights, trainer = loaded
        student.load_state_dict(weights)
        optimizer.load_state_dict(trainer["optimizer"])
        scheduler.load_state_dict(trainer["scheduler"])
        if trainer.get("scaler"):
            scaler.load_state_dict(trainer["scaler"])
        torch.set_rng_state(trainer["rng"])
        if "cuda_rng" in trainer and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(trainer["cuda_rng"])
        return TrainState(meta["step"], meta["best_score"], meta["best_step"], meta["history"])
    if damaged:
        log.warning("%s: no whole resume point; training starts afresh from step 0", folder)
    return None


_IGNORED = "resume point ignored"


def _read_resume_point(
    folder: Path, student: Student, config_hash: str
) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, Any]] | None:
    """``(state, student weights, trainer state)`` of a resume point, checked against the model
    being trained; None for another configuration's point or released weights."""
    meta = read_json_artifact(folder / "state.json", _IGNORED)
    if not isinstance(meta, dict) or not {"step", "best_score", "best_step", "history", "config_hash"} <= meta.keys():
        raise CorruptArtifact(folder / "state.json", "fields missing", _IGNORED)
    if meta["config_hash"] != config_hash:
        return None  # a different configuration: start afresh rather than mix runs
    if not all((folder / name).is_file() for name in RESUME_WEIGHTS):
        return None  # weights released by release_resume_point: only the history is left
    weights_file = folder / "student.safetensors"
    check_safetensors(weights_file, _IGNORED)
    weights = load_file(str(weights_file))
    expected = student.state_dict()
    if weights.keys() != expected.keys() or any(weights[k].shape != v.shape for k, v in expected.items()):
        raise CorruptArtifact(weights_file, "its tensors do not match the model being trained", _IGNORED)
    trainer = load_torch(folder / "trainer.pt", _IGNORED, weights_only=True)
    if not isinstance(trainer, dict) or not {"optimizer", "scheduler", "rng"} <= trainer.keys():
        raise CorruptArtifact(folder / "trainer.pt", "optimizer, scheduler or RNG state missing", _IGNORED)
    return meta, weights, trainer


BEST_REQUIRED = ("config.json", "model.safetensors", HEADS_FILE, HEADS_META)


def best_is_damaged(best_dir: Path, required: Sequence[str] = ()) -> bool:
    """Check a best checkpoint folder (HF safetensors headers, JSON files, required files);
    a damaged one is named in a warning and deleted (True)."""
    if not best_dir.is_dir():
        return False
    try:
        check_model_folder(best_dir, "retraining from step 0 to rebuild it", required=required or BEST_REQUIRED)
    except CorruptArtifact as err:
        log.warning("%s", err)
        shutil.rmtree(best_dir)
        return True
    return False


def load_history(folder: Path) -> list[dict[str, Any]]:
    return json.loads((folder / "last" / "state.json").read_text())["history"]
