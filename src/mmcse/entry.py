"""The error wrapper of every entry point (DVC stages, Prefect flows, the ``mmcse`` console script):
what a user can fix (`mmcse.errors.USER_ERRORS`: a configuration, an input file, missing data) becomes one clear
line and exit status 2; any other exception is a bug and keeps its traceback, then the same one line (exit 1);
library chatter is kept out of logs."""

from __future__ import annotations

import logging
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

from mmcse import stopping
from mmcse.errors import USER_ERRORS, ConfigError
from mmcse.experiments.params import leftover_note, load_config
from mmcse.io import hold_outputs
from mmcse.pipeline.paths import Paths
from mmcse.processes import holds_outputs
from mmcse.progress import log_lines


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
    # MLflow logs every failed SQL statement with its traceback before raising it (a locked SQLite store:
    # one per retry); the error itself is reported, once, by whoever handles it (`mmcse.tracking.retry_locked`)
    logging.getLogger("mlflow.store.db.utils").setLevel(logging.CRITICAL)


def run_entry(fn: Callable[[], object], stage: str = "", params: str = "params.yaml") -> None:
    """Run a stage/CLI body; turn expected input and environment errors into one clear line and exit 2.

    ``stage``: the DVC stage it is; the folders it writes (`mmcse.pipeline.paths.Paths.written_by`, from
    ``params``) are held exclusively while it runs (`mmcse.io.hold_outputs`: a second stage on them
    fails at once naming the first). SIGTERM and SIGINT stop it cleanly (`mmcse.stopping`: a running
    training first writes a resume point; exit 128 + the signal), and a DVC stage also stops when the
    ``dvc`` process that started it dies."""

    quiet_libraries()
    stopping.install()
    stopping.watch_parent()
    with log_lines():  # progress bars as whole lines when stderr is a log, not a terminal (`mmcse.progress`)
        _run_entry(fn, stage, params)


def _run_entry(fn: Callable[[], object], stage: str, params: str) -> None:
    try:
        holds: Sequence[Path] = ()
        if stage and holds_outputs():  # not a process of a job on several (`mmcse.processes`)
            holds = Paths.of(load_config(params)).written_by(stage)
        with hold_outputs(holds, f"the {stage} stage" if stage else "another mmcse process"):
            fn()
    except USER_ERRORS as err:
        print(f"error: {err}", file=sys.stderr)
        if isinstance(err, ConfigError) and (note := leftover_note(params)):
            print(note, file=sys.stderr)
        raise SystemExit(2) from None
    except stopping.StopRequested as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(err.exit_code) from None
    except BrokenPipeError:  # the reader went away (`mmcse … | head`): nothing more to say to it
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(1) from None
    except Exception as err:  # a bug: where it happened first, then the line a log's last screen shows
        traceback.print_exc()
        print(f"error: {type(err).__name__}: {err} (a bug in mmcse: the traceback above says where)", file=sys.stderr)
        raise SystemExit(1) from None
