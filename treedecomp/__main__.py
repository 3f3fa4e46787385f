"""Command line: ``python -m treedecomp [options] [FILE.gr] > FILE.td``.

Reads a PACE ``.gr`` graph (plain or xz; ``-`` or no file for standard
input), writes a PACE ``.td`` decomposition to standard output.  Without
``--timeout`` one deterministic heuristic run is made.  With it, randomised
improvement runs follow until the time is up (or SIGTERM/SIGINT arrives, as
in the PACE heuristic track) and the best decomposition is printed.

Exit status: 0 on success, 2 for unreadable or malformed input (the message
names the file and line) or bad options.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

from .heuristics import min_degree, min_fill
from .improve import improve_with_stats
from .pace import PaceFormatError, parse_gr, read_gr, write_td
from .validate import validate


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m treedecomp",
        description="Compute a tree decomposition of a PACE .gr graph and print it as .td.",
    )
    p.add_argument("file", nargs="?", default="-", help="input .gr or .gr.xz file ('-' or omitted: stdin)")
    p.add_argument(
        "--heuristic",
        choices=["min-fill", "min-degree"],
        default="min-fill",
        help="elimination heuristic (default: min-fill)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="S",
        help="keep improving with randomised runs for S seconds, then print the best",
    )
    p.add_argument("--seed", type=int, default=0, help="seed for the randomised runs (default 0)")
    p.add_argument("--validate", action="store_true", help="check the decomposition before printing it")
    p.add_argument("-v", "--verbose", action="store_true", help="print width and timing to stderr")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.timeout is not None and args.timeout < 0:
        print("treedecomp: error: --timeout must be >= 0", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    try:
        if args.file == "-":
            G = parse_gr(sys.stdin, "<stdin>")
        else:
            G = read_gr(args.file)
    except PaceFormatError as exc:
        print(f"treedecomp: error: {exc}", file=sys.stderr)
        return 2
    except (OSError, EOFError, UnicodeError) as exc:  # lzma errors are OSError/LZMAError
        print(f"treedecomp: error: cannot read {args.file}: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # e.g. lzma.LZMAError on a truncated .xz
        print(f"treedecomp: error: cannot read {args.file}: {exc}", file=sys.stderr)
        return 2
    t_read = time.perf_counter() - t0

    stop = {"flag": False}
    if args.timeout is None:
        td = (min_fill if args.heuristic == "min-fill" else min_degree)(G)
        runs = 1
        note = ""
    else:
        def on_signal(signum, frame):
            stop["flag"] = True

        old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            res = improve_with_stats(
                G,
                timeout=args.timeout,
                heuristic=args.heuristic,
                seed=args.seed,
                should_stop=lambda: stop["flag"],
            )
        finally:
            for s, h in old.items():
                signal.signal(s, h)
        td, runs = res.decomposition, res.runs
        note = f", lower bound {res.lower_bound}, first run width {res.first_width}"
    if args.validate:
        validate(G, td)
    try:
        write_td(td, sys.stdout, n_vertices=G.number_of_nodes())
        sys.stdout.flush()
    except BrokenPipeError:  # e.g. piped into `head`: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    if args.verbose:
        print(
            f"treedecomp: {G.number_of_nodes()} vertices, {G.number_of_edges()} edges: width {td.width}, "
            f"{len(td.bags)} bags, {runs} run(s){note}; read {t_read:.3f} s, total {time.perf_counter() - t0:.3f} s",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
