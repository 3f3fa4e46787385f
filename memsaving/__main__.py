"""``python -m memsaving``: same as the ``memsaving`` command."""

import sys

from memsaving.tools.cli import main

sys.exit(main())
