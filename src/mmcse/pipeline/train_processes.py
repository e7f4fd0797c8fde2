"""A training job started from inside a running process (an ablation job on a Prefect worker) on several
processes: ``train.devices: N``, or ``auto`` on a worker that sees several GPUs (``CUDA_VISIBLE_DEVICES=0,1,2,3``).

The caller writes what the job is (its configuration, output folder, run names, upstream artifacts and the
MLflow tags of its context) to a file beside the output folder, runs this module once per process through
torchrun (`mmcse.training.launch`), and reads back rank 0's summary: the same `run_train` call as in one
process, so the job trains, is tracked and is resumed as it would be there.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from mmcse import stopping, tracking
from mmcse.config import Config, parse_config, to_dict
from mmcse.errors import InputError
from mmcse.integrity.keys import Upstream
from mmcse.io import read_json, write_json
from mmcse.pipeline.paths import Paths
from mmcse.pipeline.train import JobArtifacts, RunNames, run_train
from mmcse.processes import lead
from mmcse.training.engine import Hooks
from mmcse.training.launch import run_launched, torchrun_command


def run_train_on_processes(cfg: Config, paths: Paths, out_dir: Path, names: RunNames | None = None,
                           hooks: Hooks | None = None, job: JobArtifacts | None = None) -> dict[str, Any]:
    """`run_train`'s job on the processes ``train.devices`` × ``train.nodes`` asks for, started here through
    torchrun; returns rank 0's summary (with its MLflow run id). ``paths`` must be the working directory's
    (the processes start there and take ``Paths.of`` their configuration). A sweep trial's ``on_eval``
    (Optuna's pruning) cannot reach other processes: refused."""
    names, hooks = names or RunNames(), hooks or Hooks(progress=False)
    if hooks.on_eval is not None:
        raise InputError("a sweep trial trains in one process (its pruning callback cannot reach the job's "
                         "processes): set train.devices: 1 for the sweep")
    if paths != Paths.of(cfg):
        raise ValueError(f"run_train_on_processes: the job's processes take the working directory's paths, not {paths}")
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    spec_file, result_file = (out_dir.with_name(f".{out_dir.name}.{part}.json") for part in ("processes", "summary"))
    result_file.unlink(missing_ok=True)
    write_json(spec_file, {
        "config": to_dict(cfg), "out_dir": str(out_dir), "experiment_name": names.experiment, "run_name": names.run,
        "parent_run_id": names.parent_id, "progress": hooks.progress,
        "data_seed": None if job is None else job.data_seed,
        "upstream": None if job is None else {
            "raw": str(job.upstream.raw), "objects": str(job.upstream.objects), "teachers": str(job.upstream.teachers),
            "teacher_manifest": str(job.upstream.teacher_manifest),
            "teacher_dirs": [str(d) for d in job.upstream.teacher_dirs], "keys": job.upstream.keys},
        "tags": tracking.extra_tags(), "result": str(result_file)})
    try:
        run_launched(torchrun_command(cfg.train, cfg.base.device, ["-m", __name__, str(spec_file)]))
        return read_json(result_file)
    finally:
        spec_file.unlink(missing_ok=True)
        result_file.unlink(missing_ok=True)


def _job(data_seed: int | None, raw: dict[str, Any] | None) -> JobArtifacts | None:
    if raw is None or data_seed is None:
        return None
    return JobArtifacts(data_seed, Upstream(
        raw=Path(raw["raw"]), objects=Path(raw["objects"]), teachers=Path(raw["teachers"]),
        teacher_manifest=Path(raw["teacher_manifest"]), teacher_dirs=tuple(Path(d) for d in raw["teacher_dirs"]),
        keys=dict(raw["keys"])))


def main(spec_file: str) -> None:
    """One process of the job ``spec_file`` describes (torchrun runs it once per process)."""
    stopping.install()  # SIGTERM from the launching process: a resume point at the next step, as in one process
    spec = json.loads(Path(spec_file).read_text())
    cfg = parse_config(spec["config"], where=spec_file)
    with tracking.tagged(spec["tags"]):
        names = RunNames(spec["experiment_name"], spec["run_name"], spec["parent_run_id"])
        summary = run_train(cfg, Paths.of(cfg), Path(spec["out_dir"]), names, Hooks(progress=spec["progress"]),
                            _job(spec["data_seed"], spec["upstream"]))
    if lead():
        write_json(Path(spec["result"]), summary)


if __name__ == "__main__":
    try:
        main(sys.argv[1])
    except stopping.StopRequested as err:  # one line, as a stage's (the launching process says what was kept)
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(err.exit_code) from None
