"""The evaluator protocol: each evaluator registered once, built from `EvaluationInputs`, called on an
encoder, returning ``dict[str, float]`` with its primary metric (mmcse.evaluation.evaluators)."""

import dataclasses
import hashlib

import numpy as np
import pytest

from mmcse.data.senteval import SentencePair
from mmcse.evaluation import evaluators as ev
from mmcse.evaluation.evaluators import EvaluationInputs, build_evaluators, register, run_evaluators
from mmcse.evaluation.geometry import sts_dev_geometry
from mmcse.evaluation.sts import evaluate_sts


def encode(sentences: list[str]) -> np.ndarray:
    """A deterministic stand-in encoder: each sentence's vector from its SHA-256, plus a shared
    word-count direction so similar sentences agree a little."""
    rows = []
    for s in sentences:
        digest = np.frombuffer(hashlib.sha256(s.encode()).digest(), dtype=np.uint8).astype(np.float64)
        rows.append(np.concatenate([digest[:8] / 255.0, [len(s.split())]]))
    return np.stack(rows)


def pairs(task: str, n: int = 12) -> list[SentencePair]:
    rng = np.random.default_rng(len(task))
    words = ["a", "dog", "runs", "on", "the", "beach", "cat", "sleeps", "red", "car"]
    out = []
    for i in range(n):
        s1 = " ".join(rng.choice(words, size=2 + i % 5))
        s2 = " ".join(rng.choice(words, size=2 + (i * 3) % 5))
        out.append(SentencePair(task, "", s1, s2, float(i % 6)))
    return out


def test_every_evaluator_is_registered_once_and_declared():
    """Each built-in evaluator is registered once with the score keys it writes, and a configuration asks for all
    of them by default ("all": each runs where its inputs are)."""
    from mmcse.config import EvaluateConfig

    builtin = ["sts", "mteb", "geometry", "transfer", "retrieval"]
    assert [n for n in ev.registered() if n in builtin] == builtin  # in their order, a contributor's beside them
    assert EvaluateConfig().evaluators == "all" and ev.asked_evaluators("all") == tuple(ev.registered())
    assert ev.evaluator_writes("sts", "STSBenchmark") and ev.evaluator_writes("geometry", "dev_alignment")
    assert ev.any_evaluator_writes("coco_5k_t2i_R10") and not ev.any_evaluator_writes("coco_5k_t2i_R2")
    orders = [r.order for r in ev.REGISTRY.values()]
    assert len(set(orders)) == len(orders)
    name = next(iter(ev.REGISTRY))
    with pytest.raises(ValueError, match="registered twice"):
        register(name, order=999, scores=("x",))(lambda inputs: None)
    with pytest.raises(ValueError, match="declare the score keys it writes"):
        register("undeclared", order=998, scores=())(lambda inputs: None)
    assert build_evaluators(EvaluationInputs()) == []


def test_the_registry_imports_no_evaluation_code():
    """Importing the registry reads every declaration without torch, transformers or mteb (a fresh process)."""
    import subprocess
    import sys

    code = ("import sys, mmcse.evaluation.evaluators as e; assert e.registered(); "
            "print(sorted(m for m in ('torch', 'transformers', 'mteb', 'mmcse.evaluation.sts') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_evaluators_give_what_the_metric_functions_give_with_their_primary_metric():
    tasks = {"STS12": pairs("STS12"), "STS13": pairs("STS13")}
    dev = pairs("dev", 20)
    built = build_evaluators(EvaluationInputs(sts=tasks, dev=dev, batch_size=4, asked=("sts", "geometry")))
    assert [e.label for e in built] == ["STS test (2 tasks)", "dev geometry"]
    scores = run_evaluators(built, encode)
    geometry = sts_dev_geometry(encode, dev, batch_size=4)  # computed on the dev split: named dev_
    direct = evaluate_sts(encode, tasks, 4).scores | {f"dev_{k}": v for k, v in geometry.items()}
    assert scores == pytest.approx(direct)
    for evaluator in built:
        assert evaluator.primary_metric in scores
    assert built[0].result.task_scores.keys() == {"STS12", "STS13"}  # the scatter's predictions are kept


def test_a_key_written_twice_is_refused():
    class Twice:
        label, primary_metric = "twice", "avg"

        def __call__(self, encode):
            return {"avg": 1.0}

    twice = Twice()
    twice.name = "sts"
    with pytest.raises(ValueError, match="'twice' writes keys another already wrote: \\['avg'\\]"):
        run_evaluators([twice, twice], encode)


def test_a_new_evaluator_is_one_registration_and_runs_where_it_is_asked_for(monkeypatch, tmp_path):
    """A throwaway evaluator reading its own file from the data folder: declared, registered, built and run where
    a configuration names it, and held to the keys it declared."""
    from mmcse.evaluation.evaluators import base

    registry = dict(ev.REGISTRY)  # the registration is this test's only
    monkeypatch.setattr(ev, "REGISTRY", registry)
    monkeypatch.setattr(base, "REGISTRY", registry)
    (tmp_path / "words.txt").write_text("dog\ncat\nbeach\n")

    class Norms:
        label, primary_metric = "mean norm", "mean_norm"

        def __init__(self, words):
            self.words = words

        def __call__(self, encode):
            return {"mean_norm": float(np.linalg.norm(encode(self.words), axis=1).mean())}

    @register("norms", order=max(r.order for r in registry.values()) + 1, scores=("mean_norm",))
    def build(inputs):
        path = inputs.data_dir / "words.txt" if inputs.data_dir else None
        return Norms(path.read_text().split()) if path and path.is_file() else None

    assert build_evaluators(EvaluationInputs(data_dir=tmp_path, asked=("sts",))) == []  # not asked for: not built
    assert "mean norm" in [e.label for e in build_evaluators(EvaluationInputs(data_dir=tmp_path))]  # all
    asked = EvaluationInputs(data_dir=tmp_path, asked=("norms",))
    assert [e.label for e in build_evaluators(asked)] == ["mean norm"]
    scores = run_evaluators(build_evaluators(asked), encode)
    assert scores["mean_norm"] == pytest.approx(float(np.linalg.norm(encode(["dog", "cat", "beach"]), axis=1).mean()))
    # a key it did not declare is refused; a name nothing registers is named
    registry["norms"] = dataclasses.replace(registry["norms"], scores=("norm_mean",))
    with pytest.raises(ValueError, match="'norms' wrote \\['mean_norm'\\], which its registration"):
        run_evaluators(build_evaluators(asked), encode)
    with pytest.raises(ValueError, match="names \\['nothing'\\], which no module"):
        build_evaluators(EvaluationInputs(asked=("nothing",)))
