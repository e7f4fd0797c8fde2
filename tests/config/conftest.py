"""A copy of the repo's params.yaml with the presets, profiles and recipes beside it."""

import shutil

import pytest

from tests.conftest import REPO


@pytest.fixture
def project(tmp_path):
    shutil.copy(REPO / "params.yaml", tmp_path / "params.yaml")
    for folder in ("ablations", "profiles", "recipes"):
        shutil.copytree(REPO / folder, tmp_path / folder)
    return tmp_path
