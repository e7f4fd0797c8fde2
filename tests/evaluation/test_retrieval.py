"""Recall@K against a direct transcription of the VSE++ protocol, and hand-checked cases."""

import numpy as np
import pytest

from mmcse.evaluation.retrieval import chance_metrics, chance_recalls, coco_1k_folds, fold_mean, retrieval_metrics


def transcribed(image_emb, text_emb, text_image):
    """VSE++'s i2t / t2i loops written out: sort by score, ties put the ground truth last."""
    def unit(v):
        return [x / np.linalg.norm(x) for x in v]

    images, texts = unit(image_emb), unit(text_emb)
    i2t_ranks, t2i_ranks = [], []
    for i, img in enumerate(images):
        order = sorted(range(len(texts)), key=lambda j: (-float(img @ texts[j]), text_image[j] == i))
        i2t_ranks.append(min(pos for pos, j in enumerate(order) if text_image[j] == i))
    for j, txt in enumerate(texts):
        order = sorted(range(len(images)), key=lambda i: (-float(images[i] @ txt), i == text_image[j]))
        t2i_ranks.append(order.index(text_image[j]))
    out = {}
    for name, ranks in (("i2t", i2t_ranks), ("t2i", t2i_ranks)):
        for k in (1, 5, 10):
            out[f"{name}_R{k}"] = 100.0 * sum(r < k for r in ranks) / len(ranks)
    out["rsum"] = sum(out.values())
    return out


def test_matches_the_transcription_on_random_embeddings_with_five_captions_per_image():
    rng = np.random.default_rng(0)
    images = rng.normal(size=(20, 8))
    owner = np.repeat(np.arange(20), 5)
    texts = images[owner] + rng.normal(scale=1.5, size=(100, 8))  # noisy captions of their image
    got = retrieval_metrics(images, texts, owner)
    want = transcribed(images, texts, owner.tolist())
    assert got.keys() == want.keys()
    for k in want:
        assert got[k] == pytest.approx(want[k]), k
    assert 0 < got["i2t_R1"] < 100 and 0 < got["t2i_R1"] < 100  # the case is not trivial


def test_perfect_embeddings_score_600():
    images = np.eye(4)
    owner = [0, 0, 1, 2, 3, 3]
    assert retrieval_metrics(images, images[owner], owner) == {
        "i2t_R1": 100.0, "i2t_R5": 100.0, "i2t_R10": 100.0,
        "t2i_R1": 100.0, "t2i_R5": 100.0, "t2i_R10": 100.0, "rsum": 600.0}


def test_ties_count_against_the_model_and_k_beyond_the_gallery():
    # every embedding the same: each ground truth ties with everything
    images, texts = np.ones((3, 4)), np.ones((6, 4))
    owner = [0, 0, 1, 1, 2, 2]
    got = retrieval_metrics(images, texts, owner)
    # i2t: 4 other captions tie above the best own one (rank 4): R@1 0, R@5 100; t2i: 2 images above
    assert (got["i2t_R1"], got["i2t_R5"], got["i2t_R10"]) == (0.0, 100.0, 100.0)
    assert (got["t2i_R1"], got["t2i_R5"], got["t2i_R10"]) == (0.0, 100.0, 100.0)
    assert got == transcribed(images, texts, owner)


def test_a_caption_shared_by_two_images():
    # the same caption (embedding) belongs to image 0 once and to image 1 once
    images = np.array([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])
    shared = np.array([1.0, 1.0])
    texts = np.stack([shared, shared, [-1.0, 0.1]])
    owner = [0, 1, 2]
    got = retrieval_metrics(images, texts, owner)
    # t2i: images 0 and 1 tie for the shared caption, so each copy ranks second; caption 2 is exact
    assert got["t2i_R1"] == pytest.approx(100 / 3) and got["t2i_R5"] == 100.0
    # i2t: image 0's own copy ties with image 1's copy: rank 1; same for image 1; image 2 rank 0
    assert got["i2t_R1"] == pytest.approx(100 / 3) and got["i2t_R5"] == 100.0
    assert got == pytest.approx(transcribed(images, texts, owner))


def test_coco_1k_is_the_mean_over_folds_each_with_its_own_captions():
    rng = np.random.default_rng(1)
    images = rng.normal(size=(30, 6))
    owner = np.repeat(np.arange(30), 2)
    texts = images[owner] + rng.normal(scale=1.0, size=(60, 6))
    folds = coco_1k_folds(30, fold=10)
    assert [(f.start, f.stop) for f in folds] == [(0, 10), (10, 20), (20, 30)]
    got = fold_mean(images, texts, owner, folds)
    per = [transcribed(images[f.start:f.stop], texts[2 * f.start:2 * f.stop], (owner[2 * f.start:2 * f.stop]
                                                                                 - f.start).tolist())
           for f in folds]
    for k in got:
        assert got[k] == pytest.approx(np.mean([p[k] for p in per])), k
    with pytest.raises(ValueError, match="folds of 10"):
        coco_1k_folds(25, fold=10)


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="3 entries for 2 captions"):
        retrieval_metrics(np.eye(2), np.eye(2), [0, 1, 1])
    with pytest.raises(ValueError, match="outside 0..1"):
        retrieval_metrics(np.eye(2), np.eye(2), [0, 2])
    with pytest.raises(ValueError, match=r"images without a caption: \[1\]"):
        retrieval_metrics(np.eye(2), np.eye(2), [0, 0])
    with pytest.raises(ValueError, match=r"1 caption embeddings hold NaN or inf \(first rows: \[1\]\)"):
        retrieval_metrics(np.eye(2), np.array([[1.0, 0.0], [np.nan, 1.0]]), [0, 1])
    with pytest.raises(ValueError, match=r"\(N_img, d\) and \(N_txt, d\)"):
        retrieval_metrics(np.eye(2), np.ones((2, 3)), [0, 1])


@pytest.mark.parametrize("block", [1, 3, 7, 1000])
def test_any_block_size_gives_the_same_ranks_as_one_block(block):
    rng = np.random.default_rng(5)
    images = rng.normal(size=(17, 6))
    owner = np.repeat(np.arange(17), 3)
    texts = images[owner] + rng.normal(scale=1.2, size=(51, 6))
    texts[4] = texts[3]  # an exact duplicate caption: ties must survive the blocking
    got = retrieval_metrics(images, texts, owner, block=block)
    assert got == pytest.approx(transcribed(images, texts, owner.tolist()))
    ties = retrieval_metrics(np.ones((3, 4)), np.ones((6, 4)), [0, 0, 1, 1, 2, 2], block=block)
    assert (ties["i2t_R1"], ties["t2i_R1"], ties["i2t_R5"]) == (0.0, 0.0, 100.0)


def test_chance_recalls_are_what_random_rankings_score_on_average():
    """`chance_recalls` (the closed form) against `retrieval_metrics` of random embeddings, averaged over 3,000
    draws: 7 images with 1 to 3 captions each (an image with more captions is found by chance more often)."""
    text_image = [0, 0, 0, 1, 2, 2, 3, 4, 4, 4, 5, 6]
    want = chance_recalls(text_image, 7)
    rng = np.random.default_rng(0)
    draws = [retrieval_metrics(rng.normal(size=(7, 16)), rng.normal(size=(12, 16)), text_image) for _ in range(3000)]
    for key, value in want.items():
        got = float(np.mean([d[key] for d in draws]))
        spread = float(np.std([d[key] for d in draws])) / np.sqrt(len(draws))
        assert abs(got - value) < 4 * spread + 1e-9, (key, got, value)
    # a caption's image in the top K of N: K / N; an image with one of M captions: K / M
    assert want["t2i_R5"] == pytest.approx(100 * 5 / 7)
    one = chance_recalls(list(range(10)), 10)
    assert one["i2t_R1"] == pytest.approx(10.0) and one["i2t_R10"] == pytest.approx(100.0)


def test_the_demo_sets_chance_and_cocos_folds():
    """100 images × 4 captions (the demo's test set): R@10 by chance ≈ 9.67 image→text, 10 text→image; COCO 5K's 1K
    folds are each 1,000 images, so their chance is 1K's."""
    demo = chance_metrics("demo", np.repeat(np.arange(100), 4), 100)
    assert demo["demo_i2t_R10"] == pytest.approx(100 * (1 - np.prod([(396 - j) / (400 - j) for j in range(10)])))
    assert demo["demo_t2i_R10"] == pytest.approx(10.0)
    coco = chance_metrics("coco_5k", np.repeat(np.arange(5000), 5), 5000)
    assert coco["coco_5k_t2i_R10"] == pytest.approx(0.2) and coco["coco_1k_t2i_R10"] == pytest.approx(1.0)
