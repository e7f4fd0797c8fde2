"""A copy of the repo's params.yaml with the presets, profiles and recipes beside it."""

import pytest

from tests.conftest import params_copy


@pytest.fixture
def project(tmp_path):
    return params_copy(tmp_path)
