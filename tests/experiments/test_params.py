"""params.yaml against its last commit: what a failed `dvc exp run -S` left behind."""

import subprocess

from mmcse.experiments.params import leftover_note, uncommitted_params


def _git(cwd, *args):
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True,
                   env={"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                        "GIT_COMMITTER_EMAIL": "t@t", "PATH": "/usr/bin:/bin"})


def test_values_left_by_failed_experiments_are_named_with_their_committed_ones(tmp_path):
    """Issue 53.6: `-S train.devices=0` fails, then `-S train.dropout_rng=bogus`: DVC left the first value in
    params.yaml, so the second is checked with it; the note names both, each with the committed value, and
    how to drop them."""
    params = tmp_path / "params.yaml"
    params.write_text("train:\n  devices: 1\n  dropout_rng: fork\nloss:\n  lambda_img: 0.1\n")
    assert uncommitted_params(params) == [] and leftover_note(params) is None  # not a repository yet
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", "params.yaml")
    _git(tmp_path, "commit", "-qm", "params")
    assert leftover_note(params) is None
    params.write_text("train:\n  devices: 0\n  dropout_rng: bogus\n  micro_batch: 64\nloss:\n  lambda_img: 0.1\n")
    assert uncommitted_params(params) == ["train.devices=0 (committed: 1)", "train.dropout_rng=bogus (committed: fork)",
                                          "train.micro_batch=64 (committed: (none))"]
    note = leftover_note(params)
    assert note.startswith(f"note: {params} differs from the last commit at train.devices=0 (committed: 1), ")
    assert note.endswith(f"`git checkout {params}` drops them") and "\n" not in note
