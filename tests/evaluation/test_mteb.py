"""MTEB through the mteb package: tiny tasks built here (no network) scored against a direct computation."""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
import textwrap

import mteb
import numpy as np
import pytest
from datasets import Dataset, DatasetDict
from mteb.abstasks.classification import AbsTaskClassification
from mteb.abstasks.retrieval import AbsTaskRetrieval
from mteb.abstasks.retrieval_dataset_loaders import RetrievalSplitData
from mteb.abstasks.sts import AbsTaskSTS
from mteb.abstasks.task_metadata import TaskMetadata
from scipy.stats import spearmanr
from sklearn.neighbors import KNeighborsClassifier

from mmcse.config import ConfigError, parse_config
from mmcse.evaluation.mteb import (
    PRIMARY_METRIC,
    MTEBTaskError,
    encoder_for_mteb,
    model_revision,
    mteb_scores,
    resolve_tasks,
    results_folder,
)
from mmcse.evaluation.sts import TextEncoder
from mmcse.integrity.files import seal_folder
from tests.conftest import REPO

MODEL = "packaged:all-MiniLM-L6-v2"
_META = dict(
    description="tiny local task (test)", reference="https://example.org",
    dataset={"path": "local/tiny", "revision": "0"},
    category="t2t", eval_splits=["test"], eval_langs=["eng-Latn"], date=("2024-01-01", "2024-01-01"), dialect=[],
    domains=[], task_subtypes=[], license="cc-by-4.0", annotations_creators="derived", modalities=["text"],
    sample_creation="found", bibtex_citation="",
)

STS_1 = ["a cat sits on the mat", "a man plays the guitar", "two dogs run in a park", "a woman is cooking pasta",
         "kids play soccer outside", "the sun sets over the hills", "a boy reads a book"]
STS_2 = ["a cat is lying on a mat", "a man is eating lunch", "dogs running on the grass", "someone cooks dinner",
         "a plane takes off", "sunset over the sea", "a child is reading"]
STS_GOLD = [5.0, 1.0, 4.0, 3.5, 0.0, 3.0, 4.5]


class TinySTS(AbsTaskSTS):
    metadata = TaskMetadata(type="STS", name="TinySTS", main_score="cosine_spearman", **_META)
    min_score, max_score = 0, 5

    def load_data(self, num_proc=None, **kwargs) -> None:
        self.dataset = DatasetDict({"test": Dataset.from_dict(
            {"sentence1": STS_1, "sentence2": STS_2, "score": STS_GOLD})})
        self.data_loaded = True


QUERIES = {"q1": "how do I cook rice", "q2": "best way to train a puppy", "q3": "fixing a flat bicycle tyre"}
DOCS = {"d1": "boil rice in salted water for twenty minutes", "d2": "dogs learn fast with treats and praise",
        "d3": "patch the inner tube and pump the tyre", "d4": "the stock market fell sharply today",
        "d5": "steamed rice goes well with curry", "d6": "a bicycle has two wheels"}
QRELS = {"q1": {"d1": 1, "d5": 1, "d4": 0}, "q2": {"d2": 1}, "q3": {"d3": 1, "d6": 0}}
TOP = {"q1": ["d1", "d4", "d5", "d6"], "q2": ["d2", "d4", "d6", "d1"], "q3": ["d6", "d3", "d4", "d5"]}


class TinyReranking(AbsTaskRetrieval):
    metadata = TaskMetadata(type="Reranking", name="TinyReranking", main_score="map_at_1000", **_META)

    def load_data(self, num_proc=None, **kwargs) -> None:
        split = RetrievalSplitData(
            queries=Dataset.from_list([{"id": k, "text": v} for k, v in QUERIES.items()]),
            corpus=Dataset.from_list([{"id": k, "text": v, "title": ""} for k, v in DOCS.items()]),
            relevant_docs=QRELS, top_ranked=TOP,
        )
        self.dataset = {"default": {"test": split}}
        self.data_loaded = True


TRAIN = [("I loved this film", 1), ("a wonderful, moving story", 1), ("great acting and a clever plot", 1),
         ("terrible, a waste of time", 0), ("boring and far too long", 0), ("the worst movie this year", 0)]
TEST = [("an excellent film", 1), ("I hated every minute", 0), ("clever and moving", 1), ("dull and too long", 0),
        ("a great story", 1)]


class TinyClassification(AbsTaskClassification):
    metadata = TaskMetadata(type="Classification", name="TinyClassification", main_score="accuracy", **_META)
    # one experiment on the whole training split, 1-NN by cosine: a probe a test can recompute exactly
    evaluator_model = KNeighborsClassifier(n_neighbors=1, metric="cosine")
    samples_per_label = 100
    n_experiments = 1

    def load_data(self, num_proc=None, **kwargs) -> None:
        rows = lambda data: {"text": [t for t, _ in data], "label": [y for _, y in data]}  # noqa: E731
        self.dataset = DatasetDict({"train": Dataset.from_dict(rows(TRAIN)), "test": Dataset.from_dict(rows(TEST))})
        self.data_loaded = True


@pytest.fixture(scope="module")
def encoder() -> TextEncoder:
    return TextEncoder(MODEL, "avg", "cpu", 64)


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _average_precision(ranked: list[str], relevant: set[str]) -> float:
    hits, precisions = 0, []
    for rank, doc in enumerate(ranked, start=1):
        if doc in relevant:
            hits += 1
            precisions.append(hits / rank)
    return sum(precisions) / len(relevant)


def test_scores_equal_a_direct_computation_on_the_same_embeddings(encoder, tmp_path):
    scores = mteb_scores(encoder, MODEL, [TinySTS(), TinyReranking(), TinyClassification()], batch_size=3,
                         output_dir=tmp_path)

    # STS: Spearman x 100 of the pairs' cosine against the gold scores
    cos = (_unit(encoder(STS_1)) * _unit(encoder(STS_2))).sum(axis=1)
    assert scores["mteb_TinySTS"] == pytest.approx(spearmanr(cos, STS_GOLD).statistic * 100, abs=1e-6)

    # reranking: each query's candidates ordered by cosine, mean average precision x 100 (MAP@1000)
    aps = []
    for qid, candidates in TOP.items():
        q = _unit(encoder([QUERIES[qid]]))[0]
        sims = _unit(encoder([DOCS[d] for d in candidates])) @ q
        ranked = [candidates[i] for i in np.argsort(-sims)]
        aps.append(_average_precision(ranked, {d for d, rel in QRELS[qid].items() if rel > 0}))
    assert scores["mteb_TinyReranking"] == pytest.approx(np.mean(aps) * 100, abs=1e-6)

    # classification: 1-NN by cosine over the training sentences, accuracy x 100
    train, test = _unit(encoder([t for t, _ in TRAIN])), _unit(encoder([t for t, _ in TEST]))
    predicted = np.array([TRAIN[i][1] for i in np.argmax(test @ train.T, axis=1)])
    accuracy = np.mean(predicted == np.array([y for _, y in TEST])) * 100
    assert scores["mteb_TinyClassification"] == pytest.approx(accuracy, abs=1e-9)

    tasks = ["mteb_TinySTS", "mteb_TinyReranking", "mteb_TinyClassification"]
    assert scores["mteb_type_STS"] == scores["mteb_TinySTS"]
    assert scores["mteb_type_Reranking"] == scores["mteb_TinyReranking"]
    assert scores[PRIMARY_METRIC] == pytest.approx(np.mean([scores[k] for k in tasks]), abs=1e-12)
    assert set(scores) == set(tasks) | {"mteb_type_STS", "mteb_type_Reranking", "mteb_type_Classification",
                                        PRIMARY_METRIC}
    # mteb's own result file, under the model's name
    (result,) = tmp_path.glob("results/*/*/TinySTS.json")
    main = json.loads(result.read_text())["scores"]["test"][0]["main_score"]
    assert main * 100 == pytest.approx(scores["mteb_TinySTS"], abs=1e-9)


def test_adapter_returns_mteb_order_and_encodes_each_distinct_text_once():
    vec = {"a": [1.0, 0.0], "bb": [0.0, 2.0], "ccc": [3.0, 3.0]}
    calls: list[list[str]] = []

    def encode(sentences: list[str]) -> np.ndarray:
        calls.append(list(sentences))
        return np.array([vec[s] for s in sentences])

    model = encoder_for_mteb(encode, "/work/models/student/best", batch_size=2)
    batches = [{"text": ["ccc", "a"]}, {"text": ["a", "bb", "ccc"]}]  # what mteb's DataLoader yields
    out = model.encode(batches, task_metadata=TinySTS.metadata, hf_split="test", hf_subset="default")
    np.testing.assert_array_equal(out, np.array([vec[t] for t in ["ccc", "a", "a", "bb", "ccc"]], dtype=np.float32))
    assert calls == [["a", "bb"], ["ccc"]]  # distinct texts, length-sorted batches of 2
    assert model.mteb_model_meta.name == "student/best"
    assert encoder_for_mteb(encode, MODEL, 2).mteb_model_meta.name == "mmcse/packaged-all-MiniLM-L6-v2"


@pytest.mark.slow  # end to end: the full suite runs it (fast tier under 5 min)
def test_names_resolve_like_the_english_benchmark_and_types_expand():
    tasks = resolve_tasks(["STS17", "Reranking", "SciDocsRR"])
    names = [t.metadata.name for t in tasks]
    assert names == ["STS17", "AskUbuntuDupQuestions", "MindSmallReranking", "SciDocsRR", "StackOverflowDupQuestions"]
    assert tasks[0].hf_subsets == ["en-en"]  # MTEB(eng, v1)'s subset, the one the paper's numbers use


@pytest.mark.slow  # end to end: the full suite runs it (fast tier under 5 min)
def test_unknown_task_names_list_close_valid_names():
    with pytest.raises(MTEBTaskError) as err:
        resolve_tasks(["STS12", "SciDocRR", "stsbenchmark"], where="--mteb")
    msg = str(err.value)
    assert msg.startswith("--mteb: unknown MTEB task(s)")
    assert "'SciDocRR' (close: SciDocsRR" in msg and "'stsbenchmark' (close: " in msg and "STSBenchmark" in msg
    assert "'STS12'" not in msg


@pytest.mark.parametrize(
    ("value", "key"),
    [("STS12", "evaluate.mteb"), ([1], "evaluate.mteb[0]"), ([" "], "evaluate.mteb[0]"),
     (["STS12", "STS12"], "evaluate.mteb")],
)
def test_config_mteb_must_be_a_list_of_distinct_names(value, key):
    with pytest.raises(ConfigError, match=re.escape(f"key '{key}'")):
        parse_config({"evaluate": {"mteb": value}})


def test_config_mteb_default_is_empty_and_a_list_parses():
    assert parse_config({}).evaluate.mteb == []
    assert parse_config({"evaluate": {"mteb": ["STS12", "Reranking"]}}).evaluate.mteb == ["STS12", "Reranking"]


def test_cli_eval_mteb_end_to_end(monkeypatch, capsys, tmp_path):
    from mmcse.cli import main

    registry = importlib.import_module("mteb.get_tasks")._TASKS_REGISTRY  # `mteb.get_tasks` is the function
    monkeypatch.setitem(registry, "TinySTS", TinySTS)
    main(["eval", "--model", MODEL, "--pooler", "avg", "--max-seq-len", "64", "--mteb", "TinySTS",
          "--mteb-output", str(tmp_path)])
    out = json.loads(capsys.readouterr().out)
    # mteb's layout, read by its own loader; a packaged model has no revision to name
    loaded = mteb.ResultCache(cache_path=tmp_path).load_results(tasks=[TinySTS()], include_remote=False)
    (model,) = loaded.model_results
    assert (model.model_name, model.model_revision) == ("mmcse/packaged-all-MiniLM-L6-v2", "no_revision_available")
    meta = json.loads((tmp_path / "results/mmcse__packaged-all-MiniLM-L6-v2/no_revision_available/"
                       "model_meta.json").read_text())
    assert (meta["embed_dim"], meta["max_tokens"], meta["n_parameters"]) == (384, 64, 22713216)
    enc = TextEncoder(MODEL, "avg", "cpu", 64)
    cos = (_unit(enc(STS_1)) * _unit(enc(STS_2))).sum(axis=1)
    assert out["mteb_TinySTS"] == pytest.approx(round(spearmanr(cos, STS_GOLD).statistic * 100, 4), abs=1e-9)
    assert out["mteb_avg"] == out["mteb_TinySTS"] and "avg" not in out  # no SentEval folder: MTEB only


@pytest.mark.parametrize(
    ("argv", "message"),
    [([], "--senteval-dir is required unless --mteb"),
     (["--mteb", "NoSuchTaskXYZ"], "unknown MTEB task(s) 'NoSuchTaskXYZ'"),  # before the (missing) model loads
     (["--transfer", "--mteb", "STS12"], "--transfer needs --senteval-dir"),
     (["--senteval-dir", "/nonexistent/senteval"], "/nonexistent/senteval: SentEval folder not found")],
)
def test_cli_eval_rejects_bad_arguments_in_one_line(argv, message, capsys):
    from mmcse.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["eval", "--model", "/nonexistent/model", *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "--model /nonexistent/model: model folder not found" in err  # all problems at once
    assert err.count("\n") == 1


@pytest.mark.slow  # end to end: real stages, models or subprocesses (the full suite runs it)
def test_offline_missing_dataset_fails_before_encoding_or_loading_the_model(tmp_path):
    """A fresh HF_HOME, offline: the library names each missing data set before encoding the tiny
    (present) task, and the CLI fails before loading the (nonexistent) model."""
    script = textwrap.dedent("""
        import sys
        from mmcse.evaluation.mteb import MTEBDataMissing, mteb_scores
        from tests.evaluation.test_mteb import TinySTS
        calls = []
        try:
            mteb_scores(lambda s: calls.append(s), "m", [TinySTS(), "STS12", "SciDocsRR"])
        except MTEBDataMissing as err:
            print("LIB:", err)
        print("CALLS:", len(calls))
        from mmcse.cli import main
        try:
            main(["eval", "--model", "/nonexistent/model", "--mteb", "STS12"])
        except SystemExit as exit_:
            print("EXIT:", exit_.code)
        from pathlib import Path
        from mmcse.config import parse_config
        from mmcse.pipeline.evaluate import run_evaluate
        from mmcse.pipeline.paths import Paths
        cfg = parse_config({"evaluate": {"mteb": ["STS12"]}})
        try:  # the evaluate stage (evaluate.mteb) stops before loading the model, too
            run_evaluate(cfg, Paths.of(cfg, sys.argv[1]), Path("/nonexistent/model"))
        except MTEBDataMissing as err:
            print("STAGE:", err)
    """)
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)])}
    env.pop("HF_HUB_CACHE", None), env.pop("HF_DATASETS_CACHE", None)
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path)], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    lib = next(line for line in proc.stdout.splitlines() if line.startswith("LIB:"))
    assert "STS12: mteb/sts12-sts (revision " in lib and "SciDocsRR: mteb/SciDocsRR (revision " in lib
    assert "TinySTS" not in lib and "offline mode is on" in lib
    assert f"hub {tmp_path / 'hf' / 'hub'}" in lib and f"datasets {tmp_path / 'hf' / 'datasets'}" in lib
    assert "mteb.get_task('STS12').load_data(); mteb.get_task('SciDocsRR').load_data()" in lib
    assert "CALLS: 0" in proc.stdout
    assert "EXIT: 2" in proc.stdout
    stage = next(line for line in proc.stdout.splitlines() if line.startswith("STAGE:"))
    assert "STS12: mteb/sts12-sts (revision " in stage
    err = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    # the cheap checks first (a local model path, task names): the data sets are not even loaded
    assert len(err) == 1 and "/nonexistent/model: model folder not found" in err[0] and "STS12" not in err[0]


def test_a_failed_evaluation_leaves_the_previous_results_folder_whole(tmp_path):
    folder = tmp_path / "mteb"
    with results_folder(folder, "mmcse/simcse", {"revision": "abc"}, ["TinySTS"]) as build:
        (build / "results").mkdir()
        (build / "results" / "first.json").write_text("{}")
    assert sorted(p.name for p in folder.iterdir()) == ["README.md", "results"]
    with pytest.raises(RuntimeError, match="encoder died"), \
            results_folder(folder, "mmcse/simcse", {}, ["TinySTS"]) as build:
        (build / "half.json").write_text("{")
        raise RuntimeError("encoder died")
    assert sorted(p.name for p in folder.iterdir()) == ["README.md", "results"]  # the old one, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mteb"]  # no build left beside it
    assert "results/mmcse__simcse/abc/" in (folder / "README.md").read_text()


def test_the_revision_is_the_seals_configuration_or_the_hub_snapshots_commit(tmp_path):
    trained = tmp_path / "best"
    trained.mkdir()
    (trained / "model.txt").write_text("w")
    seal_folder(trained, config_hash="0123456789abcdef" * 4)
    snapshot = tmp_path / "hub" / "snapshots" / "4f2a9c"
    snapshot.mkdir(parents=True)
    assert model_revision(trained) == "0123456789ab"
    assert model_revision(snapshot) == "4f2a9c"
    assert model_revision(tmp_path / "hub") is None and model_revision("packaged:all-MiniLM-L6-v2") is None


def test_a_build_a_killed_evaluation_left_is_removed_by_the_next_one(tmp_path):
    """Issue 53.9: kill -9 runs no `finally`, so the build beside metrics/mteb stays; the next
    evaluation removes it (and the dvc.yaml outputs persist, so the kill left the previous results)."""
    folder = tmp_path / "mteb"
    (tmp_path / ".mteb.k1ll3d").mkdir()
    (tmp_path / ".mteb.k1ll3d" / "half.json").write_text("{")
    with results_folder(folder, "mmcse/simcse", {"revision": "abc"}, ["TinySTS"]) as build:
        (build / "results").mkdir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mteb"]
