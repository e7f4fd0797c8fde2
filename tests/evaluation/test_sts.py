"""STS numbers against an independent direct computation (scipy) on SentEval data."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from scipy.stats import spearmanr

from mmcse.data.senteval import SentencePair, read_sts_tasks
from mmcse.evaluation.sts import TextEncoder, collapsed_message, evaluate_sts, spearman_x100
from tests.conftest import TINY_MODEL


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A random-weight BERT saved as a plain HF folder (what `mmcse eval` is given)."""
    from mmcse.config import ModelConfig
    from mmcse.models.student import load_backbone, load_tokenizer

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("tiny-model")
    cfg = ModelConfig(**{k: v for k, v in TINY_MODEL.items() if k != "proj_dim"})
    load_backbone(cfg).save_pretrained(folder)
    load_tokenizer(cfg.name_or_path).save_pretrained(folder)
    return folder


def test_spearman_x100_is_scipy_times_100():
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=50), rng.normal(size=50)
    assert spearman_x100(a, b) == pytest.approx(spearmanr(a, b).statistic * 100, abs=1e-12)


def test_all_setting_pools_subsets_and_avg_is_mean_of_tasks():
    vec = {"a": [1, 0], "b": [0, 1], "c": [1, 1], "d": [1, -1]}

    def encode(sentences):
        return np.array([vec[s] for s in sentences], dtype=float)

    pairs = [SentencePair("T", "x", "a", "c", 4.0), SentencePair("T", "x", "a", "b", 0.0),
             SentencePair("T", "y", "c", "d", 1.0), SentencePair("T", "y", "a", "a", 5.0)]
    other = [SentencePair("U", "u", "a", "d", 1.0), SentencePair("U", "u", "b", "c", 3.0),
             SentencePair("U", "u", "c", "c", 5.0)]
    result = evaluate_sts(encode, {"T": pairs, "U": other})
    cos = lambda s1, s2: np.dot(vec[s1], vec[s2]) / np.linalg.norm(vec[s1]) / np.linalg.norm(vec[s2])  # noqa: E731
    pooled = spearmanr([cos(p.s1, p.s2) for p in pairs], [p.score for p in pairs]).statistic * 100
    assert result.scores["T"] == pytest.approx(pooled, abs=1e-9)
    assert result.scores["avg"] == pytest.approx((result.scores["T"] + result.scores["U"]) / 2, abs=1e-12)


def test_each_distinct_sentence_is_encoded_once_in_length_order():
    seen = []

    def encode(sentences):
        seen.append(list(sentences))
        return np.ones((len(sentences), 2)) + np.arange(len(sentences))[:, None] * [1, -1]

    pairs = [SentencePair("T", "x", "aa", "b", 1.0), SentencePair("T", "x", "b", "cccc", 2.0),
             SentencePair("T", "x", "aa", "cccc", 3.0)]
    evaluate_sts(encode, {"T": pairs}, batch_size=2)
    flat = [s for batch in seen for s in batch]
    assert sorted(flat) == ["aa", "b", "cccc"] and flat == sorted(flat, key=len)


def _word_vector_encoder(dim: int = 32):
    """Sum of per-word random vectors: batching cannot change a sentence's embedding."""
    cache: dict[str, np.ndarray] = {}

    def vector(word: str) -> np.ndarray:
        if word not in cache:
            seed = int.from_bytes(word.encode()[:8].ljust(8, b"\0"), "little") ^ len(word)
            cache[word] = np.random.default_rng(seed).normal(size=dim)
        return cache[word]

    def encode(sentences):
        return np.stack([sum((vector(w) for w in s.split()), np.zeros(dim)) for s in sentences])

    return encode


@pytest.mark.slow  # end to end: the full suite runs it (fast tier under 5 min)
def test_matches_direct_computation_on_senteval(senteval_dir):
    tasks = read_sts_tasks(senteval_dir)
    encode = _word_vector_encoder()
    result = evaluate_sts(encode, tasks, batch_size=256)
    assert set(result.scores) == {*tasks, "avg"}
    direct = {}
    for task, pairs in tasks.items():  # every pair on its own, subsets pooled ("all")
        cos = []
        for p in pairs:
            a, b = encode([p.s1])[0], encode([p.s2])[0]
            cos.append(np.dot(a, b) / (np.sqrt(np.dot(a, a)) * np.sqrt(np.dot(b, b))))
        direct[task] = spearmanr(cos, [p.score for p in pairs]).statistic * 100
        assert result.scores[task] == pytest.approx(direct[task], abs=1e-6), task
    assert result.scores["avg"] == pytest.approx(np.mean(list(direct.values())), abs=1e-6)


def test_text_encoder_poolers_on_a_real_model_folder(tiny_model_dir):
    from transformers import AutoModel, AutoTokenizer

    sentences = ["a small red circle", "two people are walking"]
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModel.from_pretrained(tiny_model_dir).eval()
    with torch.no_grad():
        b = tok(sentences, padding=True, return_tensors="pt")
        hs = model(**b, output_hidden_states=True).hidden_states
    m = b["attention_mask"].unsqueeze(-1).float()
    mean = lambda h: ((h * m).sum(1) / m.sum(1)).numpy()  # noqa: E731
    expected = {
        "cls_before_pooler": hs[-1][:, 0].numpy(),
        "avg": mean(hs[-1]),
        "avg_first_last": mean((hs[1] + hs[-1]) / 2),
        "avg_top2": mean((hs[-2] + hs[-1]) / 2),
        "avg_embeddings_last": mean((hs[0] + hs[-1]) / 2),  # SimCSE's first-last rows as its paper printed them
    }
    for pooler, want in expected.items():
        got = TextEncoder(str(tiny_model_dir), pooler)(sentences)
        np.testing.assert_allclose(got, want, atol=1e-5, err_msg=pooler)


@pytest.mark.slow  # end to end: real stages, models or subprocesses (the full suite runs it)
def test_cli_prints_senteval_task_names(tmp_path, senteval_dir, tiny_model_dir):
    import shutil

    sts = tmp_path / "downstream" / "STS"
    for task in ("STS15-en-test", "STS16-en-test"):
        shutil.copytree(senteval_dir / "downstream" / "STS" / task, sts / task)
    out = subprocess.run(
        [sys.executable, "-m", "mmcse.cli", "eval", "--model", str(tiny_model_dir),
         "--senteval-dir", str(tmp_path), "--pooler", "avg"],
        capture_output=True, text=True, check=True,
    )
    scores = json.loads(out.stdout)
    assert set(scores) == {"STS15", "STS16", "avg"}  # missing tasks omitted, not zero
    assert scores["avg"] == pytest.approx((scores["STS15"] + scores["STS16"]) / 2, abs=1e-4)


def test_a_constant_prediction_is_a_collapsed_model_not_a_scipy_warning(caplog):
    """Issue 39.4: every sentence the same vector: each task's Spearman is NaN, the tasks are listed and
    said once in the evaluation's own words; scipy's ConstantInputWarning never fires."""
    import logging
    import math
    import warnings

    pairs = {task: [SentencePair(task, "test", f"{task} a{i}", f"{task} b{i}", float(i)) for i in range(5)]
             for task in ("STS12", "STSB")}
    with warnings.catch_warnings(), caplog.at_level(logging.WARNING, logger="mmcse.evaluation.sts"):
        warnings.simplefilter("error")
        result = evaluate_sts(lambda batch: np.ones((len(batch), 3)), pairs)
    assert result.collapsed == ["STS12", "STSB"] and all(math.isnan(v) for v in result.scores.values())
    assert [r.getMessage() for r in caplog.records] == [collapsed_message(["STS12", "STSB"])]
    assert "the model returns the same vector for every sentence" in collapsed_message(["STSB"])
    # a model that is not collapsed: nothing said, and Spearman as scipy computes it
    rng = np.random.default_rng(0)
    predicted, gold = rng.normal(size=9), rng.normal(size=9)
    assert spearman_x100(predicted, gold) == pytest.approx(spearmanr(predicted, gold).statistic * 100)
    assert math.isnan(spearman_x100([0.3] * 9, gold))
    caplog.clear()
    vectors = {s: rng.normal(size=3) for ps in pairs.values() for p in ps for s in (p.s1, p.s2)}
    assert evaluate_sts(lambda batch: np.stack([vectors[s] for s in batch]), pairs).collapsed == []
    assert not caplog.records


def test_one_task_is_reported_once_as_the_average():
    """One name per number: a single task's average is that task's score, so only ``avg`` holds it;
    ``task_scores`` still names the task (its scatter panel)."""
    rng = np.random.default_rng(0)
    vectors = {f"s{i}": rng.normal(size=4) for i in range(12)}
    pairs = [SentencePair("STSB", "test", f"s{i}", f"s{i + 6}", float(i % 5)) for i in range(6)]
    one = evaluate_sts(lambda batch: np.stack([vectors[s] for s in batch]), {"STSB": pairs})
    assert set(one.scores) == {"avg"} and set(one.task_scores) == {"STSB"}
    assert one.scores["avg"] == one.task_scores["STSB"] != 0
    two = evaluate_sts(lambda batch: np.stack([vectors[s] for s in batch]), {"A": pairs[:3], "B": pairs[3:]})
    assert set(two.scores) == {"A", "B", "avg"} and two.scores["avg"] == pytest.approx(
        (two.scores["A"] + two.scores["B"]) / 2)


def test_cli_offline_model_id_fails_fast(tmp_path, monkeypatch, senteval_dir):
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-m", "mmcse.cli", "eval", "--model", "princeton-nlp/unsup-simcse-bert-base-uncased",
         "--senteval-dir", str(senteval_dir), "--pooler", "cls"],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert out.returncode == 2
    assert "princeton-nlp/unsup-simcse-bert-base-uncased" in out.stderr and "HF_HUB_OFFLINE" in out.stderr


@pytest.fixture
def damaged_student_dir(tmp_path):
    """An mmcse student checkpoint (HF folder + heads) whose model.safetensors lost its tail."""
    from mmcse.config import ModelConfig
    from mmcse.models.student import Student, load_backbone, load_tokenizer, save_student

    cfg = ModelConfig(**{k: v for k, v in TINY_MODEL.items() if k != "proj_dim"})
    folder = tmp_path / "best"
    save_student(Student(load_backbone(cfg), 8, 4), load_tokenizer(cfg.name_or_path), folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    return folder


def test_damaged_checkpoint_is_one_line_naming_the_file(damaged_student_dir):
    from mmcse.errors import CorruptArtifact

    with pytest.raises(CorruptArtifact) as err:
        TextEncoder(str(damaged_student_dir), "cls_before_pooler")
    text = str(err.value)
    assert text.startswith(f"{damaged_student_dir / 'model.safetensors'}: truncated: ")
    assert text.endswith("; retrain it (dvc repro train)") and "\n" not in text


@pytest.mark.slow  # a CLI process start (~6 s); the test above checks the same message in-process
def test_cli_damaged_checkpoint_exits_2_with_one_line(tmp_path, damaged_student_dir):
    out = subprocess.run(
        [sys.executable, "-m", "mmcse.cli", "eval", "--model", str(damaged_student_dir), "--senteval-dir",
         str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith(
        f"error: {damaged_student_dir / 'model.safetensors'}: truncated: ")
    assert out.stderr.strip().endswith("; retrain it (dvc repro train)")


def test_cli_eval_names_a_missing_argument_before_loading_any_framework(tmp_path):
    """Issue 33.14: `mmcse eval` without --senteval-dir took ~22 s on a cold machine to say so."""
    import subprocess
    import sys

    heavy = "('torch', 'transformers', 'scipy', 'sklearn')"
    probe = ("import sys\nfrom mmcse.cli import main\ntry:\n    main(['eval', '--model', 'x'])\n"
             f"except SystemExit as e:\n    print(e.code, sorted(m for m in {heavy} if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "2 []", done.stdout + done.stderr
    assert done.stderr.strip() == ("error: --senteval-dir is required unless --mteb names tasks or --retrieval "
                                   "is given")
