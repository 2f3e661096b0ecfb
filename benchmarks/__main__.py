"""``python -m benchmarks``: the side-by-side benchmark of issue 6 (see docs/benchmarks.md)."""

import sys

from .cli import main

sys.exit(main())
