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
