"""The error a bad params file or override raises, naming the key."""

from __future__ import annotations

import typing

from mmcse.errors import ConfigError


def fail(where: str, key: str, message: str) -> typing.NoReturn:
    raise ConfigError(f"{where}: key '{key}': {message}")


def check(cond: bool, where: str, key: str, message: str) -> None:
    if not cond:
        fail(where, key, message)
