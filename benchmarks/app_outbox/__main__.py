"""``python -m benchmarks.app_outbox``: the application outbox benchmark (see docs/benchmarks.md)."""

import sys

from .cli import main

sys.exit(main())
