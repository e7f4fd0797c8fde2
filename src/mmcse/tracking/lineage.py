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

from mmcse.errors import InputError
from mmcse.integrity.files import SEAL, file_sha256
from mmcse.tracking import DESCRIPTION_TAG, run_description

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


def card_description(card: str) -> str:
    """A model card (`mmcse.models.card`) as a description: its body without the hub's metadata, up to its
    training record (the resolved configuration is the run's params already), cut at MLflow's limit."""
    body = card.split("\n---\n", 1)[1] if card.startswith("---") and "\n---\n" in card else card
    return run_description(body.split("\n## Training", 1)[0].strip(), "the whole card is the model's README.md")


def describe_with_card(card: str, run_id: str, model_uri: str | None = None) -> None:
    """The card as the description of run ``run_id`` and of its logged model ``model_uri`` (``models:/<id>``):
    what the MLflow UI shows first on their pages, instead of "No description"."""
    text = card_description(card)
    client = mlflow.MlflowClient()
    client.set_tag(run_id, DESCRIPTION_TAG, text)
    if model_uri and model_uri.startswith("models:/"):
        client.set_logged_model_tags(model_uri.removeprefix("models:/").split("/")[0], {DESCRIPTION_TAG: text})


MODEL_URI_TAG = "mmcse.model_uri"  # on a training run: the MLflow model its evaluation logged (the evaluate stage)


def latest_model_run(experiment: str) -> str:
    """The newest finished run of ``experiment`` whose evaluation logged a model (`MODEL_URI_TAG`)."""
    runs = mlflow.search_runs(experiment_names=[experiment], filter_string=f"tags.`{MODEL_URI_TAG}` LIKE 'models:/%' "
                              "and attributes.status = 'FINISHED'", order_by=["attributes.start_time DESC"],
                              max_results=1, output_format="list")
    if not runs:
        raise InputError(f"experiment {experiment!r} has no finished run with an evaluated model; run the train and "
                         "evaluate stages first (dvc repro evaluate), or name one with --run")
    return runs[0].info.run_id


def register_run_model(run_id: str, name: str) -> tuple[str, str]:
    """The model run ``run_id``'s evaluation logged, registered as a new version of ``name`` (created where
    missing) in the tracking store's registry, the run's description (its model card, `describe_with_card`) as
    the version's and the registered model's description. Returns ``(version, "models:/<name>/<version>")``."""
    client = mlflow.MlflowClient()
    try:
        run = client.get_run(run_id)
    except mlflow.exceptions.MlflowException:
        raise InputError(f"--run {run_id}: no such run in the tracking store") from None
    uri = run.data.tags.get(MODEL_URI_TAG)
    if not uri:
        raise InputError(f"run {run_id} ({run.info.run_name}) logged no evaluated model (no tag {MODEL_URI_TAG}); "
                         "evaluate it first (the evaluate stage)")
    note = run.data.tags.get(DESCRIPTION_TAG, "")
    version = mlflow.register_model(uri, name, tags={"mmcse.run_id": run_id})
    if note:
        client.update_model_version(name, version.version, description=note)
        client.update_registered_model(name, description=note)
    return str(version.version), f"models:/{name}/{version.version}"
