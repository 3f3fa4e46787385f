"""``python -m memsaving``: same as the ``memsaving`` command."""

import sys

from memsaving.cli import main

sys.exit(main())
