"""Cross-modal retrieval NDCG@25 with graded caption relevance (DUET §5.1, the TERAN protocol).

DUET (Table 1, "NDCG_ROUGE", "NDCG_SPICE") follows Messina et al., *Fine-grained Visual Textual
Alignment for Cross-Modal Retrieval using Transformer Encoders* (TERAN): recall counts only the
exact ground truth, NDCG also rewards retrieving items whose captions *say the same thing*.

Protocol as implemented here (facts from TERAN's evaluation code):

* **Relevance of a caption to an image.** TERAN stores one matrix ``(N_txt, N_img)``: the score
  of caption *c* (the candidate) against the captions of image *I* (all of them at once, as the
  references of a captioning metric; TERAN's evaluate_utils/compute_relevance.py). The same matrix
  serves both directions: image→text reads the column of the query image (relevance of every gallery
  caption to it), text→image reads the row of the query caption (relevance of every gallery image to
  it). The query's own ground truth is therefore relevant (1.0 under ROUGE-L: the caption is one of
  its image's references). ``rouge_l``: coco-caption's ROUGE-L as TERAN's evaluate_utils/rouge.py
  computes it: tokens are the lower-cased caption split on single spaces, P = max over the references
  of LCS / |c|, R = max of LCS / |r|, F = (1 + β²)·P·R / (R + β²·P) with β = 1.2 (0 when P or R is 0).
  ``spice``: SPICE's F of the caption against the image's references together (the union of their
  scene graphs), pycocoevalcap's jar, on captions PTB-tokenised first as TERAN's evaluate_utils/spice.py does
  (l.40–42: Stanford's PTBTokenizer, lower-cased, punctuation dropped; `ptb_tokenized`).
* **Gain and discount.** ``DCG@k = sum_{r=1..k} (2^rel_r - 1) / log2(r + 1)`` over the top k of
  the ranking (exponential gain, log2 discount with rank 1 undiscounted).
* **Ideal DCG.** The same sum over the gallery's k largest relevances in decreasing order (all
  of the query's gallery, not just the retrieved items); NDCG = DCG / IDCG, 0 where IDCG is 0.
* **k = 25** (DUET: "NDCG@25"); with a gallery smaller than k, the whole gallery is ranked.
* **Mean over queries.** TERAN's evaluation.py leaves out the image→text queries whose NDCG is zero
  (``i2t``: ``np.mean(rougel_ndcgs[rougel_ndcgs != 0])``, l.320–321: a query with nothing relevant in its
  top 25) and averages every text→image query (l.405–406); ``left_out=("i2t",)`` (the default, `TERAN_LEFT_OUT`)
  does the same, ``()`` averages every query in both directions, ``("i2t", "t2i")`` leaves out both.
* **Scale.** Raw NDCG in [0, 1], as DUET and TERAN report it (e.g. 0.735), not ×100.
* **Scores.** Cosine similarity of the embeddings. Ties in similarity count against the model
  (the project's convention, as in `retrieval`): items scoring the same are ranked least
  relevant first, so a constant embedding gets the worst NDCG its ties allow, never a lucky one.

DUET's table gives one NDCG per relevance without saying which direction; both directions are
reported (``i2t_NDCG25_rouge_l``, ``t2i_NDCG25_rouge_l``) and their mean
(``NDCG25_rouge_l``, the PRIMARY metric: ROUGE-L needs no Java, SPICE does), with ``_spice``
keys when a SPICE relevance is given.

Relevance computation scales to Flickr30k test (5000 captions, 12.5M caption pairs): ROUGE-L
tokenizes each caption once and computes every caption pair's LCS with a bit-parallel algorithm
(Hyyrö 2004) vectorised over all partners of a caption, then takes each image's best precision and
recall over its captions; SPICE runs pycocoevalcap's SPICE jar on chunks of (caption, image's
references) items. `relevance_matrix` caches the result keyed by the captions and their images.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import re
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from mmcse.errors import SpiceUnavailable
from mmcse.evaluation.names import ndcg_key
from mmcse.evaluation.retrieval import coco_1k_folds, unit_rows
from mmcse.io import atomic_path

log = logging.getLogger(__name__)

K = 25
KINDS = ("rouge_l", "spice")
PRIMARY = ndcg_key(K, "rouge_l")
# bumped when the way a relevance matrix is computed changes: old cache files stop matching
RELEVANCE_VERSION = 3  # 2: caption-to-image relevance (TERAN's multi-reference ROUGE-L / SPICE); 3: SPICE on
# PTB-tokenised captions
TERAN_LEFT_OUT = ("i2t",)  # the directions whose zero-NDCG queries TERAN's mean leaves out (evaluation.py l.320, l.405)
SPICE_JARS = ("spice-1.0.jar", "lib/stanford-corenlp-3.6.0.jar", "lib/stanford-corenlp-3.6.0-models.jar")
SPICE_CHUNK = 200_000  # caption pairs per SPICE run: bounds the JSON files and the JVM heap
SPICE_MAX_JAVA = 14  # SPICE 1.0 writes -out through Nashorn (gone in Java 15); its LMDB cache fails on 16+
SPICE_INSTALL = (
    'install: pip install -e ".[spice]"; then the Stanford CoreNLP 3.6.0 jars into pycocoevalcap/spice/lib with '
    "python -c 'from pycocoevalcap.spice.get_stanford_models import get_stanford_models; get_stanford_models()'; "
    f"and a Java 8 runtime (java on PATH, version 8..{SPICE_MAX_JAVA}). kind='rouge_l' needs none of these"
)


# ----------------------------------------------------------------------------- caption relevance


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"relevance kind {kind!r}: expected one of {', '.join(KINDS)}")


def _check_captions(captions: Sequence[str]) -> list[str]:
    captions = list(captions)
    if not captions:
        raise ValueError("captions: empty list")
    bad = [i for i, c in enumerate(captions) if not isinstance(c, str)]
    if bad:
        raise ValueError(f"captions: entries {bad[:5]} are not strings")
    return captions


ROUGE_BETA = 1.2  # coco-caption's ROUGE-L (TERAN's evaluate_utils/rouge.py): recall weighed 1.2 over precision


def _check_owners(text_image: Sequence[int], n_txt: int) -> np.ndarray:
    owner = np.asarray(text_image)
    if owner.shape != (n_txt,) or not np.issubdtype(owner.dtype, np.integer):
        raise ValueError(f"text_image: expected {n_txt} integer image indices, got {owner.dtype} {owner.shape}")
    if n_txt and (owner.min() < 0 or np.setdiff1d(np.arange(owner.max() + 1), owner).size):
        raise ValueError("text_image: images must be 0..N_img-1, each with at least one caption")
    return owner.astype(np.int64)


def image_relevance(captions: Sequence[str], text_image: Sequence[int], kind: str) -> np.ndarray:
    """Relevance of every caption to every image ``(N_txt, N_img)`` float32 in [0, 1]: ``R[c, I]`` scores
    caption c (candidate) against all captions of image I (references; ``text_image[j]``: the image of
    caption j), as TERAN does (module docstring). ``kind="rouge_l"``: coco-caption's multi-reference
    ROUGE-L (β = 1.2); ``kind="spice"``: SPICE's F against the references together (pycocoevalcap's jar;
    needs Java and the CoreNLP jars, checked first: `SpiceUnavailable`)."""
    _check_kind(kind)
    captions = _check_captions(captions)
    owner = _check_owners(text_image, len(captions))
    if kind == "spice":
        return _spice_relevance(captions, owner)
    return _rouge_l_relevance(captions, owner)


_SWAR = [np.uint64(v) for v in (0x5555555555555555, 0x3333333333333333, 0x0F0F0F0F0F0F0F0F, 0x0101010101010101)]


def _popcount(x: np.ndarray) -> np.ndarray:
    """Set bits of each uint64 (numpy >= 2 has it built in; the SWAR fallback for 1.26)."""
    if hasattr(np, "bitwise_count"):
        return np.bitwise_count(x).astype(np.int64)
    m1, m2, m4, h01 = _SWAR
    x = x - ((x >> np.uint64(1)) & m1)
    x = (x & m2) + ((x >> np.uint64(2)) & m2)
    x = (x + (x >> np.uint64(4))) & m4
    return ((x * h01) >> np.uint64(56)).astype(np.int64)


def _lcs_bigint(a: Sequence[int], others: Sequence[Sequence[int]]) -> list[int]:
    """LCS length of token ids ``a`` (any length) with each of ``others``: the bit-parallel
    recurrence on Python integers (captions longer than 64 tokens; rare)."""
    masks: dict[int, int] = {}
    for pos, tok in enumerate(a):
        masks[tok] = masks.get(tok, 0) | (1 << pos)
    full = (1 << len(a)) - 1
    out = []
    for b in others:
        v = full
        for tok in b:
            u = v & masks.get(tok, 0)
            v = ((v + u) | (v - u)) & full
        out.append(len(a) - bin(v).count("1"))
    return out


def teran_tokens(caption: str) -> list[str]:
    """coco-caption's ROUGE-L tokens as TERAN's rouge.py makes them: lower-cased, split on single spaces."""
    return caption.lower().split(" ")


def lcs_lengths(ids: list[list[int]]) -> np.ndarray:
    """``(N, N)`` uint16 LCS length of every pair of token-id sequences (id 0 never matches)."""
    n = len(ids)
    lengths = np.array([len(t) for t in ids], dtype=np.int64)
    perm = np.argsort(-lengths, kind="stable")  # longest first: a row's partners are never longer
    max_len = int(lengths.max())
    tokens_t = np.zeros((max(max_len, 1), n), dtype=np.int64)  # (L, N) token ids by position, sorted order
    for col, c in enumerate(perm):
        tokens_t[: lengths[c], col] = ids[c]
    sorted_len = lengths[perm]
    mask_of = np.zeros(max((max(t, default=0) for t in ids), default=0) + 1, dtype=np.uint64)  # token -> bits
    out = np.zeros((n, n), dtype=np.uint16)
    with tqdm(total=n * (n + 1) // 2, desc="ROUGE-L relevance", unit="pair", unit_scale=True) as bar:
        for p in range(n):
            a, m = ids[perm[p]], int(sorted_len[p])
            partners = perm[p:]  # (n - p,) captions no longer than a
            part_len = sorted_len[p:]
            if m > 64:
                lcs = np.array(_lcs_bigint(a, [ids[c] for c in partners]), dtype=np.int64)
            else:
                for pos, tok in enumerate(a):
                    mask_of[tok] |= np.uint64(1 << pos)
                v = np.full(n - p, np.iinfo(np.uint64).max, dtype=np.uint64)  # (n - p,) bit j clear: a[j] in an LCS
                for t in range(int(part_len[0])):
                    live = int(np.searchsorted(-part_len, -t, side="left"))  # partners longer than t: a prefix
                    u = v[:live] & mask_of[tokens_t[t, p : p + live]]
                    v[:live] = (v[:live] + u) | (v[:live] - u)  # wraps mod 2^64: carries only move upward
                low = np.uint64((1 << m) - 1) if m < 64 else np.iinfo(np.uint64).max
                lcs = m - _popcount(v & low)
                mask_of[a] = 0
            out[perm[p], partners] = np.minimum(lcs, np.iinfo(np.uint16).max)
            out[partners, perm[p]] = out[perm[p], partners]
            bar.update(n - p)
    return out


def _rouge_l_relevance(captions: list[str], owner: np.ndarray) -> np.ndarray:
    vocab: dict[str, int] = {}  # id 0: padding (never matches)
    ids = [[vocab.setdefault(t, len(vocab) + 1) for t in teran_tokens(c)] for c in captions]
    lcs = lcs_lengths(ids).astype(np.float64)  # (N, N) candidate c by reference c'
    length = np.array([len(t) for t in ids], dtype=np.float64)  # (N,) never 0: "".split(" ") is [""]
    by_image = np.argsort(owner, kind="stable")  # references grouped by image
    starts = np.searchsorted(owner[by_image], np.arange(int(owner.max()) + 1))
    prec = np.maximum.reduceat(lcs[:, by_image] / length[:, None], starts, axis=1)  # (N_txt, N_img) best P
    rec = np.maximum.reduceat(lcs[:, by_image] / length[by_image][None, :], starts, axis=1)  # best R
    b2 = ROUGE_BETA ** 2
    with np.errstate(divide="ignore", invalid="ignore"):
        f = np.where((prec > 0) & (rec > 0), (1 + b2) * prec * rec / (rec + b2 * prec), 0.0)
    return f.astype(np.float32)


def _spice_dir() -> Path | None:
    spec = importlib.util.find_spec("pycocoevalcap.spice") if importlib.util.find_spec("pycocoevalcap") else None
    return Path(spec.origin).parent if spec and spec.origin else None


def _java_major(java: str) -> int | None:
    try:
        run = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.search(r'version "(\d+)(?:\.(\d+))?', run.stderr + run.stdout)
    if not found:
        return None
    major = int(found.group(1))
    return int(found.group(2) or 0) if major == 1 else major  # "1.8.0_242" is Java 8


def _spice_missing() -> list[str]:
    """What SPICE lacks here (empty: it can run)."""
    missing = []
    spice_dir = _spice_dir()
    if spice_dir is None:
        missing.append("pycocoevalcap (not installed)")
    else:
        missing += [str(spice_dir / jar) for jar in SPICE_JARS if not (spice_dir / jar).is_file()]
    java = shutil.which("java")
    if java is None:
        missing.append("java (not on PATH)")
    else:
        major = _java_major(java)
        if major is None or not 8 <= major <= SPICE_MAX_JAVA:
            missing.append(f"a Java 8..{SPICE_MAX_JAVA} runtime ({java} is Java {major})")
    return missing


def _spice_f(value: object) -> float:
    """SPICE's "All" F of one pair; NaN/null (no tuples on either side) -> 0, nothing matched."""
    try:
        f = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return 0.0
    return f if np.isfinite(f) else 0.0


def parse_spice_output(results: list[dict], n_items: int) -> np.ndarray:
    """``(n_items,)`` F-scores from SPICE's ``-out`` JSON (a list of ``{"image_id", "scores":
    {"All": {"f", ...}, ...}}``), placed by ``image_id`` (0..n_items-1, any order)."""
    f = np.full(n_items, np.nan)
    for item in results:
        f[int(item["image_id"])] = _spice_f(item["scores"]["All"]["f"])
    if np.isnan(f).any():
        raise RuntimeError(f"SPICE output lacks items {np.flatnonzero(np.isnan(f))[:5].tolist()} of {n_items}")
    return f


def ptb_tokenized(captions: list[str]) -> list[str]:
    """SPICE's inputs as TERAN prepares them (evaluate_utils/spice.py l.40–42, ptbtokenizer.py): Stanford's
    PTBTokenizer, lower-cased, the punctuation tokens dropped, through coco-caption's wrapper in pycocoevalcap (the
    same tokenizer and punctuation list; Java, which SPICE needs anyway)."""
    from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer  # the spice extra, checked by _spice_missing

    out = PTBTokenizer().tokenize({i: [{"caption": c}] for i, c in enumerate(captions)})
    return [out[i][0] for i in range(len(captions))]


def _spice_relevance(captions: list[str], owner: np.ndarray) -> np.ndarray:
    missing = _spice_missing()
    if missing:
        raise SpiceUnavailable(f"SPICE relevance cannot run: missing {'; '.join(missing)}. {SPICE_INSTALL}")
    spice_dir = _spice_dir()
    assert spice_dir is not None
    captions = ptb_tokenized(captions)  # candidates and references alike, once each
    n_txt, n_img = len(captions), int(owner.max()) + 1
    refs = [[] for _ in range(n_img)]  # each image's captions: the references of every candidate
    for c, i in zip(captions, owner.tolist(), strict=True):
        refs[i].append(c)
    out = np.zeros((n_txt, n_img), dtype=np.float32)
    total = n_txt * n_img  # item k: caption k // n_img against the references of image k % n_img
    with tempfile.TemporaryDirectory(prefix="spice-") as tmp, \
            tqdm(total=total, desc="SPICE relevance", unit="item", unit_scale=True) as bar:
        work = Path(tmp)
        parse_cache = work / "cache"  # one parse per caption across all chunks of this call
        parse_cache.mkdir()
        for start in range(0, total, SPICE_CHUNK):
            items = range(start, min(start + SPICE_CHUNK, total))
            in_path, out_path = work / "in.json", work / "out.json"
            in_path.write_text(json.dumps([{"image_id": k - start, "test": captions[k // n_img],
                                            "refs": refs[k % n_img]} for k in items]))
            subprocess.run(["java", "-jar", "-Xmx8G", str(spice_dir / SPICE_JARS[0]), str(in_path),
                            "-cache", str(parse_cache), "-out", str(out_path), "-silent"], cwd=spice_dir, check=True)
            f = parse_spice_output(json.loads(out_path.read_text()), len(items)).astype(np.float32)
            out.reshape(-1)[start : start + len(items)] = f
            bar.update(len(items))
    return out


# ----------------------------------------------------------------------------- cache


def relevance_key(captions: Sequence[str], text_image: Sequence[int], kind: str) -> str:
    """SHA-256 of the kind, the computation version, the captions in order and each caption's image."""
    payload = json.dumps({"kind": kind, "version": RELEVANCE_VERSION, "captions": list(captions),
                          "images": [int(i) for i in text_image]})
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


def _load_cached(path: Path, shape: tuple[int, int]) -> np.ndarray | None:
    try:
        rel = np.load(path, mmap_mode="r")
    except (OSError, ValueError, EOFError) as err:
        log.warning("%s: unreadable relevance cache (%s); computing it again", path, err)
        return None
    if rel.dtype != np.float32 or rel.shape != shape:
        log.warning("%s: relevance cache is %s %s, expected float32 %s; computing it again",
                    path, rel.dtype, rel.shape, shape)
        return None
    if not (np.isfinite(rel).all() and rel.min(initial=0.0) >= 0.0 and rel.max(initial=0.0) <= 1.0):
        log.warning("%s: relevance cache holds values outside [0, 1]; computing it again", path)
        return None
    return rel


def relevance_matrix(captions: Sequence[str], text_image: Sequence[int], kind: str, cache_dir: Path) -> np.ndarray:
    """`image_relevance` through a cache: ``cache_dir/<kind>-<sha256>.npy`` (atomic write), reused when it
    reads back as float32 ``(N_txt, N_img)`` in [0, 1], rebuilt when corrupt."""
    _check_kind(kind)
    captions = _check_captions(captions)
    owner = _check_owners(text_image, len(captions))
    path = Path(cache_dir) / f"{kind}-{relevance_key(captions, owner, kind)}.npy"
    if path.is_file():
        cached = _load_cached(path, (len(captions), int(owner.max()) + 1))
        if cached is not None:
            return cached
    rel = image_relevance(captions, owner, kind)
    with atomic_path(path) as tmp, open(tmp, "wb") as handle:
        np.save(handle, rel)
    return rel


# ----------------------------------------------------------------------------- NDCG


def _validate(image_emb: np.ndarray, text_emb: np.ndarray, text_image: Sequence[int],
              relevance: Mapping[str, np.ndarray], k: int, block: int) -> np.ndarray:
    """One clear ValueError for bad input, before any scoring; returns the owners ``(N_txt,)``."""
    for name, emb in (("image_emb", image_emb), ("text_emb", text_emb)):
        if emb.ndim != 2 or emb.shape[0] == 0:
            raise ValueError(f"{name}: expected a non-empty (N, d) array, got shape {emb.shape}")
        if not np.isfinite(emb).all():
            rows = np.flatnonzero(~np.isfinite(emb).all(axis=1))
            raise ValueError(f"{name}: NaN/inf in rows {rows[:5].tolist()}")
    if image_emb.shape[1] != text_emb.shape[1]:
        raise ValueError(f"image_emb has dimension {image_emb.shape[1]}, text_emb {text_emb.shape[1]}")
    owner = np.asarray(text_image)
    n_img, n_txt = image_emb.shape[0], text_emb.shape[0]
    if owner.shape != (n_txt,):
        raise ValueError(f"text_image has shape {owner.shape} for {n_txt} captions")
    if not np.issubdtype(owner.dtype, np.integer):
        raise ValueError(f"text_image: expected integer image indices, got {owner.dtype}")
    outside = np.flatnonzero((owner < 0) | (owner >= n_img))
    if outside.size:
        raise ValueError(f"text_image: captions {outside[:5].tolist()} name images outside 0..{n_img - 1}")
    bare = np.setdiff1d(np.arange(n_img), owner)
    if bare.size:
        raise ValueError(f"images without a caption: {bare[:5].tolist()}")
    if not relevance:
        raise ValueError(f"relevance: no matrix given (kinds: {', '.join(KINDS)})")
    for kind, rel in relevance.items():
        if kind not in KINDS:
            raise ValueError(f"relevance[{kind!r}]: unknown kind, expected one of {', '.join(KINDS)}")
        if rel.shape != (n_txt, n_img):
            raise ValueError(f"relevance[{kind!r}] has shape {rel.shape}, expected ({n_txt}, {n_img}): "
                             "caption-by-image, in the order of text_emb and image_emb")
        if not (np.isfinite(rel).all() and rel.min() >= 0.0 and rel.max() <= 1.0):
            raise ValueError(f"relevance[{kind!r}]: values must be finite and in [0, 1]")
    if isinstance(k, bool) or not isinstance(k, int | np.integer) or k < 1:
        raise ValueError(f"k: expected an integer >= 1, got {k!r}")
    if isinstance(block, bool) or not isinstance(block, int | np.integer) or block < 1:
        raise ValueError(f"block: expected an integer >= 1, got {block!r}")
    return owner.astype(np.int64)


def _retrieved_gains(sim: np.ndarray, rel: np.ndarray, k: int) -> np.ndarray:
    """Relevance of the top ``min(k, n)`` items of each query in rank order ``(b, kk)`` from
    scores and relevances ``(b, n)``; tied scores rank the least relevant item first."""
    b, n = sim.shape
    kk = min(k, n)
    if kk < n:
        top = np.argpartition(-sim, kk - 1, axis=1)[:, :kk]  # (b, kk) the kk best, unordered
        kth = np.take_along_axis(sim, top, axis=1).min(axis=1)  # (b,) score of the kk-th best
        above = (sim > kth[:, None]).sum(axis=1)
        tied = (sim == kth[:, None]).sum(axis=1)
        for r in np.flatnonzero(above + tied > kk):  # a tie group crosses the cut: keep its least relevant
            cand = np.flatnonzero(sim[r] >= kth[r])
            top[r] = cand[np.lexsort((rel[r, cand], -sim[r, cand]))][:kk]
    else:
        top = np.broadcast_to(np.arange(n), (b, n))
    s = np.take_along_axis(sim, top, axis=1)
    g = np.take_along_axis(rel, top, axis=1)
    order = np.lexsort((g, -s), axis=1)  # best score first, ties least relevant first
    return np.take_along_axis(g, order, axis=1)


def _ndcg(retrieved: np.ndarray, rel: np.ndarray, k: int) -> np.ndarray:
    """NDCG per query ``(b,)`` of retrieved relevances ``(b, kk)`` against the gallery's ``(b, n)``."""
    n = rel.shape[1]
    kk = min(k, n)
    ideal = np.partition(rel, n - kk, axis=1)[:, n - kk :] if kk < n else rel
    ideal = -np.sort(-ideal, axis=1)  # (b, kk) the kk largest, decreasing
    discount = 1.0 / np.log2(np.arange(kk) + 2.0)  # rank 1 -> 1/log2(2)
    dcg = ((np.exp2(retrieved) - 1.0) * discount).sum(axis=1)
    idcg = ((np.exp2(ideal) - 1.0) * discount).sum(axis=1)
    return np.divide(dcg, idcg, out=np.zeros_like(dcg), where=idcg > 0)


def _mean(values: np.ndarray, exclude_zero: bool) -> float:
    if exclude_zero:
        values = values[values != 0]
    return float(values.mean()) if values.size else 0.0


def _check_left_out(left_out: Sequence[str]) -> tuple[str, ...]:
    unknown = sorted(set(left_out) - {"i2t", "t2i"})
    if unknown or isinstance(left_out, str):
        raise ValueError(f"left_out: directions among i2t, t2i, got {left_out!r}")
    return tuple(left_out)


def ndcg_per_query(image_emb: np.ndarray, text_emb: np.ndarray, text_image: Sequence[int],
                   relevance: Mapping[str, np.ndarray], k: int = K,
                   block: int = 1024) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """NDCG@k of every query: ``{kind: (i2t (N_img,), t2i (N_txt,))}`` (module docstring).

    ``image_emb (N_img, d)``, ``text_emb (N_txt, d)``, ``text_image[j]``: the image of caption
    j; ``relevance[kind]``: an `image_relevance` matrix ``(N_txt, N_img)`` of those captions and images.
    Queries run ``block`` at a time: at most ``block x max(N_img, N_txt)`` scores exist at once.
    """
    image_emb, text_emb = np.asarray(image_emb), np.asarray(text_emb)
    _validate(image_emb, text_emb, text_image, relevance, k, block)
    n_img, n_txt = image_emb.shape[0], text_emb.shape[0]
    img, txt = unit_rows(image_emb), unit_rows(text_emb)
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for kind, image_rel in relevance.items():
        i2t = np.empty(n_img)
        for a in range(0, n_img, block):
            b = min(a + block, n_img)
            sim = img[a:b] @ txt.T  # (b-a, N_txt) cosine of these images with every caption
            rel = np.asarray(image_rel[:, a:b], dtype=np.float64).T  # (b-a, N_txt) each caption's relevance
            i2t[a:b] = _ndcg(_retrieved_gains(sim, rel, k), rel, k)
        t2i = np.empty(n_txt)
        for a in range(0, n_txt, block):
            b = min(a + block, n_txt)
            sim = txt[a:b] @ img.T  # (b-a, N_img)
            rel = np.asarray(image_rel[a:b], dtype=np.float64)  # (b-a, N_img)
            t2i[a:b] = _ndcg(_retrieved_gains(sim, rel, k), rel, k)
        out[kind] = (i2t, t2i)
    return out


def ndcg_metrics(image_emb: np.ndarray, text_emb: np.ndarray, text_image: Sequence[int],
                 relevance: dict[str, np.ndarray], k: int = K, block: int = 1024, *,
                 left_out: Sequence[str] = TERAN_LEFT_OUT) -> dict[str, float]:
    """``i2t_NDCG<k>_<kind>``, ``t2i_NDCG<k>_<kind>`` and their mean ``NDCG<k>_<kind>``
    (raw, in [0, 1]) for each relevance kind given; `PRIMARY` is ``NDCG25_rouge_l``
    (`mmcse.evaluation.names`). The means over queries leave out the zero NDCGs of the directions in
    ``left_out``: TERAN's image→text only, by default (`ndcg_per_query`, the module docstring)."""
    left_out = _check_left_out(left_out)
    scores: dict[str, float] = {}
    for kind, (i2t, t2i) in ndcg_per_query(image_emb, text_emb, text_image, relevance, k, block).items():
        scores[ndcg_key(k, kind, "i2t")] = _mean(i2t, "i2t" in left_out)
        scores[ndcg_key(k, kind, "t2i")] = _mean(t2i, "t2i" in left_out)
        scores[ndcg_key(k, kind)] = (scores[ndcg_key(k, kind, "i2t")] + scores[ndcg_key(k, kind, "t2i")]) / 2
    return scores


def ndcg_fold_mean(image_emb: np.ndarray, text_emb: np.ndarray, text_image: Sequence[int],
                   relevance: dict[str, np.ndarray], folds: Sequence[range], k: int = K, block: int = 1024, *,
                   left_out: Sequence[str] = TERAN_LEFT_OUT) -> dict[str, float]:
    """Mean of `ndcg_metrics` over image folds (COCO 1K: `retrieval.coco_1k_folds`), each with its
    own images' captions and their relevance to its images."""
    owner = np.asarray(text_image, dtype=np.int64)
    per_fold = []
    for images in folds:
        keep = np.flatnonzero((owner >= images.start) & (owner < images.stop))
        sub = {kind: np.asarray(rel)[keep, images.start:images.stop] for kind, rel in relevance.items()}
        per_fold.append(ndcg_metrics(np.asarray(image_emb)[images.start:images.stop], np.asarray(text_emb)[keep],
                                     owner[keep] - images.start, sub, k, block, left_out=left_out))
    return {key: float(np.mean([f[key] for f in per_fold])) for key in per_fold[0]}


def test_set_ndcg(set_name: str, image_emb: np.ndarray, text_emb: np.ndarray, text_image: Sequence[int],
                  relevance: dict[str, np.ndarray], k: int = K, block: int = 1024) -> dict[str, float]:
    """`ndcg_metrics` with the keys the evaluate stage reports, prefixed by the test set as
    `mmcse.evaluation.retrieval.test_set_metrics` does: COCO over all 5K images and as the mean
    of five 1K folds (``coco_1k_*``, when the split has its 5,000 images)."""

    scores = {f"{set_name}_{key}": v
              for key, v in ndcg_metrics(image_emb, text_emb, text_image, relevance, k, block).items()}
    n = np.asarray(image_emb).shape[0]
    if set_name == "coco_5k" and n % 1000 == 0:
        folds = ndcg_fold_mean(image_emb, text_emb, text_image, relevance, coco_1k_folds(n), k, block)
        scores |= {f"coco_1k_{key}": v for key, v in folds.items()}
    return scores
