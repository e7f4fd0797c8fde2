"""The error wrapper of every entry point (DVC stages, Prefect flows, the ``mmcse`` console script):
expected input errors become one clear line and exit status 2, library chatter is kept out of logs."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable

from mmcse.config import ConfigError


def quiet_libraries() -> None:
    """Keep stage logs readable: no per-load reports or telemetry chatter."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # read by transformers and huggingface_hub when they load: no import here, so an entry point that
    # fails on its arguments answers before the seconds torch and transformers take
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "transformers" in sys.modules:  # already loaded: set what the variables would have
        transformers = sys.modules["transformers"]
        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
    for name in ("mlflow", "alembic", "optuna"):
        logging.getLogger(name).setLevel(logging.WARNING)


def run_entry(fn: Callable[[], object]) -> None:
    """Run a stage/CLI body; turn expected input errors into one clear line and exit 2."""
    from mmcse.data.fetch import DownloadError
    from mmcse.errors import PrecisionError, TrainingDiverged, TrainingOutOfMemory
    from mmcse.hub import ModelUnavailableError

    quiet_libraries()
    try:
        fn()
    except (ConfigError, ModelUnavailableError, DownloadError, FileNotFoundError, ValueError, KeyError,
            PrecisionError, TrainingOutOfMemory, TrainingDiverged) as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
