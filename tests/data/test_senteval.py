import numpy as np
import pytest

from mmcse.data.senteval import (
    TRANSFER_TASKS,
    available_sts_tasks,
    available_transfer_tasks,
    read_sts_task,
    read_sts_tasks,
    read_transfer_task,
)

EXPECTED = {
    "STS12": 3108, "STS13": 1500, "STS14": 3750, "STS15": 3000, "STS16": 1186,
    "STSBenchmark": 1379, "SICKRelatedness": 4927,
}


def test_pair_counts_match_senteval(senteval_dir):
    tasks = read_sts_tasks(senteval_dir)
    assert {t: len(p) for t, p in tasks.items()} == EXPECTED
    assert len(read_sts_task(senteval_dir, "STSBenchmark", "dev")) == 1500


def test_sentences_are_whitespace_normalised_and_scores_in_range(senteval_dir):
    for task, pairs in read_sts_tasks(senteval_dir).items():
        top = 5.0
        assert all(0.0 <= p.score <= top for p in pairs), task
        assert all(p.s1 == " ".join(p.s1.split()) and p.s1 for p in pairs), task


def test_missing_tasks_are_omitted(tmp_path, senteval_dir):
    import shutil

    target = tmp_path / "downstream" / "STS"
    shutil.copytree(senteval_dir / "downstream" / "STS" / "STS13-en-test", target / "STS13-en-test")
    assert available_sts_tasks(tmp_path) == ["STS13"]
    assert list(read_sts_tasks(tmp_path)) == ["STS13"]


def test_empty_folder_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no SentEval STS data"):
        read_sts_tasks(tmp_path)
    with pytest.raises(FileNotFoundError, match="not found"):
        read_sts_tasks(tmp_path / "absent")


def test_mismatched_gold_file_is_reported(tmp_path):
    folder = tmp_path / "downstream" / "STS" / "STS12-en-test"
    folder.mkdir(parents=True)
    (folder / "STS.input.x.txt").write_text("a\tb\nc\td\n")
    (folder / "STS.gs.x.txt").write_text("1.0\n")
    with pytest.raises(ValueError, match="2 pairs but STS.gs.x.txt has 1"):
        read_sts_task(tmp_path, "STS12")


def test_readers_give_senteval_counts_labels_and_text(transfer_dir):
    # SentEval's logged sizes: MR 10662, CR 3775, SUBJ 10000, MPQA 10606, SST2 67349/872/1821,
    # TREC 5452/500, MRPC 4076/1725
    want = {
        "MR": {"all": 10662}, "CR": {"all": 3775}, "SUBJ": {"all": 10000}, "MPQA": {"all": 10606},
        "SST2": {"train": 67349, "dev": 872, "test": 1821}, "TREC": {"train": 5452, "test": 500},
        "MRPC": {"train": 4076, "test": 1725},
    }
    data = {task: read_transfer_task(transfer_dir, task) for task in TRANSFER_TASKS}
    for task, splits in want.items():
        got = {}
        for e in data[task]:
            got[e.split] = got.get(e.split, 0) + 1
        assert got == splits, task
    labels = {task: np.bincount([e.label for e in rows]).tolist() for task, rows in data.items()}
    assert labels["MR"] == [5331, 5331] and labels["SUBJ"] == [5000, 5000]
    assert labels["CR"] == [1368, 2407] and labels["MPQA"] == [7294, 3312]
    assert len(labels["TREC"]) == 6 and labels["TREC"][0] == 95  # ABBR, the rarest class
    first_mr = data["MR"][0]
    assert first_mr.label == 1 and first_mr.text.startswith("the rock is destined to be the 21st century 's")
    first_trec = data["TREC"][0]  # "DESC:manner How did serfdom develop in and then leave Russia ?"
    assert first_trec.label == 1 and first_trec.text == "How did serfdom develop in and then leave Russia ?"
    first_mrpc = data["MRPC"][0]
    assert first_mrpc.label == 1 and first_mrpc.text.startswith("Amrozi accused his brother")
    assert first_mrpc.text2.startswith("Referring to him as only")
    assert all(e.text2 is None for e in data["SST2"])


def test_malformed_files_fail_naming_file_and_line(tmp_path):
    sst = tmp_path / "downstream" / "SST" / "binary"
    sst.mkdir(parents=True)
    (sst / "sentiment-train").write_text("good film\t1\nbad film\t7\n")
    (sst / "sentiment-dev").write_text("ok\t1\n")
    (sst / "sentiment-test").write_text("ok\t0\n")
    with pytest.raises(ValueError, match=r"sentiment-train:2"):
        read_transfer_task(tmp_path, "SST2")
    trec = tmp_path / "downstream" / "TREC"
    trec.mkdir()
    (trec / "train_5500.label").write_text("HUM:ind Who is he ?\nXYZ:foo What ?\n")
    (trec / "TREC_10.label").write_text("NUM:date When ?\n")
    with pytest.raises(ValueError, match=r"train_5500.label:2.*ABBR"):
        read_transfer_task(tmp_path, "TREC")
    with pytest.raises(FileNotFoundError, match="rt-polarity.pos"):
        read_transfer_task(tmp_path, "MR")
    assert available_transfer_tasks(tmp_path) == ["SST2", "TREC"]
