"""The error a bad params file or override raises, naming the key."""

from __future__ import annotations

import typing


class ConfigError(ValueError):
    """A params file or override that cannot be turned into a valid config."""


def fail(where: str, key: str, message: str) -> typing.NoReturn:
    raise ConfigError(f"{where}: key '{key}': {message}")


def check(cond: bool, where: str, key: str, message: str) -> None:
    if not cond:
        fail(where, key, message)
