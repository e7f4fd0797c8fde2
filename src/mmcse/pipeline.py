"""One library call per pipeline stage; DVC stages and Prefect tasks both call these."""

from __future__ import annotations

import csv
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mmcse.config import Config
from mmcse.io import read_json, read_jsonl, sha256_file, write_json, write_text


@dataclass(frozen=True)
class Paths:
    """Where each stage reads and writes, derived from ``base`` (relative to the cwd)."""

    raw: Path
    downloads: Path
    objects: Path
    teachers: Path
    student: Path
    metrics: Path
    plots: Path
    ablations: Path
    relevance: Path  # caption relevance matrices of the retrieval test set (stage relevance)
    regions: Path  # DUET region sets (stage cache_regions)

    @classmethod
    def of(cls, cfg: Config, root: str | Path = ".") -> Paths:
        root = Path(root)
        data = root / cfg.base.data_dir
        return cls(
            raw=data / "raw",
            downloads=data / cfg.data.downloads_dir,
            objects=data / "objects",
            teachers=data / cfg.teachers.cache_dir,
            student=root / cfg.base.models_dir / "student",
            metrics=root / cfg.base.metrics_dir,
            plots=root / cfg.base.plots_dir,
            ablations=root / "ablation",
            relevance=data / "relevance",
            regions=data / cfg.regions.cache_dir,
        )


# --------------------------------------------------------------------------- download


def run_download(cfg: Config, paths: Paths) -> dict[str, Any]:
    """Write ``paths.raw`` for ``cfg.data`` and ``base.seed``; its manifest records the artifact key
    (`mmcse.upstream`), so training can tell which configuration made it."""
    from mmcse.data.prepare import prepare_data
    from mmcse.upstream import artifact_keys

    manifest = prepare_data(cfg.data, cfg.base.seed, paths.raw, paths.downloads)
    manifest["artifact_key"] = artifact_keys(cfg)["data"]
    write_json(paths.raw / "manifest.json", manifest)
    return manifest


# --------------------------------------------------------------------------- detect_objects


def run_detect(cfg: Config, paths: Paths, write_metrics: bool = True) -> dict[str, Any]:
    """Object–phrase pairs of ``paths.raw`` into ``paths.objects``; ``artifact.json`` (its key and
    counts) is written last, so an interrupted run is not taken for a finished one."""
    from mmcse.detect import detect_objects
    from mmcse.models import load_tokenizer
    from mmcse.upstream import artifact_keys, record_key

    tokenizer = load_tokenizer(cfg.model.name_or_path)
    (paths.objects / "artifact.json").unlink(missing_ok=True)
    stats = detect_objects(paths.raw, paths.objects, cfg.detect, tokenizer, cfg.model.max_seq_len, cfg.base.device)
    if write_metrics:
        write_json(paths.metrics / "detect.json", stats)
    keys = artifact_keys(cfg)
    record_key(paths.objects / "artifact.json", keys["objects"], {"data_key": keys["data"], "counts": stats})
    return stats


# --------------------------------------------------------------------------- cache_teachers


def run_cache_teachers(
    cfg: Config, paths: Paths, manifest_path: Path | None = None, read_only: tuple[Path, ...] = ()
) -> dict[str, Any]:
    """Cache every frozen feature set training reads, so no step runs a teacher:

    ``image`` / ``object``: the image encoder on every image and object crop; ``text``: each
    text teacher (and pooler) on every caption and corpus sentence, one forward pass per
    model; ``joint_text`` / ``joint_image``: captions and images in the joint text–image
    teacher space (CLIP / open_clip, or a CCA fitted on the training pairs). Every model is
    resolved before any compute; a set already cached (in ``paths.teachers`` or one of the
    ``read_only`` caches) runs no model. Returns ``{"sets", "hits", "artifact_key"}``; the manifest
    ``manifest_path`` (default ``<teachers>/manifest.json``) holds ``sets`` and ``artifact_key``, not
    ``hits``: what a run found cached depends on what ran before, and the manifest is part of a DVC output.
    """
    import numpy as np

    from mmcse.device import resolve_device
    from mmcse.errors import CorruptArtifact
    from mmcse.integrity import image_size_mismatch
    from mmcse.teachers import (
        FeatureStore,
        cached_features,
        fit_cca,
        image_encoder,
        pretrained_joint_teacher,
        text_teacher_features,
        text_teacher_key,
    )
    from mmcse.upstream import artifact_keys

    t = cfg.teachers
    device = resolve_device(cfg.base.device)
    manifest = read_json(paths.raw / "manifest.json")
    images = read_jsonl(paths.raw / "images.jsonl")
    pairs = read_jsonl(paths.raw / "pairs.jsonl")
    objects = read_jsonl(paths.objects / "objects.jsonl")
    corpus = [s for s in (paths.raw / "corpus.txt").read_text().splitlines() if s.strip()]
    captions = [p["caption"] for p in pairs]
    texts = {"caption": (captions, [p["pair_id"] for p in pairs], manifest["sha256"]["pairs.jsonl"]),
             "corpus": (corpus, [f"corpus-{i}" for i in range(len(corpus))], manifest["sha256"]["corpus.txt"])}
    image_files = [paths.raw / r["file"] for r in images]
    # Image bytes are in the fingerprints (images.jsonl records each image's SHA-256); a file
    # changed since the download stage is caught by its size here (a stat, not a rehash).
    for row, file in zip(images, image_files, strict=True):
        if problem := image_size_mismatch(file, row.get("bytes")):
            raise CorruptArtifact(file, problem, "rerun the download stage (dvc repro download)")
    # Resolve every model first: an offline id fails here, before anything is computed.
    image_teacher, encode_images = image_encoder(t, device)
    wanted = [(x.teacher, x.pooler) for x in t.text]
    if t.joint.kind == "cca":
        wanted.append((t.joint.text_teacher, t.joint.text_pooler))
        joint_teacher: dict[str, Any] = {
            "kind": "cca", "dim": t.joint.dim, "regularization": t.joint.regularization,
            "text": text_teacher_key(t.joint.text_teacher, t.joint.text_pooler), "image": image_teacher}
    else:
        joint_teacher, joint_features = pretrained_joint_teacher(t, device)
    text_keys = {(m, p): text_teacher_key(m, p) for m, p in dict.fromkeys(wanted)}

    result: dict[str, Any] = {"sets": {"text": []}, "hits": {}}

    def store(name: str, teacher: dict[str, Any], fingerprint: str, ids: list[str],
              compute: Callable[[], np.ndarray], role: str | None = None) -> FeatureStore:
        features, hit = cached_features(paths.teachers, name, teacher, fingerprint, ids, compute, read_only)
        result["hits"][role or name] = hit
        return features

    image_store = store("image", image_teacher, manifest["sha256"]["images.jsonl"], [r["image_id"] for r in images],
                        lambda: encode_images(image_files, "images"))
    crop_files = sorted({o["crop"] for row in objects for o in row["objects"]})
    crops_from = sha256_file(paths.objects / "objects.jsonl") + manifest["sha256"]["images.jsonl"]  # boxes + pixels
    object_store = store("object", image_teacher, crops_from, crop_files,
                         lambda: encode_images([paths.objects / c for c in crop_files], "object crops"))
    result["sets"] |= {"image": image_store.folder.name, "object": object_store.folder.name}
    # The retrieval test images (evaluate: R@K through the trained image heads), when the data has them.
    test_table = paths.raw / "retrieval" / "images.jsonl"
    test_images = read_jsonl(test_table) if test_table.is_file() else []
    test_files = [paths.raw / r["file"] for r in test_images]
    for row, file in zip(test_images, test_files, strict=True):
        if problem := image_size_mismatch(file, row.get("bytes")):
            raise CorruptArtifact(file, problem, "rerun the download stage (dvc repro download)")
    test_ids = [r["image_id"] for r in test_images]
    test_fingerprint = manifest["sha256"].get("retrieval/images.jsonl", "")
    test_image_store = (store("retrieval_image", image_teacher, test_fingerprint, test_ids,
                              lambda: encode_images(test_files, "retrieval test images")) if test_images else None)
    if test_image_store is not None:
        result["sets"]["retrieval_image"] = test_image_store.folder.name

    # Text teachers: every (model, pooler) the config names, one forward per model and text set.
    poolers_of: dict[str, list[str]] = {}
    for model, pooler in text_keys:
        poolers_of.setdefault(model, []).append(pooler)
    computed: dict[tuple[str, str], dict[str, np.ndarray]] = {}

    def text_features(model: str, pooler: str, kind: str) -> Callable[[], np.ndarray]:
        def compute() -> np.ndarray:
            if (model, kind) not in computed:
                computed[(model, kind)] = text_teacher_features(model, texts[kind][0], poolers_of[model], t.batch_size)
            return computed[(model, kind)].pop(pooler)  # stored right after: free it (Wiki1M is GBs)

        return compute

    text_stores: dict[tuple[str, str, str], FeatureStore] = {}
    for (model, pooler), key in text_keys.items():
        for kind, (_, ids, fingerprint) in texts.items():
            text_stores[(model, pooler, kind)] = store(
                f"text_{kind}", key, fingerprint, ids, text_features(model, pooler, kind),
                role=f"text_{kind}:{model}:{pooler}",
            )
    for x in t.text:
        result["sets"]["text"].append({
            "teacher": x.teacher, "pooler": x.pooler, "weight": x.weight,
            "caption": text_stores[(x.teacher, x.pooler, "caption")].folder.name,
            "corpus": text_stores[(x.teacher, x.pooler, "corpus")].folder.name,
        })

    # Joint text–image teacher: pretrained (CLIP), or a CCA fitted on (caption, its image) pairs.
    fingerprint = manifest["sha256"]["pairs.jsonl"] + manifest["sha256"]["images.jsonl"]
    joint: dict[str, Any] = {}

    def joint_sides() -> tuple[np.ndarray, np.ndarray]:
        if not joint:
            if t.joint.kind == "cca":
                source = np.asarray(text_stores[(t.joint.text_teacher, t.joint.text_pooler, "caption")].features)
                pair_images = image_store.rows([p["image_id"] for p in pairs])  # (n_pairs, d_v)
                cca = fit_cca(source, pair_images, t.joint.dim, t.joint.regularization)
                joint["sides"] = cca.text(source), cca.image(np.asarray(image_store.features))
                joint["cca"] = cca
            else:
                joint["sides"] = joint_features(captions, image_files)
        return joint["sides"]

    def joint_test_images() -> np.ndarray:
        if t.joint.kind == "cca":  # the CCA fitted on the training pairs, applied to the test images
            joint_sides()
            return joint["cca"].image(np.asarray(test_image_store.features))
        # images only: one caption keeps the text side's batch non-empty (its output is dropped)
        return joint_features(captions[:1], test_files)[1]

    joint_text = store("joint_text", joint_teacher, fingerprint, [p["pair_id"] for p in pairs],
                       lambda: joint_sides()[0])
    joint_image = store("joint_image", joint_teacher, fingerprint, [r["image_id"] for r in images],
                        lambda: joint_sides()[1])
    result["sets"] |= {"joint_text": joint_text.folder.name, "joint_image": joint_image.folder.name}
    if test_image_store is not None:  # v̂ of the test images: the CCA is fitted on the training pairs above
        joint_test = store("retrieval_joint_image", joint_teacher, fingerprint + test_fingerprint, test_ids,
                           joint_test_images)
        result["sets"]["retrieval_joint_image"] = joint_test.folder.name
    result["artifact_key"] = artifact_keys(cfg)["teachers"]  # written last: the manifest names complete sets
    write_json(manifest_path or paths.teachers / "manifest.json", {k: v for k, v in result.items() if k != "hits"})
    return result


# --------------------------------------------------------------------------- cache_regions

# DUET's image sets: the training images, the retrieval val split (dev score) and test split
REGION_SPLITS = {"train": "images.jsonl", "val": "retrieval/val_images.jsonl", "test": "retrieval/images.jsonl"}


def region_source(cfg: Config, raw: Path, objects: Path, teacher_manifest: Path,
                  teacher_dirs: tuple[Path, ...] = ()) -> Any:
    """The `mmcse.detection.regions.RegionSource` of ``regions.source``: the TSV files, the per-image
    folder, or (``objects``) the images' objects and the whole image encoded with
    ``teachers.image_encoder``, reusing the crops and images cache_teachers already encoded (the
    sets ``teacher_manifest`` names). A missing file or folder is named here, before any compute."""
    from mmcse.detection.regions import npy_source, objects_source, tsv_source

    r = cfg.regions
    if r.source == "tsv":
        return tsv_source([Path(f).expanduser() for f in r.files], r.dim or None)
    if r.source == "npy":
        return npy_source(Path(r.folder).expanduser(), raw, r.dim or None)
    from mmcse.device import resolve_device
    from mmcse.teachers import FeatureStore, image_encoder
    from mmcse.train import teacher_set_folder

    encoder_key, encode = image_encoder(cfg.teachers, resolve_device(cfg.base.device))
    sets = read_json(teacher_manifest)["sets"] if teacher_manifest.is_file() else {}
    dirs = tuple(teacher_dirs)

    def stores(*names: str) -> list[Any]:
        found = [teacher_set_folder(sets[n], dirs[0], dirs[1:]) for n in names if n in sets] if dirs else []
        return [FeatureStore.open(f) for f in found if (f / "index.json").is_file()]

    return objects_source(raw, objects, encoder_key, encode, r.whole_image, stores("object"),
                          stores("image", "retrieval_image"))


def run_cache_regions(cfg: Config, paths: Paths, raw: Path | None = None, objects: Path | None = None,
                      teacher_manifest: Path | None = None, teacher_dirs: tuple[Path, ...] | None = None,
                      out_dir: Path | None = None, read_only: tuple[Path, ...] = ()) -> dict[str, Any]:
    """DUET's region sets (`mmcse.detection.regions.build_region_cache`) for each image set of
    `REGION_SPLITS` the data has: ``{"sets": {split: folder name}, "hits": {split: bool}, "images":
    {split: count}, "dim"}``.
    Sets are content-addressed (source, inputs, image ids, ``max_regions``, ``dtype``): a set
    already in ``out_dir`` (default ``paths.regions``) or one of ``read_only`` is opened, not rebuilt."""
    from mmcse.detection.regions import build_region_cache

    raw, objects = raw or paths.raw, objects or paths.objects
    source = region_source(cfg, raw, objects, teacher_manifest or paths.teachers / "manifest.json",
                           (paths.teachers,) if teacher_dirs is None else teacher_dirs)
    result: dict[str, Any] = {"sets": {}, "hits": {}, "images": {}, "source": cfg.regions.source}
    for split, table in REGION_SPLITS.items():
        ids = [row["image_id"] for row in read_jsonl(raw / table)] if (raw / table).is_file() else []
        if not ids:
            continue
        store, hit = build_region_cache(out_dir or paths.regions, ids, source, cfg.regions.max_regions,
                                        cfg.regions.dtype, read_only)
        result["sets"][split], result["hits"][split], result["images"][split] = store.folder.name, hit, len(ids)
        result["dim"] = store.dim
    return result


def region_sets_for(cfg: Config, paths: Paths, up: Any) -> dict[str, Path]:
    """The region sets of a training's upstream artifacts ``up`` (`mmcse.upstream.Upstream`): opened
    from the cache_regions stage's folder when it holds them, else built once (under a file lock:
    concurrent jobs share the work) in ``<data>/upstream/regions``. ``{split: folder}``."""
    from filelock import FileLock

    shared = paths.raw.parent / "upstream" / "regions"
    shared.mkdir(parents=True, exist_ok=True)
    with FileLock(str(shared / ".lock")):
        result = run_cache_regions(cfg, paths, up.raw, up.objects, up.teacher_manifest, up.teacher_dirs,
                                   out_dir=shared, read_only=(paths.regions,))
    return {split: (paths.regions / name if (paths.regions / name / "index.json").is_file() else shared / name)
            for split, name in result["sets"].items()}


# --------------------------------------------------------------------------- relevance


def run_relevance(cfg: Config, paths: Paths) -> dict[str, Any]:
    """Caption relevance of the retrieval test set for each ``evaluate.ndcg.relevance`` kind
    (`mmcse.evaluation.ndcg.relevance_matrix`) into ``paths.relevance``, computed once per set of
    captions; files of other caption sets are removed (the folder is this stage's DVC output)."""
    from mmcse.evaluation.ndcg import relevance_key, relevance_matrix

    paths.relevance.mkdir(parents=True, exist_ok=True)
    table = paths.raw / "retrieval" / "captions.jsonl"
    captions = [row["caption"] for row in read_jsonl(table)] if table.is_file() else []
    kinds = list(cfg.evaluate.ndcg.relevance) if captions else []
    keep = {f"{kind}-{relevance_key(captions, kind)}.npy" for kind in kinds}
    for stale in paths.relevance.glob("*.npy"):
        if stale.name not in keep:
            stale.unlink()
    for kind in kinds:
        relevance_matrix(captions, kind, paths.relevance)
    return {"captions": len(captions), "kinds": kinds}


def relevance_for(paths: Paths, captions: list[str], kind: str) -> Any:
    """The relevance matrix of ``captions``: the relevance stage's file when it has them, else
    computed (once, cached) under ``<data>/upstream/relevance`` (an ablation job whose data differ)."""
    from mmcse.evaluation.ndcg import relevance_key, relevance_matrix

    top = paths.relevance / f"{kind}-{relevance_key(captions, kind)}.npy"
    return relevance_matrix(captions, kind, paths.relevance if top.is_file() else
                            paths.raw.parent / "upstream" / "relevance")


# --------------------------------------------------------------------------- train + evaluate


def write_curves(history: list[dict[str, float]], plots_dir: Path, title: str = "dev geometry",
                 dev_metric: str = "dev_sts") -> None:
    """The DVC plots of a training history: ``train_loss.csv`` (step, loss), ``dev_sts.csv``
    (step, dev: STS) or, for DUET (``dev_metric`` ``val_rsum``), ``dev_rsum.csv`` (step, dev: val
    rsum) — the other one holds its header only —, ``dev_geometry.csv`` (step, alignment,
    uniformity: every dev evaluation that logged them) and ``geometry_trajectory.png``
    (`mmcse.plots.geometry_trajectory`)."""
    from mmcse.io import atomic_path
    from mmcse.plots import geometry_trajectory, save_figure

    plots_dir.mkdir(parents=True, exist_ok=True)
    dev_file = {"dev_sts": "dev_sts.csv", "val_rsum": "dev_rsum.csv"}[dev_metric]
    tables = (("train_loss.csv", ["loss"], ["loss"]), ("dev_sts.csv", ["dev"], ["dev"]),
              ("dev_rsum.csv", ["dev"], ["dev"]),
              ("dev_geometry.csv", ["dev_alignment", "dev_uniformity"], ["alignment", "uniformity"]))
    for name, keys, columns in tables:
        rows = [h for h in history if all(k in h for k in keys)]
        if name in ("dev_sts.csv", "dev_rsum.csv") and name != dev_file:
            rows = []
        with atomic_path(plots_dir / name) as tmp, open(tmp, "w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["step", *columns])
            writer.writerows([[h["step"], *(round(h[k], 6) for k in keys)] for h in rows])
    save_figure(geometry_trajectory(history, title), plots_dir / "geometry_trajectory.png")


def train_run_name(cfg: Config) -> str:
    """The MLflow run name of a training: ``<method>-seed<seed>`` (e.g. ``dalr-seed3``)."""
    return f"{cfg.train.method}-seed{cfg.base.seed}"


def run_train(
    cfg: Config,
    paths: Paths,
    out_dir: Path | None = None,
    experiment_name: str | None = None,
    run_name: str | None = None,
    parent_run_id: str | None = None,
    on_eval: Callable[[int, float], None] | None = None,
    progress: bool = True,
    data_seed: int | None = None,
) -> dict[str, Any]:
    """Train with MLflow tracking; returns the summary written to ``<out>/summary.json``.

    Without ``data_seed`` (the train stage) it trains on the top-level artifacts, refused unless
    they were made from ``cfg``. With it (an ablation job, a sweep trial: ``data_seed`` is the
    pipeline's seed) on the upstream artifacts of ``cfg``, found or computed inside the run
    (`mmcse.upstream.resolve`, so a failure there is on the record). The run is tagged with
    the artifacts' keys (``artifact.data|objects|teachers``), also in the summary with the data
    folder (``data_dir``). A training resumed from ``<out>/last`` continues the MLflow run its
    resume point names: a killed and resumed training is one run with one contiguous history."""
    import mlflow

    from mmcse import tracking
    from mmcse.device import resolve_device
    from mmcse.plots import geometry_trajectory, save_figure, training_curves
    from mmcse.precision import check_precision
    from mmcse.train import check_inputs, resume_point_run, train
    from mmcse.upstream import artifact_keys, artifact_tags, require_top_level, resolve

    out_dir = out_dir or paths.student
    keys = artifact_keys(cfg, data_seed)
    up = require_top_level(cfg, paths) if data_seed is None else None
    if up is not None:
        check_inputs(up.raw, up.teachers, up.teacher_manifest, up.teacher_dirs)
    check_precision(cfg.train.precision, resolve_device(cfg.base.device))  # before a run is started
    tracking.configure(cfg)
    resumed_run, resumed_step = resume_point_run(out_dir, cfg)
    resumed_run = tracking.existing_run(resumed_run)
    with tracking.run(
        cfg, experiment_name or cfg.train.method, run_name=run_name or train_run_name(cfg), run_id=resumed_run,
        parent_run_id=parent_run_id, tags=artifact_tags(keys),
        job=str(out_dir.resolve()),
    ) as active:
        tracking.remember_run(out_dir, active.info.run_id)  # not in out_dir: a DVC output holds nothing random
        if up is None:
            up = resolve(cfg, paths, data_seed)
            check_inputs(up.raw, up.teachers, up.teacher_manifest, up.teacher_dirs)
        if resumed_run is None:
            tracking.log_config(cfg)
        else:
            mlflow.set_tag("mmcse.resumed_from_step", str(resumed_step))
        duet = cfg.train.method == "duet"
        region_sets: dict[str, Path] = {}
        if duet:  # DUET: a retrieval model on region features; dev = val rsum (`mmcse.train_duet`)
            from mmcse.train_duet import train_duet

            region_sets = region_sets_for(cfg, paths, up)
            result = train_duet(cfg, up.raw, region_sets, out_dir, tracking.log_metric_steps, on_eval, progress)
        else:
            result = train(cfg, up.raw, up.teachers, out_dir, tracking.log_metric_steps, on_eval, progress,
                           objects_dir=up.objects, teacher_manifest=up.teacher_manifest,
                           teacher_dirs=up.teacher_dirs)
        title = f"{cfg.train.method} (seed {cfg.base.seed})"
        figures = [(training_curves(result.history, title, dev_label="val rsum" if duet else "dev STS"),
                    "training_curves.png")]
        if not duet:
            figures.append((geometry_trajectory(result.history, title, result.best_step), "geometry_trajectory.png"))
        for fig, name in figures:
            mlflow.log_artifact(str(save_figure(fig, out_dir / name)), "figures")
        best_geometry = {f"best_{k}": v for k, v in result.best_geometry.items()}  # best_dev_alignment, ...
        dev_key = "best_dev_rsum" if duet else "best_dev_sts"  # val R@K rsum | dev STS Spearman ×100
        mlflow.log_metrics({dev_key: result.best_score, "best_step": result.best_step, **best_geometry})
        summary = {
            "run_id": active.info.run_id,
            dev_key: result.best_score,
            "best_dev": result.best_score,  # whichever the method's dev score is (sweeps maximise it)
            "dev_metric": "val_rsum" if duet else "dev_sts",
            "best_step": result.best_step,
            **best_geometry,
            "steps": result.steps,
            "checkpoint": str(result.best_dir),
            "artifacts": up.keys,
            "data_dir": str(up.raw),
            "teacher_manifest": str(up.teacher_manifest),
            "teacher_dirs": [str(d) for d in up.teacher_dirs],
            "region_sets": {split: str(folder) for split, folder in region_sets.items()},
        }
    # the run id stays out of the folder (a DVC output): `tracking.folder_run_id(out_dir)` finds it
    write_json(out_dir / "summary.json", {k: v for k, v in summary.items() if k != "run_id"})
    return summary


def run_evaluate(
    cfg: Config,
    paths: Paths,
    model_dir: Path,
    run_id: str | None = None,
    plots_dir: Path | None = None,
    experiment_name: str | None = None,
    transfer: bool = True,
    data_dir: Path | None = None,
    teacher_manifest: Path | None = None,
    teacher_dirs: tuple[Path, ...] = (),
    region_sets: dict[str, Path] | None = None,
) -> dict[str, float]:
    """Test-set STS of the checkpoint at ``model_dir`` and, with ``transfer``, SentEval's transfer
    tasks found in ``data/raw/transfer`` (``data.transfer_tasks``: accuracy per task and
    ``transfer_avg``); logged into the training run ``run_id`` (metrics ``test_<name>``, STS
    scatter figure), the scatter also saved to ``plots_dir``. ``data_dir``: the data folder the
    model was trained with (default ``paths.raw``; a job's test sets are the same by construction:
    `mmcse.upstream.FIXED_KEYS`).

    With ``evaluate.retrieval.enabled`` and a retrieval test set in the data: image–text R@K
    through the method's trained heads (`mmcse.evaluation.retrieval.image_head`; image features
    from the sets ``teacher_manifest`` names, default ``<teachers>/manifest.json``, looked up in
    ``paths.teachers`` then ``teacher_dirs``), keys ``<set>_i2t_R@1`` … ``<set>_rsum``, graded
    ``<set>_{i2t,t2i}_NDCG@k_<kind>`` for ``evaluate.ndcg.relevance`` (`relevance_for`), and DALR
    Table 10's nearest test captions (``sentence_retrieval.md`` in ``plots_dir`` and the run).

    ``train.method: duet``: `evaluate_duet` (``region_sets``: the training's, `region_sets_for`)."""
    import numpy as np

    from mmcse.data.senteval import TRANSFER_TASKS, SentencePair, TransferExample
    from mmcse.device import resolve_device
    from mmcse.evaluation.figures import TSNE_CLUSTERS, TSNE_POINTS, sample_sentences, tsne_figure
    from mmcse.evaluation.geometry import POSITIVE_GOLD, sts_dev_geometry
    from mmcse.evaluation.mteb import mteb_scores, prepare_tasks
    from mmcse.evaluation.retrieval import neighbours_markdown
    from mmcse.evaluation.sts import TextEncoder, encode_unique, evaluate_sts, group_by_task
    from mmcse.evaluation.transfer import evaluate_transfer
    from mmcse.plots import sts_scatter

    if cfg.train.method == "duet":  # an image–text retrieval model: no sentence-embedding tasks
        return evaluate_duet(cfg, paths, model_dir, region_sets or {}, run_id, plots_dir, experiment_name, data_dir)
    # MTEB names and datasets are checked before any model loads: offline, a missing dataset is named here
    mteb_tasks = prepare_tasks(cfg.evaluate.mteb, "evaluate.mteb") if cfg.evaluate.mteb else []
    device = resolve_device(cfg.base.device)
    encoder = TextEncoder(str(model_dir), cfg.evaluate.pooler, str(device), precision=cfg.train.precision)
    raw = data_dir or paths.raw
    tasks = group_by_task([SentencePair.from_row(r) for r in read_jsonl(raw / "sts" / "test.jsonl")])
    transfer_files = [raw / "transfer" / f"{t}.jsonl" for t in TRANSFER_TASKS] if transfer else []
    transfer_tasks = {
        f.stem: [TransferExample.from_row(r) for r in read_jsonl(f)] for f in transfer_files if f.is_file()
    }
    result = evaluate_sts(encoder, tasks, cfg.evaluate.batch_size)
    scores = dict(result.scores)
    if mteb_tasks:  # DALR Table 5
        scores |= mteb_scores(encoder, f"mmcse/{cfg.train.method}", mteb_tasks, cfg.evaluate.batch_size)
    # DALR Table 6 / Appendix D: alignment (dev pairs with gold >= 4) and uniformity (all dev sentences)
    dev = [SentencePair.from_row(r) for r in read_jsonl(raw / "sts" / "dev.jsonl")]
    scores |= sts_dev_geometry(encoder, dev, POSITIVE_GOLD, cfg.evaluate.batch_size)
    if transfer_tasks:
        scores |= evaluate_transfer(
            encoder, transfer_tasks, cfg.evaluate.transfer, cfg.evaluate.batch_size, device
        ).scores
    test_set = None
    manifest = read_json(raw / "manifest.json") if (raw / "manifest.json").is_file() else {}
    # retrieval goes through the student's heads: a plain HF model (mmcse eval of any encoder) has none
    if cfg.evaluate.retrieval.enabled and manifest.get("retrieval_set") and encoder.student is not None:
        test_set = retrieval_test_set(cfg, paths, encoder, raw, teacher_manifest, teacher_dirs)
        scores |= test_set.scores
    examples = (neighbours_markdown(test_set.examples, f"Nearest test captions ({test_set.set_name}, "
                                    f"{cfg.evaluate.pooler} embeddings)") if test_set and test_set.examples else None)
    fig = sts_scatter(result.predictions, result.scores)
    tsne = None
    if plots_dir is not None:  # DALR Figure 3 for the stage's model (ablation jobs skip its seconds of t-SNE)
        sample = sample_sentences([s for pairs in tasks.values() for p in pairs for s in (p.s1, p.s2)],
                                  TSNE_POINTS, cfg.base.seed)
        vectors = encode_unique(encoder, sample, cfg.evaluate.batch_size, desc="t-SNE sentences")
        tsne, clusters = tsne_figure(np.stack([vectors[s] for s in sample]), n_clusters=TSNE_CLUSTERS,
                                     seed=cfg.base.seed, title=cfg.train.method)
        scores["cluster_silhouette"] = clusters["silhouette"]
    # per-pair predictions, so figures comparing runs (`mmcse figures`) need no re-encoding
    predictions = {task: {"cos": cos.tolist(), "gold": gold.tolist()}
                   for task, (cos, gold) in result.predictions.items()}
    record_evaluation(cfg, scores, run_id, experiment_name, plots_dir, examples, fig, tsne,
                      {"evaluation/sts_predictions.json": predictions})
    return scores


def record_evaluation(cfg: Config, scores: dict[str, float], run_id: str | None, experiment_name: str | None,
                      plots_dir: Path | None, examples: str | None, sts_scatter: Any, tsne: Any,
                      dicts: dict[str, Any] | None = None, log_scatter: bool = True) -> None:
    """What an evaluation leaves behind: into training run ``run_id`` the scores (``test_<name>``), the
    nearest-caption examples, the t-SNE and STS-scatter figures (``log_scatter``) and ``dicts``
    (artifact path -> JSON); into ``plots_dir`` (the evaluate stage's DVC outputs) ``sts_scatter.png``,
    ``sentence_retrieval.md`` and ``tsne.png``. Figures are closed either way."""
    import matplotlib.pyplot as plt
    import mlflow

    from mmcse import tracking
    from mmcse.plots import save_figure

    if run_id:
        with tracking.run(cfg, experiment_name or cfg.train.method, run_id=run_id):
            mlflow.log_metrics({tracking.metric_name(f"test_{k}"): v for k, v in scores.items()})
            if examples:
                mlflow.log_text(examples, "evaluation/sentence_retrieval.md")
            if tsne is not None:
                mlflow.log_figure(tsne, "figures/tsne.png")
            if log_scatter:
                mlflow.log_figure(sts_scatter, "figures/sts_scatter.png")
            for artifact, value in (dicts or {}).items():
                mlflow.log_dict(value, artifact)
    if plots_dir is not None:
        save_figure(sts_scatter, plots_dir / "sts_scatter.png")
        if examples:
            write_text(plots_dir / "sentence_retrieval.md", examples)
        if tsne is not None:
            save_figure(tsne, plots_dir / "tsne.png")
    else:
        plt.close(sts_scatter)


def evaluate_duet(cfg: Config, paths: Paths, model_dir: Path, region_sets: dict[str, Path],
                  run_id: str | None = None, plots_dir: Path | None = None, experiment_name: str | None = None,
                  data_dir: Path | None = None) -> dict[str, float]:
    """DUET's test scores (§5.1) through the shared evaluators: R@1/5/10 both ways and rsum
    (`mmcse.evaluation.retrieval.test_set_metrics`: COCO 5K and 1K folds, Flickr30k 1K) and graded
    NDCG@k per ``evaluate.ndcg.relevance`` (`relevance_for`), on v_I / v_C of the checkpoint at
    ``model_dir`` with the test region set ``region_sets["test"]``. Also: the test captions' nearest
    neighbours in the joint space (``sentence_retrieval.md``) and the t-SNE of the caption embeddings
    with cluster purity against their images (``tsne.png``, ``cluster_silhouette``,
    ``cluster_purity``); ``sts_scatter.png`` says that a retrieval model has no STS scores."""
    import matplotlib.pyplot as plt

    from mmcse.detection.regions import RegionStore
    from mmcse.device import resolve_device
    from mmcse.evaluation.figures import TSNE_CLUSTERS, TSNE_POINTS, tsne_figure
    from mmcse.evaluation.ndcg import test_set_ndcg
    from mmcse.evaluation.retrieval import neighbours_markdown, sentence_neighbours, test_set_metrics, unit_rows
    from mmcse.tokens import cached_tokens
    from mmcse.train_duet import RetrievalSplit, load_duet, split_embeddings

    raw = data_dir or paths.raw
    manifest = read_json(raw / "manifest.json")
    set_name = manifest.get("retrieval_set")
    if not set_name:
        raise ValueError(f"{raw}: no retrieval test set (data.pairs: {cfg.data.pairs}); DUET is scored by retrieval")
    if "test" not in region_sets:
        raise FileNotFoundError(f"{model_dir}: no test region set recorded for this training; rerun it "
                                "(dvc repro train)")
    device = resolve_device(cfg.base.device)
    model, tokenizer = load_duet(model_dir, device)
    split = RetrievalSplit.load(raw / "retrieval" / "images.jsonl", raw / "retrieval" / "captions.jsonl",
                                RegionStore.open(region_sets["test"]))
    tokens = cached_tokens(raw.parent / "tokens", "test_captions", tokenizer, split.captions, cfg.model.max_seq_len)
    image_emb, text_emb = split_embeddings(model, split, tokens, cfg.evaluate.batch_size, device,
                                           cfg.train.precision)
    block = cfg.evaluate.retrieval.block_size
    scores = test_set_metrics(set_name, image_emb, text_emb, split.text_image, block)
    if cfg.evaluate.ndcg.relevance:
        relevance = {kind: relevance_for(paths, split.captions, kind) for kind in cfg.evaluate.ndcg.relevance}
        scores |= test_set_ndcg(set_name, image_emb, text_emb, split.text_image, relevance, cfg.evaluate.ndcg.k,
                                block)
    r = cfg.evaluate.retrieval
    examples = None
    if r.examples:
        rows = sentence_neighbours(split.captions, text_emb, split.text_image, r.examples, r.examples_k)
        examples = neighbours_markdown(rows, f"Nearest test captions ({set_name}, DUET v_C in the joint space)")
    tsne = None
    if plots_dir is not None:  # the captions of each image should share a cluster: purity against the image
        tsne, clusters = tsne_figure(unit_rows(text_emb), n_clusters=TSNE_CLUSTERS, seed=cfg.base.seed,
                                     groups=split.text_image, max_points=TSNE_POINTS, title="duet captions")
        scores |= {f"cluster_{k}": v for k, v in clusters.items() if k in ("silhouette", "purity")}
    no_sts, ax = plt.subplots(figsize=(5, 2))
    ax.axis("off")
    ax.text(0.5, 0.5, "train.method duet is an image–text retrieval model:\nno STS scores (see eval.json: R@K, NDCG)",
            ha="center", va="center")
    record_evaluation(cfg, scores, run_id, experiment_name, plots_dir, examples, no_sts, tsne, log_scatter=False)
    return scores


def retrieval_test_set(cfg: Config, paths: Paths, encoder: Any, raw: Path, teacher_manifest: Path | None = None,
                       teacher_dirs: tuple[Path, ...] = (), head: Any = "config") -> Any:
    """`mmcse.evaluation.retrieval.evaluate_test_set` on ``<raw>/retrieval`` with the image features
    the teacher manifest names, plus graded NDCG (``evaluate.ndcg``, relevance from `relevance_for`)
    in its scores: what the evaluate stage and ``mmcse eval --retrieval`` report."""
    from mmcse.evaluation.ndcg import test_set_ndcg
    from mmcse.evaluation.retrieval import evaluate_test_set
    from mmcse.train import teacher_set_folder

    manifest = read_json(raw / "manifest.json")
    sets = read_json(teacher_manifest or paths.teachers / "manifest.json")["sets"]
    folders = {name: teacher_set_folder(sets[name], paths.teachers, teacher_dirs)
               for name in ("retrieval_image", "retrieval_joint_image") if name in sets}
    test_set = evaluate_test_set(cfg, encoder, raw, folders, manifest["retrieval_set"], head)
    if test_set.image_emb is not None and cfg.evaluate.ndcg.relevance:
        relevance = {kind: relevance_for(paths, test_set.captions, kind) for kind in cfg.evaluate.ndcg.relevance}
        test_set.scores |= test_set_ndcg(test_set.set_name, test_set.image_emb, test_set.text_emb,
                                         test_set.text_image, relevance, cfg.evaluate.ndcg.k,
                                         cfg.evaluate.retrieval.block_size)
    return test_set


def checkpoint_retrieval(cfg: Config, paths: Paths, encoder: Any, model_dir: Path) -> dict[str, float]:
    """``mmcse eval --retrieval``: R@K and NDCG of a best checkpoint (``train_state.json`` records
    its method's image head) on the retrieval test set of ``cfg``'s top-level artifacts, refused
    when they were made from another configuration (`mmcse.upstream.require_top_level`)."""
    from mmcse.upstream import require_top_level

    state_file = Path(model_dir) / "train_state.json"
    if state_file.is_file() and read_json(state_file).get("method") == "duet":
        return checkpoint_duet_retrieval(cfg, paths, Path(model_dir), read_json(state_file))
    if encoder.student is None or not state_file.is_file():
        raise FileNotFoundError(f"{state_file}: not an mmcse best checkpoint; --retrieval scores a student's "
                                "trained image head (models/student/best)")
    state = read_json(state_file)
    if "image_head" not in state:
        raise ValueError(f"{state_file}: written before checkpoints recorded their image head; retrain it "
                         "(dvc repro train) or use the evaluate stage")
    up = require_top_level(cfg, paths)
    if not read_json(up.raw / "manifest.json").get("retrieval_set"):
        raise ValueError(f"{up.raw}: no retrieval test set (data.pairs: {cfg.data.pairs})")
    head = tuple(state["image_head"]) if state["image_head"] else None
    return retrieval_test_set(cfg, paths, encoder, up.raw, up.teacher_manifest, up.teacher_dirs, head).scores


def checkpoint_duet_retrieval(cfg: Config, paths: Paths, model_dir: Path, state: dict[str, Any]) -> dict[str, float]:
    """``mmcse eval --retrieval`` of a DUET checkpoint: `evaluate_duet` on the test region set its
    training recorded (``train_state.json``), found in the cache_regions folder or
    ``<data>/upstream/regions``, on ``cfg``'s top-level artifacts (refused when stale)."""
    from mmcse.upstream import require_top_level

    up = require_top_level(cfg, paths)
    name = (state.get("region_sets") or {}).get("test")
    folders = [d / name for d in (paths.regions, paths.raw.parent / "upstream" / "regions")] if name else []
    found = [f for f in folders if (f / "index.json").is_file()]
    if not found:
        raise FileNotFoundError(f"{model_dir / 'train_state.json'}: its test region set "
                                f"{name or '(not recorded)'} is in neither {paths.regions} nor "
                                f"{paths.raw.parent / 'upstream' / 'regions'}: rerun cache_regions (dvc repro)")
    return evaluate_duet(cfg, paths, model_dir, {"test": found[0]}, data_dir=up.raw)


def log_ablation(cfg: Config, rows: list[dict[str, Any]], files: dict[str, Path], paths: Paths,
                 results: list[dict[str, Any]] | None = None, run_id: str | None = None,
                 step: int | None = None) -> None:
    """Table (``mlflow.log_table``: every column, the paired t-test p-values ``<metric>_p``
    included), CSV/Markdown, figure, the aggregate metrics (mean, std and p per variant,
    `mmcse.ablate.aggregate_metrics`), the list of jobs (``jobs.json``: variant, seed, status,
    MLflow run, artifact keys) and the paired t-tests in full (``significance.json``: t, p,
    paired seeds, mean difference, note per variant and metric) into the active (parent) MLflow
    run: bars per variant, or a line over ``ablate.plot_x`` for a parameter sweep; the figure
    also to ``plots/ablation.png`` and the per-variant primary metric (with its p-value against
    the reference) to ``metrics/ablate.json``. ``run_id``: the parent run, named (not taken from
    the thread's active run, which a job's run may be); default the active run. ``step``: of the
    aggregate metrics (the flow: jobs done, continuing the history `log_partial` logs)."""
    import math
    import time

    import mlflow
    import pandas as pd
    from mlflow.entities import Metric

    from mmcse.ablate import ALPHA, aggregate_metrics, paired_significance
    from mmcse.plots import ablation_bars, ablation_line, save_figure

    def finite(value: Any) -> Any:  # JSON has no NaN
        return value if not isinstance(value, float) or math.isfinite(value) else None

    from mmcse.ablate import table_metric

    metric = table_metric(cfg)
    if run_id is None:
        active = mlflow.active_run()
        if active is None:
            raise RuntimeError("log_ablation needs run_id or an active MLflow run (the ablation's parent)")
        run_id = active.info.run_id
    client = mlflow.MlflowClient()
    now = int(time.time() * 1000)
    values = [Metric(k, v, now, step or 0) for k, v in aggregate_metrics(rows).items()]
    for start in range(0, len(values), 1000):  # MLflow's batch limit
        client.log_batch(run_id, metrics=values[start : start + 1000])
    if results is not None:
        jobs = [{k: r.get(k) for k in ("variant", "seed", "status", "run_id", "artifacts", "error") if k in r}
                for r in results]
        client.log_dict(run_id, {"jobs": jobs}, "jobs.json")
        metrics = [k[: -len("_mean")] for k in rows[0] if k.endswith("_mean")] if rows else []
        tests = paired_significance(results, cfg.ablate.reference, metrics)
        client.log_dict(run_id, {"reference": cfg.ablate.reference, "alpha": ALPHA,
                                 "test": "paired t-test (scipy.stats.ttest_rel), runs paired by seed, two-sided",
                                 "variants": {v: {m: {k: finite(x) for k, x in cell.items()}
                                                  for m, cell in by_metric.items()}
                                              for v, by_metric in tests.items()}}, "significance.json")
    client.log_table(run_id, pd.DataFrame(rows), artifact_file="ablation_table.json")
    client.log_artifact(run_id, str(files["csv"]))
    client.log_artifact(run_id, str(files["md"]))
    means = [r.get(f"{metric}_mean", math.nan) for r in rows]
    stds = [r.get(f"{metric}_std", math.nan) for r in rows]
    if cfg.ablate.plot_x:
        xs = [cfg.ablate.variants[r["variant"]][cfg.ablate.plot_x] for r in rows]
        fig = ablation_line(xs, means, stds, metric, cfg.ablate.plot_x)
    else:
        fig = ablation_bars([r["variant"] for r in rows], means, stds, metric)
    client.log_figure(run_id, fig, "figures/ablation.png")
    save_figure(fig, paths.plots / "ablation.png")
    summary = {
        r["variant"]: {"mean": r.get(f"{metric}_mean"), "std": r.get(f"{metric}_std"), "status": r["status"],
                       "p": finite(r.get(f"{metric}_p", math.nan)), "note": r.get("note", "")}
        for r in rows
    }
    write_json(paths.metrics / "ablate.json", {"metric": metric, "preset": cfg.ablate.preset, "variants": summary})
