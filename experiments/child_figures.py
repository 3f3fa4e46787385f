"""One model per Python process: the protocol the side-by-side benchmarks share.

A benchmark measures each model in a process of its own, so that no figure is
moved by what an earlier model left in the allocator.  The child prints one
line ``FIGURES <json>``; the parent runs the child and reads that line back.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

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


def models_asked(argv: Optional[Sequence[str]], module: str, doc: str, models: Dict[str, str], default_models: str,
                 default_repeats: int, measure: Callable[[str, int], Dict[str, object]]) -> Optional[Tuple[List[str], int]]:
    """A side-by-side benchmark's command line: ``--models`` (names of
    ``models``, comma-separated), ``--repeats`` and the hidden ``--child``.

    As the child (``--child NAME``): ``measure(NAME, repeats)`` is run and
    printed (:func:`print_figures`), and None returned.  As the parent: the
    models asked for (an unknown one is a usage error) and the repeats.
    """
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=doc.split("\n\n")[0])
    parser.add_argument("--models", default=default_models, help=f"of {', '.join(models)}")
    parser.add_argument("--repeats", type=int, default=default_repeats,
                        help=f"measured runs per way (default {default_repeats})")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print_figures(measure(args.child, args.repeats))
        return None
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = sorted(set(names) - set(models))
    if unknown:
        parser.error(f"unknown model(s) {unknown}; choose from {', '.join(models)}")
    return names, args.repeats


def each_model(module: str, names: Sequence[str], repeats: int) -> Iterator[Tuple[str, Optional[Dict[str, object]], str]]:
    """``(name, figures, error)`` for each model, each measured by ``module``
    as a child process of its own: figures None and the error's last line
    when the child printed none."""
    for name in names:
        try:
            yield name, run_child(module, ["--child", name, "--repeats", str(repeats)]), ""
        except RuntimeError as error:
            yield name, None, str(error)
