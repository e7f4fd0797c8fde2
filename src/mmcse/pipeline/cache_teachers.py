"""Stage ``cache_teachers``: the frozen teachers' features training and evaluation read instead of
running a model, computed once and content-addressed."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from mmcse.config import Config
from mmcse.config.inputs import JOINT_TEXT_TEACHER
from mmcse.integrity.files import check_image_digests, verify_images
from mmcse.integrity.keys import artifact_keys
from mmcse.io import read_json, read_jsonl, sha256_file, write_json
from mmcse.models.device import resolve_device, with_base_threads
from mmcse.pipeline.paths import Paths
from mmcse.teachers.cache import (
    FeatureStore,
    cached_features,
    fit_cca,
    image_encoder,
    pretrained_joint_teacher,
    text_teacher_features,
    text_teacher_key,
)


@with_base_threads
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
    sets = TeacherSets(cfg, paths, read_only)
    sets.image_sets()
    sets.text_sets()
    sets.joint_sets()
    result = sets.result
    result["artifact_key"] = artifact_keys(cfg)["teachers"]  # written last: the manifest names complete sets
    write_json(manifest_path or paths.teachers / "manifest.json", {k: v for k, v in result.items() if k != "hits"})
    return result


class TeacherSets:
    """One ``cache_teachers`` run: its inputs read and every model resolved at construction (an offline id fails
    there, before anything is computed), then the image, text and joint sets in that order, each taken from a
    cache or computed (`store`); ``result`` names the sets and says which were found cached."""

    def __init__(self, cfg: Config, paths: Paths, read_only: tuple[Path, ...]) -> None:
        self.t = t = cfg.teachers
        self.paths, self.read_only = paths, read_only
        self.device = device = resolve_device(cfg.base.device)
        self.manifest = read_json(paths.raw / "manifest.json")
        sha = self.manifest["sha256"]
        self.images = read_jsonl(paths.raw / "images.jsonl")
        self.pairs = read_jsonl(paths.raw / "pairs.jsonl")
        self.objects = read_jsonl(paths.objects / "objects.jsonl")
        self.corpus = [s for s in (paths.raw / "corpus.txt").read_text().splitlines() if s.strip()]
        self.captions = [p["caption"] for p in self.pairs]
        self.texts = {"caption": (self.captions, [p["pair_id"] for p in self.pairs], sha["pairs.jsonl"]),
                      "corpus": (self.corpus, [f"corpus-{i}" for i in range(len(self.corpus))], sha["corpus.txt"])}
        self.image_files = [paths.raw / r["file"] for r in self.images]
        # Image bytes are in the fingerprints (images.jsonl records each image's SHA-256): every image is
        # checked against them here, cached sets or not (hashed only when its stat moved since last checked)
        verify_images(paths.raw, ("images.jsonl", "retrieval/images.jsonl"))
        self.image_teacher, self.encode_images = image_encoder(t, device)
        # `joint` text teachers are the joint teacher's text side, computed with it in `joint_sets`
        wanted = [(x.teacher, x.pooler) for x in t.text if x.teacher != JOINT_TEXT_TEACHER]
        self.joint_features: Callable[[list[str], list[Path]], tuple[np.ndarray, np.ndarray]] | None = None
        if t.joint.kind == "cca":
            wanted.append((t.joint.text_teacher, t.joint.text_pooler))
            self.joint_teacher: dict[str, Any] = {
                "kind": "cca", "dim": t.joint.dim, "regularization": t.joint.regularization,
                "text": text_teacher_key(t.joint.text_teacher, t.joint.text_pooler), "image": self.image_teacher}
        else:
            self.joint_teacher, self.joint_features = pretrained_joint_teacher(t, device)
        self.text_keys = {(m, p): text_teacher_key(m, p) for m, p in dict.fromkeys(wanted)}
        self.result: dict[str, Any] = {"sets": {"text": []}, "hits": {}}
        self.text_stores: dict[tuple[str, str, str], FeatureStore] = {}
        self.joint: dict[str, Any] = {}  # the joint teacher's two sides (and a CCA), computed once when asked
        # the retrieval test images (evaluate: R@K through the trained image heads), when the data has them
        test_table = paths.raw / "retrieval" / "images.jsonl"
        self.test_images = read_jsonl(test_table) if test_table.is_file() else []
        self.test_files = [paths.raw / r["file"] for r in self.test_images]
        self.test_ids = [r["image_id"] for r in self.test_images]
        self.test_fingerprint = sha.get("retrieval/images.jsonl", "")

    def store(self, name: str, teacher: dict[str, Any], fingerprint: str, ids: list[str],
              compute: Callable[[], np.ndarray], role: str | None = None) -> FeatureStore:
        """The set ``name`` of ``teacher`` over ``ids``: found in a cache, else ``compute``d and written."""
        features, hit = cached_features(self.paths.teachers, name, teacher, fingerprint, ids, compute, self.read_only)
        self.result["hits"][role or name] = hit
        return features

    def encode_checked(self, rows: list[dict[str, Any]], files: list[Path], what: str) -> np.ndarray:
        check_image_digests(rows, files)  # only when a set is built: a cached one was built from checked bytes
        return self.encode_images(files, what)

    def image_sets(self) -> None:
        """``image``, ``object`` (the detect stage's crops) and ``retrieval_image`` (the test images)."""
        sha = self.manifest["sha256"]
        self.image_store = self.store("image", self.image_teacher, sha["images.jsonl"],
                                      [r["image_id"] for r in self.images],
                                      lambda: self.encode_checked(self.images, self.image_files, "images"))
        crop_files = sorted({o["crop"] for row in self.objects for o in row["objects"]})
        crops_from = sha256_file(self.paths.objects / "objects.jsonl") + sha["images.jsonl"]  # boxes + pixels
        object_store = self.store("object", self.image_teacher, crops_from, crop_files,
                                  lambda: self.encode_images([self.paths.objects / c for c in crop_files],
                                                             "object crops"))
        self.result["sets"] |= {"image": self.image_store.folder.name, "object": object_store.folder.name}
        self.test_image_store = (self.store(
            "retrieval_image", self.image_teacher, self.test_fingerprint, self.test_ids,
            lambda: self.encode_checked(self.test_images, self.test_files, "retrieval test images"))
            if self.test_images else None)
        if self.test_image_store is not None:
            self.result["sets"]["retrieval_image"] = self.test_image_store.folder.name

    def text_sets(self) -> None:
        """Every (model, pooler) the config names on captions and corpus: one forward per model and text set."""
        poolers_of: dict[str, list[str]] = {}
        for model, pooler in self.text_keys:
            poolers_of.setdefault(model, []).append(pooler)
        computed: dict[tuple[str, str], dict[str, np.ndarray]] = {}

        def text_features(model: str, pooler: str, kind: str) -> Callable[[], np.ndarray]:
            def compute() -> np.ndarray:
                if (model, kind) not in computed:
                    computed[(model, kind)] = text_teacher_features(model, self.texts[kind][0], poolers_of[model],
                                                                    self.t.batch_size, device=self.device)
                return computed[(model, kind)].pop(pooler)  # stored right after: free it (Wiki1M is GBs)

            return compute

        for (model, pooler), key in self.text_keys.items():
            for kind, (_, ids, fingerprint) in self.texts.items():
                self.text_stores[(model, pooler, kind)] = self.store(
                    f"text_{kind}", key, fingerprint, ids, text_features(model, pooler, kind),
                    role=f"text_{kind}:{model}:{pooler}",
                )

    def joint_sides(self) -> tuple[np.ndarray, np.ndarray]:
        """(captions, images) in the joint space: a pretrained teacher's, or a CCA fitted on (caption, its image)."""
        t, joint = self.t.joint, self.joint
        if not joint:
            if t.kind == "cca":
                source = np.asarray(self.text_stores[(t.text_teacher, t.text_pooler, "caption")].features)
                pair_images = self.image_store.rows([p["image_id"] for p in self.pairs])  # (n_pairs, d_v)
                cca = fit_cca(source, pair_images, t.dim, t.regularization)
                joint["sides"] = cca.text(source), cca.image(np.asarray(self.image_store.features))
                joint["cca"] = cca
            else:
                check_image_digests(self.images, self.image_files)
                joint["sides"] = self.joint_features(self.captions, self.image_files)
        return joint["sides"]

    def joint_sets(self) -> None:
        """``joint_text``, ``joint_image``, the joint text side as a text teacher, ``retrieval_joint_image``; then
        the text teachers' entries of the manifest."""
        t, sha = self.t, self.manifest["sha256"]
        fingerprint = sha["pairs.jsonl"] + sha["images.jsonl"]
        own_image_side = t.joint.image_side == "joint"

        def joint_captions() -> np.ndarray:
            if own_image_side or t.joint.kind == "cca":
                return self.joint_sides()[0]
            # text only: one image keeps the image batch non-empty
            return self.joint_features(self.captions, self.image_files[:1])[0]

        joint_text = self.store("joint_text", self.joint_teacher, fingerprint, [p["pair_id"] for p in self.pairs],
                                joint_captions)
        # image_side image_encoder: v̂ is the image encoder's own set (an image-only teacher, DALR Table 9's ResNet)
        joint_image = (self.store("joint_image", self.joint_teacher, fingerprint, [r["image_id"] for r in self.images],
                                  lambda: self.joint_sides()[1]) if own_image_side else self.image_store)
        self.result["sets"] |= {"joint_text": joint_text.folder.name, "joint_image": joint_image.folder.name}
        if any(x.teacher == JOINT_TEXT_TEACHER for x in t.text):
            # The joint teacher's text side as a text teacher (DALR Table 9's CLIP text teacher): its
            # caption features are joint_text itself; corpus sentences go through the same text side.
            def joint_corpus() -> np.ndarray:
                if t.joint.kind == "cca":
                    self.joint_sides()
                    source = self.text_stores[(t.joint.text_teacher, t.joint.text_pooler, "corpus")].features
                    return self.joint["cca"].text(np.asarray(source))
                return self.joint_features(self.corpus, self.image_files[:1])[0]  # one image: a non-empty batch

            self.text_stores[(JOINT_TEXT_TEACHER, "avg", "caption")] = joint_text
            _, corpus_ids, corpus_fingerprint = self.texts["corpus"]
            self.text_stores[(JOINT_TEXT_TEACHER, "avg", "corpus")] = self.store(
                "text_corpus", {"joint": self.joint_teacher, "side": "text"}, fingerprint + corpus_fingerprint,
                corpus_ids, joint_corpus, role=f"text_corpus:{JOINT_TEXT_TEACHER}")
        for x in t.text:
            self.result["sets"]["text"].append({
                "teacher": x.teacher, "pooler": x.pooler, "weight": x.weight,
                "caption": self.text_stores[(x.teacher, x.pooler, "caption")].folder.name,
                "corpus": self.text_stores[(x.teacher, x.pooler, "corpus")].folder.name,
            })
        if self.test_image_store is not None:  # v̂ of the test images: the CCA is fitted on the training pairs
            joint_test = (self.store("retrieval_joint_image", self.joint_teacher, fingerprint + self.test_fingerprint,
                                     self.test_ids, self.joint_test_images) if own_image_side
                          else self.test_image_store)
            self.result["sets"]["retrieval_joint_image"] = joint_test.folder.name

    def joint_test_images(self) -> np.ndarray:
        """The test images in the joint space."""
        if self.t.joint.kind == "cca":  # the CCA fitted on the training pairs, applied to the test images
            self.joint_sides()
            return self.joint["cca"].image(np.asarray(self.test_image_store.features))
        # images only: one caption keeps the text side's batch non-empty (its output is dropped)
        check_image_digests(self.test_images, self.test_files)
        return self.joint_features(self.captions[:1], self.test_files)[1]


# DUET's image sets: the training images, the retrieval val split (dev score) and test split
