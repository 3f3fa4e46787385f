"""The ``memsaving`` command line."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

from memsaving.errors import MemsavingError
from memsaving.tools.arguments import (USAGE_STATUS, OneLineParser, UsageError, import_tensorflow_quietly, memory_size,
                                       positive_int)
from memsaving.tools.footprints import BUILT_IN, dense_stack, refuse_if_too_big


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The ``memsaving`` command; its exit status.

    Arguments are checked before TensorFlow is imported: one line on
    stderr and status 2 for an argument that cannot work (a number below 1,
    an unreadable budget, a plot path that cannot be written, a model too
    big for this machine), status 1 for work that failed.
    """
    parser = OneLineParser(prog="memsaving", description="Gradient checkpointing for TensorFlow 2.")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="compare peak memory and time of one gradient step, plain vs memsaving")
    demo.add_argument("--depth", type=positive_int, default=64, help="layers of the MLP (default 64)")
    demo.add_argument("--batch", type=positive_int, default=2048, help="batch size (default 2048)")
    demo.add_argument("--width", type=positive_int, default=256, help="units per layer (default 256)")
    demo.add_argument("--checkpoints", default="memory", choices=["memory", "speed"],
                      help="how checkpoints are chosen (default memory: about sqrt(n) separators)")
    plan = commands.add_parser("plan", help="print the plan memsaving would run for a Keras model's training step")
    plan.add_argument("model", help="a saved Keras model (.keras/.h5) or a built-in name: " + ", ".join(BUILT_IN))
    plan.add_argument("--batch", type=positive_int, default=8, help="batch size (default 8)")
    plan.add_argument("--size", type=positive_int, default=None,
                      help="every unknown non-batch input dimension of a saved model (sequence length, image "
                           "size; required when there is one); the image size, or sequence length for "
                           "transformer, of built-in models (default 64)")
    plan.add_argument("--checkpoints", default="memory", choices=["memory", "speed"],
                      help="how checkpoints are chosen (default memory)")
    plan.add_argument("--budget", type=memory_size, default=None,
                      help="a memory budget such as 2GiB or 512MB, as budget= takes it (default: none)")
    plan.add_argument("--swap", default="off", choices=["off", "all", "auto"],
                      help="host-memory swapping: off, all (every tensor the backward reads, as TFLMS) or "
                           "auto (keep / swap / recompute chosen under --budget)")
    plan.add_argument("--plot", default=None, metavar="OUT.png", help="also draw the predicted memory timelines")
    plan.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                      help="import MODULE (or a .py file) before loading: the package or module that defines a "
                           "saved model's custom layers, e.g. keras_hub or my_layers (repeatable)")
    plan.add_argument("--verbose", "-v", action="store_true",
                      help="also print where the time went (importing, loading, tracing, planning; wall and "
                           "CPU seconds) and the size of the traced graph")
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:
        return run_command(args)
    except UsageError as error:
        print(f"memsaving {args.command}: {error}", file=sys.stderr)
        return USAGE_STATUS


def run_command(args: argparse.Namespace) -> int:
    """Run the parsed ``plan`` or ``demo`` command; its exit status."""
    if args.command == "plan":
        from memsaving.tools.plan_command import run

        try:
            run(args.model, args.batch, args.size, args.checkpoints, args.budget, args.swap, args.plot,
                imports=args.imports, verbose=args.verbose)
        except MemsavingError as error:
            print(f"memsaving plan: {error}", file=sys.stderr)
            return 1
        return 0
    refuse_if_too_big(dense_stack(args.depth, args.width), args.batch, f"the demo at --depth {args.depth} --width "
                      f"{args.width}", "give a smaller --depth, --width or --batch")
    import_tensorflow_quietly()
    from memsaving.tools.demo import main as demo_main

    return demo_main(args.depth, args.batch, args.width, args.checkpoints)


if __name__ == "__main__":
    sys.exit(main())
