"""Real datasets for the ``download`` stage: Flickr30k and MS-COCO 2014 with Karpathy's splits,
Conceptual 12M webdataset shards, Flickr30k Entities phrase boxes, Wiki1M and SimCSE's SentEval archive.

Every source is declared in ``params.yaml`` (``data.sources.<name>``) as a URL (plain HTTP,
resumed with Range requests), a Hugging Face hub file (the hub client's cache and offline
mode) or a local path, and fetched with :mod:`mmcse.data.fetch`. Archives are extracted once
into ``<downloads>/<name>/`` (safely: no member may leave the folder) and the folder is
marked with the archive's SHA-256, so a changed archive is extracted again. What the
sources hold (digests, sizes) goes into the download manifest, which later stages depend on.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import shutil
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from mmcse.config import DataConfig, SourceConfig
from mmcse.data.fetch import DownloadError, file_digest, http_download, hub_file, safe_extract
from mmcse.errors import InputError
from mmcse.io import open_image, sha256_file, write_json

log = logging.getLogger(__name__)

_MARKER = ".mmcse-extracted.json"


@dataclass
class Fetched:
    """A fetched source: the file (or folder) on disk and what the manifest records of it."""

    path: Path
    record: dict[str, Any] = field(default_factory=dict)


def fetch_source(spec: SourceConfig, name: str, downloads: str | Path) -> Fetched:
    """The file of source ``name`` (``data.sources.<name>``) on this machine, fetched if needed."""
    key = f"data.sources.{name}"
    if spec.path:
        path = Path(spec.path).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"params.yaml: {key}.path={spec.path!r} does not exist")
        if path.is_dir():
            return Fetched(path, {"origin": f"path:{path}"})
        # the user's own file: hashed, but nothing is written beside it
        return Fetched(path, {"origin": f"path:{path}", "sha256": _checked(spec, key, path, sha256_file(path)),
                              "bytes": path.stat().st_size})
    origin = spec.url or f"hub:{spec.hub}/{spec.file}" + (f"@{spec.revision}" if spec.revision else "")
    # the digest params.yaml declares, else the one recorded when this origin was first fetched
    trusted = None if spec.sha256 else first_use_digest(Path(downloads), origin)
    if spec.url:
        filename = spec.url.rstrip("/").rsplit("/", 1)[-1].split("?")[0] or name
        path = http_download(spec.url, Path(downloads) / name / filename, spec.sha256.lower() or trusted)
    else:
        path = hub_file(spec.hub, spec.file, repo_type="dataset", revision=spec.revision or None)
    digest = _checked(spec, key, path, file_digest(path), trusted)
    record = {"origin": origin, "sha256": digest, "bytes": path.stat().st_size,
              "verified": "declared" if spec.sha256 else "first use"}
    if not spec.sha256 and trusted is None:
        record_first_use(Path(downloads), origin, digest, record["bytes"])
        log.warning("%s: no sha256 declared in params.yaml; recorded %s on first use (trusted from now on, in %s): "
                    "pin it as %s.sha256", key, digest, Path(downloads) / TRUST_FILE, key)
    return Fetched(path, record)


# Digests of sources params.yaml declares none for, recorded when each was first fetched (trust on
# first use): a later fetch of the same origin that gives other bytes is refused, not used.
TRUST_FILE = "first_use_sha256.json"


def first_use_digest(downloads: Path, origin: str) -> str | None:
    """The SHA-256 recorded for ``origin`` when it was first fetched into ``downloads`` (None: never)."""
    try:
        entry = json.loads((downloads / TRUST_FILE).read_text()).get(origin)
    except (OSError, ValueError, AttributeError):
        return None
    return entry.get("sha256") if isinstance(entry, dict) else None


def record_first_use(downloads: Path, origin: str, digest: str, size: int) -> None:
    file = downloads / TRUST_FILE
    try:
        recorded = json.loads(file.read_text())
        recorded = recorded if isinstance(recorded, dict) else {}
    except (OSError, ValueError):
        recorded = {}
    recorded[origin] = {"sha256": digest, "bytes": size, "first_fetched": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                        time.gmtime())}
    write_json(file, recorded)


def _checked(spec: SourceConfig, key: str, path: Path, digest: str, trusted: str | None = None) -> str:
    if spec.sha256 and digest != spec.sha256.lower():
        raise DownloadError(f"{key}: {path} has SHA-256 {digest}, params.yaml expects {spec.sha256}; "
                            "a changed or corrupt file — delete it (or fix the digest) and rerun")
    if trusted and digest != trusted:
        raise DownloadError(f"{key}: {path} has SHA-256 {digest}, not the {trusted} recorded when it was first "
                            f"fetched ({TRUST_FILE}); the source changed or the file is corrupt — check it, then "
                            "declare the right digest in params.yaml")
    return digest


def extracted_source(spec: SourceConfig, name: str, downloads: str | Path) -> Fetched:
    """The folder holding source ``name``'s archive contents (a local folder is used as it is)."""
    fetched = fetch_source(spec, name, downloads)
    if fetched.path.is_dir():
        return fetched
    dest = Path(downloads) / name / "extracted"
    marker = dest / _MARKER
    try:
        done = json.loads(marker.read_text()).get("sha256") == fetched.record["sha256"]
    except (OSError, json.JSONDecodeError):
        done = False
    if done:
        return Fetched(dest, fetched.record)
    log.info("extracting %s into %s", fetched.path, dest)
    safe_extract(fetched.path, dest)
    write_json(marker, {"archive": str(fetched.path), "sha256": fetched.record["sha256"]})
    return Fetched(dest, fetched.record)


def find_named(folder: Path, name: str, want_dir: bool = False) -> Path:
    """The shallowest path called ``name`` under ``folder`` (archives differ in their top folder)."""
    hits = sorted((p for p in folder.rglob(name) if p.is_dir() == want_dir), key=lambda p: len(p.parts))
    if not hits:
        raise FileNotFoundError(f"{folder}: no {'folder' if want_dir else 'file'} named {name!r} in the extracted "
                                "archive — is the source the right archive?")
    return hits[0]


# --------------------------------------------------------------------------- Karpathy splits


@dataclass(frozen=True)
class KarpathyImage:
    """One listed image of a split (Karpathy's, or Flickr30k Entities' with its Sentences' captions)."""

    image_id: str  # flickr30k-<stem> | coco-<cocoid>
    filename: str
    folder: str  # COCO: train2014 / val2014 (which archive holds the file); Flickr30k: ""
    split: str
    captions: tuple[str, ...]


def read_karpathy(path: str | Path, dataset: str, splits: list[str]) -> list[KarpathyImage]:
    """Images of ``splits`` from Karpathy's ``dataset_<dataset>.json``, in file order.

    An image without captions or a blank caption is an error naming the file and image: the
    published files have none, so one means a damaged or different file."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf8"))
        entries = data["images"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise InputError(f"{path}: not a Karpathy split file ({type(err).__name__}: {err})") from None
    images = []
    for entry in entries:
        split = entry.get("split")
        if split not in splits:
            continue
        filename = entry["filename"]
        captions = tuple(" ".join(s.get("raw", "").split()) for s in entry.get("sentences", []))
        if not captions or not all(captions):
            raise InputError(f"{path}: image {filename} has an empty caption or none")
        if dataset == "coco":
            image_id = f"coco-{entry.get('cocoid', Path(filename).stem)}"
        else:
            image_id = f"{dataset}-{Path(filename).stem}"
        images.append(KarpathyImage(image_id, filename, entry.get("filepath", ""), split, captions))
    return images


KARPATHY_SETS = ("flickr30k", "coco")


def karpathy_test_captions(cfg: DataConfig, downloads: Path) -> tuple[dict[str, list[dict]], dict[str, Any]]:
    """Every caption of Karpathy's test split of each data set in Karpathy's file (``image_id,
    caption`` rows by data set), read from the caption file alone (no image is fetched): the
    caption sets a figure may encode (``ablate.figure_captions``; DALR Fig. 3: COCO's). A data set
    the archive lacks (a local copy holding one of them) is left out: a figure asking for it names
    the file. Returns the rows and the source's manifest record."""
    splits = extracted_source(cfg.sources.karpathy_splits, "karpathy_splits", downloads)
    rows = {}
    for dataset in KARPATHY_SETS:
        try:
            file = find_named(splits.path, f"dataset_{dataset}.json")
        except FileNotFoundError:
            continue
        rows[dataset] = [{"image_id": image.image_id, "caption": caption}
                         for image in read_karpathy(file, dataset, ["test"]) for caption in image.captions]
    return rows, splits.record


# --------------------------------------------------------------------------- Flickr30k Entities


@dataclass(frozen=True)
class EntityCaption:
    text: str
    phrases: tuple[tuple[str, int, int], ...]  # (entity id, char start, char end)


def parse_entities_sentence(line: str) -> EntityCaption:
    """One line of Flickr30k Entities' ``Sentences/<id>.txt``: ``[/EN#18/people A man] with …``
    → the plain caption and each phrase's entity id and character span in it."""
    text, phrases, i = [], [], 0
    while i < len(line):
        if line.startswith("[/EN#", i):
            close = line.find("]", i)
            head_end = line.find(" ", i)
            if close < 0 or head_end < 0 or head_end > close:
                raise InputError(f"malformed phrase markup at column {i}: {line!r}")
            entity = line[i + len("[/EN#") : head_end].split("/")[0]
            start = sum(map(len, text))
            text.append(line[head_end + 1 : close])
            phrases.append((entity, start, start + close - head_end - 1))
            i = close + 1
        else:
            text.append(line[i])
            i += 1
    return EntityCaption("".join(text), tuple(phrases))


def parse_entities_boxes(path: str | Path) -> dict[str, list[int]]:
    """Entity id → one box (the union of its boxes, ``[x0, y0, x1, y1)``) from an
    ``Annotations/<id>.xml``; entities without a box (scene, not visual) are absent."""
    root = ET.parse(path).getroot()
    boxes: dict[str, list[int]] = {}
    for obj in root.iter("object"):
        box = obj.find("bndbox")
        if box is None:
            continue
        x0, y0, x1, y1 = (int(float(box.findtext(k))) for k in ("xmin", "ymin", "xmax", "ymax"))
        for name in obj.findall("name"):
            old = boxes.get(name.text)
            # the XML's max is the last pixel inside: +1 makes an exclusive box like every other box here
            new = [x0, y0, x1 + 1, y1 + 1]
            boxes[name.text] = new if old is None else [min(old[0], new[0]), min(old[1], new[1]),
                                                         max(old[2], new[2]), max(old[3], new[3])]
    return boxes


def entities_for(folder: Path, stem: str) -> tuple[list[EntityCaption], dict[str, list[int]]] | None:
    sentences = folder / "Sentences" / f"{stem}.txt"
    annotations = folder / "Annotations" / f"{stem}.xml"
    if not (sentences.is_file() and annotations.is_file()):
        return None
    lines = [ln.strip() for ln in sentences.read_text(encoding="utf8").splitlines() if ln.strip()]
    return [parse_entities_sentence(ln) for ln in lines], parse_entities_boxes(annotations)


ENTITIES_SPLITS = ("train", "val", "test")


def read_entities_split(path: Path, split: str) -> list[str]:
    """The image ids (file stems) of one of Flickr30k Entities' split lists, in file order; a line that is
    not an image id is an error naming the file and line."""
    ids = []
    for number, line in enumerate(path.read_text(encoding="utf8").splitlines(), 1):
        if not line.strip():
            continue
        if not line.strip().isdigit():
            raise InputError(f"{path}:{number}: not a Flickr30k image id: {line.strip()!r} (a {split}.txt of "
                             "Flickr30k Entities lists one numeric id a line)")
        ids.append(line.strip())
    return ids


def entities_images(cfg: DataConfig, downloads: Path) -> tuple[list[KarpathyImage], Path, dict[str, Any], int]:
    """The Flickr30k images of ``cfg.splits`` under Flickr30k Entities' split (``data.flickr_split:
    entities``): its split lists (``data.sources.entities_<split>``, digests declared) and each image's five
    captions from its ``Sentences/<id>.txt`` (``data.sources.flickr30k_entities``, the phrase markup removed),
    as MCSE's preprocess/prepare_flickr.py reads them. Returns the images, the Entities folder, the sources'
    manifest records and how many listed images have no Sentences file (skipped, counted)."""
    sources: dict[str, Any] = {}
    fetched = extracted_source(cfg.sources.flickr30k_entities, "flickr30k_entities", downloads)
    sources["flickr30k_entities"] = fetched.record
    folder = find_named(fetched.path, "Sentences", want_dir=True).parent
    images, missing = [], 0
    for split in [s for s in ENTITIES_SPLITS if s in cfg.splits]:
        listed = fetch_source(getattr(cfg.sources, f"entities_{split}"), f"entities_{split}", downloads)
        sources[f"entities_{split}"] = listed.record
        for stem in read_entities_split(listed.path, split):
            sentences = folder / "Sentences" / f"{stem}.txt"
            if not sentences.is_file():
                log.warning("%s: listed in Flickr30k Entities' %s split but absent; skipped", sentences, split)
                missing += 1
                continue
            lines = [ln.strip() for ln in sentences.read_text(encoding="utf8").splitlines() if ln.strip()]
            captions = tuple(" ".join(parse_entities_sentence(ln).text.split()) for ln in lines)
            if not captions or not all(captions):
                raise InputError(f"{sentences}: image {stem} has an empty caption or none")
            images.append(KarpathyImage(f"flickr30k-{stem}", f"{stem}.jpg", "", split, captions))
    return images, folder, sources, missing


# --------------------------------------------------------------------------- pairs


def _readable(path: Path) -> bool:
    """Decodes fully: a truncated JPEG fails here, not in a later stage."""
    try:
        open_image(path)
        return True
    except (FileNotFoundError, ValueError):
        return False


def _file_record(path: Path) -> dict[str, Any]:
    """SHA-256 and size of an image file (recorded in images.jsonl: the teacher-cache fingerprints)."""
    return {"sha256": sha256_file(path), "bytes": path.stat().st_size}


class _Verdicts:
    """Remembered digests and decode results of the images of one extracted folder
    (``.mmcse-verified.json``: file name -> ``{sha256, bytes[, readable]}``)."""

    def __init__(self, folder: Path, remember: bool):
        # only folders this stage extracted are remembered: a user's own folder may change
        self.file = folder / ".mmcse-verified.json"
        self.remember = remember
        self.seen: dict[str, Any] = json.loads(self.file.read_text()) if remember and self.file.is_file() else {}
        self.changed = False

    def inspect(self, path: Path, decode: bool) -> dict[str, Any]:
        """``{sha256, bytes}`` of ``path`` and, with ``decode``, ``readable``; each computed once
        per file (older verdict files hold a bare bool: the digest is computed then)."""
        entry = self.seen.get(path.name)
        if not isinstance(entry, dict) or entry.get("bytes") != path.stat().st_size:
            entry = _file_record(path)
        if decode and "readable" not in entry:
            entry = {**entry, "readable": _readable(path)}
        if entry is not self.seen.get(path.name):
            self.seen[path.name] = entry
            self.changed = True
        return entry

    def save(self) -> None:
        if self.remember and self.changed:
            write_json(self.file, self.seen)


def _place(src: Path, dest: Path) -> None:
    """Hard-link ``src`` to ``dest`` (no second copy of a 19 GB image set), copying across devices."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dest)
    except OSError:
        shutil.copy2(src, dest)


def _image_roots(cfg: DataConfig, entries: list[KarpathyImage], downloads: Path, sources: dict[str, Any]
                 ) -> dict[str, Path]:
    """The extracted image folder of each folder the entries name (Flickr30k: one; COCO: train2014, val2014), each
    archive fetched and its manifest record added to ``sources``."""
    roots: dict[str, Path] = {}
    if cfg.pairs == "flickr30k":
        fetched = extracted_source(cfg.sources.flickr30k_images, "flickr30k_images", downloads)
        sources["flickr30k_images"] = fetched.record
        roots[""] = find_named(fetched.path, entries[0].filename).parent
        return roots
    for folder in sorted({e.folder for e in entries}):
        name = f"coco_{folder}"
        if not hasattr(cfg.sources, name):
            raise InputError(f"Karpathy COCO entry names folder {folder!r}; no data.sources.{name} for it")
        fetched = extracted_source(getattr(cfg.sources, name), name, downloads)
        sources[name] = fetched.record
        roots[folder] = find_named(fetched.path, folder, want_dir=True)
    return roots


def real_pairs(cfg: DataConfig, out: Path, downloads: Path, allow_empty: bool = False
               ) -> tuple[list[dict], list[dict], dict[str, Any]]:
    """Images (linked under ``out/images/<dataset>/``) and every caption pair of ``cfg.pairs``.

    Returns ``(images, pairs, report)``; the report holds the sources' manifest records and
    the counts of images dropped as missing or unreadable (logged, never fatal). With
    ``allow_empty`` splits without images return no images instead of an error."""
    dataset = cfg.pairs
    sources: dict[str, Any] = {}
    entities, captions_missing = None, 0
    if dataset == "flickr30k" and cfg.flickr_split == "entities":
        entries, entities, sources, captions_missing = entities_images(cfg, downloads)
    else:
        splits = extracted_source(cfg.sources.karpathy_splits, "karpathy_splits", downloads)
        sources["karpathy_splits"] = splits.record
        entries = read_karpathy(find_named(splits.path, f"dataset_{dataset}.json"), dataset, cfg.splits)
    if cfg.image_limit:
        entries = entries[: cfg.image_limit]
    if not entries:
        if allow_empty:
            return [], [], {"sources": sources}
        raise InputError(f"params.yaml: data.splits={cfg.splits} selects no {dataset} images")

    roots = _image_roots(cfg, entries, downloads, sources)
    boxes_from = None
    if cfg.annotations == "flickr30k_entities":
        if entities is None:
            fetched = extracted_source(cfg.sources.flickr30k_entities, "flickr30k_entities", downloads)
            sources["flickr30k_entities"] = fetched.record
            entities = find_named(fetched.path, "Sentences", want_dir=True).parent
        boxes_from = entities

    images, pairs = [], []
    report: dict[str, Any] = {"sources": sources, "images_missing": 0, "images_unreadable": 0,
                              "images_without_entities": 0, "captions_missing": captions_missing}
    # An extracted folder never changes (it is redone when its archive does), so each image is
    # hashed and decoded once: a rerun over 120k COCO images reads the verdicts instead.
    verdicts = {folder: _Verdicts(root, Path(downloads).resolve() in root.resolve().parents)
                for folder, root in roots.items()}
    for entry in tqdm(entries, desc=f"download: {dataset} images", unit="img"):
        src = roots[entry.folder] / entry.filename
        if not src.is_file():
            log.warning("%s: listed in the %s split but not in the image archive; skipped", src,
                        "Flickr30k Entities" if dataset == "flickr30k" and cfg.flickr_split == "entities"
                        else "Karpathy")
            report["images_missing"] += 1
            continue
        record = verdicts[entry.folder].inspect(src, decode=cfg.verify_images)
        if cfg.verify_images and not record["readable"]:
            log.warning("%s: unreadable or truncated image; skipped", src)
            report["images_unreadable"] += 1
            continue
        rel = f"images/{dataset}/{entry.folder + '/' if entry.folder else ''}{entry.filename}"
        row: dict[str, Any] = {"image_id": entry.image_id, "file": rel, "split": entry.split,
                               "sha256": record["sha256"], "bytes": record["bytes"]}
        captions = [(text, []) for text in entry.captions]
        if boxes_from is not None:
            found = entities_for(boxes_from, Path(entry.filename).stem)
            if found is None:
                report["images_without_entities"] += 1
            else:
                sentences, boxes = found
                ids = sorted({e for s in sentences for e, _, _ in s.phrases if e in boxes}, key=int)
                index = {e: k for k, e in enumerate(ids)}
                row["objects"] = [{"entity": e, "box": boxes[e]} for e in ids]
                # the Entities sentences are the same captions with phrase markup: they replace the plain ones
                captions = [(s.text, [{"object": index[e], "start": a, "end": b}
                                      for e, a, b in s.phrases if e in index]) for s in sentences]
        _place(src, out / rel)
        images.append(row)
        for c, (text, phrases) in enumerate(captions):
            pairs.append({"pair_id": f"{entry.image_id}-c{c}", "image_id": entry.image_id, "caption": text,
                          "phrases": phrases})
    for v in verdicts.values():
        v.save()
    if not images:
        raise InputError(f"no readable {dataset} images among {len(entries)} listed (see the warnings above)")
    return images, pairs, report


# --------------------------------------------------------------------------- Conceptual 12M


def _cc12m_shards(spec: SourceConfig, downloads: Path) -> Iterator[tuple[str, Path, dict[str, Any]]]:
    """``(name, folder, record)`` of each CC12M shard in order, fetched and extracted lazily (the
    caller stops when it has its subset): the pattern's shards 0, 1, …, or a local folder's
    ``*.tar`` shards, or the folder itself when it holds extracted samples."""
    if spec.path:
        root = fetch_source(spec, "cc12m", downloads).path
        if not root.is_dir():
            raise InputError(f"params.yaml: data.sources.cc12m.path={spec.path!r} must be a folder of shards "
                             "(*.tar) or of samples (<key>.jpg + <key>.txt)")
        tars = sorted(root.glob("*.tar"))
        if not tars:
            yield root.name, root, {"origin": f"path:{root}"}
            return
        for tar in tars:
            yield tar.stem, *_extracted(SourceConfig(path=str(tar)), f"cc12m/{tar.stem}", downloads)
        return
    for shard in itertools.count():
        if spec.url:
            one = SourceConfig(url=spec.url.format(shard=shard))
            name = one.url.rstrip("/").rsplit("/", 1)[-1].split("?")[0]
        else:
            one = SourceConfig(hub=spec.hub, file=spec.file.format(shard=shard), revision=spec.revision)
            name = Path(one.file).name
        stem = name.removesuffix(".tar")
        try:
            folder, record = _extracted(one, f"cc12m/{stem}", downloads)
        except DownloadError as err:
            if shard == 0:
                raise
            # past the last shard, or a shard that failed: either way the subset is not complete
            raise DownloadError(f"data.sources.cc12m: {err}; shards 0-{shard - 1} hold too few usable samples "
                                "for data.cc12m_subset × data.image_limit") from None
        yield stem, folder, record


def _extracted(spec: SourceConfig, name: str, downloads: Path) -> tuple[Path, dict[str, Any]]:
    fetched = extracted_source(spec, name, downloads)
    return fetched.path, fetched.record


def cc12m_pairs(cfg: DataConfig, out: Path, downloads: Path) -> tuple[list[dict], list[dict], dict[str, Any]]:
    """Images (linked under ``out/images/cc12m/``) and their captions of CC12M subset
    ``data.cc12m_subset``: the samples ``(k-1)·N … k·N-1`` (N = ``data.image_limit``; 0: all) in
    shard order, counting only samples with a caption and a readable image, so the subsets of one
    N never overlap (KDMCSE Table 4's two 1M subsets: k = 1, 2). A sample is ``<key>.jpg`` and
    ``<key>.txt`` (webdataset / img2dataset); one without its caption, or unreadable, is skipped
    and counted."""
    n, k = cfg.image_limit, cfg.cc12m_subset
    skip = (k - 1) * n
    images: list[dict] = []
    pairs: list[dict] = []
    report: dict[str, Any] = {"sources": {}, "images_missing": 0, "images_unreadable": 0, "captions_missing": 0}
    seen = 0
    bar = tqdm(total=n or None, desc=f"download: cc12m subset {k}", unit="img")
    for name, folder, record in _cc12m_shards(cfg.sources.cc12m, downloads):
        report["sources"][f"cc12m/{name}"] = record
        verdicts = _Verdicts(folder, Path(downloads).resolve() in folder.resolve().parents)
        for jpg in sorted(folder.rglob("*.jpg")):
            caption_file = jpg.with_suffix(".txt")
            if not caption_file.is_file():
                report["captions_missing"] += 1
                continue
            caption = " ".join(caption_file.read_text(encoding="utf-8", errors="replace").split())
            if not caption:
                report["captions_missing"] += 1
                continue
            verdict = verdicts.inspect(jpg, decode=cfg.verify_images)
            if cfg.verify_images and not verdict["readable"]:
                log.warning("%s: unreadable or truncated image; skipped", jpg)
                report["images_unreadable"] += 1
                continue
            seen += 1
            if seen <= skip:
                continue
            key = jpg.stem
            rel = f"images/cc12m/{key}.jpg"
            _place(jpg, out / rel)
            image_id = f"cc12m-{key}"
            images.append({"image_id": image_id, "file": rel, "split": "train", "sha256": verdict["sha256"],
                           "bytes": verdict["bytes"]})
            pairs.append({"pair_id": f"{image_id}-c0", "image_id": image_id, "caption": caption, "phrases": []})
            bar.update()
            if n and len(images) == n:
                break
        verdicts.save()
        if n and len(images) == n:
            break
    bar.close()
    if not images:
        raise InputError(f"data.sources.cc12m: no readable image–caption sample in subset {k} "
                         f"({seen} samples before it)")
    if n and len(images) < n:
        raise InputError(f"data.sources.cc12m: subset {k} of {n:,} pairs needs {k * n:,} samples, the shards "
                         f"hold {seen:,}")
    return images, pairs, report


def senteval_folder(cfg: DataConfig, downloads: Path) -> tuple[Path, dict[str, Any]]:
    """The SentEval-layout folder of ``data.senteval_dir``; ``download`` fetches sources.senteval."""
    if cfg.senteval_dir != "download":
        folder = Path(cfg.senteval_dir).expanduser()
        if not folder.is_dir():
            raise FileNotFoundError(
                f"params.yaml: data.senteval_dir={cfg.senteval_dir!r} is not a folder (point it at a "
                "SentEval-layout folder holding downstream/STS and downstream/SICK, or set it to `download`)")
        return folder, {"origin": f"path:{folder}"}
    fetched = extracted_source(cfg.sources.senteval, "senteval", downloads)
    return find_named(fetched.path, "STS", want_dir=True).parent, fetched.record
