"""``python -m benchmarks``: the side-by-side benchmark (see docs/benchmarks.md)."""

import sys

from .cli import main

sys.exit(main())
