"""A checkpoint as an MLflow logged model of the run that trained it, with its metrics and params.

MLflow 3's logged models carry their source run, params, tags and the metrics logged against them: a
sweep trial's best checkpoint becomes one (`link_checkpoint_model`), so the MLflow UI's "Logged models"
lists every trial's checkpoint with its dev score and the parameters Optuna drew, and each links back
to its run, its study and its trial. The checkpoint stays where training wrote it (an *external* model:
its files are not copied into the artifact store; a BERT-base checkpoint per trial would be ~0.4 GB);
the model names its folder and the SHA-256 of the folder's seal (`mmcse.integrity.files.SEAL`), so a
folder overwritten since is told apart from the one the model describes.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import mlflow

from mmcse.integrity.files import SEAL, file_sha256

CHECKPOINT_TAG = "mmcse.checkpoint"  # a model's (and its run's) checkpoint folder, absolute
SEAL_TAG = "mmcse.checkpoint_seal_sha256"  # SHA-256 of that folder's seal: which files the model is
MODEL_TAG = "mmcse.model_id"  # on a run: the logged model of its checkpoint


def link_checkpoint_model(
    run_id: str,
    checkpoint: str | Path,
    name: str,
    params: Mapping[str, object],
    metrics: Mapping[str, float],
    tags: Mapping[str, str] | None = None,
    model_type: str = "mmcse checkpoint",
) -> str:
    """Log ``checkpoint`` (a sealed folder run ``run_id`` trained) as an external MLflow model named
    ``name`` in the run's experiment: ``params`` and ``tags`` on the model, ``metrics`` logged to the run
    against the model (the model's page shows them), and the run tagged with the model's id. Returns
    the model id."""

    folder = Path(checkpoint).resolve()
    seal = folder / SEAL
    if not seal.is_file():
        raise FileNotFoundError(f"{seal}: a checkpoint logged as a model must be sealed (no seal here)")
    client = mlflow.MlflowClient()
    run = client.get_run(run_id)
    model_tags = {**dict(tags or {}), CHECKPOINT_TAG: str(folder), SEAL_TAG: file_sha256(seal)}
    model = mlflow.create_external_model(
        name=name, source_run_id=run_id, experiment_id=run.info.experiment_id, model_type=model_type,
        params={key: str(value)[:6000] for key, value in params.items()}, tags=model_tags,
    )
    mlflow.log_metrics(dict(metrics), run_id=run_id, model_id=model.model_id)
    for key, value in {MODEL_TAG: model.model_id, CHECKPOINT_TAG: str(folder)}.items():
        client.set_tag(run_id, key, value)
    return model.model_id
