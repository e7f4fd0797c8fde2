"""Progress bars in a log (issue 56.5): whole lines at a steady pace, never a kilobyte of carriage returns."""

import io
import subprocess
import sys

from tqdm import tqdm

from mmcse.progress import LogLines, log_lines


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_bars_redraws_become_a_line_per_tenth_or_per_interval_and_its_last_state():
    out, clock = io.StringIO(), Clock()
    log = LogLines(out, every=30.0, clock=clock)
    log.write("starting\n")
    for step in range(1, 101):
        clock.now += 0.5  # 50 s in all: the tenths decide
        log.write(f"\rtrain mcse: {step:3d}%|#| {step}/100")
    log.write("\n")
    log.write("done\n")
    lines = out.getvalue().splitlines()
    assert lines[0] == "starting" and lines[-1] == "done"
    bars = lines[1:-1]
    assert [b.split(":")[1].split("%")[0].strip() for b in bars] == ["1", *map(str, range(10, 101, 10))]
    assert max(len(line) for line in lines) < 60


def test_a_slow_bar_gets_a_line_every_interval_and_a_cleared_bar_none():
    out, clock = io.StringIO(), Clock()
    log = LogLines(out, every=30.0, clock=clock)
    for step in range(6):  # no percentage (an unknown total): time alone
        clock.now += 20.0
        log.write(f"\rdownload: {step} files")
    log.write("\r" + " " * 20 + "\r")  # leave=False: the bar clears its line
    log.write("next\n")
    assert out.getvalue().splitlines() == ["download: 0 files", "download: 2 files", "download: 4 files", "next"]


def test_a_real_tqdm_bar_written_to_a_pipe_has_no_long_line():
    code = ("import time; from tqdm import tqdm; from mmcse.progress import log_lines\n"
            "with log_lines():\n"
            "    for _ in tqdm(range(2000), desc='train', mininterval=0): time.sleep(0.0005)\n"
            "    import sys; print('error: one line', file=sys.stderr)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    lines = out.stderr.splitlines()
    assert out.returncode == 0 and "\r" not in out.stderr, out.stderr[-500:]
    assert 2 <= len(lines) <= 13 and lines[-1] == "error: one line" and "2000/2000" in lines[-2], lines
    assert max(len(line) for line in lines) < 200


def test_on_a_terminal_or_twice_nothing_is_wrapped(monkeypatch):
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(sys, "stderr", Tty())
    with log_lines():
        assert not isinstance(sys.stderr, LogLines)
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    with log_lines():
        wrapped = sys.stderr
        assert isinstance(wrapped, LogLines)
        with log_lines():
            assert sys.stderr is wrapped
        for _ in tqdm(range(3), desc="x", file=sys.stderr):
            pass
    assert not isinstance(sys.stderr, LogLines)


def test_a_bar_that_says_it_does_something_else_gets_a_line_and_its_last_state_one():
    out, clock = io.StringIO(), Clock()
    log = LogLines(out, every=30.0, clock=clock)
    for line in ("evaluate:   0%|  | 0/4 [00:00<?, ?evaluator/s]",
                 "evaluate:   0%|  | 0/4 [00:00<?, ?evaluator/s, STS test (1 task)]",
                 "evaluate:   0%|  | 0/4 [00:01<?, ?evaluator/s, STS test (1 task)]",  # the clock alone: not a line
                 "evaluate: 100%|##| 4/4 [00:02<00:00, 2.1evaluator/s, done]",
                 "evaluate: 100%|##| 4/4 [00:02<00:00, 1.9evaluator/s, done]"):  # close(): the rate again
        log.write("\r" + line)
    log.write("\n")
    assert out.getvalue().splitlines() == [
        "evaluate:   0%|  | 0/4 [00:00<?, ?evaluator/s]",
        "evaluate:   0%|  | 0/4 [00:00<?, ?evaluator/s, STS test (1 task)]",
        "evaluate: 100%|##| 4/4 [00:02<00:00, 2.1evaluator/s, done]"]


def test_the_next_bar_of_the_same_name_starts_its_own_lines():
    out, clock = io.StringIO(), Clock()
    log = LogLines(out, every=30.0, clock=clock)
    for _job in range(2):  # two ablation jobs: two "train" bars, one after the other
        for step in (0, 5, 10):
            log.write(f"\rtrain: {step * 10:3d}%|#| {step}/10 [00:0{step}<00:00, 1.0it/s]")
        log.write("\n")
    assert [line.split("|")[0] for line in out.getvalue().splitlines()] == ["train:   0%", "train:  50%",
                                                                           "train: 100%"] * 2
