"""Resume points and best weights of one training run, and which configuration they belong to.

A training folder holds ``best/`` (the best dev checkpoint, what evaluation reads) and ``last/`` (the
resume point: weights, optimizer, scheduler, RNG and the history). Both are written atomically, both
say which configuration and which library code wrote them (`run_definition_hash`; the code's files are
listed too, `mmcse.integrity.code`, so a refusal names what changed) and carry their files' SHA-256 (``best/``:
its seal, `mmcse.integrity.files.SEAL`; ``last/``: ``state.json``'s ``files``), and both are checked
before anything is taken from them (`plan_start`): a folder left by another configuration, a damaged
or missing ``best/``, a ``best/`` that is not the step the resume point calls best, or a folder trained
by code that has been edited since (a loss, the loop: DVC reruns the stage, and the stage must not stop
at yesterday's weights) is never taken for this run's result. The best weights are held in memory and
written together with the next resume point, so on disk the two always agree (`Checkpoints`).

Both are also kept, as hard links, outside the folder (`kept_dir`, under the project's data folder):
`dvc exp run` checks every output out of its commit before it reproduces, which replaces an
interrupted run's ``last/`` with the committed one; the kept copy puts it back (`restore_kept`), so
"rerun to continue" holds under `dvc repro`, `dvc exp run` and a queued experiment alike. A finished
run's kept copy is removed (`Checkpoints.finish`): it is kept only while there is something to resume.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import shutil
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from mmcse.config import LAUNCH_KEYS, Config, to_dict
from mmcse.errors import CorruptArtifact, StageError, TrainingDiverged
from mmcse.integrity.code import TRAINING_CODE, changed_code, code_digest, code_files
from mmcse.integrity.files import (
    check_model_folder,
    check_safetensors,
    file_sha256,
    load_torch,
    read_json_artifact,
    read_seal,
    seal_folder,
)
from mmcse.io import BackgroundWriter, at_home, follow_umask, sha256_json, swap_in_dir
from mmcse.models.student import HEADS_FILE, HEADS_META
from mmcse.tracking import folder_key, remembered_run
from mmcse.training.distributed import from_lead_object, world

log = logging.getLogger(__name__)


@dataclass
class TrainState:
    step: int = 0
    best_score: float = -math.inf
    best_step: int = -1
    history: list[dict[str, float]] = field(default_factory=list)


BEST_REQUIRED = ("config.json", "model.safetensors", HEADS_FILE, HEADS_META)
RESUME_WEIGHTS = ("student.safetensors", "trainer.pt")
STATE_FIELDS = {"step", "best_score", "best_step", "history", "config_hash"}
_IGNORED = "resume point ignored"


def run_definition_hash(cfg: Config) -> str:
    """What defines a training run: the configuration but bookkeeping that cannot change the numbers,
    and the library code that trains (`mmcse.integrity.code.TRAINING_CODE`'s modules); a resume point or
    best checkpoint of another definition is never taken for this run's. Recorded as ``config_hash``."""
    run_def = to_dict(cfg)
    for section in ("ablate", "sweep", "evaluate"):
        run_def.pop(section)
    for key in LAUNCH_KEYS:  # 1 process or N: the same update, so the same run (resumable on either)
        run_def["train"].pop(key)
    run_def["dev_pooler"] = cfg.evaluate.pooler  # it picks the best checkpoint
    return sha256_json({"config": run_def, "code": code_digest(code_files(TRAINING_CODE))})


def code_change(recorded: dict[str, Any]) -> str | None:
    """``trained by other library code (changed since: <files>)`` when a folder's seal or state
    (``recorded``) was written by training code other than this process's; None when it was not (a
    different `run_definition_hash` is then another configuration's)."""
    code = recorded.get("code_files")
    current = code_files(TRAINING_CODE)
    if isinstance(code, dict) and code_digest(code) == code_digest(current):
        return None
    return f"trained by other library code (changed since: {changed_code(code, current)})"


# --------------------------------------------------------------------------- writing


def _fresh_tmp(folder: Path) -> Path:
    tmp = folder.with_name(folder.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    return tmp


def _disk_full(err: BaseException) -> bool:
    """ENOSPC, as an OSError or as the message a writer wraps it in (safetensors: "os error 28")."""

    if isinstance(err, OSError) and err.errno == errno.ENOSPC:
        return True
    text = str(err)
    return "No space left on device" in text or "os error 28" in text


def _tensor_bytes(tree: Any) -> int:
    """Bytes of the tensors in ``tree`` (a tensor, or dicts / lists of them: state dicts, optimizer state)."""
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(_tensor_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(_tensor_bytes(v) for v in tree)
    return 0


def disk_full_error(folder: Path, needed: int) -> StageError:
    """One line for a checkpoint that did not fit: the folder, about how much it needs, what is free."""
    free = shutil.disk_usage(folder.parent if folder.parent.exists() else Path(".")).free
    return StageError(f"{folder}: no space left on the device while writing it (it needs about "
                      f"{needed / 2**20:,.0f} MiB, {free / 2**20:,.0f} MiB are free on its file system); the "
                      "previous checkpoint is intact and the partial copy was removed: free space, then rerun to "
                      "continue from the last resume point")


def check_finite(weights: dict[str, torch.Tensor], what: str, step: int) -> None:
    """Refuse to save ``weights`` holding a NaN or infinity (one host sync for all tensors)."""
    floats = [(k, v) for k, v in weights.items() if v.is_floating_point()]
    if not floats:
        return
    finite = torch.stack([torch.isfinite(v).all() for _, v in floats]).cpu()
    bad = [k for (k, _), ok in zip(floats, finite.tolist(), strict=True) if not ok]
    if bad:
        raise TrainingDiverged(f"training diverged: {len(bad)} of {len(floats)} tensors of the {what} at step "
                               f"{step} are not finite (first: {bad[0]}); nothing was saved")


def write_weights_folder(model: torch.nn.Module, weights: dict[str, torch.Tensor], folder: Path,
                         save: Callable[[Path], None], **seal: Any) -> None:
    """Write ``model`` with ``weights`` (the best checkpoint's, held in memory) to ``folder`` through
    ``save(tmp)``, sealed with ``seal`` (e.g. ``config_hash``, ``step``) and every file's SHA-256, then
    swapped in atomically (`mmcse.io.swap_in_dir`); the model's current weights are restored afterwards."""
    current = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model.load_state_dict(weights)
    tmp = _fresh_tmp(folder)
    try:
        save(tmp)
        follow_umask(tmp)  # safetensors writes owner-only files; the checkpoint reads as every output does
        seal_folder(tmp, **seal)
        swap_in_dir(tmp, folder)
    except Exception as err:
        if _disk_full(err):
            raise disk_full_error(folder, _tensor_bytes(weights)) from None
        raise
    finally:
        model.load_state_dict(current)
        if tmp.exists():  # a failed write (a full disk) leaves no half folder behind
            shutil.rmtree(tmp, ignore_errors=True)


def unshared(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict as safetensors writes it: a tensor two keys share (BERT's LM head ties its bias to
    its decoder's) is written under each key, the second as a copy; loading fills both again."""
    seen: set[int] = set()
    out = {}
    for key, value in state.items():
        value = value.detach()
        storage = value.untyped_storage().data_ptr()
        out[key] = value.clone() if storage in seen else value.contiguous()
        seen.add(storage)
    return out


@dataclass
class ResumeSnapshot:
    """What a resume point holds, copied off the live model at one step (`resume_snapshot`), so that it can be
    written while training goes on: weights, trainer state (optimizer, scheduler, scaler, RNG), the run's state."""

    weights: dict[str, torch.Tensor]
    trainer: dict[str, Any]
    state: dict[str, Any]

    @property
    def nbytes(self) -> int:
        return _tensor_bytes((self.weights, self.trainer))


def _copied(tree: Any) -> Any:
    """``tree`` with every tensor copied to the CPU (a new tensor even where it is on the CPU already)."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().to("cpu", copy=True)
    if isinstance(tree, dict):
        return {k: _copied(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_copied(v) for v in tree)
    return tree


def resume_snapshot(student: torch.nn.Module, optimizer, scheduler, scaler, state: TrainState) -> ResumeSnapshot:
    """The resume point of this step as CPU copies: later steps may change the model, never the snapshot."""
    rng = {"rng": torch.get_rng_state()}
    if torch.cuda.is_initialized():  # dropout on the GPU draws from the CUDA generators
        rng["cuda_rng"] = torch.cuda.get_rng_state_all()
    trainer = {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
               "scaler": scaler.state_dict(), **rng}
    return ResumeSnapshot(_copied(unshared(student.state_dict())), _copied(trainer),
                          json.loads(json.dumps(asdict(state))))


def write_resume_point(folder: Path, snapshot: ResumeSnapshot, config_hash: str) -> None:
    """The resume point ``snapshot`` in ``folder``: weights, trainer state and ``state.json`` with the history,
    the configuration's hash and both files' SHA-256, swapped in whole (a crash leaves the previous one)."""
    tmp = _fresh_tmp(folder)
    try:
        tmp.mkdir(parents=True)
        save_file(snapshot.weights, str(tmp / "student.safetensors"))
        torch.save(snapshot.trainer, tmp / "trainer.pt")
        state = snapshot.state
        (tmp / "state.json").write_text(
            json.dumps({"step": state["step"], "best_score": state["best_score"], "best_step": state["best_step"],
                        "history": state["history"], "config_hash": config_hash,
                        "code_files": code_files(TRAINING_CODE),
                        "files": {name: file_sha256(tmp / name) for name in RESUME_WEIGHTS}})
        )
        follow_umask(tmp)
        swap_in_dir(tmp, folder)
    except Exception as err:
        if _disk_full(err):
            raise disk_full_error(folder, snapshot.nbytes) from None
        raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def save_resume_point(
    folder: Path, student: torch.nn.Module, optimizer, scheduler, scaler, state: TrainState, config_hash: str,
) -> None:
    """The resume point in ``folder``, written now (`resume_snapshot`, `write_resume_point`)."""
    write_resume_point(folder, resume_snapshot(student, optimizer, scheduler, scaler, state), config_hash)


def release_resume_point(out_dir: Path) -> int:
    """Delete a finished run's resume weights (student + AdamW moments, ~3x the model),
    keeping ``last/state.json`` for its history; returns the bytes freed.

    An ablation keeps dozens of finished runs whose result is already recorded; their
    resume points would only fill the disk and the DVC cache. A later ``train`` with the
    same folder starts afresh (see `plan_start`)."""
    freed = 0
    for name in RESUME_WEIGHTS:
        path = out_dir / "last" / name
        if path.is_file():
            freed += path.stat().st_size
            path.unlink()
    return freed


def kept_dir(cfg: Config, out_dir: Path, config_hash: str) -> Path:
    """Where the resume point of the run of ``config_hash`` in ``out_dir`` is kept outside every DVC
    output: ``<project>/<base.data_dir>/resume/<run>-<folder>`` (`mmcse.io.at_home`: the workspace's,
    also when DVC runs the stage in an experiment's copy; the folder as the records name it)."""
    return (at_home(Path(cfg.base.data_dir) / "resume")
            / f"{config_hash[:16]}-{sha256_json(folder_key(out_dir))[:8]}")


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)  # the same bytes, no more disk (the writers replace files, never rewrite them)
    except OSError:
        shutil.copy2(src, dst)


def keep_resume_point(out_dir: Path, kept: Path) -> None:
    """``out_dir``'s ``best/`` and ``last/`` mirrored into ``kept`` (hard links, swapped in whole)."""
    tmp = _fresh_tmp(kept)
    try:
        tmp.mkdir(parents=True)
        for name in ("best", "last"):
            if (out_dir / name).is_dir():
                shutil.copytree(out_dir / name, tmp / name, copy_function=_link_or_copy)
        swap_in_dir(tmp, kept)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def restore_kept(out_dir: Path, config_hash: str, kept: Path) -> str | None:
    """Put the kept resume point of ``config_hash`` (`keep_resume_point`) back into ``out_dir`` when it is
    ahead of what the folder holds (another configuration's ``last/``, as DVC's checkout leaves it, or an
    earlier step); returns what was done, None when nothing was. `plan_start` then checks it like any."""
    meta = _state(kept / "last")
    if meta is None or meta.get("config_hash") != config_hash or _resume_point_problem(kept / "last"):
        return None
    own = _state(out_dir / "last")
    if own is not None and own.get("config_hash") == config_hash and own.get("step", -1) >= meta["step"]:
        return None
    for name in ("best", "last"):
        if (kept / name).is_dir():
            tmp = _fresh_tmp(out_dir / name)
            shutil.copytree(kept / name, tmp, copy_function=_link_or_copy)
            swap_in_dir(tmp, out_dir / name)
    return f"the resume point of step {meta['step']} put back into {out_dir} from {kept}"


# --------------------------------------------------------------------------- reading


def _state(folder: Path) -> dict[str, Any] | None:
    """``state.json`` of a resume point, None when absent or unreadable."""
    try:
        meta = json.loads((folder / "state.json").read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def _resume_point_problem(folder: Path) -> str | None:
    """Why the resume point in ``folder`` cannot be restored (state fields, both weight files, the
    safetensors header, trainer.pt's zip directory, and each file against the SHA-256 its state.json
    records); None: whole."""
    meta = _state(folder)
    if meta is None:
        return f"{folder / 'state.json'}: unreadable"
    if not STATE_FIELDS <= meta.keys():
        return f"{folder / 'state.json'}: fields missing"
    missing = [name for name in RESUME_WEIGHTS if not (folder / name).is_file()]
    if missing:
        return f"{folder}: {', '.join(missing)} released or missing"
    try:
        check_safetensors(folder / "student.safetensors", _IGNORED)
    except CorruptArtifact as err:
        return str(err)
    if not zipfile.is_zipfile(folder / "trainer.pt"):
        return f"{folder / 'trainer.pt'}: damaged (not a whole torch archive)"
    for name, digest in (meta.get("files") or {}).items():
        if file_sha256(folder / name) != digest:
            return (f"{folder / name}: content does not match the SHA-256 state.json records (damaged since it "
                    "was written)")
    return None


def best_problem(best: Path, config_hash: str, best_step: int, required: Sequence[str]) -> str | None:
    """Why ``best`` is not this run's best checkpoint at ``best_step`` (missing, damaged — headers or
    its files' SHA-256 —, unsealed, another configuration's, or another step's); None: it is."""
    if not best.is_dir():
        return f"{best} is missing"
    try:
        check_model_folder(best, "rebuilt", required=required)
        sealed = read_seal(best, "rebuilt")
    except CorruptArtifact as err:
        return str(err)
    if sealed is None:
        return f"{best} has no checkpoint seal (written by an older mmcse)"
    if sealed.get("config_hash") != config_hash:
        changed = code_change(sealed)
        return f"{best} holds a checkpoint {changed}" if changed else f"{best} holds another configuration's checkpoint"
    if sealed.get("step") != best_step:
        return f"{best} holds step {sealed.get('step')}, not the best step {best_step} of the resume point"
    return None


@dataclass(frozen=True)
class StartPlan:
    """Where a training in a folder starts (`plan_start`): from the resume point ``resume_from`` at
    ``step`` (``rewrite_best``: its weights are the best ones and ``best/`` is rebuilt from them), or
    from step 0 (``resume_from`` None); ``reason``: why something in the folder was not taken."""

    resume_from: Path | None = None
    step: int = 0
    rewrite_best: bool = False
    reason: str = ""


def plan_start(out_dir: Path, config_hash: str, best_required: Sequence[str] = BEST_REQUIRED) -> StartPlan:
    """What `Checkpoints.start` will do in ``out_dir`` for the configuration ``config_hash``, known before
    anything loads. A resume point is taken only when it is this configuration's and whole (``last/``,
    else the ``.old`` copy a kill between renames left) and ``best/`` is this configuration's checkpoint
    of the step that resume point calls best; when ``best/`` is not (deleted, damaged, another
    configuration's or step's), it is rebuilt from the resume point if the best step is the resume
    point's own, else training restarts from step 0 (the best weights can only be had by training)."""
    last = out_dir / "last"
    problems = []
    for folder in (last, last.with_name(last.name + ".old")):
        meta = _state(folder)
        if meta is None and not (folder / "state.json").exists():
            continue
        if meta is not None and meta.get("config_hash") != config_hash:
            if (changed := code_change(meta)) is not None:
                # mixing steps of two versions of a loss is neither version's result: trained again
                problems.append(f"{folder} was {changed}")
            continue  # another configuration's (another method, a changed param): not ours, not a problem
        problem = _resume_point_problem(folder)
        if problem is not None:
            problems.append(problem)
            continue
        step, best_step = int(meta["step"]), int(meta["best_step"])
        wrong = best_problem(out_dir / "best", config_hash, best_step, best_required) if best_step >= 0 else None
        skipped = "".join(f"{problem}; " for problem in problems)
        if wrong is None:
            return StartPlan(folder, step, reason=f"{skipped}resumed from {folder}" if problems else "")
        if best_step == step:
            return StartPlan(folder, step, rewrite_best=True,
                             reason=f"{skipped}{wrong}; rebuilt from the resume point (step {step}, the best one)")
        return StartPlan(reason=f"{skipped}{wrong}, and its weights (step {best_step}) can only be had again by "
                                "training: retrained from step 0")
    return StartPlan(reason="; ".join(problems) + "; retrained from step 0" if problems else "")


def restore_resume_point(folder: Path, model: torch.nn.Module, optimizer, scheduler, scaler) -> TrainState:
    """Load the resume point ``folder`` (chosen by `plan_start`) into the model and trainer."""
    meta = read_json_artifact(folder / "state.json", _IGNORED)
    weights_file = folder / "student.safetensors"
    weights = load_file(str(weights_file))
    expected = model.state_dict()
    if weights.keys() != expected.keys() or any(weights[k].shape != v.shape for k, v in expected.items()):
        raise CorruptArtifact(weights_file, "its tensors do not match the model being trained", _IGNORED)
    trainer = load_torch(folder / "trainer.pt", _IGNORED, weights_only=True)
    if not isinstance(trainer, dict) or not {"optimizer", "scheduler", "rng"} <= trainer.keys():
        raise CorruptArtifact(folder / "trainer.pt", "optimizer, scheduler or RNG state missing", _IGNORED)
    model.load_state_dict(weights)
    optimizer.load_state_dict(trainer["optimizer"])
    scheduler.load_state_dict(trainer["scheduler"])
    if trainer.get("scaler"):
        scaler.load_state_dict(trainer["scaler"])
    torch.set_rng_state(trainer["rng"])
    if "cuda_rng" in trainer and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(trainer["cuda_rng"])
    return TrainState(meta["step"], meta["best_score"], meta["best_step"], meta["history"])


class Checkpoints:
    """The best checkpoint (``<out>/best``) and resume point (``<out>/last``) of one run of the
    configuration ``config_hash``, shared by the students' loop and DUET's. ``save_best(tmp, state)``
    writes the model (its weights set to the best ones) with whatever travels with it into ``tmp``."""

    def __init__(self, out_dir: Path, config_hash: str, save_best: Callable[[Path, TrainState], None],
                 best_required: Sequence[str] = BEST_REQUIRED, writes: bool = True, kept: Path | None = None) -> None:
        self.out_dir, self.config_hash, self.save_best = Path(out_dir), config_hash, save_best
        self.kept = kept  # `kept_dir`: the copy outside the DVC output (None: none kept)
        # false: a rank other than 0 of a job on several processes, which keeps the run's state (the best
        # score and step) but holds and writes no weights: rank 0 writes them
        self.writes = writes
        self.best_required = tuple(best_required)
        self.last, self.best = self.out_dir / "last", self.out_dir / "best"
        self.best_weights: dict[str, torch.Tensor] | None = None  # held until the next resume point
        self.restored = False  # `start` continued a resume point (else the run starts at step 0)
        self.writer = BackgroundWriter()

    def start(self, model: torch.nn.Module, optimizer, scheduler, scaler) -> TrainState:
        """The run's state: restored from this configuration's resume point when `plan_start` takes it
        (``best/`` rebuilt from it at once when needed), else a fresh one (what was not taken is named
        in a warning; it is replaced at the first checkpoint). On several processes every rank starts from
        rank 0's: the resume point is on rank 0's disk, which another machine's processes may not see, and
        ranks that started from different states would each train another model."""
        rank, size = world()
        state = self._start_here(model, optimizer, scheduler, scaler) if rank == 0 else TrainState()
        if size == 1:
            return state
        self.restored = from_lead_object(self.restored)
        if not self.restored:  # every rank from the same seeded initial weights
            return state
        shared = from_lead_object(_copied({
            "model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
            "scaler": scaler.state_dict() if scaler.is_enabled() else None,
            "state": asdict(state)} if rank == 0 else None))
        if rank > 0:
            model.load_state_dict(shared["model"])
            optimizer.load_state_dict(shared["optimizer"])
            scheduler.load_state_dict(shared["scheduler"])
            if shared["scaler"]:
                scaler.load_state_dict(shared["scaler"])
            state = TrainState(**shared["state"])
        return state

    def _start_here(self, model: torch.nn.Module, optimizer, scheduler, scaler) -> TrainState:
        if self.kept is not None and (restored := restore_kept(self.out_dir, self.config_hash, self.kept)):
            log.info("%s", restored)
        plan = plan_start(self.out_dir, self.config_hash, self.best_required)
        if plan.reason:
            log.warning("%s", plan.reason)
        if plan.resume_from is None:
            return TrainState()
        state = restore_resume_point(plan.resume_from, model, optimizer, scheduler, scaler)
        self.restored = True
        if plan.rewrite_best and self.writes:
            self.best_weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
            self.write_best(model, state)
        return state

    def consider(self, score: float, state: TrainState, model: torch.nn.Module) -> None:
        """Hold the model's weights as the best ones when ``score`` beats the run's best."""
        if score > state.best_score:
            state.best_score, state.best_step = score, state.step
            if self.writes:
                self.best_weights = {k: v.detach().clone() for k, v in model.state_dict().items()}

    def write_best(self, model: torch.nn.Module, state: TrainState) -> None:
        """Write the held best weights (if any) to ``best/``, sealed with the configuration and step."""
        if self.best_weights is None:
            return
        check_finite(self.best_weights, "best checkpoint", state.best_step)
        write_weights_folder(model, self.best_weights, self.best, lambda tmp: self.save_best(tmp, state),
                             config_hash=self.config_hash, step=state.best_step,
                             code_files=code_files(TRAINING_CODE))
        self.best_weights = None

    def save(self, model: torch.nn.Module, optimizer, scheduler, scaler, state: TrainState) -> None:
        """A checkpoint: the held best weights to ``best/``, then the resume point to ``last/`` (and the kept copy),
        written on a thread while training goes on (`BackgroundWriter`: copied off the model first, at most one
        write in flight, its error raised at the next save or at `wait`); weights that are not finite are never
        written (`check_finite`)."""
        if not self.writes:
            return
        check_finite(model.state_dict(), "model", state.step)
        self.writer.wait()  # the previous resume point is on disk before best/ moves past it
        self.write_best(model, state)
        snapshot = resume_snapshot(model, optimizer, scheduler, scaler, state)

        def write() -> None:
            write_resume_point(self.last, snapshot, self.config_hash)
            if self.kept is not None:
                keep_resume_point(self.out_dir, self.kept)

        self.writer.submit(write)

    def wait(self) -> None:
        """Until the last resume point is on disk (its write's error raised here)."""
        self.writer.wait()

    def finish(self, result: Any) -> Any:
        """``result`` (the finished run's, `mmcse.training.engine.finished`), once the kept copy is removed:
        nothing is left to resume, and a finished folder's result is the DVC output's."""
        self.writer.wait()
        if self.kept is not None and self.writes:
            shutil.rmtree(self.kept, ignore_errors=True)
        return result


# --------------------------------------------------------------------------- the MLflow run


@dataclass(frozen=True)
class ResumeDecision:
    """What `train` will do in a folder, known before it runs (`resume_point_run`): continue
    ``run_id`` from ``step``, or start afresh (``run_id`` None); ``stale_run`` is the folder's
    remembered run of the same configuration that a fresh start leaves behind, and ``reason`` why."""

    run_id: str | None = None
    step: int = 0
    stale_run: str | None = None
    reason: str = ""


def resume_point_run(out_dir: Path, cfg: Config, best_required: Sequence[str] = ()) -> ResumeDecision:
    """Whether ``train`` will continue this configuration's resume point in ``out_dir`` (`plan_start`),
    so the caller continues that MLflow run only for a true resume of the same configuration, and starts
    a new one when training restarts from step 0. The run id is the folder's remembered run of this
    configuration (`mmcse.tracking.remembered_run`), not part of the resume point: a tracked output holds
    nothing random. ``best_required``: the files a best checkpoint must hold (default: a student's). A kept
    resume point that DVC's checkout took from the folder is put back first (`restore_kept`), so the decision
    is about it."""
    config_hash = run_definition_hash(cfg)
    restore_kept(out_dir, config_hash, kept_dir(cfg, out_dir, config_hash))
    plan = plan_start(out_dir, config_hash, best_required or BEST_REQUIRED)
    record = remembered_run(out_dir, config_hash=config_hash)
    remembered = record["run_id"] if record else None
    if plan.resume_from is not None:
        return ResumeDecision(remembered, plan.step, reason=plan.reason)
    return ResumeDecision(stale_run=remembered if plan.reason else None, reason=plan.reason)


def load_history(folder: Path) -> list[dict[str, Any]]:
    return json.loads((folder / "last" / "state.json").read_text())["history"]
