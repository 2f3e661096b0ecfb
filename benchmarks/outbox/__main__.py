"""``python -m benchmarks.outbox``: the outbox benchmark (see docs/benchmarks.md)."""

import sys

from .cli import main

sys.exit(main())
