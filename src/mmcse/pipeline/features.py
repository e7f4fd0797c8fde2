"""Stages ``cache_teachers``, ``cache_regions`` and ``relevance``: everything training and
evaluation read instead of running a model, computed once and content-addressed.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from mmcse.config import Config
from mmcse.io import read_json, read_jsonl, sha256_file, write_json
from mmcse.pipeline.paths import Paths


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

    from mmcse.config.inputs import JOINT_TEXT_TEACHER
    from mmcse.integrity.files import check_image_digests, verify_images
    from mmcse.integrity.keys import artifact_keys
    from mmcse.models.device import resolve_device
    from mmcse.teachers.cache import (
        FeatureStore,
        cached_features,
        fit_cca,
        image_encoder,
        pretrained_joint_teacher,
        text_teacher_features,
        text_teacher_key,
    )

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
    # Image bytes are in the fingerprints (images.jsonl records each image's SHA-256): every image is
    # checked against them here, cached sets or not (hashed only when its stat moved since last checked)
    verify_images(paths.raw, ("images.jsonl", "retrieval/images.jsonl"))
    # Resolve every model first: an offline id fails here, before anything is computed.
    image_teacher, encode_images = image_encoder(t, device)
    # `joint` text teachers are the joint teacher's text side, computed with it below
    wanted = [(x.teacher, x.pooler) for x in t.text if x.teacher != JOINT_TEXT_TEACHER]
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

    def encode_checked(rows: list[dict[str, Any]], files: list[Path], what: str) -> np.ndarray:
        check_image_digests(rows, files)  # only when a set is built: a cached one was built from checked bytes
        return encode_images(files, what)

    image_store = store("image", image_teacher, manifest["sha256"]["images.jsonl"], [r["image_id"] for r in images],
                        lambda: encode_checked(images, image_files, "images"))
    crop_files = sorted({o["crop"] for row in objects for o in row["objects"]})
    crops_from = sha256_file(paths.objects / "objects.jsonl") + manifest["sha256"]["images.jsonl"]  # boxes + pixels
    object_store = store("object", image_teacher, crops_from, crop_files,
                         lambda: encode_images([paths.objects / c for c in crop_files], "object crops"))
    result["sets"] |= {"image": image_store.folder.name, "object": object_store.folder.name}
    # The retrieval test images (evaluate: R@K through the trained image heads), when the data has them.
    test_table = paths.raw / "retrieval" / "images.jsonl"
    test_images = read_jsonl(test_table) if test_table.is_file() else []
    test_files = [paths.raw / r["file"] for r in test_images]
    test_ids = [r["image_id"] for r in test_images]
    test_fingerprint = manifest["sha256"].get("retrieval/images.jsonl", "")
    test_image_store = (store("retrieval_image", image_teacher, test_fingerprint, test_ids,
                              lambda: encode_checked(test_images, test_files, "retrieval test images"))
                        if test_images else None)
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
                computed[(model, kind)] = text_teacher_features(model, texts[kind][0], poolers_of[model],
                                                                t.batch_size, device=device)
            return computed[(model, kind)].pop(pooler)  # stored right after: free it (Wiki1M is GBs)

        return compute

    text_stores: dict[tuple[str, str, str], FeatureStore] = {}
    for (model, pooler), key in text_keys.items():
        for kind, (_, ids, fingerprint) in texts.items():
            text_stores[(model, pooler, kind)] = store(
                f"text_{kind}", key, fingerprint, ids, text_features(model, pooler, kind),
                role=f"text_{kind}:{model}:{pooler}",
            )
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
                check_image_digests(images, image_files)
                joint["sides"] = joint_features(captions, image_files)
        return joint["sides"]

    def joint_test_images() -> np.ndarray:
        if t.joint.kind == "cca":  # the CCA fitted on the training pairs, applied to the test images
            joint_sides()
            return joint["cca"].image(np.asarray(test_image_store.features))
        # images only: one caption keeps the text side's batch non-empty (its output is dropped)
        check_image_digests(test_images, test_files)
        return joint_features(captions[:1], test_files)[1]

    joint_text = store("joint_text", joint_teacher, fingerprint, [p["pair_id"] for p in pairs],
                       lambda: joint_sides()[0])
    joint_image = store("joint_image", joint_teacher, fingerprint, [r["image_id"] for r in images],
                        lambda: joint_sides()[1])
    result["sets"] |= {"joint_text": joint_text.folder.name, "joint_image": joint_image.folder.name}
    if any(x.teacher == JOINT_TEXT_TEACHER for x in t.text):
        # The joint teacher's text side as a text teacher (DALR Table 9's CLIP text teacher): its
        # caption features are joint_text itself; corpus sentences go through the same text side.
        def joint_corpus() -> np.ndarray:
            if t.joint.kind == "cca":
                joint_sides()
                source = text_stores[(t.joint.text_teacher, t.joint.text_pooler, "corpus")].features
                return joint["cca"].text(np.asarray(source))
            return joint_features(corpus, image_files[:1])[0]  # one image keeps the image batch non-empty

        text_stores[(JOINT_TEXT_TEACHER, "avg", "caption")] = joint_text
        _, corpus_ids, corpus_fingerprint = texts["corpus"]
        text_stores[(JOINT_TEXT_TEACHER, "avg", "corpus")] = store(
            "text_corpus", {"joint": joint_teacher, "side": "text"}, fingerprint + corpus_fingerprint, corpus_ids,
            joint_corpus, role=f"text_corpus:{JOINT_TEXT_TEACHER}")
    for x in t.text:
        result["sets"]["text"].append({
            "teacher": x.teacher, "pooler": x.pooler, "weight": x.weight,
            "caption": text_stores[(x.teacher, x.pooler, "caption")].folder.name,
            "corpus": text_stores[(x.teacher, x.pooler, "corpus")].folder.name,
        })
    if test_image_store is not None:  # v̂ of the test images: the CCA is fitted on the training pairs above
        joint_test = store("retrieval_joint_image", joint_teacher, fingerprint + test_fingerprint, test_ids,
                           joint_test_images)
        result["sets"]["retrieval_joint_image"] = joint_test.folder.name
    result["artifact_key"] = artifact_keys(cfg)["teachers"]  # written last: the manifest names complete sets
    write_json(manifest_path or paths.teachers / "manifest.json", {k: v for k, v in result.items() if k != "hits"})
    return result


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
    from mmcse.models.device import resolve_device
    from mmcse.teachers.cache import FeatureStore, image_encoder
    from mmcse.training.batches import teacher_set_folder

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
    from mmcse.detection.regions import IMAGE_TABLES, build_region_cache
    from mmcse.integrity.files import verify_images

    raw, objects = raw or paths.raw, objects or paths.objects
    if cfg.regions.source == "objects":  # the images are read (crops, whole images): checked, sets cached or not
        verify_images(raw, IMAGE_TABLES)
    source = region_source(cfg, raw, objects, teacher_manifest or paths.teachers / "manifest.json",
                           (paths.teachers,) if teacher_dirs is None else teacher_dirs)
    result: dict[str, Any] = {"sets": {}, "hits": {}, "images": {}, "folders": {}, "source": cfg.regions.source}
    for split, table in REGION_SPLITS.items():
        ids = [row["image_id"] for row in read_jsonl(raw / table)] if (raw / table).is_file() else []
        if not ids:
            continue
        store, hit = build_region_cache(out_dir or paths.regions, ids, source, cfg.regions.max_regions,
                                        cfg.regions.dtype, read_only)
        result["sets"][split], result["hits"][split], result["images"][split] = store.folder.name, hit, len(ids)
        result["folders"][split] = store.folder  # where the intact set is: a damaged read-only one is passed by
        result["dim"] = store.dim
    return result


def region_sets_for(cfg: Config, paths: Paths, up: Any) -> dict[str, Path]:
    """The region sets of a training's upstream artifacts ``up`` (`mmcse.integrity.keys.Upstream`): opened
    (and checked) from the cache_regions stage's folder when it holds them intact, else built once
    (under a file lock: concurrent jobs share the work) in ``<data>/upstream/regions``. ``{split: folder}``."""
    from filelock import FileLock

    shared = paths.raw.parent / "upstream" / "regions"
    shared.mkdir(parents=True, exist_ok=True)
    with FileLock(str(shared / ".lock")):
        result = run_cache_regions(cfg, paths, up.raw, up.objects, up.teacher_manifest, up.teacher_dirs,
                                   out_dir=shared, read_only=(paths.regions,))
    # the folder the lookup opened and checked: a damaged set in the stage's folder is never used,
    # its rebuilt copy under `shared` is
    return dict(result["folders"])


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
