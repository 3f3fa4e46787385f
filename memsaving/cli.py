"""The ``memsaving`` command line."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="memsaving", description="Gradient checkpointing for TensorFlow 2.")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="compare peak memory and time of one gradient step, plain vs memsaving")
    demo.add_argument("--depth", type=int, default=64, help="layers of the MLP (default 64)")
    demo.add_argument("--batch", type=int, default=2048, help="batch size (default 2048)")
    demo.add_argument("--width", type=int, default=256, help="units per layer (default 256)")
    demo.add_argument("--checkpoints", default="memory", choices=["memory", "speed"],
                      help="how checkpoints are chosen (default memory: about sqrt(n) separators)")
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if args.command == "demo":
        for name in ("depth", "batch", "width"):
            if getattr(args, name) < 1:
                parser.error(f"--{name} must be at least 1")
        from memsaving.demo import main as demo_main

        return demo_main(args.depth, args.batch, args.width, args.checkpoints)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
