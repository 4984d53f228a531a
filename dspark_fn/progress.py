"""A status line on stderr for one-off waits (the first calibration, the
first compile on a machine): what is happening, how far it got, about how
long is left, and where its result is kept. On a terminal the line is
redrawn in place; into a file or pipe it is written when it changes
its first words, at most every ``PIPE_SECONDS``, and at the end."""

import sys
import time

PIPE_SECONDS = 10.0


def duration(seconds: float) -> str:
    """A rough duration: "40 s", "3 min"."""
    return f"{max(1, round(seconds))} s" if seconds < 90 else f"{round(seconds / 60)} min"


def about(seconds: float) -> str:
    return f"about {duration(seconds)}"


class Status:
    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.terminal = self.stream.isatty()
        self.width = 0
        self.written_at = float("-inf")
        self.last = ""

    def show(self, text: str) -> None:
        if self.terminal:
            self.stream.write("\r" + text.ljust(self.width))
            self.width = len(text)
        elif text.split(":")[0] != self.last.split(":")[0] or time.monotonic() - self.written_at >= PIPE_SECONDS:
            self.stream.write(text + "\n")
            self.written_at = time.monotonic()
        self.last = text
        self.stream.flush()

    def done(self, text: str) -> None:
        self.stream.write(("\r" + text.ljust(self.width) if self.terminal else text) + "\n")
        self.stream.flush()
