"""Graded NDCG@k (DUET/TERAN) against a direct transcription, hand-checked cases, ROUGE-L relevance
against rouge-score itself, the relevance cache, and the SPICE path (fail-fast and a fake java)."""

import json
import math
import os
import stat
import sys

import numpy as np
import pytest
from rouge_score.rouge_scorer import RougeScorer

from mmcse.evaluation import ndcg
from mmcse.evaluation.ndcg import (
    PRIMARY,
    SpiceUnavailable,
    caption_relevance,
    ndcg_fold_mean,
    ndcg_metrics,
    ndcg_per_query,
    parse_spice_output,
    relevance_key,
    relevance_matrix,
)


def transcribed(image_emb, text_emb, text_image, pair_rel, k, exclude_zero=True):
    """The protocol written out: relevance of caption c to image i is the best S[c, c'] over the
    captions c' of i; rank by cosine (ties: least relevant first), DCG with gain 2^r - 1 and
    discount log2(rank + 1), ideal DCG from the whole gallery sorted, mean over non-zero NDCGs."""
    images = [x / np.linalg.norm(x) for x in np.asarray(image_emb, dtype=float)]
    texts = [x / np.linalg.norm(x) for x in np.asarray(text_emb, dtype=float)]
    n_img, n_txt = len(images), len(texts)

    def rel(c, i):
        return max(float(pair_rel[c][c2]) for c2 in range(n_txt) if text_image[c2] == i)

    def dcg(gains):
        return sum((2.0 ** g - 1.0) / math.log2(pos + 2) for pos, g in enumerate(gains[:k]))

    def one(scores, gains):
        order = sorted(range(len(scores)), key=lambda j: (-scores[j], gains[j]))
        ideal = dcg(sorted(gains, reverse=True))
        return dcg([gains[j] for j in order]) / ideal if ideal > 0 else 0.0

    i2t = [one([float(images[i] @ t) for t in texts], [rel(c, i) for c in range(n_txt)]) for i in range(n_img)]
    t2i = [one([float(im @ texts[c]) for im in images], [rel(c, i) for i in range(n_img)]) for c in range(n_txt)]

    def mean(values):
        values = [v for v in values if v != 0] if exclude_zero else values
        return sum(values) / len(values) if values else 0.0

    return mean(i2t), mean(t2i), i2t, t2i


def random_case(seed, n_img=9, sparse=False):
    rng = np.random.default_rng(seed)
    owner = np.concatenate([np.arange(n_img), rng.integers(0, n_img, size=2 * n_img)])  # 1..n captions each
    rng.shuffle(owner)  # captions of an image are not contiguous
    images = rng.normal(size=(n_img, 6))
    texts = images[owner] + rng.normal(scale=1.2, size=(owner.size, 6))
    pair_rel = rng.uniform(size=(owner.size, owner.size))  # not symmetric: orientation matters
    if sparse:
        pair_rel = np.where(rng.uniform(size=pair_rel.shape) < 0.08, pair_rel, 0.0)
    np.fill_diagonal(pair_rel, 1.0)
    return images, texts, owner, pair_rel.astype(np.float32)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("k", [1, 4, 25])
def test_matches_the_transcription_in_both_directions(seed, k):
    images, texts, owner, pair_rel = random_case(seed)
    got = ndcg_metrics(images, texts, owner, {"rouge_l": pair_rel}, k=k, block=4)
    i2t, t2i, _, _ = transcribed(images, texts, owner.tolist(), pair_rel.tolist(), k)
    assert got[f"i2t_NDCG{k}_rouge_l"] == pytest.approx(i2t)
    assert got[f"t2i_NDCG{k}_rouge_l"] == pytest.approx(t2i)
    assert got[f"NDCG{k}_rouge_l"] == pytest.approx((i2t + t2i) / 2)
    assert 0.05 < i2t < 0.999 and 0.05 < t2i < 0.999  # the case is not trivial
    # the block size changes nothing
    assert ndcg_metrics(images, texts, owner, {"rouge_l": pair_rel}, k=k, block=1000) == pytest.approx(got)


def test_zero_ndcg_queries_are_left_out_of_the_mean_like_teran_unless_asked():
    images, texts, owner, pair_rel = random_case(3, n_img=12, sparse=True)
    _, _, i2t_all, t2i_all = transcribed(images, texts, owner.tolist(), pair_rel.tolist(), 2)
    assert 0.0 in t2i_all  # some query has nothing relevant in its top 2
    for exclude in (True, False):
        got = ndcg_metrics(images, texts, owner, {"spice": pair_rel}, k=2, exclude_zero=exclude)
        i2t, t2i, _, _ = transcribed(images, texts, owner.tolist(), pair_rel.tolist(), 2, exclude_zero=exclude)
        assert (got["i2t_NDCG2_spice"], got["t2i_NDCG2_spice"]) == pytest.approx((i2t, t2i))
    per_query = ndcg_per_query(images, texts, owner, {"spice": pair_rel}, k=2)["spice"]
    np.testing.assert_allclose(per_query[0], i2t_all)
    np.testing.assert_allclose(per_query[1], t2i_all)


def test_perfect_ranking_scores_one_and_keys_name_both_kinds():
    images = np.eye(4)
    owner = np.array([0, 0, 1, 2, 3, 3])
    same = owner[:, None] == owner[None, :]
    rel = np.where(same, 1.0, 0.2).astype(np.float32)
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
    images, texts, owner4, pair_rel = np.ones((4, 3)), np.ones((8, 3)), np.repeat(np.arange(4), 2), None
    pair_rel = np.random.default_rng(5).uniform(size=(8, 8)).astype(np.float32)
    got = ndcg_metrics(images, texts, owner4, {"rouge_l": pair_rel}, k=2)
    i2t, t2i_mean, _, _ = transcribed(images, texts, owner4.tolist(), pair_rel.tolist(), 2)
    assert (got["i2t_NDCG2_rouge_l"], got["t2i_NDCG2_rouge_l"]) == pytest.approx((i2t, t2i_mean))


def test_k_larger_than_the_gallery_ranks_the_whole_gallery():
    images, texts, owner, pair_rel = random_case(2, n_img=3)
    got25 = ndcg_metrics(images, texts, owner, {"rouge_l": pair_rel}, k=25)
    got_n = ndcg_metrics(images, texts, owner, {"rouge_l": pair_rel}, k=owner.size)
    assert list(got25.values()) == pytest.approx(list(got_n.values()))
    i2t, t2i, _, _ = transcribed(images, texts, owner.tolist(), pair_rel.tolist(), 25)
    assert (got25["i2t_NDCG25_rouge_l"], got25["t2i_NDCG25_rouge_l"]) == pytest.approx((i2t, t2i))


def test_identical_captions_make_the_other_image_fully_relevant():
    captions = ["A dog runs on the grass.", "a dog runs on the grass", "A cat sleeps on a red sofa."]
    owner = [0, 1, 2]
    rel = caption_relevance(captions, "rouge_l")
    assert rel[0, 1] == pytest.approx(1.0)
    # image 0 retrieves caption 1 (of image 1) first; caption 0 retrieves image 1 first
    images = np.array([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    texts = np.array([[0.6, 1.0, 0.0], [0.9, 1.0, 0.0], [0.0, 0.0, 1.0]])
    i2t, t2i = ndcg_per_query(images, texts, owner, {"rouge_l": rel})["rouge_l"]
    assert i2t[0] == pytest.approx(1.0) and t2i[0] == pytest.approx(1.0)
    assert float(texts[1] @ images[0]) / np.linalg.norm(texts[1]) > float(texts[0] @ images[0]) / np.linalg.norm(
        texts[0])  # the exact match of image 0 is not its top caption: R@1 would be 0


def test_fold_mean_averages_folds_with_their_own_captions():
    images, texts, owner, pair_rel = random_case(4, n_img=10)
    folds = [range(0, 5), range(5, 10)]
    got = ndcg_fold_mean(images, texts, owner, {"rouge_l": pair_rel}, folds, k=3)
    want = []
    for fold in folds:
        keep = [j for j in range(owner.size) if fold.start <= owner[j] < fold.stop]
        sub = [[pair_rel[a][b] for b in keep] for a in keep]
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


def test_rouge_l_relevance_equals_rouge_score():
    scorer = RougeScorer(["rougeL"])
    got = caption_relevance(CAPTIONS, "rouge_l")
    assert got.dtype == np.float32 and got.shape == (len(CAPTIONS), len(CAPTIONS))
    for a, cand in enumerate(CAPTIONS):
        for b, ref in enumerate(CAPTIONS):
            want = scorer.score(ref, cand)["rougeL"].fmeasure  # score(target, prediction)
            assert got[a, b] == pytest.approx(want, abs=1e-6), (cand, ref)
    np.testing.assert_array_equal(got, got.T)
    assert got[0, 0] == 1.0 and got[4, 4] == 0.0 and 0 < got[0, 1] < 1


def test_rouge_l_relevance_on_random_captions_matches_a_sample(monkeypatch):
    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in range(40)]
    captions = [" ".join(rng.choice(words, size=rng.integers(0, 30))) for _ in range(120)]
    got = caption_relevance(captions, "rouge_l")
    monkeypatch.delattr(np, "bitwise_count", raising=False)  # the SWAR popcount of numpy < 2
    np.testing.assert_array_equal(caption_relevance(captions, "rouge_l"), got)
    scorer = RougeScorer(["rougeL"])
    for a, b in rng.integers(0, len(captions), size=(150, 2)):
        assert got[a, b] == pytest.approx(scorer.score(captions[b], captions[a])["rougeL"].fmeasure, abs=1e-6)


# ----------------------------------------------------------------------------- cache


def test_cache_is_reused_keyed_by_captions_and_kind(tmp_path, monkeypatch):
    first = relevance_matrix(CAPTIONS, "rouge_l", tmp_path)
    path = tmp_path / f"rouge_l-{relevance_key(CAPTIONS, 'rouge_l')}.npy"
    assert path.is_file() and [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary left

    def fail(*args):
        raise AssertionError("recomputed although cached")

    monkeypatch.setattr(ndcg, "caption_relevance", fail)
    np.testing.assert_array_equal(relevance_matrix(CAPTIONS, "rouge_l", tmp_path), first)
    assert relevance_key(CAPTIONS, "rouge_l") != relevance_key(CAPTIONS[::-1], "rouge_l")
    assert relevance_key(CAPTIONS, "rouge_l") != relevance_key(CAPTIONS, "spice")
    with pytest.raises(AssertionError, match="recomputed"):
        relevance_matrix(CAPTIONS[:-1], "rouge_l", tmp_path)  # other captions: another key


@pytest.mark.parametrize("damage", ["truncate", "garbage", "shape", "values"])
def test_corrupt_cache_is_rebuilt(tmp_path, damage):
    want = relevance_matrix(CAPTIONS, "rouge_l", tmp_path)
    path = tmp_path / f"rouge_l-{relevance_key(CAPTIONS, 'rouge_l')}.npy"
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[:-20])
    elif damage == "garbage":
        path.write_bytes(b"not a numpy file")
    elif damage == "shape":
        np.save(path, np.zeros((3, 3), dtype=np.float32))
    else:
        np.save(path, np.full(want.shape, np.nan, dtype=np.float32))
    np.testing.assert_array_equal(relevance_matrix(CAPTIONS, "rouge_l", tmp_path), want)
    np.testing.assert_array_equal(np.load(path), want)  # the file is whole again


# ----------------------------------------------------------------------------- SPICE


def test_spice_fails_fast_naming_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setattr(ndcg, "_spice_dir", lambda: tmp_path)  # a SPICE folder without its jars
    monkeypatch.setenv("PATH", str(tmp_path))  # and no java
    with pytest.raises(SpiceUnavailable) as err:
        relevance_matrix(CAPTIONS, "spice", tmp_path / "cache")
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
    assert len(item["refs"]) == 1
    a, b = set(item["test"].split()), set(item["refs"][0].split())
    f = len(a & b) / len(a | b) if a and b else None  # json-simple writes NaN as null
    out.append({{"image_id": item["image_id"], "scores": {{"All": {{"f": f, "pr": f, "re": f}}}}}})
    log.write(item["test"] + "|" + item["refs"][0] + "\\n")
json.dump(out, open(args[args.index("-out") + 1], "w"))
"""


def test_spice_relevance_with_a_fake_java_reads_per_pair_scores(tmp_path, monkeypatch):
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    java = bin_dir / "java"
    java.write_text(FAKE_JAVA.format(python=sys.executable, log=str(log)))
    java.chmod(java.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(ndcg, "_spice_missing", lambda: [])
    monkeypatch.setattr(ndcg, "_spice_dir", lambda: tmp_path)
    monkeypatch.setattr(ndcg, "SPICE_CHUNK", 4)  # 10 pairs of 4 captions: three runs
    captions = ["a dog runs", "a dog sleeps", "", "cat on mat"]
    got = relevance_matrix(captions, "spice", tmp_path / "cache")

    def jaccard(a, b):
        a, b = set(a.split()), set(b.split())
        return len(a & b) / len(a | b) if a and b else 0.0

    want = np.array([[jaccard(a, b) for b in captions] for a in captions], dtype=np.float32)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert len(log.read_text().splitlines()) == 10  # each unordered pair (diagonal included) once
    assert (tmp_path / "cache" / f"spice-{relevance_key(captions, 'spice')}.npy").is_file()


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
    ("rel_shape", r"relevance\['rouge_l'\] has shape \(3, 3\), expected \(4, 4\)"),
    ("rel_values", r"relevance\['rouge_l'\]: values must be finite"),
    ("rel_kind", "unknown kind"),
    ("rel_empty", "no matrix given"),
    ("k", "k: expected an integer"),
])
def test_bad_input_is_one_clear_error(case, message):
    images, texts = np.eye(3), np.eye(3)[[0, 1, 2, 2]]
    owner = np.array([0, 1, 2, 2])
    rel = {"rouge_l": np.eye(4, dtype=np.float32)}
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
        rel = {"rouge_l": np.eye(3, dtype=np.float32)}
    elif case == "rel_values":
        rel = {"rouge_l": np.full((4, 4), 2.0, dtype=np.float32)}
    elif case == "rel_kind":
        rel = {"bleu": np.eye(4, dtype=np.float32)}
    elif case == "rel_empty":
        rel = {}
    else:
        k = 0
    with pytest.raises(ValueError, match=message):
        ndcg_metrics(images, texts, owner, rel, k=k)


def test_bad_relevance_requests_are_refused_before_compute(tmp_path):
    with pytest.raises(ValueError, match="relevance kind 'bleu'"):
        relevance_matrix(CAPTIONS, "bleu", tmp_path)
    with pytest.raises(ValueError, match="captions: empty"):
        caption_relevance([], "rouge_l")
    with pytest.raises(ValueError, match=r"entries \[1\] are not strings"):
        caption_relevance(["a", None], "rouge_l")
    assert not any(tmp_path.iterdir())
