"""The loss terms' sections: declared beside their terms, copied into src/mmcse/config/sections.py by `mmcse
generate`; the copy is what the configuration uses, and a declaration that differs from it does not import."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import sys

import pytest

from mmcse.config import Config, LossConfig
from mmcse.config.sections import LOSS_SECTIONS, TermSections
from mmcse.methods.sections import OUT, TERMS_DIR, generated_text
from mmcse.methods.terms import REGISTRY
from mmcse.methods.terms.base import loss_section
from tests.conftest import REPO


def test_the_generated_copy_is_the_term_modules_sections():
    assert OUT.read_text() == generated_text(), "src/mmcse/config/sections.py is stale: run `mmcse generate`"
    assert set(LOSS_SECTIONS) >= {"simcse", "mcse", "kdmcse", "dalr", "mcseo"}  # and a contributor's
    assert {f.name for f in dataclasses.fields(TermSections)} == set(LOSS_SECTIONS)
    assert issubclass(LossConfig, TermSections) and Config().loss.dalr == LOSS_SECTIONS["dalr"][0]()


def test_a_term_modules_section_is_its_copy_in_the_configuration():
    import mmcse.methods.terms.dalr as dalr

    assert dalr.DALRLossConfig is LOSS_SECTIONS["dalr"][0]  # one class: the configuration's
    assert REGISTRY["cma"].compute.__module__ == dalr.__name__


def test_a_declaration_that_differs_from_its_copy_names_the_command():
    @dataclasses.dataclass(frozen=True)
    class MCSELossConfig:
        clip_text: bool = True  # another default than the copy's

    with pytest.raises(ImportError, match=r"loss.mcse .* differs from its copy .*run `mmcse generate`"):
        loss_section("mcse", LOSS_SECTIONS["mcse"][1])(MCSELossConfig)
    with pytest.raises(ImportError, match="loss.toy"):
        loss_section("toy", "a section nobody generated")(MCSELossConfig)


def test_a_new_section_is_generated_with_its_imports_and_docs(tmp_path):
    terms = tmp_path / "terms"
    shutil.copytree(TERMS_DIR, terms)
    (terms / "toy.py").write_text(
        'from dataclasses import dataclass\n\nfrom mmcse.config.declared import SECTION, Angle\n'
        'from mmcse.methods.terms.base import loss_section\n\n\n'
        '@loss_section("toy", "a toy section")\n@dataclass(frozen=True)\nclass ToyLossConfig:\n'
        '    __pydantic_config__ = SECTION\n    margin: Angle = 0.5\n    """the toy margin"""\n')
    text = generated_text(terms)
    assert "class ToyLossConfig:" in text and "    toy: ToyLossConfig = field(default_factory=ToyLossConfig)" in text
    assert "'toy': (ToyLossConfig, 'a toy section')," in text and '    """a toy section"""' in text
    out = tmp_path / "sections.py"
    out.write_text(text)
    ruff = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(out)], capture_output=True,
                          text=True, cwd=REPO)
    assert ruff.returncode == 0, ruff.stdout
