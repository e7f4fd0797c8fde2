"""CONTRIBUTING.md's recipes hold: in a copy of the tree, a new loss term with its own weight parameter and a new
evaluator, each added in exactly the files CONTRIBUTING names, train and evaluate the demo."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO

TERM_DECLARATION = '''"""A toy term: Wang & Isola's uniformity of the sentence embeddings (ICML 2020, Eq. 5)."""

from mmcse.config import RETRIEVAL_METHODS
from mmcse.methods.terms.base import LossTerm, register

register(LossTerm(
    name="uniformity", equation="Wang & Isola 2020, uniformity (Eq. 5)", order=95,
    weight="loss.uniformity_weight",
    active=lambda o: o.method not in RETRIEVAL_METHODS and o.loss.uniformity_weight > 0,
    inputs=lambda o: {"z"}, reads=lambda o: {"loss.uniformity_t"}, on_text=lambda o: True,
))
'''

TERM_FUNCTION = '''"""The toy uniformity term's function."""

import torch

from mmcse.methods.compute.base import computes


@computes("uniformity")
def uniformity(o, e, generator=None):
    """Wang & Isola 2020, Eq. 5: log E exp(-t ||f(x) - f(y)||²) over the batch's distinct pairs (normalised)."""
    z = torch.nn.functional.normalize(e.z1, dim=-1)  # (N, H)
    return torch.pdist(z).pow(2).mul(-o.loss.uniformity_t).exp().mean().log()
'''

TERM_TEST = '''import torch


def test_uniformity_is_log_mean_exp_of_pairwise_distances():
    from mmcse.methods.compute.toy import uniformity
    z = torch.randn(5, 3)
    n = torch.nn.functional.normalize(z, dim=-1)
    want = torch.log(torch.stack([torch.exp(-2 * (n[i] - n[j]).pow(2).sum())
                                  for i in range(5) for j in range(i + 1, 5)]).mean())
    class E: z1 = z
    class O: loss = type("L", (), {"uniformity_t": 2.0})
    torch.testing.assert_close(uniformity(O, E), want)
'''

EVALUATOR = '''"""A toy evaluator: the mean norm of the test sentences' embeddings."""

from dataclasses import dataclass

import numpy as np

from mmcse.evaluation.evaluators.base import EvaluationInputs, register


@dataclass
class NormEvaluator:
    sentences: list
    label: str = "mean norm"
    primary_metric: str = "mean_norm"

    def __call__(self, encode):
        return {"mean_norm": float(np.linalg.norm(encode(self.sentences), axis=1).mean())}


@register("norms", order=60)
def build(inputs: EvaluationInputs):
    sentences = [p.s1 for pairs in inputs.sts.values() for p in pairs][:32]
    return NormEvaluator(sentences) if sentences else None
'''


def _insert_after(path: Path, anchor: str, text: str) -> None:
    source = path.read_text()
    assert anchor in source, f"{path}: CONTRIBUTING's anchor {anchor!r} is gone"
    path.write_text(source.replace(anchor, anchor + text, 1))


def _contribute(tree: Path) -> set[str]:
    """CONTRIBUTING's two recipes applied to ``tree``; returns the files they touched."""
    src = tree / "src" / "mmcse"
    # a loss term: its declaration, its function, its parameters (a new one in config/training.py, as CONTRIBUTING
    # says for a parameter the loss section lacks), params.yaml, its test, its docs row
    (src / "methods/terms/toy.py").write_text(TERM_DECLARATION)
    (src / "methods/compute/toy.py").write_text(TERM_FUNCTION)
    _insert_after(src / "config/training.py", '    """its weight: λ (MCSE, KDMCSE) / α (MCSEO); papers: 0.01"""\n',
                  "    uniformity_weight: NonNegative = 0.1\n"
                  '    """the toy uniformity term\'s weight (0: off)"""\n'
                  "    uniformity_t: Positive = 2.0\n"
                  '    """its t"""\n')
    (tree / "tests/methods/test_toy.py").write_text(TERM_TEST)
    _insert_after(tree / "docs/methods.md", "\n", "\n| uniformity | a toy term (Wang & Isola) |\n")
    # an evaluator: its module, its declared scores, where a configuration asks for it, its test, its docs
    (src / "evaluation/evaluators/toy.py").write_text(EVALUATOR)
    _insert_after(src / "evaluation/names.py", 'EVALUATOR_SCORES: dict[str, tuple[str, ...]] = {\n',
                  '    "norms": ("mean_norm",),\n')
    (tree / "tests/evaluation/test_toy.py").write_text("def test_toy():\n    pass\n")
    _insert_after(tree / "docs/evaluation.md", "\n", "\n`norms`: the mean norm of test sentences.\n")
    params = tree / "params.yaml"
    raw = yaml.safe_load(params.read_text())
    raw["loss"]["uniformity_weight"] = 0.1
    raw["evaluate"]["evaluators"].append("norms")
    params.write_text(yaml.safe_dump(raw, sort_keys=False))
    return {"src/mmcse/methods/terms/toy.py", "src/mmcse/methods/compute/toy.py", "src/mmcse/config/training.py",
            "params.yaml", "tests/methods/test_toy.py", "docs/methods.md", "src/mmcse/evaluation/evaluators/toy.py",
            "src/mmcse/evaluation/names.py", "tests/evaluation/test_toy.py", "docs/evaluation.md"}


def _named_in_contributing(path: str) -> bool:
    text = (REPO / "CONTRIBUTING.md").read_text()
    generic = re.sub(r"toy", "<paper>", path) if "methods" in path else re.sub(r"toy", "<name>", path)
    return path in text or generic in text


@pytest.mark.slow  # a copy of the tree, then the train and evaluate stages in their own processes: ~60 s
def test_a_term_and_an_evaluator_added_as_contributing_says_train_and_evaluate_the_demo(project, tmp_path):
    tree = tmp_path / "tree"
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    for name in files:
        if (REPO / name).is_file():
            (tree / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, tree / name)
    touched = _contribute(tree)
    unnamed = sorted(p for p in touched if not _named_in_contributing(p))
    assert not unnamed, f"files CONTRIBUTING.md does not name: {unnamed}"
    # the demo project, trained and evaluated by the copy's code with the copy's params
    raw = yaml.safe_load((project / "params.yaml").read_text())
    contributed = yaml.safe_load((tree / "params.yaml").read_text())
    raw["loss"]["uniformity_weight"] = contributed["loss"]["uniformity_weight"]
    raw["evaluate"]["evaluators"] = contributed["evaluate"]["evaluators"]
    (project / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    for stage in ("check_params", "train", "evaluate"):
        done = subprocess.run([sys.executable, str(tree / "stages" / f"{stage}.py")], cwd=project, env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{stage}: {done.stderr[-3000:]}"
    scores = json.loads((project / "metrics/eval.json").read_text())
    assert scores["test_mean_norm"] > 0 and "test_avg" in scores
    logged = subprocess.run(
        [sys.executable, "-c", "import mlflow, sys; sys.path.insert(0, 'src'); from mmcse import tracking; "
         "from mmcse.experiments.params import load_config; tracking.configure(load_config('params.yaml')); "
         "runs = mlflow.search_runs(search_all_experiments=True, output_format='list'); "
         "print(sorted({k for r in runs for k in r.data.metrics}))"],
        cwd=project, env=env, capture_output=True, text=True, timeout=300)
    assert "'loss/uniformity'" in logged.stdout and "'test_mean_norm'" in logged.stdout, logged.stdout + logged.stderr
