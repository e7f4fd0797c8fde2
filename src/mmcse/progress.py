"""Progress bars that read well in a log. On a terminal a bar redraws itself in place; written to a file or a
pipe (`dvc repro > log`, CI, a Prefect worker) each redraw was appended to the same line, which grew to
kilobytes. `LogLines` stands in for stderr there: a bar's redraws become whole lines, one each time it
passes another tenth, says it does something else (its description or postfix) or `EVERY` seconds after the
last, and its final state; other text passes unchanged.
"""

from __future__ import annotations

import contextlib
import io
import re
import sys
import time
from collections.abc import Callable, Iterator
from typing import TextIO

EVERY = 30.0  # seconds between two lines of one bar, at most (a tenth of the way also gives one)
PERCENT = re.compile(r"(\d{1,3})%\|")  # tqdm's "  40%|████      | 4/10"
# a bar's numbers: "40%|████      | 4/10 [00:02<00:03, 1.9it/s" (what is left: its description and postfix)
NUMBERS = re.compile(r"\d{1,3}%\|[^|]*\|\s*[\d.?kMG]+/[\d.?kMG]+(\s*\[[^,\]]*(,\s*[^\s,\]]*/[^\s,\]]*)?)?")
COUNTS = re.compile(r"\|\s*([\d.?kMG]+/[\d.?kMG]+)")  # "| 4/10": how far, as counted


def _counts(line: str) -> str | None:
    found = COUNTS.search(line)
    return found.group(1) if found else None


def _what(line: str) -> str:
    """A bar's line without its numbers: what it says it does (its description and postfix)."""
    return " ".join(NUMBERS.sub("", line).split())


class LogLines(io.TextIOBase):
    """``stream`` (a log) as a bar sees a terminal: text after a carriage return is a redraw of the current
    line, kept until it is worth a line (`EVERY` seconds, another tenth — or a new bar's first —, another
    description or postfix) or the line ends; a redraw that only clears the line (a bar that does not stay),
    or repeats the last line's counts and words, is dropped."""

    def __init__(self, stream: TextIO, every: float = EVERY, clock: Callable[[], float] = time.monotonic) -> None:
        self.stream, self.every, self.clock = stream, every, clock
        self.line = ""  # the text of the line being written
        self.redrawn = False  # the line is a bar's redraw (it followed a carriage return)
        self.shown = ""  # the last line written
        self.shown_at, self.shown_tenth = -float("inf"), -1
        self.shown_what = ""  # the last line's description and postfix (`NUMBERS` taken out)

    def write(self, text: str) -> int:
        for n, piece in enumerate(text.split("\r")):
            if n:
                self.line, self.redrawn = "", True
            for m, part in enumerate(piece.split("\n")):
                if m:
                    self._end_line()
                self.line += part
        if self.redrawn and self.line.strip():
            found = PERCENT.search(self.line)
            tenth = int(found.group(1)) // 10 if found else -1
            moved = found is not None and (tenth != self.shown_tenth or _what(self.line) != self.shown_what)
            if moved or self.clock() - self.shown_at >= self.every:
                self._show(self.line, tenth)
        return len(text)

    def _end_line(self) -> None:
        line, self.line = self.line, ""
        found = PERCENT.search(line)
        counts = COUNTS.search(line)
        same = line == self.shown or (counts is not None and counts.group(1) == _counts(self.shown)
                                      and _what(line) == self.shown_what)
        if self.redrawn and (not line.strip() or same):
            self.redrawn = False
            return  # a cleared bar, or its last state already written (but for the rate)
        self._show(line, int(found.group(1)) // 10 if found else -1)
        self.redrawn = False

    def _show(self, line: str, tenth: int) -> None:
        self.stream.write(line.rstrip() + "\n")
        self.stream.flush()
        self.shown, self.shown_at, self.shown_tenth, self.shown_what = line, self.clock(), tenth, _what(line)

    def end(self) -> None:
        """Write a last line that never got its newline (a bar's redraw is written by its own close)."""
        if self.line.strip() and not self.redrawn:
            self._show(self.line, -1)
        self.line = ""

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self.stream.fileno()

    def writable(self) -> bool:
        return True

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self.stream, "encoding", "utf-8")


@contextlib.contextmanager
def log_lines() -> Iterator[None]:
    """Inside, ``sys.stderr`` is a `LogLines` when it is not a terminal (bars read as lines in a log)."""
    stream = sys.stderr
    if stream is None or stream.isatty() or isinstance(stream, LogLines):
        yield
        return
    sys.stderr = LogLines(stream)
    try:
        yield
    finally:
        if isinstance(sys.stderr, LogLines):
            with contextlib.suppress(Exception):
                sys.stderr.end()
        sys.stderr = stream
