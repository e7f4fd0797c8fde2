"""DVC stage `train`: the student, best dev checkpoint in models/student/best, curves in plots/."""

from mmcse.entry import run_entry
from mmcse.experiments.params import load_config
from mmcse.io import write_metrics
from mmcse.pipeline.paths import Paths
from mmcse.processes import lead
from mmcse.training.launch import needs_launch, run_launched, torchrun_command


def main() -> None:
    cfg = load_config("params.yaml")
    if needs_launch(cfg.train, cfg.base.device):  # train.devices > 1: this script once per process, via torchrun
        run_launched(torchrun_command(cfg.train, cfg.base.device, [__file__]))
        return
    # the training stack (torch, transformers, MLflow: ~7 s of imports) in the processes that train, not in the
    # launcher above, which starts torchrun and waits
    from mmcse.pipeline.train import run_train, write_curves
    from mmcse.training.checkpoints import load_history

    paths = Paths.of(cfg)
    summary = run_train(cfg, paths)
    if not lead():  # a process beside rank 0, which writes the outputs
        return
    write_curves(load_history(paths.student), paths.plots, title=f"{cfg.train.method} (seed {cfg.base.seed})")
    keys = ("best_dev_sts", "best_dev_rsum", "best_step", "steps", "best_dev_alignment", "best_dev_uniformity")
    write_metrics(paths.metrics / "train.json", {k: summary[k] for k in keys if k in summary})


if __name__ == "__main__":
    run_entry(main, stage="train")
