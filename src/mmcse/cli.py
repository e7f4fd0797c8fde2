"""The ``mmcse`` console script and the error wrapper every stage entry point uses."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path

from mmcse.config import ConfigError


def quiet_libraries() -> None:
    """Keep stage logs readable: no per-load reports or telemetry chatter."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    try:
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
    except ImportError:
        pass
    for name in ("mlflow", "alembic", "optuna"):
        logging.getLogger(name).setLevel(logging.WARNING)


def run_entry(fn: Callable[[], object]) -> None:
    """Run a stage/CLI body; turn expected input errors into one clear line and exit 2."""
    from mmcse.data.fetch import DownloadError
    from mmcse.errors import PrecisionError, TrainingOutOfMemory
    from mmcse.hub import ModelUnavailableError

    quiet_libraries()
    try:
        fn()
    except (ConfigError, ModelUnavailableError, DownloadError, FileNotFoundError, ValueError, KeyError,
            PrecisionError, TrainingOutOfMemory) as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


def _cmd_eval(args: argparse.Namespace) -> None:
    from mmcse.config import TransferConfig
    from mmcse.data.senteval import (
        TRANSFER_TASKS,
        available_sts_tasks,
        available_transfer_tasks,
        read_sts_tasks,
        read_transfer_task,
    )
    from mmcse.evaluation.sts import TextEncoder, evaluate_sts
    from mmcse.evaluation.transfer import evaluate_transfer

    if args.senteval_dir is None and not args.mteb:
        raise ValueError("--senteval-dir is required unless --mteb names tasks")
    if args.senteval_dir is None and args.transfer is not None:
        raise ValueError("--transfer needs --senteval-dir")
    if args.senteval_dir is not None and not args.senteval_dir.is_dir():
        raise FileNotFoundError(f"{args.senteval_dir}: SentEval folder not found")
    transfer: list[str] = []
    if args.transfer is not None:
        present = available_transfer_tasks(args.senteval_dir)
        transfer = args.transfer or present
        unknown = [t for t in transfer if t not in TRANSFER_TASKS]
        if unknown:
            raise ValueError(f"--transfer: unknown task(s) {', '.join(unknown)}; valid: {', '.join(TRANSFER_TASKS)}")
        missing = [t for t in transfer if t not in present]
        if missing or not transfer:
            raise FileNotFoundError(f"{args.senteval_dir}: no data for transfer task(s) "
                                    f"{', '.join(missing) or 'any'} (present: {', '.join(present) or 'none'})")
        probe = TransferConfig(kfold=args.kfold)
        probe.validate("--kfold")
    mteb_tasks = []
    if args.mteb:
        from mmcse.evaluation.mteb import prepare_tasks

        # names checked and every data set loaded (offline: from the HF cache) before the model loads
        mteb_tasks = prepare_tasks(args.mteb, "--mteb")
    encoder = TextEncoder(args.model, args.pooler, args.device, args.max_seq_len,  # fails fast if offline
                          precision=args.precision)
    scores: dict[str, float] = {}
    if args.senteval_dir is not None and (not transfer or available_sts_tasks(args.senteval_dir)):
        scores |= evaluate_sts(encoder, read_sts_tasks(args.senteval_dir), args.batch_size).scores
    if transfer:
        tasks = {t: read_transfer_task(args.senteval_dir, t) for t in transfer}
        scores |= evaluate_transfer(encoder, tasks, probe, args.batch_size, args.device).scores
    if mteb_tasks:
        from mmcse.evaluation.mteb import mteb_scores

        scores |= mteb_scores(encoder, args.model, mteb_tasks, args.batch_size, args.mteb_output)
    print(json.dumps({k: round(v, 4) for k, v in scores.items()}, indent=2))


def _cmd_sweep(args: argparse.Namespace) -> None:
    from mmcse.config import load_config
    from mmcse.pipeline import Paths
    from mmcse.sweep import run_sweep

    cfg = load_config(args.params)
    summary = run_sweep(
        cfg, Paths.of(cfg), n_trials=args.n_trials, study_name=args.study_name, storage=args.storage
    )
    print(json.dumps(summary, indent=2))


def _cmd_profile(args: argparse.Namespace) -> None:
    import subprocess

    from mmcse.profiles import apply_profile, list_profiles

    if args.name is None:
        print("\n".join(list_profiles(args.profiles_dir)))
        return
    changed = apply_profile(args.params, args.name, args.profiles_dir)
    for key, (old, new) in changed.items():
        print(f"{key}: {old!r} -> {new!r}")
    print(f"{args.params}: profile {args.name} applied ({len(changed)} value(s) changed)")
    if args.repro:
        # the whole DAG: download, detect, teachers, train, evaluate and the paper's ablation table
        raise SystemExit(subprocess.run(["dvc", "repro"], check=False).returncode)


def main(argv: list[str] | None = None) -> None:
    from mmcse.config import POOLERS

    parser = argparse.ArgumentParser(prog="mmcse", description="multimodal sentence embeddings workflow")
    sub = parser.add_subparsers(dest="command", required=True)

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
    ev.add_argument("--mteb-output", type=Path, default=None, help="folder for mteb's per-task result JSONs")
    ev.set_defaults(func=_cmd_eval)

    sw = sub.add_parser("sweep", help="Optuna sweep over params.yaml's sweep.space (resumable)")
    sw.add_argument("--params", default="params.yaml")
    sw.add_argument("--n-trials", type=int, default=None, help="total trials in the study (default sweep.n_trials)")
    sw.add_argument("--study-name", default=None)
    sw.add_argument("--storage", default=None, help="Optuna storage URL (default sweep.storage)")
    sw.set_defaults(func=_cmd_sweep)

    pr = sub.add_parser("profile", help="write a paper profile (profiles/<paper>.yaml) into params.yaml")
    pr.add_argument("name", nargs="?", help="<paper>-<flickr|coco>-<bert|roberta>; omit to list them")
    pr.add_argument("--params", default="params.yaml")
    pr.add_argument("--profiles-dir", default="profiles")
    pr.add_argument("--repro", action="store_true", help="then run `dvc repro` (the paper's full table)")
    pr.set_defaults(func=_cmd_profile)

    args = parser.parse_args(argv)
    run_entry(lambda: args.func(args))


if __name__ == "__main__":
    main()
