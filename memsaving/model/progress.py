"""One progress line on stderr for long work (profiling kernels, planning).

Short work prints nothing: the line appears once the work has taken
``delay`` seconds.  On a terminal it is rewritten in place; elsewhere (logs,
CI) only the closing line is printed, so logs get one line per long task.
"""

from __future__ import annotations

import sys
import time
from typing import Optional, TextIO


class Progress:
    """A progress line that shows up only for work longer than ``delay`` seconds.

    Examples
    --------
    >>> import io
    >>> out = io.StringIO()
    >>> progress = Progress(stream=out, delay=0.0)
    >>> progress.update("memsaving: working 1/2")
    >>> progress.close("memsaving: done")
    >>> out.getvalue().startswith("memsaving: done in ")
    True
    """

    def __init__(self, stream: Optional[TextIO] = None, delay: float = 1.0):
        self.stream = stream if stream is not None else sys.stderr
        self.delay = delay
        self.start = time.perf_counter()
        self.live = hasattr(self.stream, "isatty") and self.stream.isatty()

    @property
    def elapsed(self) -> float:
        """Wall seconds since the work started."""
        return time.perf_counter() - self.start

    def update(self, text: str) -> None:
        """Show ``text`` and the time so far (terminals only, after ``delay``)."""
        elapsed = self.elapsed
        if elapsed < self.delay or not self.live:
            return
        self.stream.write(f"\r{text} ({elapsed:.0f} s)")
        self.stream.flush()

    def close(self, text: str) -> None:
        """Print ``text`` and the total time, when the work took ``delay`` or more."""
        elapsed = self.elapsed
        if elapsed < self.delay:
            return
        self.stream.write(f"{chr(13) if self.live else ''}{text} in {elapsed:.1f} s\n")
        self.stream.flush()
