"""Prefect flows `ablations` (variants × seeds, then the aggregated table) and `ablation-job` (one of them).

`ablate.fan_out` (or the flow parameter ``fan_out``) says where the jobs run:

* ``local``: one task per variant × seed inside the `ablations` flow run, one after another.
  That is the DVC stage `ablate`, `python flows/ablations.py`, and deployment `ablations`.
* ``deployment``: every unfinished job becomes a flow run of deployment `ablation-job/ablation-job`
  (work pool `gpu`, subflow runs of this one). With one worker per GPU (each started with its own
  ``CUDA_VISIBLE_DEVICES`` and ``--limit 1``) the jobs run concurrently, one per GPU; this flow
  waits for them, resubmits a failed job ``ablate.retries`` times and gathers the results.
  It holds no GPU itself: deployment `ablations/fan-out` runs it on work pool `head`.

Every job's MLflow run records the device it trained on, ``CUDA_VISIBLE_DEVICES``, the host,
the Prefect flow run and worker (`mmcse.models.device.device_tags`, `mmcse.tracking.prefect_tags`).
All work is done by library functions in `mmcse.experiments.ablate` and `mmcse.pipeline`.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import Any

from prefect import flow, task

from mmcse import stopping
from mmcse.analysis.tables import (
    aggregate,
    environment_notes,
    table_metric,
    write_table,
)
from mmcse.analysis.text import terminal_table
from mmcse.config import Config
from mmcse.errors import TrainingDiverged
from mmcse.experiments.ablate import (
    SCORE_NAMES,
    failed_result,
    finished_result,
    previous_parent,
    prune_other_tables,
    record_result,
    remember_parent,
    run_job,
    start_line,
)
from mmcse.experiments.ablation_record import log_ablation, log_ablation_figures
from mmcse.experiments.jobs import (
    Job,
    ablation_hash,
    expand,
    job_config,
    job_hash,
    job_run_name,
    parent_run_name,
    table_params,
)
from mmcse.experiments.params import check_params, check_preset_name, load_config
from mmcse.experiments.prefect_server import (
    check_api_url,
    claim_temporary_server,
    start_retry,
    stop_stale_temporary_servers,
)
from mmcse.experiments.stand_ins import check_stand_ins
from mmcse.pipeline.paths import Paths
from mmcse.tracking import prefect_tags, record_reuse

JOB_DEPLOYMENT = "ablation-job/ablation-job"  # <flow name>/<deployment name> in prefect.yaml
FAN_OUT = ("local", "deployment")


def find_job(cfg: Config, variant: str, seed: int) -> Job:
    for job in expand(cfg):
        if job.variant == variant and job.seed == seed:
            return job
    raise ValueError(f"params.yaml: no ablation job {variant!r} seed {seed} in ablate.variants × ablate.seeds")


REUSED = "Reused"  # the state name of a job task / flow run whose finished result was reused


def reused_or_result(result: dict[str, Any]) -> Any:
    """A job's result; a reused one (finished before with the same configuration, `run_job`'s
    ``skipped``) as a Completed state named ``Reused`` that says so, so Prefect's UI and logs tell
    a reused job from a trained one (a bare return reads "Completed in 0.1 s")."""
    if not result.get("skipped"):
        return result
    from prefect.states import Completed

    return Completed(data=result, name=REUSED, message=f"{result['variant']} seed={result['seed']}: finished "
                     "before with this configuration (its result.json and MLflow run), not retrained")


def unwrap(value: Any) -> dict[str, Any]:
    """The result dict of a job task's return value (a state when it was reused)."""
    from prefect.states import State

    return value.result() if isinstance(value, State) else value


def retry_unless_diverged(_task: Any, _task_run: Any, state: Any) -> bool:
    """A failed job is retried (``ablate.retries``) unless its training diverged: the same
    configuration diverges again, so it is recorded as failed at once."""
    try:
        state.result()
    except TrainingDiverged:
        return False
    except BaseException:  # noqa: BLE001  any other failure may be transient (a worker, a disk)
        return True
    return True


def diverged(message: str | None) -> bool:
    """Whether a failed flow run's state message is a diverged training's (`TrainingDiverged`)."""
    return TrainingDiverged.__name__ in (message or "")


def run_overrides(preset: str | None, overrides: dict[str, Any] | None) -> dict[str, Any]:
    """A run's dotted overrides of params.yaml (deployment parameters ``preset`` and ``overrides``: a user chooses a
    table without editing the file); ``preset`` is ``ablate.preset``."""
    return {**(overrides or {}), **({"ablate.preset": preset} if preset else {})}


@task(name="train-variant", task_run_name="{variant} seed={seed}")
def train_variant(params_path: str, variant: str, seed: int, parent_run_id: str | None,
                  overrides: dict[str, Any] | None = None) -> Any:
    cfg = load_config(params_path, overrides=overrides or None)
    return reused_or_result(run_job(cfg, find_job(cfg, variant, seed), Paths.of(cfg).ablations,
                                    parent_run_id=parent_run_id, tags=prefect_tags()))


def job_line(result: dict[str, Any], metric: str, minutes: float | None = None) -> str:
    """One line per finished job: variant, seed, how it ended, device, minutes, its table score."""
    head = f"{result.get('variant')} seed={result.get('seed')}"
    if result.get("status") != "ok":
        return f"{head}: failed: {str(result.get('error', ''))[:200]}"
    score = (result.get("scores") or {}).get(metric)
    scored = f", {metric} {score:.2f}" if isinstance(score, (int, float)) else ""
    if result.get("skipped"):
        return f"{head}: reused (finished before){scored}"
    took = f" in {minutes:.1f} min" if minutes is not None else ""
    return f"{head}: trained on {result.get('device', '?')}{took}{scored}"


def publish_table(files: dict[str, Any], rows: list[dict[str, Any]], metric: str) -> None:
    """The finished table as artifacts of this flow run (Prefect UI, ``prefect artifact ls``): the
    Markdown table (key ``ablation-table``) and the rows as a table artifact (``ablation-rows``)."""
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    create_markdown_artifact(markdown=files["md"].read_text(), key="ablation-table",
                             description=f"the ablation table (primary column {metric})")
    columns = sorted({k for row in rows for k, v in row.items() if not isinstance(v, (dict, list))})
    create_table_artifact(table=[{k: row.get(k) for k in columns} for row in rows], key="ablation-rows",
                          description="every row of the ablation table, full precision")


@flow(name="ablation-job", log_prints=True, persist_result=True, result_serializer="json")
def ablation_job(
    params_path: str, variant: str, seed: int, parent_run_id: str | None = None, config_hash: str | None = None,
    overrides: dict[str, Any] | None = None,
) -> dict:
    """Train + evaluate ONE variant × seed in this process (a worker's GPU; skipped when finished)
    and return its result. ``config_hash`` (from the submitting `ablations` run) makes a worker
    whose params.yaml differs fail instead of training something else; ``overrides`` are the submitting run's."""
    cfg = load_config(params_path, overrides=overrides or None)
    started = time.perf_counter()
    result = run_job(cfg, find_job(cfg, variant, seed), Paths.of(cfg).ablations, parent_run_id=parent_run_id,
                     tags=prefect_tags(), expected_hash=config_hash)
    print(job_line(result, table_metric(cfg), (time.perf_counter() - started) / 60))
    return reused_or_result(result)


def ablation_params(cfg: Config, jobs: list[Job]) -> dict[str, str]:
    """The ablation's settings as params of its parent run (``ablation.*``), logged when it starts:
    what the table compares, readable in the runs table before any job has finished."""
    return {
        "ablation.preset": cfg.ablate.preset,
        "ablation.title": cfg.ablate.title[:500],
        "ablation.reference": cfg.ablate.reference,
        "ablation.test": cfg.ablate.test,
        "ablation.profile": cfg.base.profile,  # the block of the paper's table it reproduces (mmcse report)
        "ablation.metric": table_metric(cfg),
        "ablation.seeds": ",".join(str(s) for s in cfg.ablate.seeds),
        "ablation.variants": ", ".join(cfg.ablate.variants)[:500],
        "ablation.jobs": str(len(jobs)),
        # rows that are not their paper's and why (the preset's caveats): mmcse report prints them
        "ablation.caveats": json.dumps(cfg.ablate.caveats, ensure_ascii=False),
        # where paper and authors' code differ, what the table follows (recipe, printed, code): mmcse report
        # keeps the latest ablation per profile and reading, side by side
        "ablation.reading": cfg.ablate.reading,
        # rows the profile cannot train, with what they need (DALR Table 9's RankCSE rows): mmcse report shows them
        "ablation.skipped": json.dumps(cfg.ablate.skipped, ensure_ascii=False)[:6000],
    }


def log_partial(cfg: Config, parent_run_id: str, results: list[dict[str, Any]], n_jobs: int) -> None:
    """The comparison so far in the parent run: its figure (`comparison_figure` over the variants
    that have a finished job, ``figures/ablation.png``, replaced after each job) and the progress
    ``ablation/jobs_done`` of ``ablation/jobs`` (step = jobs done). The parent shows the comparison
    while the other jobs still train; the table's aggregates come once, at the end (`log_ablation`)."""
    import time

    import mlflow
    from mlflow.entities import Metric

    from mmcse.experiments.ablation_record import comparison_figure

    done = {r["variant"] for r in results}
    rows = [row for row in aggregate(cfg, results) if row["variant"] in done]
    now = int(time.time() * 1000)
    client = mlflow.MlflowClient()
    client.log_batch(parent_run_id, metrics=[Metric("ablation/jobs_done", float(len(results)), now, len(results)),
                                             Metric("ablation/jobs", float(n_jobs), now, len(results))])
    client.log_figure(parent_run_id, comparison_figure(cfg, rows), "figures/ablation.png")


def _deployment_exists(name: str) -> None:
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound
    from prefect.settings import PREFECT_API_URL

    with get_client(sync_client=True) as client:
        try:
            client.read_deployment_by_name(name)
        except ObjectNotFound:
            raise RuntimeError(
                f"ablate.fan_out=deployment: Prefect deployment {name!r} not found at "
                f"{PREFECT_API_URL.value() or 'the ephemeral API (PREFECT_API_URL unset)'}: deploy it "
                "(`prefect --no-prompt deploy --name ablation-job`) and start workers on pool gpu "
                '(docs/prefect.md, "Scaling out")'
            ) from None


def _job_result(cfg: Config, job: Job, flow_run: Any) -> dict[str, Any]:
    """The result a completed `ablation-job` flow run returned (Prefect's result storage), or the
    job's result.json here when that storage is out of reach (another host, no shared storage)."""
    try:
        return flow_run.state.result()
    except Exception as err:
        print(f"{job.variant} seed={job.seed}: result of flow run {flow_run.name!r} unreadable here ({err})")
        paths = Paths.of(cfg)
        done = finished_result(job.folder(paths.ablations), job_hash(job_config(cfg, job), cfg.base.seed), paths.jobs)
        if done is not None:
            return done
        return failed_result(job, f"flow run {flow_run.name!r} completed but its result is unreadable here ({err}); "
                                  "give every host one Prefect result storage (docs/prefect.md, \"Scaling out\")")


def fan_out_jobs(
    params_path: str, cfg: Config, jobs: list[Job], parent_run_id: str, deployment: str, poll_seconds: float,
    on_result: Callable[[list[dict[str, Any]]], None] | None = None, overrides: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Run ``jobs`` as flow runs of ``deployment`` (all submitted at once, the workers take them as
    they free up) and return their results in ``jobs`` order; finished jobs are not submitted.
    ``on_result(results so far)`` after each job that finished or failed for good."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.deployments import run_deployment
    from prefect.runtime import flow_run as this_run

    root = Paths.of(cfg).ablations
    results: dict[int, dict[str, Any]] = {}  # by position in ``jobs`` (a Job holds a dict: not hashable)
    hashes: dict[int, str] = {}
    for i, job in enumerate(jobs):
        try:
            hashes[i] = job_hash(job_config(cfg, job), cfg.base.seed)
        except Exception as err:  # a bad override: no worker would do better
            results[i] = failed_result(job, err)
            continue
        done = finished_result(job.folder(root), hashes[i], Paths.of(cfg).jobs)
        if done is not None and done.get("score_names") == SCORE_NAMES:  # older names: a worker rescores it
            results[i] = done | {"skipped": True}
            record_reuse(parent_run_id, job_run_name(job), done.get("run_id"), prefect_tags())
    todo = [i for i in range(len(jobs)) if i not in results]
    if results and on_result is not None:
        on_result(list(results.values()))
    if todo:
        _deployment_exists(deployment)
    running: dict[Any, tuple[int, int]] = {}  # flow run id -> (job position, attempt)

    def submit(i: int, attempt: int) -> None:
        job = jobs[i]
        run = run_deployment(
            deployment,
            parameters={"params_path": params_path, "variant": job.variant, "seed": job.seed,
                        "parent_run_id": parent_run_id, "config_hash": hashes[i], "overrides": overrides or {}},
            flow_run_name=f"{job.variant} seed={job.seed}" + (f" retry {attempt}" if attempt else ""),
            # a repeated submission by this coordinator run gives back the same flow run
            idempotency_key=f"{this_run.id}/{job.variant}/{job.seed}/{attempt}",
            timeout=0,  # submit only; the loop below waits for all of them together
        )
        running[run.id] = (i, attempt)

    for i in todo:
        submit(i, 0)
    if todo:
        print(f"submitted {len(todo)} jobs to {deployment} ({len(jobs) - len(todo)} already finished or invalid)")
    with get_client(sync_client=True) as client:
        while running:
            time.sleep(poll_seconds)
            ids = list(running)
            runs = [r for start in range(0, len(ids), 100) for r in client.read_flow_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=ids[start:start + 100])), limit=100)]
            for run in runs:
                if run.state is None or not run.state.is_final():
                    continue
                i, attempt = running.pop(run.id)
                job = jobs[i]
                if run.state.is_completed():
                    results[i] = _job_result(cfg, job, run)
                    record_result(root, job, results[i])
                    print(job_line(results[i], table_metric(cfg)))
                elif attempt < cfg.ablate.retries and not run.state.is_cancelled() and not diverged(run.state.message):
                    print(f"{job.variant} seed={job.seed}: {run.state.name} ({run.state.message}); retrying")
                    submit(i, attempt + 1)
                else:
                    print(f"variant {job.variant!r} seed {job.seed} failed after retries: {run.state.message}")
                    results[i] = failed_result(job, f"{run.state.name}: {run.state.message}")
                if i in results and on_result is not None:
                    on_result(list(results.values()))
    return [results[i] for i in range(len(jobs))]


@flow(name="ablations", log_prints=True)
def ablations(
    params_path: str = "params.yaml",
    fan_out: str | None = None,
    job_deployment: str = JOB_DEPLOYMENT,
    poll_seconds: float = 5.0,
    preset: str | None = None,
    overrides: dict[str, Any] | None = None,
) -> list[dict]:
    """Train + evaluate every variant × seed (finished ones are skipped), retry failures
    `ablate.retries` times, and write/log the table; returns its rows. ``fan_out`` (default
    ``ablate.fan_out``): ``local`` runs the jobs here, ``deployment`` as flow runs of
    ``job_deployment`` on the GPU workers (state polled every ``poll_seconds``). ``preset`` (``ablate.preset``)
    and ``overrides`` (dotted keys) change params.yaml's values for this run only, its jobs' included."""
    import mlflow

    from mmcse import tracking

    given = run_overrides(preset, overrides)
    check_preset_name(params_path, preset, given_as="flow parameter preset")
    cfg = load_config(params_path, overrides=given or None)
    mode = fan_out or cfg.ablate.fan_out
    if mode not in FAN_OUT:
        raise ValueError(f"flow ablations: fan_out={mode!r}; choose one of {list(FAN_OUT)}")
    paths = Paths.of(cfg)
    jobs: list[Job] = expand(cfg)
    # An interrupted ablation, rerun, continues its parent run: one record listing every job.
    ablation = ablation_hash(cfg, jobs)
    tracking.configure(cfg)
    previous = tracking.existing_run(previous_parent(paths.ablations, ablation))
    # the flow run (and worker) on the parent: a rerun that continues it names the newest one
    with tracking.run(cfg, "ablate", run_name=parent_run_name(cfg), run_id=previous,
                      tags={"fan_out": mode, **prefect_tags()},
                      job=str(paths.ablations.resolve())) as parent:
        parent_id = parent.info.run_id
        remember_parent(paths.ablations, ablation, parent_id)
        if previous is None:  # a row's method or seed is not the table's: those keys say "table: <preset>"
            tracking.log_config(cfg, table_params(cfg, jobs))
        # also into a continued parent (one an older mmcse started has none); the same ablation hash
        # means the same values, which MLflow accepts again
        mlflow.log_params(ablation_params(cfg, jobs))

        def progress(so_far: list[dict[str, Any]]) -> None:
            try:
                log_partial(cfg, parent_id, so_far, len(jobs))
            except Exception as err:  # the final log_ablation is the record; a hiccup here must not stop the jobs
                print(f"ablation parent run {parent_id}: metrics so far not logged ({err!r})")

        if mode == "deployment":
            results = fan_out_jobs(params_path, cfg, jobs, parent_id, job_deployment, poll_seconds, progress, given)
        else:
            retrying = train_variant.with_options(retries=cfg.ablate.retries, retry_delay_seconds=0,
                                                  retry_condition_fn=retry_unless_diverged)
            results = []
            metric = table_metric(cfg)
            for n, job in enumerate(jobs, start=1):
                print(f"[{n}/{len(jobs)}] {job.variant} seed={job.seed}: starting")
                started = time.perf_counter()
                try:
                    results.append(unwrap(retrying(params_path, job.variant, job.seed, parent_id, given)))
                except Exception as err:  # recorded as failed in the table, never dropped
                    if stopping.requested():  # Ctrl-C / SIGTERM as the job started: Prefect reports it as a crash
                        raise stopping.stop_exception(
                            f"job {n} of {len(jobs)} ({job.variant} seed={job.seed}) did not finish; rerun to "
                            "continue (finished jobs are reused)") from None
                    results.append(failed_result(job, err))
                print(f"[{n}/{len(jobs)}] " + job_line(results[-1], metric, (time.perf_counter() - started) / 60))
                progress(results)
        rows = aggregate(cfg, results)
        files = write_table(rows, paths.ablations, table_metric(cfg), cfg.ablate.reference, cfg.ablate.title,
                            environment_notes(results))
        log_ablation(cfg, rows, files, paths, results, run_id=parent_id)
        log_ablation_figures(cfg, results, parent_id, paths.ablations)
        for line in prune_other_tables(paths.ablations, jobs, paths.jobs):
            print(line)
    publish_table(files, rows, table_metric(cfg))
    print(terminal_table(files["md"].read_text()))  # fits 120 columns; ablation.csv keeps full precision
    return rows


def main(params_path: str) -> None:
    """``python flows/ablations.py [params.yaml]`` and the ablate stage: the params checked before
    the flow (and its temporary Prefect server) starts; a server a killed run of this project left
    behind is stopped first (`mmcse.experiments.prefect_server`); then the flow."""
    cfg = check_params(params_path)
    check_stand_ins(cfg, params_path)
    # its first line: how many jobs, how many are reused, and how long the rest train here (the train stage's pace)
    print(f"ablate: {start_line(cfg)}", flush=True)
    for variant, why in cfg.ablate.skipped.items():
        print(f"ablate: row {variant} not run: {why}", flush=True)
    check_api_url()  # an exported PREFECT_API_URL nothing answers: one line, not Prefect's traceback
    stop_stale_temporary_servers()
    claim_temporary_server()
    start_retry(lambda: ablations(params_path))


if __name__ == "__main__":
    from mmcse.entry import run_entry

    run_entry(lambda: main(sys.argv[1] if len(sys.argv) > 1 else "params.yaml"))
