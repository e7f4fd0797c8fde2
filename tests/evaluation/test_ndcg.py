"""Graded NDCG@k (DUET/TERAN) against a direct transcription, hand-checked cases, the caption-to-image ROUGE-L
relevance against a transcription of TERAN's coco-caption ROUGE-L, the relevance cache, and the SPICE path
(fail-fast and a fake java)."""

import json
import math
import os
import stat
import sys

import numpy as np
import pytest

from mmcse.evaluation import ndcg
from mmcse.evaluation.ndcg import (
    PRIMARY,
    SpiceUnavailable,
    image_relevance,
    ndcg_fold_mean,
    ndcg_metrics,
    ndcg_per_query,
    parse_spice_output,
    relevance_key,
    relevance_matrix,
)


def transcribed(image_emb, text_emb, text_image, image_rel, k, left_out=("i2t",)):
    """The protocol written out: caption c's relevance to image i is R[c][i]; rank by cosine (ties: least
    relevant first), DCG with gain 2^r - 1 and discount log2(rank + 1), ideal DCG from the whole gallery
    sorted, mean over the queries, leaving out the zero NDCGs of the directions in ``left_out``."""
    images = [x / np.linalg.norm(x) for x in np.asarray(image_emb, dtype=float)]
    texts = [x / np.linalg.norm(x) for x in np.asarray(text_emb, dtype=float)]
    n_img, n_txt = len(images), len(texts)

    def rel(c, i):
        return float(image_rel[c][i])

    def dcg(gains):
        return sum((2.0 ** g - 1.0) / math.log2(pos + 2) for pos, g in enumerate(gains[:k]))

    def one(scores, gains):
        order = sorted(range(len(scores)), key=lambda j: (-scores[j], gains[j]))
        ideal = dcg(sorted(gains, reverse=True))
        return dcg([gains[j] for j in order]) / ideal if ideal > 0 else 0.0

    i2t = [one([float(images[i] @ t) for t in texts], [rel(c, i) for c in range(n_txt)]) for i in range(n_img)]
    t2i = [one([float(im @ texts[c]) for im in images], [rel(c, i) for i in range(n_img)]) for c in range(n_txt)]

    def mean(values, direction):
        values = [v for v in values if v != 0] if direction in left_out else values
        return sum(values) / len(values) if values else 0.0

    return mean(i2t, "i2t"), mean(t2i, "t2i"), i2t, t2i


# ----------------------------------------------------------------------------- TERAN's code, transcribed
# mesnico/TERAN @ e564ecb: evaluate_utils/dcg.py (DCG.compute_ndcg, dcg_from_ranking, ndcg_from_ranking) and
# evaluation.py (i2t, t2i), line by line on the same relevance matrix (N_txt, N_img) and similarities.


def teran_dcg_from_ranking(y_true, ranking):
    y_true = np.asarray(y_true)  # dcg.py l.186
    ranking = np.asarray(ranking)  # l.187
    rel = y_true[ranking]  # l.188
    gains = 2 ** rel - 1  # l.189
    discounts = np.log2(np.arange(len(ranking)) + 2)  # l.190
    return np.sum(gains / discounts)  # l.191


def teran_ndcg_from_ranking(y_true, ranking):
    k = len(ranking)  # l.211
    best_ranking = np.argsort(y_true)[::-1]  # l.212
    best = teran_dcg_from_ranking(y_true, best_ranking[:k])  # l.213
    if best == 0:  # l.214
        return 0  # l.215
    return teran_dcg_from_ranking(y_true, ranking) / best  # l.216


def teran_means(sims_i2t, sims_t2i, relevance, rank=25):
    """evaluation.py i2t (l.242–325) and t2i (l.328–411) for one fold: ``sims_i2t (N_img, N_txt)``, ``sims_t2i
    (N_txt, N_img)``; DCG(rank=25) reads relevance[:, image] for image→text ('sentence') and relevance[caption, :]
    for text→image ('image', dcg.py l.19–33)."""
    n_img, n_txt = sims_i2t.shape
    i2t = np.zeros(n_img)  # l.254
    for index in range(n_img):
        inds = np.argsort(sims_i2t[index])[::-1]  # l.296 (their d is one image's row)
        relevances = relevance[:, index]  # dcg.py l.29: retrieval == 'sentence'
        i2t[index] = teran_ndcg_from_ranking(relevances, inds[:rank].astype(int))  # dcg.py l.20, l.31; l.310
    t2i = np.zeros(n_txt)  # l.342
    for query in range(n_txt):
        inds = np.argsort(sims_t2i[query])[::-1]  # l.389
        relevances = relevance[query, :]  # dcg.py l.25: retrieval == 'image'
        t2i[query] = teran_ndcg_from_ranking(relevances, inds[:rank].astype(int))  # l.395–397
    return np.mean(i2t[i2t != 0]), np.mean(t2i)  # l.320 (non-zero only), l.405 (every query)


@pytest.mark.parametrize("seed", [0, 1, 3])
def test_authors_code_teran_ndcg_per_direction(seed):
    """mmcse's NDCG against TERAN's released code, transcribed: the image→text mean over the non-zero queries only,
    the text→image mean over every query; a sparse relevance makes zero-NDCG queries in both directions."""
    images, texts, owner, image_rel = random_case(seed, n_img=12, sparse=seed == 3)
    unit = lambda x: x / np.linalg.norm(x, axis=1, keepdims=True)  # noqa: E731
    sims = unit(images) @ unit(texts).T  # (N_img, N_txt) cosine, as mmcse scores
    k = 2 if seed == 3 else 4
    i2t, t2i = teran_means(sims, sims.T, image_rel.astype(np.float64), rank=k)
    got = ndcg_metrics(images, texts, owner, {"spice": image_rel}, k=k)
    assert (got[f"i2t_NDCG{k}_spice"], got[f"t2i_NDCG{k}_spice"]) == pytest.approx((i2t, t2i), abs=1e-6)
    if seed == 3:  # the directions' rules differ where zeros occur: leaving them out of t2i breaks the equality
        per_query = ndcg_per_query(images, texts, owner, {"spice": image_rel}, k=k)["spice"]
        assert (per_query[0] == 0).any() and (per_query[1] == 0).any()
        both = ndcg_metrics(images, texts, owner, {"spice": image_rel}, k=k, left_out=("i2t", "t2i"))
        assert both[f"t2i_NDCG{k}_spice"] != pytest.approx(t2i, abs=1e-6)
        kept = ndcg_metrics(images, texts, owner, {"spice": image_rel}, k=k, left_out=())
        assert kept[f"i2t_NDCG{k}_spice"] != pytest.approx(i2t, abs=1e-6)


@pytest.mark.parametrize("seed", [0, 4])
def test_authors_code_teran_ndcg_with_tied_relevances(seed):
    """Relevances on a coarse grid (0, ¼, ½, ¾, 1: many ties, as ROUGE-L's and SPICE's on short captions are): the ideal
    ranking's order within a tie changes no DCG, so mmcse and TERAN's code still agree; tied *scores* are mmcse's own
    rule (`test_tied_scores_count_against_the_model`), where TERAN's argsort would pick an order by chance."""
    images, texts, owner, image_rel = random_case(seed, n_img=10)
    image_rel = (np.round(image_rel * 4) / 4).astype(np.float32)
    ordered = np.sort(image_rel, axis=1)
    assert len(np.unique(image_rel)) <= 5 and (ordered[:, 1:] == ordered[:, :-1]).any()  # ties within a query's row
    unit = lambda x: x / np.linalg.norm(x, axis=1, keepdims=True)  # noqa: E731
    sims = unit(images) @ unit(texts).T
    i2t, t2i = teran_means(sims, sims.T, image_rel.astype(np.float64), rank=4)
    got = ndcg_metrics(images, texts, owner, {"spice": image_rel}, k=4)
    assert (got["i2t_NDCG4_spice"], got["t2i_NDCG4_spice"]) == pytest.approx((i2t, t2i), abs=1e-6)


def random_case(seed, n_img=9, sparse=False):
    rng = np.random.default_rng(seed)
    owner = np.concatenate([np.arange(n_img), rng.integers(0, n_img, size=2 * n_img)])  # 1..n captions each
    rng.shuffle(owner)  # captions of an image are not contiguous
    images = rng.normal(size=(n_img, 6))
    texts = images[owner] + rng.normal(scale=1.2, size=(owner.size, 6))
    image_rel = rng.uniform(size=(owner.size, n_img))  # (N_txt, N_img)
    if sparse:
        image_rel = np.where(rng.uniform(size=image_rel.shape) < 0.08, image_rel, 0.0)
    image_rel[np.arange(owner.size), owner] = 1.0  # a caption is one of its own image's references
    return images, texts, owner, image_rel.astype(np.float32)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("k", [1, 4, 25])
def test_matches_the_transcription_in_both_directions(seed, k):
    images, texts, owner, image_rel = random_case(seed)
    got = ndcg_metrics(images, texts, owner, {"rouge_l": image_rel}, k=k, block=4)
    i2t, t2i, _, _ = transcribed(images, texts, owner.tolist(), image_rel.tolist(), k)
    assert got[f"i2t_NDCG{k}_rouge_l"] == pytest.approx(i2t)
    assert got[f"t2i_NDCG{k}_rouge_l"] == pytest.approx(t2i)
    assert got[f"NDCG{k}_rouge_l"] == pytest.approx((i2t + t2i) / 2)
    assert 0.05 < i2t < 0.999 and 0.05 < t2i < 0.999  # the case is not trivial
    # the block size changes nothing
    assert ndcg_metrics(images, texts, owner, {"rouge_l": image_rel}, k=k, block=1000) == pytest.approx(got)


def test_zero_ndcg_queries_are_left_out_of_the_mean_of_the_directions_asked():
    images, texts, owner, image_rel = random_case(3, n_img=12, sparse=True)
    _, _, i2t_all, t2i_all = transcribed(images, texts, owner.tolist(), image_rel.tolist(), 2)
    assert 0.0 in t2i_all and 0.0 in i2t_all  # some query has nothing relevant in its top 2
    for left_out in (("i2t",), (), ("i2t", "t2i"), ("t2i",)):
        got = ndcg_metrics(images, texts, owner, {"spice": image_rel}, k=2, left_out=left_out)
        i2t, t2i, _, _ = transcribed(images, texts, owner.tolist(), image_rel.tolist(), 2, left_out=left_out)
        assert (got["i2t_NDCG2_spice"], got["t2i_NDCG2_spice"]) == pytest.approx((i2t, t2i))
    with pytest.raises(ValueError, match="left_out: directions among i2t, t2i"):
        ndcg_metrics(images, texts, owner, {"spice": image_rel}, k=2, left_out=("up",))
    per_query = ndcg_per_query(images, texts, owner, {"spice": image_rel}, k=2)["spice"]
    np.testing.assert_allclose(per_query[0], i2t_all)
    np.testing.assert_allclose(per_query[1], t2i_all)


def test_perfect_ranking_scores_one_and_keys_name_both_kinds():
    images = np.eye(4)
    owner = np.array([0, 0, 1, 2, 3, 3])
    rel = np.where(owner[:, None] == np.arange(4)[None, :], 1.0, 0.2).astype(np.float32)  # (6, 4)
    got = ndcg_metrics(images, images[owner], owner, {"rouge_l": rel, "spice": rel})
    assert got == {f"{d}NDCG25_{kind}": 1.0 for kind in ("rouge_l", "spice") for d in ("i2t_", "t2i_", "")}
    assert PRIMARY == "NDCG25_rouge_l" and PRIMARY in got


def test_hand_checked_value_with_tied_relevances():
    # caption 0 ranks image 1 (cos .98), image 0 (.89), image 2 (0); its relevance to them: .5, 1, .5
    images = np.array([[1.0, 0.5], [1.0, 0.2], [0.0, 1.0]])
    texts = np.array([[1.0, 0.0], [1.0, 0.2], [0.0, 1.0]])
    owner = [0, 1, 2]
    rel = np.array([[1.0, 0.5, 0.5], [0.5, 1.0, 0.0], [0.5, 0.0, 1.0]], dtype=np.float32)
    g = math.sqrt(2.0) - 1.0  # gain of relevance .5
    want = (g + 1 / math.log2(3) + g / 2) / (1 + g / math.log2(3) + g / 2)  # ideal: 1, .5, .5
    t2i = ndcg_per_query(images, texts, owner, {"rouge_l": rel})["rouge_l"][1]
    assert t2i[0] == pytest.approx(want)
    assert t2i[0] == pytest.approx(0.8528, abs=1e-4)
    # which of the two .5 images is retrieved first makes no difference
    swapped = rel[:, [0, 2, 1]][[0, 2, 1]]
    texts_swapped = texts[[0, 2, 1]]
    t2i_swapped = ndcg_per_query(images[[0, 2, 1]], texts_swapped, owner, {"rouge_l": swapped})["rouge_l"][1]
    assert t2i_swapped[0] == pytest.approx(want)


def test_tied_scores_count_against_the_model():
    # constant embeddings: every gallery item ties, so the least relevant are ranked first
    owner = [0, 1, 2]
    rel = np.array([[1.0, 0.5, 0.0], [0.5, 1.0, 0.0], [0.0, 0.0, 1.0]], dtype=np.float32)
    t2i = ndcg_per_query(np.ones((3, 4)), np.ones((3, 4)), owner, {"rouge_l": rel})["rouge_l"][1]
    g = math.sqrt(2.0) - 1.0
    want = (0.0 + g / math.log2(3) + 1 / 2) / (1 + g / math.log2(3))  # ranked .0, .5, 1 vs 1, .5, 0
    assert t2i[0] == pytest.approx(want)
    # with the cut inside the tie group (k=2 of 4 tied items) too
    images, texts, owner4 = np.ones((4, 3)), np.ones((8, 3)), np.repeat(np.arange(4), 2)
    image_rel = np.random.default_rng(5).uniform(size=(8, 4)).astype(np.float32)
    got = ndcg_metrics(images, texts, owner4, {"rouge_l": image_rel}, k=2)
    i2t, t2i_mean, _, _ = transcribed(images, texts, owner4.tolist(), image_rel.tolist(), 2)
    assert (got["i2t_NDCG2_rouge_l"], got["t2i_NDCG2_rouge_l"]) == pytest.approx((i2t, t2i_mean))


def test_k_larger_than_the_gallery_ranks_the_whole_gallery():
    images, texts, owner, image_rel = random_case(2, n_img=3)
    got25 = ndcg_metrics(images, texts, owner, {"rouge_l": image_rel}, k=25)
    got_n = ndcg_metrics(images, texts, owner, {"rouge_l": image_rel}, k=owner.size)
    assert list(got25.values()) == pytest.approx(list(got_n.values()))
    i2t, t2i, _, _ = transcribed(images, texts, owner.tolist(), image_rel.tolist(), 25)
    assert (got25["i2t_NDCG25_rouge_l"], got25["t2i_NDCG25_rouge_l"]) == pytest.approx((i2t, t2i))


def test_identical_captions_make_the_other_image_fully_relevant():
    captions = ["A dog runs on the grass.", "a dog runs on the grass.", "A cat sleeps on a red sofa."]
    owner = [0, 1, 2]
    rel = image_relevance(captions, owner, "rouge_l")
    assert rel[0, 1] == pytest.approx(1.0)  # lower-cased, the same tokens
    # image 0 retrieves caption 1 (of image 1) first; caption 0 retrieves image 1 first
    images = np.array([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    texts = np.array([[0.6, 1.0, 0.0], [0.9, 1.0, 0.0], [0.0, 0.0, 1.0]])
    i2t, t2i = ndcg_per_query(images, texts, owner, {"rouge_l": rel})["rouge_l"]
    assert i2t[0] == pytest.approx(1.0) and t2i[0] == pytest.approx(1.0)
    assert float(texts[1] @ images[0]) / np.linalg.norm(texts[1]) > float(texts[0] @ images[0]) / np.linalg.norm(
        texts[0])  # the exact match of image 0 is not its top caption: R@1 would be 0


def test_fold_mean_averages_folds_with_their_own_captions():
    images, texts, owner, image_rel = random_case(4, n_img=10)
    folds = [range(0, 5), range(5, 10)]
    got = ndcg_fold_mean(images, texts, owner, {"rouge_l": image_rel}, folds, k=3)
    want = []
    for fold in folds:
        keep = [j for j in range(owner.size) if fold.start <= owner[j] < fold.stop]
        sub = [[image_rel[a][i] for i in fold] for a in keep]
        want.append(transcribed(images[fold.start:fold.stop], texts[keep], [owner[j] - fold.start for j in keep],
                                sub, 3)[:2])
    assert got["i2t_NDCG3_rouge_l"] == pytest.approx(np.mean([w[0] for w in want]))
    assert got["t2i_NDCG3_rouge_l"] == pytest.approx(np.mean([w[1] for w in want]))


# ----------------------------------------------------------------------------- ROUGE-L relevance

CAPTIONS = [
    "A man in a red shirt is riding a bike down the street.",
    "a man rides his bicycle down a street",
    "Two dogs play with a ball in the park!",
    "The dog's ball -- bright RED -- rolls, rolls and rolls.",
    "",  # no tokens: rouge-score scores 0 with everything
    "!!!",
    "3 kids, 2 dogs and 1 cat",
    " ".join(f"w{i % 37}" for i in range(90)),  # longer than 64 tokens: the big-integer path
    " ".join(f"w{i % 23}" for i in range(70)),
]


OWNERS = [0, 0, 1, 1, 2, 2, 3, 4, 4]  # the image of each caption above


def coco_rouge_l(candidate: str, refs: list[str], beta: float = 1.2) -> float:
    """TERAN's evaluate_utils/rouge.py (coco-caption's ROUGE-L) written out: lower-cased tokens split on single
    spaces, the LCS by dynamic programming, best precision and best recall over the references, F_beta."""
    def lcs(a, b):
        table = [[0] * (len(b) + 1) for _ in range(len(a) + 1)]
        for i in range(1, len(a) + 1):
            for j in range(1, len(b) + 1):
                table[i][j] = table[i - 1][j - 1] + 1 if a[i - 1] == b[j - 1] else max(table[i - 1][j], table[i][j - 1])
        return table[-1][-1]

    c = candidate.lower().split(" ")
    prec = max(lcs(r.lower().split(" "), c) / len(c) for r in refs)
    rec = max(lcs(r.lower().split(" "), c) / len(r.lower().split(" ")) for r in refs)
    return (1 + beta ** 2) * prec * rec / (rec + beta ** 2 * prec) if prec and rec else 0.0


def test_rouge_l_relevance_is_teran_s_multi_reference_rouge_l():
    got = image_relevance(CAPTIONS, OWNERS, "rouge_l")
    assert got.dtype == np.float32 and got.shape == (len(CAPTIONS), 5)
    for c, cand in enumerate(CAPTIONS):
        for i in range(5):
            refs = [r for r, o in zip(CAPTIONS, OWNERS, strict=True) if o == i]
            assert got[c, i] == pytest.approx(coco_rouge_l(cand, refs), abs=1e-6), (cand, refs)
    assert got[0, 0] == got[1, 0] == got[4, 2] == 1.0 and 0 < got[2, 0] < 1  # a caption is among its refs
    # the whole reference set at once: not the best single reference's F
    refs = [CAPTIONS[0], CAPTIONS[1]]
    single = max(coco_rouge_l("a man in a street", [r]) for r in refs)
    assert image_relevance(["a man in a street", *refs], [1, 0, 0], "rouge_l")[0, 0] >= single


def test_rouge_l_relevance_on_random_captions_matches_the_transcription(monkeypatch):
    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in range(40)]
    captions = [" ".join(rng.choice(words, size=rng.integers(1, 30))) for _ in range(120)]
    owner = np.concatenate([np.arange(30), rng.integers(0, 30, size=90)])
    got = image_relevance(captions, owner, "rouge_l")
    monkeypatch.delattr(np, "bitwise_count", raising=False)  # the SWAR popcount of numpy < 2
    np.testing.assert_array_equal(image_relevance(captions, owner, "rouge_l"), got)
    for c, i in rng.integers(0, 30, size=(60, 2)) * [4, 1]:
        refs = [captions[j] for j in range(len(captions)) if owner[j] == i]
        assert got[c, i] == pytest.approx(coco_rouge_l(captions[c], refs), abs=1e-6)


# ----------------------------------------------------------------------------- cache


def test_cache_is_reused_keyed_by_captions_and_kind(tmp_path, monkeypatch):
    first = relevance_matrix(CAPTIONS, OWNERS, "rouge_l", tmp_path)
    path = tmp_path / f"rouge_l-{relevance_key(CAPTIONS, OWNERS, 'rouge_l')}.npy"
    assert path.is_file() and [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary left

    def fail(*args):
        raise AssertionError("recomputed although cached")

    monkeypatch.setattr(ndcg, "image_relevance", fail)
    np.testing.assert_array_equal(relevance_matrix(CAPTIONS, OWNERS, "rouge_l", tmp_path), first)
    assert relevance_key(CAPTIONS, OWNERS, "rouge_l") != relevance_key(CAPTIONS[::-1], OWNERS, "rouge_l")
    assert relevance_key(CAPTIONS, OWNERS, "rouge_l") != relevance_key(CAPTIONS, OWNERS, "spice")
    other = [0, 1, 1, 1, 2, 2, 3, 4, 4]  # the same captions of other images: another key
    assert relevance_key(CAPTIONS, OWNERS, "rouge_l") != relevance_key(CAPTIONS, other, "rouge_l")
    with pytest.raises(AssertionError, match="recomputed"):
        relevance_matrix(CAPTIONS[:-1], OWNERS[:-1], "rouge_l", tmp_path)  # other captions: another key


@pytest.mark.parametrize("damage", ["truncate", "garbage", "shape", "values"])
def test_corrupt_cache_is_rebuilt(tmp_path, damage):
    want = relevance_matrix(CAPTIONS, OWNERS, "rouge_l", tmp_path)
    path = tmp_path / f"rouge_l-{relevance_key(CAPTIONS, OWNERS, 'rouge_l')}.npy"
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[:-20])
    elif damage == "garbage":
        path.write_bytes(b"not a numpy file")
    elif damage == "shape":
        np.save(path, np.zeros((3, 3), dtype=np.float32))
    else:
        np.save(path, np.full(want.shape, np.nan, dtype=np.float32))
    np.testing.assert_array_equal(relevance_matrix(CAPTIONS, OWNERS, "rouge_l", tmp_path), want)
    np.testing.assert_array_equal(np.load(path), want)  # the file is whole again


# ----------------------------------------------------------------------------- SPICE


def test_spice_fails_fast_naming_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setattr(ndcg, "_spice_dir", lambda: tmp_path)  # a SPICE folder without its jars
    monkeypatch.setenv("PATH", str(tmp_path))  # and no java
    with pytest.raises(SpiceUnavailable) as err:
        relevance_matrix(CAPTIONS, OWNERS, "spice", tmp_path / "cache")
    text = str(err.value)
    for needed in ("stanford-corenlp-3.6.0.jar", "stanford-corenlp-3.6.0-models.jar", "spice-1.0.jar",
                   'pip install -e ".[spice]"', "get_stanford_models", "java (not on PATH)", "rouge_l"):
        assert needed in text, needed
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


FAKE_JAVA = """#!{python}
# stands in for `java -jar spice-1.0.jar IN -cache DIR -out OUT -silent`: F = Jaccard of word sets
import json, sys
args = sys.argv[1:]
items = json.load(open(args[args.index("-Xmx8G") + 2]))
log = open({log!r}, "a")
out = []
for item in reversed(items):  # SPICE need not keep the input order
    a, b = set(item["test"].split()), set(w for r in item["refs"] for w in r.split())  # the refs' union
    f = len(a & b) / len(a | b) if a and b else None  # json-simple writes NaN as null
    out.append({{"image_id": item["image_id"], "scores": {{"All": {{"f": f, "pr": f, "re": f}}}}}})
    log.write(item["test"] + "|" + "/".join(item["refs"]) + "\\n")
json.dump(out, open(args[args.index("-out") + 1], "w"))
"""


def test_spice_relevance_with_a_fake_java_scores_each_caption_against_each_images_references(tmp_path, monkeypatch):
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    java = bin_dir / "java"
    java.write_text(FAKE_JAVA.format(python=sys.executable, log=str(log)))
    java.chmod(java.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(ndcg, "_spice_missing", lambda: [])
    monkeypatch.setattr(ndcg, "_spice_dir", lambda: tmp_path)
    monkeypatch.setattr(ndcg, "SPICE_CHUNK", 4)  # 4 captions x 3 images: three runs
    # TERAN tokenises SPICE's inputs first (PTB, lower-cased, punctuation dropped): a stand-in that does the same to
    # these captions, so the scores below are those of the tokenised text
    monkeypatch.setattr(ndcg, "ptb_tokenized", lambda cs: [c.lower().replace(" .", "").replace(",", "") for c in cs])
    raw = ["A dog runs .", "a dog, sleeps", "", "Cat on mat"]
    got = relevance_matrix(raw, [0, 0, 1, 2], "spice", tmp_path / "cache")
    captions, owner = ["a dog runs", "a dog sleeps", "", "cat on mat"], [0, 0, 1, 2]

    def jaccard(a, refs):
        a, b = set(a.split()), {w for r in refs for w in r.split()}
        return len(a & b) / len(a | b) if a and b else 0.0

    refs = [[c for c, o in zip(captions, owner, strict=True) if o == i] for i in range(3)]
    want = np.array([[jaccard(a, refs[i]) for i in range(3)] for a in captions], dtype=np.float32)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert len(log.read_text().splitlines()) == 12  # each caption against each image's references together
    assert "a dog runs|a dog runs/a dog sleeps" in log.read_text().splitlines()
    assert (tmp_path / "cache" / f"spice-{relevance_key(raw, owner, 'spice')}.npy").is_file()


def test_parse_spice_output_places_by_image_id_and_reads_nan_as_zero():
    results = [{"image_id": 1, "scores": {"All": {"f": "NaN"}}}, {"image_id": 0, "scores": {"All": {"f": 0.25}}},
               {"image_id": 2, "scores": {"All": {"f": float("nan")}, "Object": {"f": 1.0}}}]
    np.testing.assert_array_equal(parse_spice_output(json.loads(json.dumps(results)), 3), [0.25, 0.0, 0.0])
    with pytest.raises(RuntimeError, match="lacks items"):
        parse_spice_output(results[:2], 3)


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("case, message", [
    ("nan_image", r"image_emb: NaN/inf in rows \[1\]"),
    ("nan_text", r"text_emb: NaN/inf in rows \[2\]"),
    ("dims", "dimension"),
    ("owner_count", "text_image has shape"),
    ("owner_range", r"captions \[3\] name images outside 0..2"),
    ("owner_float", "integer image indices"),
    ("bare_image", r"images without a caption: \[2\]"),
    ("rel_shape", r"relevance\['rouge_l'\] has shape \(4, 4\), expected \(4, 3\)"),
    ("rel_values", r"relevance\['rouge_l'\]: values must be finite"),
    ("rel_kind", "unknown kind"),
    ("rel_empty", "no matrix given"),
    ("k", "k: expected an integer"),
])
def test_bad_input_is_one_clear_error(case, message):
    images, texts = np.eye(3), np.eye(3)[[0, 1, 2, 2]]
    owner = np.array([0, 1, 2, 2])
    rel = {"rouge_l": np.eye(4, 3, dtype=np.float32)}
    k = 25
    if case == "nan_image":
        images[1, 0] = np.nan
    elif case == "nan_text":
        texts[2, 1] = np.nan
    elif case == "dims":
        texts = np.ones((4, 5))
    elif case == "owner_count":
        owner = owner[:3]
    elif case == "owner_range":
        owner = np.array([0, 1, 2, 3])
    elif case == "owner_float":
        owner = owner.astype(float)
    elif case == "bare_image":
        owner = np.array([0, 1, 1, 0])
    elif case == "rel_shape":
        rel = {"rouge_l": np.eye(4, dtype=np.float32)}
    elif case == "rel_values":
        rel = {"rouge_l": np.full((4, 3), 2.0, dtype=np.float32)}
    elif case == "rel_kind":
        rel = {"bleu": np.eye(4, 3, dtype=np.float32)}
    elif case == "rel_empty":
        rel = {}
    else:
        k = 0
    with pytest.raises(ValueError, match=message):
        ndcg_metrics(images, texts, owner, rel, k=k)


def test_bad_relevance_requests_are_refused_before_compute(tmp_path):
    with pytest.raises(ValueError, match="relevance kind 'bleu'"):
        relevance_matrix(CAPTIONS, OWNERS, "bleu", tmp_path)
    with pytest.raises(ValueError, match="captions: empty"):
        image_relevance([], [], "rouge_l")
    with pytest.raises(ValueError, match=r"entries \[1\] are not strings"):
        image_relevance(["a", None], [0, 0], "rouge_l")
    with pytest.raises(ValueError, match="each with at least one caption"):
        image_relevance(["a", "b"], [0, 2], "rouge_l")
    assert not any(tmp_path.iterdir())
