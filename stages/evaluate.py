"""DVC stage `evaluate`: test-set scores of the best checkpoint (STS, retrieval, NDCG; DUET: retrieval
and NDCG) -> metrics/eval.json, keyed as in MLflow (``test_<name>``; the dev geometry ``dev_<name>``,
`mmcse.evaluation.names`)."""

from pathlib import Path

from mmcse import tracking
from mmcse.entry import run_entry
from mmcse.evaluation.names import test_metrics
from mmcse.experiments.params import load_config
from mmcse.io import read_json, write_metrics
from mmcse.pipeline.evaluate import EvalOutputs, TrainedOn, require_trained_with, run_evaluate
from mmcse.pipeline.paths import Paths


def main() -> None:
    cfg = load_config("params.yaml")
    paths = Paths.of(cfg)
    summary = read_json(paths.student / "summary.json")
    trained_with = require_trained_with(cfg, paths.student / "best")  # this configuration's, whole
    # the training's run of this configuration (kept beside mlruns/)
    run_id = tracking.folder_run_id(paths.student, summary, config_hash=trained_with)
    # mteb's own results layout, README.md beside it
    outputs = EvalOutputs(run_id, plots_dir=paths.plots, mteb_dir=paths.metrics / "mteb")
    trained_on = TrainedOn(region_sets={k: Path(v) for k, v in summary.get("region_sets", {}).items()})
    scores = run_evaluate(cfg, paths, paths.student / "best", outputs, trained_on)
    write_metrics(paths.metrics / "eval.json", test_metrics(scores))


if __name__ == "__main__":
    run_entry(main, stage="evaluate")
