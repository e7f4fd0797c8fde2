"""A model folder exported for sentence-transformers encodes as `mmcse eval` (TextEncoder) does."""

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from mmcse.data.demo import sts_pair
from mmcse.data.senteval import SentencePair
from mmcse.evaluation.sts import TextEncoder, evaluate_sts, group_by_task
from mmcse.hub import resolve_model
from mmcse.io import read_jsonl
from mmcse.models.export import EVAL_MAX_SEQ_LEN, export_sentence_transformers
from mmcse.training.engine import Hooks
from tests.conftest import TINY_MODEL

# longer than 8 tokens: the truncation test cuts it
LONG = "a small red circle above a large green triangle and a blue square to the left of a yellow star " * 3


def _sts_tasks(n: int = 40) -> dict[str, list[SentencePair]]:
    """Generated STS pairs (the demo data's generator) in two tasks, plus a long sentence."""
    rng = random.Random(7)
    pairs = [SentencePair("DemoA" if i % 2 else "DemoB", "all", *sts_pair(rng, 1, 4)) for i in range(n)]
    pairs.append(SentencePair("DemoA", "all", LONG, pairs[0].s1, 1.0))
    return group_by_task(pairs)


def _sentences(tasks) -> list[str]:
    return sorted({s for pairs in tasks.values() for p in pairs for s in (p.s1, p.s2)})


def _st_encoder(folder):
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(folder), device="cpu")

    def encode(sentences: list[str]) -> np.ndarray:
        return model.encode(sentences, convert_to_numpy=True, batch_size=16)

    return encode


@pytest.fixture(scope="module")
def minilm(tmp_path_factory):
    """A private copy of the packaged MiniLM (the export writes into its folder)."""
    folder = tmp_path_factory.mktemp("minilm") / "model"
    shutil.copytree(resolve_model("packaged:all-MiniLM-L6-v2"), folder)
    return folder


# ~3-8 s each: the fast tier keeps the default pooler and a layer-mixing one (test_layer_poolers_really_read_the_
# hidden_states keeps every pooler's reading in the fast tier); the full suite exports all five
@pytest.mark.parametrize("pooler", ["cls_before_pooler", pytest.param("avg", marks=pytest.mark.slow),
                                    pytest.param("avg_first_last", marks=pytest.mark.slow),
                                    pytest.param("avg_top2", marks=pytest.mark.slow),
                                    pytest.param("avg_embeddings_last", marks=pytest.mark.slow),
                                    pytest.param("cls", marks=pytest.mark.slow)])
def test_exported_minilm_encodes_as_text_encoder(minilm, pooler):
    tasks = _sts_tasks()
    export_sentence_transformers(minilm, pooler)
    modules = json.loads((minilm / "modules.json").read_text())
    # the packaged model's own Normalize (and any earlier export's modules) are gone
    assert [m["type"].rsplit(".", 1)[1] for m in modules][0] == "Transformer"
    assert not (minilm / "2_Normalize").exists()
    st, ref = _st_encoder(minilm), TextEncoder(str(minilm), pooler)
    sentences = _sentences(tasks)
    got, want = st(sentences), ref(sentences)
    assert got.shape == want.shape == (len(sentences), 384)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    a, b = evaluate_sts(st, tasks).scores, evaluate_sts(ref, tasks).scores
    assert a.keys() == b.keys() == {"DemoA", "DemoB", "avg"}
    for key in a:
        assert a[key] == pytest.approx(b[key], abs=1e-4), key


def test_layer_poolers_really_read_the_hidden_states(minilm):
    """avg_first_last / avg_top2 differ from avg (a missing hidden-state path would fall back to it)."""
    sentences = _sentences(_sts_tasks(8))
    vectors = {}
    for pooler in ("avg", "avg_first_last", "avg_top2", "avg_embeddings_last", "cls", "cls_before_pooler"):
        export_sentence_transformers(minilm, pooler)
        vectors[pooler] = _st_encoder(minilm)(sentences)
    for pooler in ("avg_first_last", "avg_top2", "avg_embeddings_last"):
        assert np.abs(vectors[pooler] - vectors["avg"]).max() > 1e-2, pooler
    assert np.abs(vectors["cls"] - vectors["cls_before_pooler"]).max() > 1e-2
    # avg_top2 by hand: masked mean of (hidden_states[-2] + hidden_states[-1]) / 2
    from transformers import AutoModel, AutoTokenizer

    tok, model = AutoTokenizer.from_pretrained(minilm), AutoModel.from_pretrained(minilm).eval()
    batch = tok(sentences[:3], padding=True, truncation=True, max_length=512, return_tensors="pt")
    with torch.no_grad():
        hs = model(**batch, output_hidden_states=True).hidden_states
    mask = batch["attention_mask"].unsqueeze(-1).float()
    direct = (((hs[-2] + hs[-1]) / 2) * mask).sum(1) / mask.sum(1)
    np.testing.assert_allclose(vectors["avg_top2"][:3], direct.numpy(), rtol=0, atol=1e-5)
    embeddings_last = (((hs[0] + hs[-1]) / 2) * mask).sum(1) / mask.sum(1)  # SimCSE's evaluation.py of 2021
    np.testing.assert_allclose(vectors["avg_embeddings_last"][:3], embeddings_last.numpy(), rtol=0, atol=1e-5)


def test_exported_length_truncates_as_text_encoder(minilm):
    export_sentence_transformers(minilm, "avg", max_seq_len=8)
    assert json.loads((minilm / "sentence_bert_config.json").read_text())["max_seq_length"] == 8
    short = _st_encoder(minilm)([LONG, "a cat"])
    np.testing.assert_allclose(short, TextEncoder(str(minilm), "avg", max_length=8)([LONG, "a cat"]), rtol=0,
                               atol=1e-5)
    export_sentence_transformers(minilm, "avg", max_seq_len=4096)  # capped by the tokenizer's 512, as TextEncoder
    assert json.loads((minilm / "sentence_bert_config.json").read_text())["max_seq_length"] == 512
    full = _st_encoder(minilm)([LONG, "a cat"])
    np.testing.assert_allclose(full, TextEncoder(str(minilm), "avg", max_length=4096)([LONG, "a cat"]), rtol=0,
                               atol=1e-5)
    assert np.abs(full[0] - short[0]).max() > 1e-3  # the cut really happened
    np.testing.assert_allclose(full[1], short[1], rtol=0, atol=1e-5)  # a short sentence is not cut


def test_export_length_default_is_text_encoders():
    import inspect

    assert inspect.signature(TextEncoder).parameters["max_length"].default == EVAL_MAX_SEQ_LEN


def test_trained_student_best_is_a_sentence_transformers_folder(project):
    from mmcse.cli import main
    from mmcse.config import with_overrides
    from mmcse.experiments.params import load_config
    from mmcse.integrity.files import check_model_folder
    from mmcse.models.student import load_student
    from mmcse.training.checkpoints import BEST_REQUIRED
    from mmcse.training.loop import train

    cfg = with_overrides(load_config("params.yaml"), {"evaluate.pooler": "cls", "train.max_steps": 4,
                                                      "train.eval_steps": 4})
    best = train(cfg, "data/raw", "data/teachers", project / "m", hooks=Hooks(progress=False)).best_dir
    tasks = group_by_task([SentencePair.from_row(r) for r in read_jsonl(project / "data/raw/sts/test.jsonl")])
    check_model_folder(best, "retrain", required=BEST_REQUIRED)  # the extra JSON files parse
    load_student(best)
    bert_config = json.loads((best / "sentence_bert_config.json").read_text())
    assert bert_config["max_seq_length"] == EVAL_MAX_SEQ_LEN
    assert [m["path"] for m in json.loads((best / "modules.json").read_text())] == ["", "1_Pooling", "2_Dense"]

    vectors = {}
    for pooler in ("cls", "cls_before_pooler"):
        if pooler == "cls_before_pooler":
            main(["export", "--model", str(best), "--pooler", pooler])
            assert not (best / "2_Dense").exists()
        st, ref = _st_encoder(best), TextEncoder(str(best), pooler)
        a, b = evaluate_sts(st, tasks, keep_vectors=True), evaluate_sts(ref, tasks, keep_vectors=True)
        assert a.scores.keys() == b.scores.keys() and "avg" in a.scores
        for key in a.scores:
            assert a.scores[key] == pytest.approx(b.scores[key], abs=1e-4), (pooler, key)
        for s, v in b.vectors.items():
            np.testing.assert_allclose(a.vectors[s], v, rtol=0, atol=1e-5)
        vectors[pooler] = np.stack([a.vectors[s] for s in sorted(a.vectors)])
    # cls is the student's MLP over [CLS]: tanh(W [CLS] + b) of the cls_before_pooler vectors
    student, _ = load_student(best)
    with torch.no_grad():
        mlp = student.mlp(torch.from_numpy(vectors["cls_before_pooler"]).float()).double().numpy()
    np.testing.assert_allclose(vectors["cls"], mlp, rtol=0, atol=1e-5)


@pytest.fixture
def plain_folder(tmp_path):
    """A random-weight BERT saved without an HF pooler and without heads."""
    from mmcse.config import ModelConfig
    from mmcse.models.student import load_backbone, load_tokenizer

    torch.manual_seed(0)
    folder = tmp_path / "plain"
    cfg = ModelConfig(**{k: v for k, v in TINY_MODEL.items() if k != "proj_dim"})
    load_backbone(cfg).save_pretrained(folder)
    load_tokenizer(cfg.name_or_path).save_pretrained(folder)
    return folder


def test_bad_exports_are_refused_before_anything_is_written(plain_folder, tmp_path, capsys):
    from mmcse.cli import main

    with pytest.raises(ValueError, match="unknown pooler 'mean'"):
        export_sentence_transformers(plain_folder, "mean")
    with pytest.raises(ValueError, match="pooler 'cls' needs the student's MLP"):
        export_sentence_transformers(plain_folder, "cls")
    with pytest.raises(ValueError, match="max_seq_len"):
        export_sentence_transformers(plain_folder, "avg", max_seq_len=0)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        export_sentence_transformers(tmp_path, "avg")
    assert not (plain_folder / "modules.json").exists() and not (plain_folder / "1_Pooling").exists()
    for argv, message in ((["--model", "packaged:all-MiniLM-L6-v2", "--pooler", "avg"], "copy the packaged model"),
                          (["--model", str(tmp_path / "none"), "--pooler", "avg"], "no such local model folder")):
        with pytest.raises(SystemExit) as exit_:
            main(["export", *argv])
        assert exit_.value.code == 2 and message in capsys.readouterr().err
    # the same folder with a pooler that needs no head exports and encodes
    export_sentence_transformers(plain_folder, "avg_first_last")
    got = _st_encoder(plain_folder)(["a red circle", "two blue squares"])
    np.testing.assert_allclose(got, TextEncoder(str(plain_folder), "avg_first_last")(["a red circle",
                                                                                     "two blue squares"]),
                               rtol=0, atol=1e-5)


def test_the_logged_mlflow_model_loads_back_and_encodes_as_the_evaluation(minilm, tmp_path, monkeypatch):
    """The best checkpoint as an MLflow model (sentence_transformers flavour): listed among the run's
    logged models, and MLflow's own loaders give the vectors TextEncoder computes with its pooler."""
    import mlflow

    from mmcse.models.export import MLFLOW_MODEL_NAME, log_mlflow_model

    monkeypatch.chdir(tmp_path)
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    try:
        folder = export_sentence_transformers(minilm, "avg")
        sentences = ["A dog runs across the grass.", "Two children play football in a park."]
        with pytest.raises(FileNotFoundError, match="no modules.json"):
            log_mlflow_model(tmp_path, sentences)
        # a folder's model card (README.md, mmcse.models.card) travels with the MLflow model
        (folder / "README.md").write_text("---\nlibrary_name: sentence-transformers\n---\n\n# the card\n")
        with mlflow.start_run() as run:
            uri = log_mlflow_model(folder, sentences)
        logged = mlflow.search_logged_models(output_format="list")
        assert [(m.name, m.source_run_id) for m in logged] == [(MLFLOW_MODEL_NAME, run.info.run_id)]
        want = np.asarray(TextEncoder(str(folder), "avg")(sentences))
        got = mlflow.sentence_transformers.load_model(uri).encode(sentences)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
        pyfunc = np.asarray(mlflow.pyfunc.load_model(uri).predict(sentences))
        np.testing.assert_allclose(pyfunc, want, rtol=0, atol=1e-5)
        assert mlflow.models.get_model_info(uri).metadata["mmcse_pooler"] == "avg"
        cards = list(Path(mlflow.artifacts.download_artifacts(uri, dst_path=str(tmp_path / "dl"))).rglob("README.md"))
        assert [c.read_text() for c in cards] == [(folder / "README.md").read_text()]
    finally:
        mlflow.set_tracking_uri(None)
