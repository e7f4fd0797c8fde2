"""The entry wrapper: what a user can fix is one line (exit 2); a bug keeps its traceback, then the line (exit 1)."""

import pytest

from mmcse import stopping
from mmcse.entry import _run_entry
from mmcse.errors import ConfigError, InputError, MissingEntry


def _run(fn, capsys):
    capsys.readouterr()
    try:
        with pytest.raises(SystemExit) as stopped:
            _run_entry(fn, "", "params.yaml")
    finally:
        stopping.reset()
    return stopped.value.code, capsys.readouterr().err


def _raise(err):
    def fn():
        raise err
    return fn


@pytest.mark.parametrize("err, line", [
    (ConfigError("params.yaml: loss.temperature: must be > 0"), "error: params.yaml: loss.temperature: must be > 0"),
    (InputError("data/raw/pairs.jsonl:3: corrupt JSON line"), "error: data/raw/pairs.jsonl:3: corrupt JSON line"),
    (MissingEntry("data/teachers/x: no cached features for id 'zz'"),
     "error: data/teachers/x: no cached features for id 'zz'"),  # no quotes around a KeyError's message
    (FileNotFoundError("data/raw/sts/test.jsonl"), "error: data/raw/sts/test.jsonl"),
])
def test_what_a_user_can_fix_is_one_line_and_exit_2(err, line, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no params.yaml here: no leftover note
    code, err_text = _run(_raise(err), capsys)
    assert code == 2 and err_text == line + "\n"


@pytest.mark.parametrize("err", [KeyError("loss.toy.wieght"), ValueError("shapes (3,) and (4,)"),
                                 TypeError("unsupported operand")])
def test_a_bug_keeps_its_traceback_then_the_line_and_exit_1(err, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)

    def inner():
        raise err

    code, err_text = _run(inner, capsys)
    assert code == 1
    assert err_text.startswith("Traceback (most recent call last):") and "in inner" in err_text
    last = err_text.rstrip("\n").splitlines()[-1]
    assert last.startswith(f"error: {type(err).__name__}: ") and "a bug in mmcse" in last
