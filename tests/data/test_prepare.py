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


def test_demo_images_record_their_digest_and_size(tmp_path):
    import hashlib

    from mmcse.config import DataConfig, DemoDataConfig
    from mmcse.data.prepare import prepare_data
    from mmcse.io import read_jsonl

    demo = DemoDataConfig(num_images=3, captions_per_image=1, corpus_sentences=5, sts_dev_pairs=10,
                          sts_test_pairs=10)
    prepare_data(DataConfig(demo=demo), 3, tmp_path / "raw")
    rows = read_jsonl(tmp_path / "raw/images.jsonl")
    assert len(rows) == 3
    for row in rows:
        data = (tmp_path / "raw" / row["file"]).read_bytes()
        assert row["sha256"] == hashlib.sha256(data).hexdigest() and row["bytes"] == len(data)
    assert len({r["sha256"] for r in rows}) == 3


def test_corpus_from_a_text_file_and_from_the_hub_cache(tmp_path, monkeypatch):
    from mmcse.config import ConfigError, DataConfig, parse_config
    from mmcse.data.prepare import load_corpus

    text = tmp_path / "corpus.txt"
    text.write_text("first sentence.\n\n  second one.  \nthird\n")
    assert load_corpus(DataConfig(corpus=str(text)), 0) == ["first sentence.", "second one.", "third"]
    assert load_corpus(DataConfig(corpus=str(text), corpus_limit=2), 0) == ["first sentence.", "second one."]
    with pytest.raises(ConfigError, match="data.corpus"):
        parse_config({"data": {"corpus": str(tmp_path / "missing.txt")}})
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(ValueError, match="holds no sentences"):
        load_corpus(DataConfig(corpus=str(tmp_path / "empty.txt")), 0)

    # wiki1m from a cache laid out as the hub client lays it out, offline
    import huggingface_hub.constants as constants

    repo, filename = DataConfig().sources.wiki1m.hub, DataConfig().sources.wiki1m.file
    commit = "f" * 40
    root = tmp_path / "hub" / f"datasets--{repo.replace('/', '--')}"
    (root / "snapshots" / commit).mkdir(parents=True)
    (root / "snapshots" / commit / filename).write_text("a wiki sentence.\nanother one.\n")
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert load_corpus(DataConfig(corpus="wiki1m"), 0, tmp_path / "downloads") == ["a wiki sentence.", "another one."]


def test_download_copies_the_chosen_transfer_tasks(tmp_path, transfer_dir):
    from mmcse.config import DataConfig, DemoDataConfig
    from mmcse.data.prepare import prepare_data
    from mmcse.data.senteval import TransferExample
    from mmcse.io import read_jsonl

    demo = DemoDataConfig(num_images=6, captions_per_image=1, corpus_sentences=5)
    cfg = DataConfig(source="senteval", senteval_dir=str(transfer_dir), transfer_tasks=["TREC", "MRPC"], demo=demo)
    manifest = prepare_data(cfg, 3, tmp_path / "raw")
    assert manifest["counts"]["transfer_TREC"] == 5452 + 500 and manifest["counts"]["transfer_MRPC"] == 4076 + 1725
    assert sorted(p.name for p in (tmp_path / "raw" / "transfer").iterdir()) == ["MRPC.jsonl", "TREC.jsonl"]
    assert {"transfer/TREC.jsonl", "transfer/MRPC.jsonl"} <= set(manifest["sha256"])
    rows = [TransferExample.from_row(r) for r in read_jsonl(tmp_path / "raw" / "transfer" / "MRPC.jsonl")]
    assert rows[0].text.startswith("Amrozi accused") and rows[0].text2.startswith("Referring to him")


def test_download_fails_before_building_when_a_transfer_task_is_missing(tmp_path, transfer_dir):
    import shutil

    from mmcse.config import DataConfig
    from mmcse.data.prepare import prepare_data

    shutil.copytree(transfer_dir / "downstream" / "STS" / "STSBenchmark",
                    tmp_path / "se" / "downstream" / "STS" / "STSBenchmark")
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "keep.txt").write_text("previous data")
    cfg = DataConfig(source="senteval", senteval_dir=str(tmp_path / "se"), transfer_tasks=["SUBJ"])
    with pytest.raises(FileNotFoundError, match=r"data.transfer_tasks names SUBJ.*present: none"):
        prepare_data(cfg, 3, tmp_path / "raw")
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".raw")] == []  # nothing half-built
    assert (tmp_path / "raw" / "keep.txt").read_text() == "previous data"
