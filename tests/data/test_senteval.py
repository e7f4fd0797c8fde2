import pytest

from mmcse.data.senteval import available_sts_tasks, read_sts_task, read_sts_tasks

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
