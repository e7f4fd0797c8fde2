"""CONTRIBUTING.md's recipes hold: in a copy of the tree, a new loss term with its own ``loss.<section>`` and a new
evaluator, each added in exactly the files CONTRIBUTING names (then its one command, `mmcse generate`), pass the
schema, defaults, registry and layout checks and their own tests, and train and evaluate the demo."""

from __future__ import annotations

import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO

# 1. the term's module: its section, its function, its declaration (CONTRIBUTING "Adding a loss term", step 1)
TERM_MODULE = '''"""A toy term: Wang & Isola's uniformity of the sentence embeddings (ICML 2020, Eq. 5), with its
section ``loss.toy``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from mmcse.config.declared import SECTION, NonNegative, Positive
from mmcse.config.training import RETRIEVAL_METHODS
from mmcse.methods.terms.base import LossTerm, Objective, StepEmbeddings, always, loss_section, register

if TYPE_CHECKING:
    import torch


@loss_section("toy", "a toy term: Wang & Isola's uniformity (ICML 2020, Eq. 5)")
@dataclass(frozen=True)
class ToyLossConfig:
    __pydantic_config__ = SECTION
    weight: NonNegative = 0.1
    """the toy uniformity term's weight (0: off)"""
    t: Positive = 2.0
    """its t"""


def uniformity(o: Objective, e: StepEmbeddings, draw: torch.Tensor | None = None) -> torch.Tensor:
    """Wang & Isola 2020, Eq. 5: log E exp(-t ||f(x) - f(y)||²) over the batch's distinct pairs (normalised)."""
    import torch

    z = torch.nn.functional.normalize(e.z1, dim=-1)  # (N, H)
    return torch.pdist(z).pow(2).mul(-o.loss.toy.t).exp().mean().log()


register(LossTerm(
    name="toy", equation="Wang & Isola 2020, uniformity (Eq. 5)", order=95, weight="loss.toy.weight",
    active=lambda o: o.method not in RETRIEVAL_METHODS and o.loss.toy.weight > 0,
    inputs=lambda o: {"z"}, on_pairs=always, on_text=always, compute=uniformity, reads=lambda o: {"loss.toy.t"},
))
'''

# 3. its test (step 3): the term against a direct transcription of the equation, with its gradient
TERM_TEST = '''import torch

from mmcse.config import Config, with_overrides
from mmcse.methods.objectives import Objective
from mmcse.methods.terms import REGISTRY, StepEmbeddings


def test_toy_is_log_mean_exp_of_pairwise_distances_with_its_gradient():
    z = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    o = Objective.of(with_overrides(Config(), {"loss.toy.t": 2.0}))
    got = REGISTRY["toy"].compute(o, StepEmbeddings(z1=z, z2=z), None)
    n = z / z.norm(dim=1, keepdim=True)
    want = torch.log(torch.stack([torch.exp(-2 * (n[i] - n[j]).pow(2).sum())
                                  for i in range(5) for j in range(i + 1, 5)]).mean())
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(torch.autograd.grad(got, z)[0], torch.autograd.grad(want, z)[0])
'''

# the evaluator's module (CONTRIBUTING "Adding an evaluator", step 1)
EVALUATOR_MODULE = '''"""A toy evaluator: the mean norm of the test sentences' embeddings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from mmcse.evaluation.evaluators.base import EvaluationInputs, register

if TYPE_CHECKING:
    from mmcse.evaluation.sts import EncodeFn


@dataclass
class NormEvaluator:
    sentences: list[str]
    label: str = "mean norm"
    primary_metric: str = "mean_norm"

    def __call__(self, encode: EncodeFn) -> dict[str, float]:
        return {"mean_norm": float(np.linalg.norm(encode(self.sentences), axis=1).mean())}


@register("toy", order=60, scores=("mean_norm",))
def build(inputs: EvaluationInputs) -> NormEvaluator | None:
    sentences = [p.s1 for pairs in inputs.sts.values() for p in pairs][:32]
    return NormEvaluator(sentences) if sentences else None
'''

EVALUATOR_TEST = '''import numpy as np

from mmcse.data.senteval import SentencePair
from mmcse.evaluation.evaluators import EvaluationInputs, build_evaluators, run_evaluators


def encode(sentences):
    return np.array([[len(s), 1.0] for s in sentences])


def test_toy_is_the_mean_norm_of_the_test_sentences():
    inputs = EvaluationInputs(sts={"STS12": [SentencePair("STS12", "", "a dog", "a cat", 1.0),
                                            SentencePair("STS12", "", "beach", "sea", 2.0)]}, asked=("toy",))
    scores = run_evaluators(build_evaluators(inputs), encode)
    assert scores == {"mean_norm": (np.hypot(5, 1) + np.hypot(5, 1)) / 2}
'''

CHECKS = ["tests/config/test_schema.py", "tests/methods/test_sections.py", "tests/methods/test_terms.py",
          "tests/test_layout.py", "tests/evaluation/test_evaluators.py", "tests/methods/test_toy.py",
          "tests/evaluation/test_toy.py",
          "tests/methods/test_objectives.py::test_every_registered_term_reads_what_it_declares"]


# argv: the tree, then the stages, each run as its script's __main__ (`mmcse.entry.run_entry`: exit 0 or a status)
RUN_STAGES = """
import runpy, sys
from mmcse import stopping
for stage in sys.argv[2:]:
    try:
        runpy.run_path(f"{sys.argv[1]}/stages/{stage}.py", run_name="__main__")
    except SystemExit as stopped:
        if stopped.code:
            sys.exit(f"{stage}: exit status {stopped.code}")
    stopping.reset()
"""


def _insert_after(path: Path, anchor: str, text: str) -> None:
    source = path.read_text()
    assert anchor in source, f"{path}: CONTRIBUTING's anchor {anchor!r} is gone"
    path.write_text(source.replace(anchor, anchor + text, 1))


def _contribute(tree: Path) -> set[str]:
    """CONTRIBUTING's two recipes applied to ``tree`` by hand, each name one nothing else uses; returns the files
    they touched."""
    src = tree / "src" / "mmcse"
    # a loss term: its module (section, function, declaration), params.yaml, its test, its docs row
    (src / "methods/terms/toy.py").write_text(TERM_MODULE)
    _insert_after(tree / "params.yaml", "loss:                         # every term has its own switch and weight "
                  "(docs/methods.md)\n", "  toy:                        # a toy term (Wang & Isola's uniformity)\n"
                  "    weight: 0.1               # its weight (0: off)\n    t: 2.0                    # its t\n")
    (tree / "tests/methods/test_toy.py").write_text(TERM_TEST)
    _insert_after(tree / "docs/methods.md", "|---|---|---|\n", "| `toy` | + 0.1·uniformity (a toy term) | `toy` |\n")
    # an evaluator: its module, its test, its docs (params.yaml's evaluate.evaluators: all asks for it)
    (src / "evaluation/evaluators/toy.py").write_text(EVALUATOR_MODULE)
    (tree / "tests/evaluation/test_toy.py").write_text(EVALUATOR_TEST)
    _insert_after(tree / "docs/evaluation.md", "\n", "\n`toy`: the mean norm of test sentences.\n")
    return {"src/mmcse/methods/terms/toy.py", "params.yaml", "tests/methods/test_toy.py", "docs/methods.md",
            "src/mmcse/evaluation/evaluators/toy.py", "tests/evaluation/test_toy.py", "docs/evaluation.md"}


def _named_in_contributing(path: str) -> bool:
    text = (REPO / "CONTRIBUTING.md").read_text()
    generic = re.sub(r"toy", "<paper>", path) if "methods" in path else re.sub(r"toy", "<name>", path)
    return path in text or generic in text


@pytest.mark.slow  # a copy of the tree, its checks, then the train and evaluate stages in a process of its code: ~1 min
def test_a_term_and_an_evaluator_added_as_contributing_says_pass_the_checks_and_train_the_demo(project, tmp_path):
    tree = tmp_path / "tree"
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    for name in files:
        if (REPO / name).is_file():
            (tree / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, tree / name)
    touched = _contribute(tree)
    unnamed = sorted(p for p in touched if not _named_in_contributing(p))
    assert not unnamed, f"files CONTRIBUTING.md does not name: {unnamed}"
    term, evaluator = ({p for p in touched if "evaluat" not in p}, {p for p in touched if "evaluat" in p})
    assert len(term) == 4 and len(evaluator) == 3  # by hand; the generated files come from `mmcse generate`
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    # until the one command runs, the new section is not the configuration's: its module says which command
    stale = subprocess.run([sys.executable, "-c", "import mmcse.methods.terms"], cwd=tree, env=env,
                           capture_output=True, text=True)
    assert stale.returncode != 0 and "run `mmcse generate`" in stale.stderr
    generate = subprocess.run([sys.executable, "-m", "mmcse.cli", "generate"], cwd=tree, env=env,
                              capture_output=True, text=True, timeout=300)
    assert generate.returncode == 0, generate.stderr[-3000:]
    for name in ("src/mmcse/config/sections.py", "params.schema.json"):
        assert (tree / name).read_text() != (REPO / name).read_text(), f"{name}: not renewed"
    # the checks a change must pass, run on the copy: schema, typed defaults, sections, registries, layout, its tests
    checks = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n0", "-p", "no:cacheprovider", *CHECKS],
                            cwd=tree, env=env, capture_output=True, text=True, timeout=900)
    assert checks.returncode == 0, checks.stdout[-4000:]
    # the demo project, trained and evaluated by the copy's code with the copy's params
    raw = yaml.safe_load((project / "params.yaml").read_text())
    raw["loss"]["toy"] = yaml.safe_load((tree / "params.yaml").read_text())["loss"]["toy"]
    (project / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    # the three stages as DVC runs them, in one process of the copy's code (tests.conftest.stage_here's way: a stage
    # process spends ~7 s on imports before its first line, and this test is about the copy's code, not processes)
    done = subprocess.run([sys.executable, "-c", RUN_STAGES, str(tree), "check_params", "train", "evaluate"],
                          cwd=project, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    scores = json.loads((project / "metrics/eval.json").read_text())
    assert scores["test_mean_norm"] > 0 and "test_avg" in scores
    with sqlite3.connect(project / "mlruns/mlflow.db") as db:  # what MLflow logged, read without MLflow
        logged = {key for (key,) in db.execute("select distinct key from metrics")}
    assert {"loss/toy", "test_mean_norm"} <= logged, sorted(logged)
