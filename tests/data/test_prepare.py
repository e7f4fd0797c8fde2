"""The download stage's caption choice per image (data.captions)."""

import pytest

from mmcse.data.prepare import select_captions

PAIRS = [
    {"pair_id": f"i{i}-c{c}", "image_id": f"i{i}", "caption": "x" * (3 + (c * 7 + i) % 5)}
    for i in range(6) for c in range(4)
]


def test_all_keeps_every_caption():
    assert select_captions(PAIRS, "all", 0) == PAIRS


def test_longest_takes_the_longest_caption_of_each_image():
    chosen = select_captions(PAIRS, "longest", 0)
    assert [p["image_id"] for p in chosen] == [f"i{i}" for i in range(6)]
    for p in chosen:
        group = [q for q in PAIRS if q["image_id"] == p["image_id"]]
        assert len(p["caption"]) == max(len(q["caption"]) for q in group)
        assert p is next(q for q in group if len(q["caption"]) == len(p["caption"]))  # ties: the first


def test_random_takes_one_seeded_caption_per_image():
    a, b = select_captions(PAIRS, "random", 1), select_captions(PAIRS, "random", 1)
    assert a == b and [p["image_id"] for p in a] == [f"i{i}" for i in range(6)]
    draws = {tuple(p["pair_id"] for p in select_captions(PAIRS, "random", s)) for s in range(10)}
    assert len(draws) > 1  # the seed changes the choice
    with pytest.raises(ValueError, match="all, random, longest"):
        select_captions(PAIRS, "first", 0)


def test_download_writes_only_the_chosen_captions(tmp_path):
    from mmcse.config import DataConfig, DemoDataConfig
    from mmcse.data.prepare import prepare_data

    demo = DemoDataConfig(num_images=6, captions_per_image=3, corpus_sentences=5, sts_dev_pairs=10,
                          sts_test_pairs=10)
    everything = prepare_data(DataConfig(demo=demo), 3, tmp_path / "all")
    longest = prepare_data(DataConfig(demo=demo, captions="longest"), 3, tmp_path / "longest")
    assert everything["counts"]["pairs"] == 18 and longest["counts"]["pairs"] == 6
