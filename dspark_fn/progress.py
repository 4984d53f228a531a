"""A status line on stderr for one-off waits (the first calibration, the
first compile on a machine): what is happening, how far it got, about how
long is left, and where its result is kept. On a terminal the line is
redrawn in place; into a file or pipe it is written first, then at most
every ``PIPE_SECONDS``, and at the end."""

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

    def show(self, text: str) -> None:
        if self.terminal:
            self.stream.write("\r" + text.ljust(self.width))
            self.width = len(text)
        elif time.monotonic() - self.written_at >= PIPE_SECONDS:
            self.stream.write(text + "\n")
            self.written_at = time.monotonic()
        self.stream.flush()

    def done(self, text: str) -> None:
        self.stream.write(("\r" + text.ljust(self.width) if self.terminal else text) + "\n")
        self.stream.flush()
