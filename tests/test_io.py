"""Atomic writes: all or nothing, and the file mode a plain write would give."""

from __future__ import annotations

import os
import stat

import matplotlib.pyplot as plt
import pytest
import yaml

from mmcse.evaluation.plots import save_figure
from mmcse.io import atomic_path, load_yaml, write_json, write_text
from tests.conftest import REPO


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_written_files_get_the_umask_mode_not_the_temporary_files(tmp_path, umask):
    old = os.umask(umask)
    try:
        write_text(tmp_path / "a.txt", "x")
        write_json(tmp_path / "b.json", {"k": 1})
        fig, _ = plt.subplots()
        save_figure(fig, tmp_path / "c.png")
        plain = tmp_path / "plain.txt"
        plain.write_text("x")
    finally:
        os.umask(old)
    want = stat.S_IMODE(plain.stat().st_mode)
    assert want == 0o666 & ~umask
    for name in ("a.txt", "b.json", "c.png"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == want, name


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "t.txt"
    target.write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.write_text("half")
            raise RuntimeError("crash")
    assert target.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["t.txt"]


@pytest.mark.parametrize("width_in", [4.0, 15.0, 30.0])
def test_a_saved_figure_fits_a_1400_px_page(tmp_path, width_in):
    from PIL import Image

    fig, axes = plt.subplots(1, 3, figsize=(width_in, 3.8))
    for ax in axes:
        ax.set_title("a panel title long enough to reach the edge")
    save_figure(fig, tmp_path / "f.png")
    width = Image.open(tmp_path / "f.png").size[0]
    assert width <= 1400
    if width_in == 4.0:
        assert width < 1400 * 0.5  # a small figure keeps its resolution (110 dpi)


def test_build_folders_and_their_files_follow_the_umask(tmp_path):
    """Issue 33.13: mkdtemp's 0700 and safetensors' 0600 do not leak into outputs."""
    import os
    import stat

    import torch
    from safetensors.torch import save_file

    from mmcse.io import build_dir, follow_umask

    old = os.umask(0o022)
    try:
        build = build_dir(tmp_path, prefix=".x.")
        assert stat.S_IMODE(build.stat().st_mode) == 0o755
        (build / "sub").mkdir()
        save_file({"a": torch.zeros(2)}, str(build / "sub" / "w.safetensors"))
        assert stat.S_IMODE((build / "sub" / "w.safetensors").stat().st_mode) == 0o600  # what safetensors gives
        follow_umask(build)
        assert stat.S_IMODE((build / "sub" / "w.safetensors").stat().st_mode) == 0o644
        assert stat.S_IMODE((build / "sub").stat().st_mode) == 0o755
        os.umask(0o077)
        follow_umask(build)
        assert stat.S_IMODE((build / "sub" / "w.safetensors").stat().st_mode) == 0o600
        assert stat.S_IMODE(build_dir(tmp_path, prefix=".y.").stat().st_mode) == 0o700
    finally:
        os.umask(old)


def test_what_dvc_tracks_keeps_four_decimals_or_four_significant_digits(tmp_path):
    """Issue 39.3: the digits a different x86-64 CPU changes (6th-8th) never reach metrics/ or plots/."""
    import json
    import math

    from mmcse.io import tracked, write_metrics

    assert tracked(0.5147409416451164) == 0.5147 and tracked(70.85724738795254) == 70.8572
    assert tracked(-1.9071157801527643) == -1.9071
    assert tracked(1.2245297805642633e-05) == 1.225e-05 and tracked(0.00041634012539184953) == 0.0004163
    assert tracked(0.0) == 0.0 and tracked(20) == 20 and isinstance(tracked(20), int) and tracked("avg") == "avg"
    assert math.isnan(tracked(float("nan"))) and tracked(float("inf")) == float("inf")
    # a CPU's last-digit difference vanishes
    assert tracked(0.7415521047994973) == tracked(0.7415521047994981)
    write_metrics(tmp_path / "m.json", {"a": {"mean": 66.42305867886199, "p": None}, "rows": [0.123456789, 3]})
    assert json.loads((tmp_path / "m.json").read_text()) == {"a": {"mean": 66.4231, "p": None}, "rows": [0.1235, 3]}


def test_the_fast_yaml_loader_reads_every_project_file_as_the_safe_loader_does():
    files = [REPO / "params.yaml", REPO / "dvc.yaml", *sorted((REPO / "ablations").glob("*.yaml")),
             *sorted((REPO / "profiles").glob("*.yaml")), *sorted((REPO / "recipes").glob("*.yaml")),
             *sorted((REPO / "papers").glob("*.yaml"))]
    assert len(files) > 30
    for file in files:
        text = file.read_text()
        assert load_yaml(text) == yaml.safe_load(text), file
    # what the safe loader refuses, so does it
    with pytest.raises(yaml.YAMLError):
        load_yaml("a: !!python/object/apply:os.system ['true']")
    with pytest.raises(yaml.YAMLError):
        load_yaml("a: [1, 2")
