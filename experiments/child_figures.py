"""One model per Python process: the protocol the side-by-side benchmarks share.

A benchmark measures each model in a process of its own, so that no figure is
moved by what an earlier model left in the allocator.  The child prints one
line ``FIGURES <json>``; the parent runs the child and reads that line back.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Dict, List, Optional

PREFIX = "FIGURES "


def print_figures(figures: Dict[str, object]) -> None:
    """The child's side: print ``figures`` as the one line the parent reads."""
    print(PREFIX + json.dumps(figures), flush=True)


def run_child(module: str, arguments: List[str]) -> Dict[str, object]:
    """The parent's side: ``python -m module *arguments`` in a new process
    (TensorFlow's C++ logging quiet), and the figures it printed.

    Raises
    ------
    RuntimeError
        when the child printed none, with the last line of its error output.
    """
    done = subprocess.run([sys.executable, "-m", module, *arguments], capture_output=True, text=True,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    found: Optional[str] = None
    for line in done.stdout.splitlines():
        if line.startswith(PREFIX):
            found = line[len(PREFIX):]
    if found is None:
        last = done.stderr.strip().splitlines()[-1:] or [f"exit code {done.returncode}"]
        raise RuntimeError(last[0])
    return json.loads(found)
