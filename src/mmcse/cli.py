"""The ``mmcse`` console script and the error wrapper every stage entry point uses."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from mmcse.entry import run_entry
from mmcse.errors import InputError

if TYPE_CHECKING:

    from matplotlib.figure import Figure

    from mmcse.config import Config


def _json_field(path: Path, key: str) -> object:
    try:
        return json.loads(path.read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None


def _local_model_problems(model: str) -> list[str]:
    """What is wrong with ``--model`` when it names a packaged model or a local folder (no hub
    lookup: a hub id is checked when it loads, after the cheap checks)."""
    from mmcse.hub import ModelUnavailableError, resolve_model

    if not (model.startswith(("packaged:", ".", "/", "~")) or Path(model).expanduser().exists()
            or model.count("/") > 1):
        return []
    try:
        resolve_model(model)
    except ModelUnavailableError as err:
        return [f"--model {err}"]
    return []


def _eval_retrieval_model(args: argparse.Namespace, method: str) -> None:
    """``mmcse eval`` of DUET / VSE++ / VSRN: an image–text retrieval model, scored on its own test regions."""
    problems = [] if args.retrieval else [f"--model {args.model}: an image–text retrieval model ({method}): score "
                                          "it with --retrieval"]
    problems += [f"{flag}: a retrieval model has no sentence-embedding tasks" for flag, given in
                 (("--senteval-dir", args.senteval_dir is not None), ("--mteb", bool(args.mteb)),
                  ("--transfer", args.transfer is not None)) if given]
    if problems:
        raise InputError("; ".join(problems))
    from mmcse.experiments.params import load_config
    from mmcse.pipeline.evaluate import checkpoint_retrieval
    from mmcse.pipeline.paths import Paths

    cfg = load_config(args.params)
    scores = checkpoint_retrieval(cfg, Paths.of(cfg), None, Path(args.model))
    print(json.dumps({k: round(v, 4) for k, v in scores.items()}, indent=2))


def _eval_transfer_tasks(args: argparse.Namespace) -> list[str]:
    """The transfer tasks ``--transfer`` asks for (none given: every one in the SentEval folder), each checked."""
    from mmcse.data.senteval import TRANSFER_TASKS, available_transfer_tasks

    present = available_transfer_tasks(args.senteval_dir)
    transfer = args.transfer or present
    unknown = [t for t in transfer if t not in TRANSFER_TASKS]
    if unknown:
        raise InputError(f"--transfer: unknown task(s) {', '.join(unknown)}; valid: {', '.join(TRANSFER_TASKS)}")
    missing = [t for t in transfer if t not in present]
    if missing or not transfer:
        raise FileNotFoundError(f"{args.senteval_dir}: no data for transfer task(s) "
                                f"{', '.join(missing) or 'any'} (present: {', '.join(present) or 'none'})")
    return transfer


def _cmd_eval(args: argparse.Namespace) -> None:
    # every argument checked before the first expensive step (the evaluators import torch, transformers,
    # scipy and scikit-learn: seconds), all problems named at once
    from mmcse.config import RETRIEVAL_METHODS, TransferConfig
    from mmcse.data.senteval import available_sts_tasks, read_sts_tasks, read_transfer_task

    state = Path(args.model) / "train_state.json"
    if state.is_file() and (method := _json_field(state, "method")) in RETRIEVAL_METHODS:
        _eval_retrieval_model(args, method)
        return
    problems = _local_model_problems(args.model)
    if args.senteval_dir is None and not args.mteb and not args.retrieval:
        problems.append("--senteval-dir is required unless --mteb names tasks or --retrieval is given")
    if args.senteval_dir is None and args.transfer is not None:
        problems.append("--transfer needs --senteval-dir")
    if args.senteval_dir is not None and not args.senteval_dir.is_dir():
        problems.append(f"{args.senteval_dir}: SentEval folder not found")
    mteb_tasks = []
    if args.mteb:
        from mmcse.evaluation.mteb import resolve_tasks

        try:
            mteb_tasks = resolve_tasks(args.mteb, "--mteb")
        except (ValueError, KeyError) as err:
            problems.append(str(err))
    if problems:
        raise InputError("; ".join(problems))
    if mteb_tasks:  # every data set loaded (offline: from the HF cache) before the model loads
        from mmcse.evaluation.mteb import load_task_data

        load_task_data(mteb_tasks)
    transfer: list[str] = []
    if args.transfer is not None:
        transfer = _eval_transfer_tasks(args)
        probe = TransferConfig(kfold=args.kfold)
        probe.validate("--kfold")
    cfg = None
    if args.retrieval:
        from mmcse.experiments.params import load_config

        cfg = load_config(args.params)  # before the model loads: a bad params.yaml is one line
    from mmcse.hub import resolve_model

    model = resolve_model(args.model)  # a hub id not on this machine, offline: one line before the imports
    from mmcse.evaluation.evaluators import EvaluationInputs, build_evaluators, run_evaluators
    from mmcse.evaluation.sts import TextEncoder

    encoder = TextEncoder(model, args.pooler, args.device, args.max_seq_len, precision=args.precision)
    retrieval = None
    if cfg is not None:
        from mmcse.pipeline.evaluate import checkpoint_retrieval
        from mmcse.pipeline.paths import Paths

        def retrieval(_: object) -> dict[str, float]:
            return checkpoint_retrieval(cfg, Paths.of(cfg), encoder, Path(model))

    sts = (read_sts_tasks(args.senteval_dir)
           if args.senteval_dir is not None and (not transfer or available_sts_tasks(args.senteval_dir)) else {})
    if args.senteval_dir is not None and not transfer and not any(sts.values()):
        raise FileNotFoundError(f"{args.senteval_dir}: no STS task data in this SentEval folder")
    details = {}
    if mteb_tasks:
        from mmcse.evaluation.mteb import encoder_details

        details = encoder_details(encoder, model)
    evaluators = build_evaluators(EvaluationInputs(
        sts=sts, transfer={t: read_transfer_task(args.senteval_dir, t) for t in transfer},
        transfer_probe=probe if transfer else TransferConfig(), mteb=mteb_tasks, mteb_model_name=args.model,
        mteb_output=args.mteb_output, mteb_details=details, retrieval=retrieval, data_dir=args.senteval_dir,
        batch_size=args.batch_size, device=args.device,
    ))
    scores = run_evaluators(evaluators, encoder)
    print(json.dumps({k: round(v, 4) for k, v in scores.items()}, indent=2))


def _cmd_export(args: argparse.Namespace) -> None:
    from mmcse.models.export import EVAL_MAX_SEQ_LEN, export_sentence_transformers

    # a local folder only: the export writes into it (never into site-packages or the HF cache)
    if args.model.startswith("packaged:"):
        raise InputError("--model: export writes into the folder; copy the packaged model to a folder of yours first")
    folder = Path(args.model).expanduser()
    if not folder.is_dir():
        raise FileNotFoundError(f"--model {args.model}: no such local model folder")
    length = EVAL_MAX_SEQ_LEN if args.max_seq_len is None else args.max_seq_len
    export_sentence_transformers(folder, args.pooler, length)
    print(f"{folder}: sentence-transformers folder (pooler {args.pooler}); "
          f"SentenceTransformer({str(folder)!r}).encode(...) gives `mmcse eval --pooler {args.pooler}`'s vectors")


def _cmd_sweep(args: argparse.Namespace) -> None:
    from mmcse.experiments.params import load_config
    from mmcse.experiments.sweep import best_line, run_sweep
    from mmcse.pipeline.paths import Paths

    cfg = load_config(args.params)
    summary = run_sweep(
        cfg, Paths.of(cfg), n_trials=args.n_trials, study_name=args.study_name, storage=args.storage
    )
    print(json.dumps(summary, indent=2))
    print(best_line(summary), file=sys.stderr)  # stdout stays JSON


def _cmd_profile(args: argparse.Namespace) -> None:
    import subprocess

    from mmcse.experiments.profiles import apply_profile, list_profiles

    root = Path(args.params).parent
    if args.name is None:
        print("\n".join(list_profiles(root)))
        return
    kept: dict[str, str] = {}
    changed = apply_profile(args.params, args.name, root, write=not args.show, kept=kept)
    for key, (old, new) in changed.items():
        print(f"{key}: {old!r} -> {new!r}")
    for key, folder in kept.items():
        print(f"{key}: {folder!r} kept (a local copy; the profile would download it)")
    if args.show:
        print(f"{args.params}: profile {args.name} would change {len(changed)} value(s) (nothing written)")
        return
    print(f"{args.params}: profile {args.name} applied ({len(changed)} value(s) changed)")
    if args.repro:
        # the whole DAG: download, detect, teachers, train, evaluate and the paper's ablation table
        raise SystemExit(subprocess.run(["dvc", "repro"], check=False).returncode)


def _cmd_plan(args: argparse.Namespace) -> None:
    from mmcse.experiments.plan import defaults_config, plan, plan_text

    result = plan(args.params, args.preset, args.reading)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(plan_text(result, defaults_config(Path(args.params))), end="")


def _cmd_preflight(args: argparse.Namespace) -> None:
    from mmcse.experiments.params import check_preset_name
    check_preset_name(args.params, args.preset)  # an unknown preset is said before torch is imported
    from mmcse.experiments.preflight import failed_rows, preflight, preflight_json, preflight_text, progress_line

    shown = None if args.json else lambda row: print(progress_line(row), file=sys.stderr, flush=True)
    result = preflight(args.params, args.preset, args.steps, args.timeout, progress=shown, cache_items=args.cache_items)
    print(preflight_json(result) if args.json else preflight_text(result))
    raise SystemExit(1 if failed_rows(result) else 0)


def _cmd_schema(args: argparse.Namespace) -> None:
    from mmcse.config import Config
    from mmcse.config.declared import json_schema
    from mmcse.io import write_text

    text = json.dumps(json_schema(Config), indent=2, ensure_ascii=False) + "\n"
    if args.out is None:
        print(text, end="")
    else:
        write_text(args.out, text)


def _cmd_generate(args: argparse.Namespace) -> None:
    """The files made from others, renewed: src/mmcse/config/sections.py from the term modules' sections, then
    params.schema.json from the configuration (in a fresh process: it imports the renewed sections)."""
    import subprocess
    import sys

    from mmcse.methods.sections import OUT, write_sections

    print(f"{OUT}: {'renewed' if write_sections() else 'up to date'}")
    subprocess.run([sys.executable, "-m", "mmcse.cli", "schema", "--out", str(args.schema)], check=True)
    print(f"{args.schema}: written")


def _cmd_runs(args: argparse.Namespace) -> None:
    import shutil

    from mmcse.experiments.runs import experiments_table, read_experiments, read_provenance

    exps, width = read_experiments(Path(args.repo)), args.width or shutil.get_terminal_size((200, 24)).columns
    print(experiments_table(exps, width, read_provenance(exps, Path(args.repo))), end="")


def _cmd_report(args: argparse.Namespace) -> None:
    from mmcse.experiments.params import load_config
    from mmcse.experiments.report import write_report
    from mmcse.runstore import SqliteRuns

    cfg = load_config(args.params)
    reader = SqliteRuns.open(cfg.base.mlflow_tracking_uri)
    if reader is None or args.log:  # another store than a SQLite file, or logging into it: through MLflow
        from mmcse import tracking
        from mmcse.tracking.reading import log_report, run_reader

        tracking.configure(cfg)
        reader = reader or run_reader(cfg.base.mlflow_tracking_uri)
    report = write_report(cfg, args.paper, args.table, args.out, Path(args.params).parent, reader)
    if args.log:
        log_report(report.files, report.runs, report.verdicts)
    print(report.markdown, end="")
    print(f"\nwritten: {report.files['md']} and {report.files['html']} (one self-contained page)"
          + (f"; logged under report/ in {len(report.runs)} ablation run(s)" if args.log and report.runs else ""))


def _log_figure(
    cfg: Config, fig: Figure, artifact: str, metrics: dict[str, float], log_run: str | None, run_name: str
) -> str:
    """Log ``fig`` (and finite ``metrics``) into run ``log_run`` (left as it is: its status is not
    touched) or, without one, into a new run ``run_name`` of experiment ``<prefix>-figures``."""
    import math

    import mlflow

    from mmcse import tracking

    finite = {k.replace("@", "_at_"): float(v) for k, v in metrics.items() if math.isfinite(v)}
    if log_run:
        client = mlflow.MlflowClient()
        client.get_run(log_run)  # an unknown id fails here, before anything is logged
        client.log_figure(log_run, fig, artifact)
        for key, value in finite.items():
            client.log_metric(log_run, f"figures/{key}", value)
        return log_run
    with tracking.run(cfg, "figures", run_name=run_name) as active:
        mlflow.log_figure(fig, artifact)
        mlflow.log_metrics(finite)
        return active.info.run_id


def _figures_config(args: argparse.Namespace) -> Config:
    """``--params`` with ``--tracking-uri`` in place of ``base.mlflow_tracking_uri``; MLflow pointed at it."""
    from dataclasses import replace

    from mmcse import tracking
    from mmcse.experiments.params import load_config

    cfg = load_config(args.params)
    if args.tracking_uri:
        cfg = replace(cfg, base=replace(cfg.base, mlflow_tracking_uri=args.tracking_uri))
    tracking.configure(cfg)
    return cfg


def _cmd_figures_sts(args: argparse.Namespace) -> None:
    from mmcse.evaluation.figures import sts_run_statistics, sts_scatter_runs
    from mmcse.evaluation.plots import save_figure
    from mmcse.tracking.reading import ablation_job_runs, load_sts_predictions, run_labels

    cfg = _figures_config(args)
    log_run = args.log_run
    if args.run:
        runs = run_labels(args.run)
    else:
        parent = args.parent
        if parent is None:
            from mmcse.tracking import remembered_run

            record = remembered_run(Path("ablation"), "ablation")
            if record is None:
                raise FileNotFoundError("ablation: no ablation parent run recorded (mlruns/records); "
                                        "pass --parent RUN_ID")
            parent = record["run_id"]
        runs = ablation_job_runs(parent, args.ablation, args.seed)
        log_run = log_run or parent  # the comparison belongs with the ablation's table
    predictions = {label: load_sts_predictions(run_id) for label, run_id in runs.items()}
    fig = sts_scatter_runs(predictions, args.task)
    stats = sts_run_statistics(predictions, args.task)
    save_figure(fig, args.out)
    if not args.no_mlflow:
        logged = _log_figure(cfg, fig, f"figures/{Path(args.out).name}", {}, log_run, "sts scatter of runs")
        print(f"logged figures/{Path(args.out).name} into MLflow run {logged}")
    print(json.dumps({"out": str(args.out), "runs": runs, **{k: round(v, 4) for k, v in stats.items()}}, indent=2))


def _cmd_figures_thresholds(args: argparse.Namespace) -> None:
    from mmcse.evaluation.teacher_statistics import save_threshold_statistics
    from mmcse.pipeline.paths import Paths

    cfg = _figures_config(args)
    paths = Paths.of(cfg)
    stats, fig = save_threshold_statistics(paths.teachers, paths.raw, args.out, args.metrics,
                                           threshold=cfg.loss.kdmcse.threshold_value,
                                           text_anchors=args.text_anchors or None)
    if not args.no_mlflow:
        logged = _log_figure(cfg, fig, f"figures/{Path(args.out).name}", stats, args.log_run,
                             "kdmcse threshold statistics")
        print(f"logged figures/{Path(args.out).name} into MLflow run {logged}")
    print(json.dumps({k: round(v, 4) for k, v in stats.items()}, indent=2))


def _cmd_prefect(args: argparse.Namespace) -> None:
    from mmcse.experiments.prefect_server import prefect_down, prefect_up

    if args.workers is not None and args.workers < 1:
        raise InputError(f"--workers {args.workers}: must be >= 1")
    if args.action == "up":
        prefect_up(".", port=args.port, gpu_workers=args.workers, gpus_per_worker=args.gpus_per_worker)
    else:
        prefect_down(".")


def _cmd_ui(args: argparse.Namespace) -> None:
    from mmcse.analysis.views import serve_ui
    from mmcse.experiments.params import load_config

    serve_ui(load_config(args.params), args.port, args.dashboard_port, dashboard=not args.no_dashboard)


class _Version(argparse.Action):
    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        from mmcse.integrity.code import version_line  # (git, only when asked)

        print(version_line())
        parser.exit()


def _model_commands(sub: argparse._SubParsersAction) -> None:
    """``eval`` and ``export``: any encoder, scored or made a sentence-transformers folder."""
    from mmcse.config import POOLERS

    ev = sub.add_parser("eval", help="SentEval STS (transfer, MTEB tasks) of any HF / sentence-transformers model")
    ev.add_argument("--model", required=True, help="HF id, local model folder or mmcse checkpoint")
    ev.add_argument("--senteval-dir", type=Path, default=None,
                    help="SentEval-layout folder (STS, transfer tasks); optional with --mteb")
    ev.add_argument("--pooler", default="cls_before_pooler", choices=POOLERS)
    ev.add_argument("--batch-size", type=int, default=128)
    ev.add_argument("--max-seq-len", type=int, default=512)
    ev.add_argument("--device", default="cpu")
    ev.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32",
                    help="autocast dtype of the encoder (vectors are compared in fp32)")
    ev.add_argument("--transfer", nargs="*", metavar="TASK", default=None,
                    help="also SentEval transfer tasks (MR CR SUBJ MPQA SST2 TREC MRPC; none named: all present)")
    ev.add_argument("--kfold", type=int, default=10, help="folds of the transfer-task probe (SimCSE: 10)")
    ev.add_argument("--mteb", nargs="+", metavar="TASK", default=None,
                    help="also MTEB tasks through the mteb package (names, or task types Reranking Classification "
                         "Retrieval STS: DALR Table 5); data from the HF datasets cache when offline")
    ev.add_argument("--mteb-output", type=Path, default=None, metavar="DIR",
                    help="keep mteb's results in its own layout under DIR/results/<model>/<revision>/ (one JSON "
                         "per task; mteb.ResultCache(cache_path=DIR) loads them)")
    ev.add_argument("--retrieval", action="store_true",
                    help="also image-text R@K and graded NDCG of an mmcse checkpoint (its trained image head) on "
                         "the retrieval test set of --params' data and teacher cache")
    ev.add_argument("--params", default="params.yaml", help="with --retrieval: the project's params.yaml")
    ev.set_defaults(func=_cmd_eval)

    ex = sub.add_parser("export", help="make a model folder (e.g. models/student/best) a sentence-transformers folder "
                                       "that pools as `mmcse eval --pooler` does")
    ex.add_argument("--model", required=True, help="local HF model folder or mmcse checkpoint (written into)")
    ex.add_argument("--pooler", required=True, choices=POOLERS)
    ex.add_argument("--max-seq-len", type=int, default=None,
                    help="tokens kept per sentence, capped by the tokenizer's model_max_length (default 512: "
                         "mmcse eval's and the evaluate stage's)")
    ex.set_defaults(func=_cmd_export)
    rg = sub.add_parser("register", help="register a trained, evaluated model in MLflow's model registry, its model "
                                         "card as the description")
    rg.add_argument("--name", required=True, help="the registered model's name (a new version when it exists)")
    rg.add_argument("--run", default=None, help="the training run whose model to register (default: the newest "
                                                "evaluated run of <prefix>-<train.method>, the train stage's)")
    rg.add_argument("--params", default="params.yaml")
    rg.set_defaults(func=_cmd_register)


def _cmd_register(args: argparse.Namespace) -> None:
    from mmcse import tracking
    from mmcse.experiments.params import load_config
    from mmcse.tracking.lineage import latest_model_run, register_run_model

    cfg = load_config(args.params)
    tracking.configure(cfg)
    experiment = f"{cfg.base.experiment_prefix}-{cfg.train.method}"
    run_id = args.run or latest_model_run(experiment)
    version, uri = register_run_model(run_id, args.name)
    print(f"registered {args.name} version {version} (run {run_id}, its model card as the description): {uri}")


def _experiment_commands(sub: argparse._SubParsersAction) -> None:
    """``sweep``, ``profile``, ``plan``, ``preflight``, ``schema``: what to run, and its configuration."""
    sw = sub.add_parser("sweep", help="Optuna sweep over params.yaml's sweep.space (resumable)")
    sw.add_argument("--params", default="params.yaml")
    sw.add_argument("--n-trials", type=int, default=None, help="total trials in the study (default sweep.n_trials)")
    sw.add_argument("--study-name", default=None)
    sw.add_argument("--storage", default=None, help="Optuna storage URL (default sweep.storage)")
    sw.set_defaults(func=_cmd_sweep)

    pr = sub.add_parser("profile", help="write a paper profile (profiles/<paper>.yaml) into params.yaml")
    pr.add_argument("name", nargs="?", help="<paper>-<flickr|coco>-<bert|roberta>, duet-<flickr|coco> or demo; "
                                            "omit to list them")
    pr.add_argument("--params", default="params.yaml", help="the params file (profiles/ and recipes/ beside it)")
    pr.add_argument("--show", action="store_true", help="print what it would change, write nothing")
    pr.add_argument("--repro", action="store_true", help="then run `dvc repro` (the paper's full table)")
    pr.set_defaults(func=_cmd_profile)

    pl = sub.add_parser("plan", help="the jobs an ablation would run, each row's configuration; trains nothing")
    pl.add_argument("--preset", default=None, help="an ablation preset (ablations/<name>.yaml); default ablate.preset")
    pl.add_argument("--params", default="params.yaml")
    pl.add_argument("--reading", default=None, help="recipe, printed or code (default ablate.reading)")
    pl.add_argument("--json", action="store_true", help="every row's whole configuration as JSON")
    pl.set_defaults(func=_cmd_plan)

    pf = sub.add_parser("preflight", help="every row of a table at its real shapes, a few steps here: ran or failed, "
                                          "peak memory, step time, projected time; downloads nothing")
    pf.add_argument("--preset", default=None, help="an ablation preset; default ablate.preset")
    pf.add_argument("--params", default="params.yaml")
    pf.add_argument("--steps", type=int, default=2, help="training steps per row (the first is not timed)")
    pf.add_argument("--timeout", type=float, default=None, help="seconds a row may take before it counts as failed")
    pf.add_argument("--cache-items", type=int, default=16, help="synthetic items per teacher-cache check (0: none)")
    pf.add_argument("--json", action="store_true", help="the rows' measurements as JSON")
    pf.set_defaults(func=_cmd_preflight)

    sc_ = sub.add_parser("schema", help="the JSON Schema of params.yaml (types, bounds, valid keys) for an editor")
    sc_.add_argument("--out", type=Path, default=None, help="write it here (params.schema.json) instead of stdout")
    sc_.set_defaults(func=_cmd_schema)
    gen = sub.add_parser("generate", help="renew the generated files: src/mmcse/config/sections.py (the loss terms' "
                         "sections) and params.schema.json; run it after adding or changing a loss.<section>")
    gen.add_argument("--schema", type=Path, default=Path("params.schema.json"), help="where the schema goes")
    gen.set_defaults(func=_cmd_generate)


def _record_commands(sub: argparse._SubParsersAction) -> None:
    """``runs`` and ``report``: what ran, and how it compares with the papers."""
    rn = sub.add_parser("runs", help="DVC's experiments in one compact table: method, changed params, headline "
                        "scores (what `dvc exp show` lists in ~400 columns)")
    rn.add_argument("--repo", default=".", help="the DVC repository")
    rn.add_argument("--width", type=int, default=None, help="columns (default: the terminal's)")
    rn.set_defaults(func=_cmd_runs)

    rp = sub.add_parser("report", help="a paper's tables beside mmcse's reproduction (Markdown + HTML, from MLflow)")
    rp.add_argument("paper", help="dalr, kdmcse, mcseo or duet (papers/<paper>.yaml)")
    rp.add_argument("--table", default=None, help="one table or figure: 3, table3 or fig7 (default: all)")
    rp.add_argument("--out", default="reports", help="folder of <paper>.md and <paper>.html")
    rp.add_argument("--params", default="params.yaml", help="its store and prefix name the MLflow record read")
    rp.add_argument("--log", action="store_true", help="also log the report into the ablation runs it read "
                    "(the report stage does)")
    rp.set_defaults(func=_cmd_report)


def _figure_commands(sub: argparse._SubParsersAction) -> None:
    """``figures sts-scatter`` and ``figures thresholds``."""
    fg = sub.add_parser("figures", help="figures comparing runs and teachers (PNG + MLflow)")
    fsub = fg.add_subparsers(dest="figure", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--params", default="params.yaml")
    common.add_argument("--tracking-uri", default=None, help="MLflow store (default base.mlflow_tracking_uri)")
    common.add_argument("--log-run", default=None, metavar="RUN_ID",
                        help="log the figure into this run (default: the ablation parent, else a new run "
                             "in experiment <prefix>-figures)")
    common.add_argument("--no-mlflow", action="store_true", help="only write the PNG")
    sc = fsub.add_parser("sts-scatter", parents=[common],
                         help="STS predicted cosine vs gold of several runs side by side (DALR Fig. 4)")
    which = sc.add_mutually_exclusive_group(required=True)
    which.add_argument("--run", nargs="+", metavar="RUN_ID", help="MLflow runs with evaluation/sts_predictions.json")
    which.add_argument("--ablation", nargs="+", metavar="VARIANT", help="variants of an ablation (its jobs.json)")
    sc.add_argument("--parent", default=None, metavar="RUN_ID",
                    help="the ablation's parent run (default: the last ablation recorded in mlruns/records)")
    sc.add_argument("--seed", type=int, default=None, help="--ablation: the job seed (default: each variant's lowest)")
    sc.add_argument("--task", default=None,
                    help="STS task to plot (default STSBenchmark, else the first task every run has)")
    sc.add_argument("--out", type=Path, default=Path("plots/sts_scatter_runs.png"))
    sc.set_defaults(func=_cmd_figures_sts)
    th = fsub.add_parser("thresholds", parents=[common],
                         help="KDMCSE threshold statistics of the cached joint teacher (paper §6.2)")
    th.add_argument("--out", type=Path, default=Path("plots/kdmcse_threshold.png"))
    th.add_argument("--metrics", type=Path, default=Path("metrics/threshold.json"))
    th.add_argument("--text-anchors", type=int, default=2000,
                    help="captions sampled as anchors for the caption–caption α (0: all)")
    th.set_defaults(func=_cmd_figures_thresholds)


def _server_commands(sub: argparse._SubParsersAction) -> None:
    """``ui`` and ``prefect``: the local servers, bound to 127.0.0.1."""
    ui = sub.add_parser("ui", help="MLflow UI (runs view) and, when installed, optuna-dashboard on 127.0.0.1")
    ui.add_argument("--params", default="params.yaml")
    ui.add_argument("--port", type=int, default=5000, help="MLflow UI port")
    ui.add_argument("--dashboard-port", type=int, default=8080, help="optuna-dashboard port")
    ui.add_argument("--no-dashboard", action="store_true", help="only the MLflow UI")
    ui.set_defaults(func=_cmd_ui)

    pf = sub.add_parser("prefect", help="bring the Prefect side up in order (server, pools, deployments, workers) "
                        "or down")
    pf.add_argument("action", choices=("up", "down"))
    pf.add_argument("--port", type=int, default=4200, help="the server's port on 127.0.0.1")
    pf.add_argument("--workers", type=int, default=None, help="workers on pool gpu where no GPU is visible (default 1)")
    pf.add_argument("--gpus-per-worker", type=int, default=1, help="with GPUs: each gpu worker's (train.devices: auto)")
    pf.set_defaults(func=_cmd_prefect)


def build_parser() -> argparse.ArgumentParser:
    """The ``mmcse`` command line (each command's handler in its ``func`` default)."""
    parser = argparse.ArgumentParser(prog="mmcse", description="multimodal sentence embeddings workflow")
    parser.add_argument("--version", action=_Version, nargs=0, help="the package's version and its commit")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_model_commands, _experiment_commands, _record_commands, _figure_commands, _server_commands):
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    run_entry(lambda: args.func(args))


if __name__ == "__main__":
    main()
